"""The tools: they read checkpoints and answer questions (eval, verify, inspect, plan).

    perplexity.py      `moeify eval`: perplexity on the same windows for every model, generation health
    routing.py         routing statistics of an MoE on those windows (expert load, oracle top-k), its MoE layers
    tasks.py           zero-shot task accuracy through lm-evaluation-harness (the one module that imports lm-eval)
    loglik.py          log-likelihoods of continuations, each context run once (the scoring under `eval --tasks`)
    verify.py          `moeify verify`: is a converted checkpoint complete, consistent and faithful?
    verify_carve.py    `verify --against` for a carve (weights bit for bit, logits)
    verify_upcycle.py  `verify --against` for an upcycled or merged output
    verify_layout.py   what verify reads of an output: its MoE layout and report.json
    analysis.py        `moeify inspect`: per-layer analyses of an MoE
    inspect_plots.py   its PNG figures (matplotlib)
    planning.py        `moeify plan`: what an MoE built from a dense config costs
    layerwise.py       any checkpoint run one decoder layer at a time: the one layer-by-layer runner (calibration,
                       a merge's router rows, the upcycle check, verify --against)
"""
