"""Quality benchmark: held-out perplexity ratio (MoE / dense) for partition x router x compensation x config.

    python scripts/bench_quality.py                       # bundled tiny model, all configs, writes
                                                          # results/quality/tiny-llama-carving-methods.json
    python scripts/bench_quality.py --configs e8k2 --rows contiguous/mean-gate,coactivation/fitted+refit

Every row converts the same model with `moeify` (the real pipeline, the real output format), loads the
output with AutoModelForCausalLM and scores the same held-out tokens as the dense model. An `oracle` row
replaces the router of a partition by the true top-k experts by output norm (the upper bound without refit).
Calibration text: wikitext2/calib_train_200k.txt (training split); evaluation: wikitext2/valid.txt (held out).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeify.formats.config import build_config  # noqa: E402
from moeify.carving.conversion import plan_conversion, run_conversion  # noqa: E402

CORPORA = ROOT.parent / "shared" / "corpora" / "wikitext2"
CONFIGS = ("e8k2", "e8k4", "s1e7k1", "s2e16k2")  # the tiny model's table; any [sS]eEkK (or a preset path) works


def parse_config(name: str) -> dict:
    """'s2e16k2' -> 2 shared + 16 routed, top-2: share of FFN neurons active = (k + s) / (e + s).
    A path to a TOML preset (configs/active-50.toml) runs that preset's whole pipeline."""
    if name.endswith(".toml"):
        from moeify.formats.config import load_preset

        return {"preset": name, **{k: v for k, v in load_preset(name).items() if k in ("experts", "top_k", "shared")}}
    m = re.fullmatch(r"(?:s(\d+))?e(\d+)k(\d+)", name)
    if not m:
        raise SystemExit(f"config {name!r}: write [sS]eEkK, e.g. e64k16 or s1e63k15, or a preset .toml")
    return {"experts": int(m.group(2)), "top_k": int(m.group(3)), "shared": int(m.group(1) or 0)}


def active_fraction(c: dict) -> float:
    return (c["top_k"] + c.get("shared", 0)) / (c["experts"] + c.get("shared", 0))
ROWS = [  # method/router[+refit][+corrected|+moefeed][+tuneN]; "oracle" router = top-k by true expert output norm
    "contiguous/mean-gate", "gate-cluster/representative", "gate-cluster/mean-gate", "activation/representative",
    "activation/fitted", "coactivation/fitted", "gate-cluster/fitted",
    "gate-cluster/fitted+refit", "activation/fitted+refit", "coactivation/fitted+refit",
    "contiguous/oracle", "gate-cluster/oracle", "activation/oracle", "coactivation/oracle",
]


def tokens_of(model_dir: Path, text_file: Path, max_tokens: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(text_file.read_text(), add_special_tokens=False)["input_ids"][:max_tokens]
    return torch.tensor(ids)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, batch: int = 8) -> float:
    """Mean NLL over non-overlapping windows (every window's first token has no context and is not scored)."""
    n = ids.numel() // seq_len
    windows = ids[: n * seq_len].view(n, seq_len)
    nll, count = 0.0, 0
    for s in range(0, n, batch):
        w = windows[s:s + batch].to(model.device)
        logits = model(w).logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    return float(torch.exp(torch.tensor(nll / count)))


def masked_dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts' output as one dense masked product: every expert's neurons computed for every token and weighted
    by the token's routing weight for that expert (0 when not selected). The same sum over the selected experts as
    transformers' kernels, at the dense FFN's cost, which on a CPU beats grouped matmuls over many narrow experts."""
    n_e, w2, d = self.gate_up_proj.shape
    w = w2 // 2
    weights = torch.zeros(hidden_states.shape[0], n_e, dtype=hidden_states.dtype, device=hidden_states.device)
    weights.scatter_(1, top_k_index, top_k_weights.to(hidden_states.dtype))
    gate = self.gate_up_proj[:, :w].reshape(n_e * w, d)
    up = self.gate_up_proj[:, w:].reshape(n_e * w, d)
    h = self.act_fn(hidden_states @ gate.T) * (hidden_states @ up.T)  # (T, E * w)
    h = (h.view(-1, n_e, w) * weights.unsqueeze(-1)).view(-1, n_e * w)
    return h @ self.down_proj.permute(1, 0, 2).reshape(d, n_e * w).T


def load_moe(path: Path):
    """The converted checkpoint through AutoModelForCausalLM, scored with masked_dense_experts_forward (checked
    against transformers' default experts kernel on one window first)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("masked_dense", masked_dense_experts_forward)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the kernel against transformers' default on the same inputs and routing (not end to end: with many experts a
    # perturbation at float32 rounding level flips near-tied top-k choices, so whole-model logits are no test)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    gen = torch.Generator().manual_seed(0)
    n_e = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    k = model.config.num_experts_per_tok
    x = torch.randn(256, model.config.hidden_size, generator=gen)
    idx = torch.stack([torch.randperm(n_e, generator=gen)[:k] for _ in range(256)])
    w = torch.rand(256, k, generator=gen)
    with torch.no_grad():
        ref = block.experts(x, idx, w)
        model.config._experts_implementation = "masked_dense"
        got = block.experts(x, idx, w)
    diff = ((got - ref).abs().max() / ref.abs().max()).item()
    assert diff < 1e-5, f"masked dense experts differ from transformers' kernel by {diff:.2e}"
    return model


def install_oracle_router(model) -> None:
    """Replace every MoE router by the oracle: top-k experts by the L2 norm of their true output, gates 1/k."""
    for layer in model.model.layers:
        block = layer.mlp
        if not hasattr(block, "gate") or not hasattr(block, "experts"):
            continue  # a dense layer
        experts, router = block.experts, block.gate

        def forward(hidden, experts=experts, router=router):
            x = hidden.reshape(-1, router.hidden_dim)
            gate_up = torch.einsum("th,eih->tei", x, experts.gate_up_proj)
            g, u = gate_up.chunk(2, dim=-1)
            out = torch.einsum("tei,ehi->teh", experts.act_fn(g) * u, experts.down_proj)
            norms = out.norm(dim=-1)  # (tokens, experts)
            idx = norms.topk(router.top_k, dim=-1).indices
            scores = torch.full(idx.shape, 1.0 / router.top_k, dtype=x.dtype, device=x.device)
            return norms, scores, idx

        router.forward = forward


def row_settings(row: str) -> dict:
    """'activation/fitted+refit+corrected+tune2' -> ConvertConfig fields. 'preset' = the config's preset as is;
    'preset+distill64k+gen0+frozen' = the preset with --tune-tokens 65536, --tune-generated 0, --freeze-router."""
    if row == "preset" or row.startswith("preset+"):
        head, extras = {}, row.split("+")[1:]
    else:
        method, rest = row.split("/")
        router, *extras = rest.split("+")
        head = {"method": method, "router": "mean-gate" if router == "oracle" else router,
                "compensate": "refit" in extras, "oracle": router == "oracle"}
    unknown = [e for e in extras if e not in ("refit", "corrected", "moefeed", "frozen", "attn")
               and not re.fullmatch(r"(tune|gen)\d+|distill\d+k?", e)]
    if unknown:
        raise SystemExit(f"row {row!r}: unknown suffix {unknown[0]!r} (refit, corrected, moefeed, tuneN, distillN[k], "
                         "genP (percent of self-generated tuning text), frozen, attn (also tune attention and norms))")
    out = dict(head)
    for e in extras:
        if e.startswith("tune"):
            out["fit_epochs"] = int(e[4:])
        elif e.startswith("distill"):
            out["tune_tokens"] = int(e[7:].rstrip("k")) * (1024 if e.endswith("k") else 1)
        elif e.startswith("gen"):
            out["tune_generated"] = int(e[3:]) / 100
    if "frozen" in extras:
        out["tune_router"] = False
    if "attn" in extras:
        out["tune_attention"] = True
    feed = "corrected" if "corrected" in extras else "moe" if "moefeed" in extras else None
    if head or feed:
        out["calib_feed"] = feed
    return out


def parse_sweep(items: list[str]) -> list[dict]:
    """['lr=0.0015', 'lr=0.006,batch_tokens=512'] -> [{'lr': 0.0015}, {'lr': 0.006, 'batch_tokens': 512}]: overrides
    of moeify.training.distill.DistillSettings, each one tuning run from the same carved model and tuning text."""
    from dataclasses import fields

    from moeify.training.distill import DistillSettings

    types = {f.name: type(getattr(DistillSettings(tokens=0), f.name)) for f in fields(DistillSettings)}
    out = []
    for item in items:
        over = {}
        for kv in item.split(","):
            key, _, value = kv.partition("=")
            if key not in types or key == "tokens":
                raise SystemExit(f"--sweep {item!r}: {key!r} is not a tuning setting (one of "
                                 f"{', '.join(k for k in types if k != 'tokens')})")
            over[key] = value.lower() in ("1", "true", "yes") if types[key] is bool else types[key](value)
        out.append(over)
    return out


def install_sweep(sweep: list[dict], evals: dict, seq_len: int, results: list) -> None:
    """Make every tuning run of the conversion a sweep: from the same carved student and tuning text, one run per
    override set (the student restored between runs), each scored on the eval texts; the last run's weights are what
    the conversion writes. The calibration and the sampling of tuning text happen once."""
    import dataclasses

    import moeify.training.distill as distill_mod

    original = distill_mod.distill

    def swept(teacher, student, train, held_out, settings, progress=None, state=None, resume=None, **kw):
        # what tuning may train: every decoder layer's tensors (experts, routers, and attention and norms under
        # --tune-attention), restored before each run
        start = {k: v.detach().clone() for k, v in student.state_dict().items() if ".layers." in k}
        info = None
        for over in sweep:
            student.load_state_dict(start, strict=False)
            run = dataclasses.replace(settings, **over)
            # no saved state (each run from scratch); the kept teacher targets and held-out states (kw) as given
            info = original(teacher, student, train, held_out, run, progress, **kw)
            ppl = {n: perplexity(student, ids, seq_len) for n, ids in evals.items()}
            results.append({"settings": over, "ppl": ppl, "tuning": info})
            print(f"  sweep {over}: " + ", ".join(f"{n} {p:.3f}" for n, p in ppl.items())
                  + f"  held-out KL {info['holdout_kl_before']:.3f} -> {info['holdout_kl_after']:.3f} "
                  f"({info['seconds']:.0f} s)", flush=True)
        return info

    distill_mod.distill = swept


def run_row(model_dir: Path, row: str, config: str, calib: Path, calib_tokens: int, evals: dict, seq_len, work: Path,
            feed: str, tune_tokens: int | None = None, curve_at: tuple[int, ...] = (), keep: Path | None = None,
            sweep: list[dict] | None = None) -> dict:

    settings, shape = row_settings(row), parse_config(config)
    oracle = settings.pop("oracle", False)
    preset = shape.pop("preset", None)
    if settings.get("calib_feed") is None:
        settings["calib_feed"] = None if preset else feed
    if tune_tokens is not None and "tune_tokens" not in settings:
        settings["tune_tokens"] = tune_tokens
    needs_calib = bool(preset) or (settings.get("method") in ("activation", "coactivation")
                                   or settings.get("router") == "fitted" or settings.get("compensate")
                                   or settings.get("fit_epochs") or settings.get("tune_tokens"))
    cfg = build_config(preset, source=model_dir, **shape, **settings, calib=[str(calib)] if needs_calib else None,
                       calib_tokens=(calib_tokens or None) if needs_calib else None)
    out = work / re.sub(r"[^A-Za-z0-9.+-]", "_", f"{config}-{row}")
    curve = []
    if curve_at:  # score the student (which computes what the exported MoE computes) along the tuning run
        from moeify.training.distill import set_step_hook

        def hook(student, step, tokens):
            if any(tokens - 1024 < m <= tokens for m in curve_at) or (tokens == 0 and 0 in curve_at):
                point = {"tokens": tokens, "ppl": {n: perplexity(student, ids, seq_len) for n, ids in evals.items()}}
                curve.append(point)
                print(f"  tuned on {tokens:,} tokens: " + ", ".join(f"{n} {p:.3f}" for n, p in point["ppl"].items()),
                      flush=True)

        set_step_hook(hook)
    swept = []
    if sweep:
        install_sweep(sweep, evals, seq_len, swept)
    t0 = time.time()
    report = run_conversion(plan_conversion(model_dir, cfg), out, overwrite=True)
    seconds = time.time() - t0
    if curve_at:
        set_step_hook(None)
    model = load_moe(out)
    if oracle:
        install_oracle_router(model)
    ppl = {name: perplexity(model, ids, seq_len) for name, ids in evals.items()}
    layers = [lay for lay in report["layers"] if not lay.get("dense")]
    agreement = [lay.get(f"agreement_{cfg.router}") for lay in layers if lay.get(f"agreement_{cfg.router}") is not None]
    errors = [lay["rel_error"] for lay in layers if "rel_error" in lay]
    if keep:  # the written checkpoint, for engine checks after the run (scripts/check_engines.py)
        shutil.rmtree(keep / out.name, ignore_errors=True)
        shutil.move(str(out), str(keep / out.name))
    else:
        shutil.rmtree(out)
    return {"config": config, "row": row, "active": active_fraction(shape | {"experts": cfg.experts, "top_k": cfg.top_k,
                                                                             "shared": cfg.shared}),
            "ppl": ppl, "seconds": round(seconds, 2), "calib_tokens": report["calibration"].get("tokens"),
            "tuning": {k: v for k, v in (report.get("tuning", {}).get("runs") or [{}])[-1].items() if k != "text"} or None,
            "settings": report["settings"], "curve": curve, "sweep": swept,
            "agreement": sum(agreement) / len(agreement) if agreement and not oracle else None,
            "layer_rel_error": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "tiny-llama")
    ap.add_argument("--calib", type=Path, default=CORPORA / "calib_train_200k.txt")
    ap.add_argument("--eval", type=Path, nargs="+", default=[CORPORA / "valid.txt"],
                    help="held-out texts (each scored separately, same first --eval-tokens tokens for every model)")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--calib-tokens", type=int, default=32768, help="0: the preset's, else all of the calibration "
                    "text (up to 65,536)")
    ap.add_argument("--tune-tokens", type=int, default=None, help="--tune-tokens of every row that does not set it "
                    "(0: training-free) [default: the preset's]")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--feed", default="dense", choices=("dense", "moe"))
    ap.add_argument("--curve", default="", help="comma-separated token counts (e.g. 16384,65536,262144) at which to "
                    "score the eval texts along each row's tuning run: the tokens -> quality curve")
    ap.add_argument("--sweep", nargs="+", default=[], metavar="KEY=V[,KEY=V]", help="tuning settings to compare "
                    "(moeify.training.distill.DistillSettings fields, e.g. lr=0.0015 lr=0.006 batch_tokens=512): each row's "
                    "tuning runs once per item from the same carved model and tuning text, each scored; the last "
                    "item's weights are written")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "quality" / "tiny-llama-carving-methods.json")
    ap.add_argument("--keep", type=Path, default=None, help="move each row's written checkpoint into this directory "
                    "instead of deleting it")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --json (same model and texts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads()))
    curve_at = tuple(int(t) for t in args.curve.split(",") if t)
    sweep = parse_sweep(args.sweep)

    from transformers import AutoModelForCausalLM

    evals = {path.parent.name: tokens_of(args.model, path, args.eval_tokens) for path in args.eval}
    dense = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    dense_ppl = {name: perplexity(dense, ids, args.seq_len) for name, ids in evals.items()}
    del dense
    print("dense ppl " + ", ".join(f"{n} {p:.3f} ({evals[n].numel()} tokens)" for n, p in dense_ppl.items()), flush=True)
    results = {"model": str(args.model), "eval": {n: str(p) for n, p in zip(evals, args.eval)},
               "eval_tokens": {n: int(ids.numel()) for n, ids in evals.items()}, "seq_len": args.seq_len,
               "calib": str(args.calib), "calib_tokens": args.calib_tokens, "feed": args.feed, "dense_ppl": dense_ppl,
               "rows": []}
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    if args.json.is_file() and args.append:
        results["rows"] = json.loads(args.json.read_text())["rows"]
    with tempfile.TemporaryDirectory() as work:
        for config in args.configs.split(","):
            for row in args.rows.split(","):
                r = run_row(args.model, row, config, args.calib, args.calib_tokens, evals, args.seq_len, Path(work),
                            args.feed, args.tune_tokens, curve_at, args.keep, sweep)
                r["ratio"] = {n: r["ppl"][n] / dense_ppl[n] for n in evals}
                results["rows"].append(r)
                agree = f"  agreement {r['agreement']:.3f}" if r["agreement"] is not None else ""
                ratios = "  ".join(f"{n} {v:.3f}" for n, v in r["ratio"].items())
                print(f"{config:9s} {r['active']:.3f} {row:34s} ratio {ratios}{agree}  ({r['seconds']}s)", flush=True)
                args.json.write_text(json.dumps(results, indent=1) + "\n")  # after every row: a long run keeps its rows


if __name__ == "__main__":
    main()
