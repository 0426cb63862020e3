#!/bin/bash
# Zero-shot task accuracy of the presets as users get them (BENCHMARKS "Zero-shot task accuracy"): each step carves
# (calibrated on the bundled sample, as `moeify convert --preset` does), tunes on the preset's 262,144 tokens where
# it says so, and scores the dense model beside its outputs with scripts/bench_tasks.py on the first 1,000 items of
# each of the six tasks (the first three steps: 100, the earlier tables); a step is resumable (an interrupted tune
# goes on with --resume) and writes its result file at once:
#     bash scripts/bench_tasks.sh [STEP...]
# steps (each ~2 cores alone, 2026-11 timings):
#   smollm2-262k   SmolLM2-135M, both presets tuned on 262,144 tokens    (~50 min a tune + ~45 min of tasks)
#   qwen05-free    Qwen2.5-Coder-0.5B, both presets training-free          (~22 min of carving + ~35 min of tasks)
#   qwen05-262k    Qwen2.5-Coder-0.5B, both presets tuned on 262,144 tokens (hours a tune + ~25 min of tasks)
#   smollm2-1000   SmolLM2-135M, both presets training-free and the 50% one carved again with --seed 1 (the noise
#                  floor), each task's first 1,000 items in bfloat16 (~12 min of carving + ~45 min of tasks)
#   smollm2-contribution  the 50% preset with its shared expert chosen by contribution (shared_by), beside the
#                  preset and its seed-1 twin (their answers cached by smollm2-1000: ~4 min carving + ~12 min)
#   smollm2-active75  a 75% layout training-free beside both presets (~3 min carving + ~10 min of tasks)
#   smollm2-dense-layers  the 50% preset with its 2 most sensitive layers kept dense and top-10 elsewhere (equal
#                  compute), beside the preset and its seed-1 twin (~4 min carving + ~12 min of tasks)
#   qwen05-1000    Qwen2.5-Coder-0.5B, the 50% preset (its file written), then its seed-1 twin beside it, first
#                  1,000 items (~25 min of carving + ~2 h of tasks)
#   qwen05-dense-layers  the 0.5B's 50% preset with its 2 most sensitive layers kept dense and top-7 of 28 elsewhere
#                  (0.515x the dense FFN FLOPs, the preset 0.502x), beside the preset and its twin (~12 + ~25 min)
#   qwen05-active75  the 0.5B's active-75 preset training-free beside the 50% one (~11 min + ~30 min)
#   qwen05-active25  the 0.5B's 25% preset at 1,000 items beside the 50% one (~12 min + ~25 min)
#   smollm2-chat   lever 3: the 50% preset calibrated on half the bundled sample, half conversations the model
#                  writes from its own chat template (scripts/chat_text.py), beside the preset and its twin
#   qwen05-chat    lever 3 on the 0.5B (~12 min of sampling + ~12 min carving + ~30 min of tasks)
#   smollm2-genres lever 3's control: War and Peace (the bundled sample's second genre) in place of the
#                  conversations (~4 min carving + ~10 min of tasks)
#   smollm2-spread the presets' calibration windows spread over both genres of the bundled sample (the default
#                  since 2026-11-29) beside the head-calibrated preset and its twin (~4 min carving + ~10 min)
#   qwen05-spread  the same on the 0.5B (~12 min carving + ~30 min of tasks)
#   smollm2-spread-presets  all three presets calibrated spread (~6 min carving + ~20 min of tasks)
#   qwen05-spread-active75  the 0.5B's active-75 calibrated spread beside its spread 50% (~11 min + ~25 min)
#   qwen05-spread-active25  the same for the 0.5B's active-25 (~11 min + ~20 min)
#   smollm2-chat-spread  lever 3 on top of the spread windows: half the bundled sample spread, half the model's own
#                  conversations (the smollm2-chat ones), beside the spread preset (~3 min carving + ~10 min)
#   qwen05-chat-spread  the same on the 0.5B (~12 min carving + ~30 min of tasks)
#   smollm2-spread-contribution  lever 2 on SmolLM2's spread preset, as qwen05-contribution (~4 + ~10 min)
#   smollm2-spread-262k  the spread 50% preset tuned on its 262,144 tokens, beside it (~50 min + ~10 min)
#   smollm2-spread-262k-chat  the same tune with the conversations as its --tune-text (~50 min + ~10 min)
#   qwen05-spread-262k-chat, -attention, -routers  the 0.5B's versions of SmolLM2's steps of those names (with
#                  PLAIN=0 ONLY=the four, on 2026-12-07's AVX512-BF16 EPYC: 13 min carving, 20-36 min sampling,
#                  62 min of steps with -attention, 44 with -routers, 56 with -chat, 13-14 min a model; -chat's
#                  conversations 18 min)
#   qwen05-contribution  lever 2 on the second size: the 0.5B's 50% preset (spread windows, as it carves now) with
#                  its shared expert chosen by contribution, beside the preset (~25 min carving + ~60 min of tasks)
#   smollm2-spread-262k-hidden  lever 4's objective: the same tune with every layer's output matched too
#                  (--hidden-weight 16: the two terms' gradients of similar size at step 0,
#                  results/tuning/layer-match-scale-smollm2-active50.json; the teacher in the loop), beside the plain
#                  tune in the same run (~36 + ~40 min of tuning, ~30 min of tasks)
#   smollm2-spread-262k-attention  lever 4's "attention at a low rate": the same tune with attention projections
#                  and norms trained too (--tune-attention: a third of the experts' step), beside the plain tune
#                  (~40 min of tuning + ~10 min of tasks once the plain tune is scored)
#   smollm2-spread-262k-prose, qwen05-spread-262k-prose  lever 3 in the tune: the same tune with real text the
#                  bundled sample does not hold added (War and Peace's calibration slice, half of it past the sample's,
#                  and WikiText-2's train.txt, ~300,000 tokens; never the valid.txt the perplexity tables read), so no
#                  real window repeats much, beside the plain tune (0.5B on AVX512-BF16: 13 min carving, 16 + 8 min of
#                  sampling and teacher targets, 63 min of steps, 14 min of four tasks a model)
#   smollm2-spread-262k-routers  lever 4's "routers alone first": the same tune with the experts frozen
#                  (--router-only: what routing alone recovers), beside the plain tune (~30 min + ~10 min)
#   qwen05-spread-262k  the 0.5B's spread 50% preset tuned on its 262,144 tokens, beside it (~2 h of sampling and
#                  tuning + ~20 min of tasks, its dense and carve answers cached by qwen05-contribution)
#   smollm2-spread-262k-bundled, qwen05-spread-262k-bundled  the presets' tune as it ships since 2026-12-07 (the
#                  bundled prose in its tune_text, moeify/data/tune_prose.txt), beside the carve: what -prose measured
#                  with the corpora read whole (the 0.5B's with PLAIN=0 ONLY=the four, 2026-12-07: 16 + 8 min of
#                  sampling and teacher targets, 57 min of steps, 14 min the tune's tasks). Before 2026-12-07 the
#                  presets tuned on the sample and sampled text alone: out/ folders tuned then (a plain -262k tune,
#                  -524k, -1m) keep that mix
#   smollm2-spread-524k-bundled, qwen05-spread-524k-bundled  the -bundled tune continued to 524,288 tokens, beside
#                  it and the carve (the 0.5B's with ONLY=the four, 2026-12-07: 52 min of sampling and targets beside
#                  other work, 57 min of steps, 13 min of tasks)
#   smollm2-spread-1m-bundled  the -524k-bundled tune continued by 524,288 more (1,048,576 in all), beside the carve
#                  and the two shorter tunes (not yet run; SmolLM2 on the AVX512-BF16 EPYC: ~20 min of sampling,
#                  ~45 min of steps, ~10 min of tasks once the others are scored)
#   smollm2-contribution-262k-bundled, smollm2-dense-layers-262k-bundled, smollm2-chat-spread-262k-bundled and the
#                  same qwen05-... steps: levers 2, 1 and 3 tuned, each lever's carve (spread windows, as the preset
#                  carves now) tuned as the preset ships, beside the preset's shipped tune (-spread-262k-bundled,
#                  its answers cached): what the lever adds once both are tuned (not yet run; a tune's time each)
#   qwen05-spread-262k-hidden  lever 4's layer matching on the 0.5B, beside the plain tune (with PLAIN=0 ONLY=the four on
#                  2026-12-07's AVX512-BF16 EPYC: 13 min carving, 16 min sampling, 72 min of steps, 13-14 min a model)
#   smollm2-spread-active75-262k  lever 5 tuned: the active-75 preset's 262,144-token tune against dense, then its
#                  training-free carve beside them (float32 on an AVX2-only CPU: ~50 min of sampling and tuning,
#                  ~20 min of tasks a model)
#   qwen05-spread-active75-262k  the same on the 0.5B (AVX512-BF16, 2026-12-07: 11 min carving, 16 + 8 min of
#                  sampling and teacher targets, 61 min of steps; its tune kept the carve's weights, so not scored)
#   smollm2-spread-524k  lever 4's tokens: smollm2-spread-262k's plain tune tuned on for 262,144 more (524,288 in
#                  all), beside the carve and the 262k tune (float32 on an AVX2-only CPU: ~22 min of sampling, ~48 min of
#                  steps, ~20 min of tasks)
#   smollm2-spread-1m  the 524k tune tuned on for 524,288 more (1,048,576 in all), beside the carve and the three
#                  tunes (not yet run; float32 on the AVX2 CPU: ~45 min of sampling, ~95 min of steps, ~20 min of tasks)
# PLAIN=0 before a step that pairs a tune with the plain one leaves the plain tune out (beside the carve alone, its
# result file named ...-vs-carve-1000.json; dense and the tune scored first, the carve then added): a fresh machine
# has the time of one 0.5B tune, not two. ONLY=arc_easy,piqa,hellaswag,lambada_openai before a 1,000-item step scores
# the four tasks retention reads and not ARC-Challenge and BoolQ (near chance on both models): the 0.5B dense
# model's four in 806 s on 2026-12-04's AVX512-BF16 EPYC.
# Run it alone (nice is fine): tuning and scoring share nothing with other jobs but the cores.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/levers
TASKS="--task-data ../shared/tasks --limit 100 --max-tokens 4096"
# DTYPE=float32 scores in float32, its result files named ...-1000-float32.json: on a CPU without AVX512-BF16 or AMX
# bfloat16 products are emulated, about 100 times slower than float32 (2026-12-02's AVX2 machine)
DTYPE=${DTYPE:-bfloat16} SUFFIX=
[ "$DTYPE" = bfloat16 ] || SUFFIX=-$DTYPE
carve() {  # SRC OUT PRESET [FLAGS...]: the training-free carve, unless it is there (PRESET: 50, 25 or a file)
  local preset=$3
  [ -f "$preset" ] || [ -f "$preset.toml" ] && preset=${preset%.toml}.toml || preset=configs/active-$3.toml
  [ -f "$2/report.json" ] || .venv/bin/moeify convert "$1" "$2" --preset "$preset" --no-tune --overwrite "${@:4}"
}
lever() {  # PRESET KEY VALUE: out/levers/PRESET-KEY-VALUE.toml, the preset with one key set (a lever to measure)
  { echo "$2 = \"$3\""; cat "configs/$1.toml"; } > "out/levers/$1-$2-$3.toml"
}
carve_dense2() {  # SRC OUT: lever 1, the 50% preset with its 2 layers of largest carve error kept dense and top-K
  # routed elsewhere at the same compute (K 10 on SmolLM2, 7 on the 0.5B), from
  # out/levers/active-50-dense_layers-auto2-topK.toml (for transformers and vLLM only: llama.cpp's qwen2moe maps no
  # mlp_only_layers)
  local k=7; [[ $1 = *smollm2* ]] && k=10
  sed -e 's/^targets = .*/targets = ["transformers", "vllm"]/' configs/active-50.toml \
    > out/levers/active-50-dense_layers-auto2-top$k.toml
  carve $1 $2 out/levers/active-50-dense_layers-auto2-top$k --dense-layers auto:2 --top-k $k
}
carve_contribution() {  # SRC OUT: lever 2, the 50% preset with its shared expert chosen by contribution
  lever active-50 shared_by contribution
  carve $1 $2 out/levers/active-50-shared_by-contribution
}
chat_spread_text() {  # SRC M: out/levers/chat-spread-M.txt, half the bundled sample (512-token windows spread over it,
  # as the presets read it) and half the conversations the model wrote itself from its chat template (the ones
  # smollm2-chat / qwen05-chat used: 12,877 / 14,930 tokens), so the preset's 16,384 windows, spread, take half of each
  local n=14848 conv=out/levers/conversations-$2.txt
  [ $2 = smollm2-135m ] && n=12800
  [ -f $conv ] || .venv/bin/python scripts/chat_text.py $1 $conv --tokens 12288
  .venv/bin/python scripts/chat_text.py $1 out/levers/chat-spread-$2.txt \
    --prefix moeify/data/calib_sample.txt --prefix-tokens $n --spread --control $conv
}
tokens_of() {  # OUT: the tuning tokens OUT has had in all (0 untuned or absent)
  .venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("tuning", {}).get("tokens", 0))' \
    "$1/report.json" 2>/dev/null || echo 0
}
tuned() {  # SRC FROM OUT TOKENS [FLAGS...]: FROM (a carve, or a tuned output: then the rest of one cosine, as
  # `moeify tune` continues by default) copied to OUT and tuned on TOKENS more, unless OUT has them; resumed if a run
  # was interrupted
  if [ -d "$3.moeify-tune" ]; then
    .venv/bin/moeify tune "$1" "$3" --resume
  elif [ "$(tokens_of "$3")" != $(( $(tokens_of "$2") + $4 )) ]; then
    rm -rf "$3" && cp -r "$2" "$3" && .venv/bin/moeify tune "$1" "$3" --tokens "$4" "${@:5}"
  fi
}
score() {  # RESULT MODEL...: scripts/bench_tasks.py on the first 1,000 items of each task (ONLY: those tasks), the
  # dense model first, into results/quality/tasks-RESULT-1000[-DTYPE].json
  local res=$1
  .venv/bin/python scripts/bench_tasks.py "${@:2}" --task-data ../shared/tasks --limit 1000 --dtype $DTYPE \
    --max-tokens 4096 ${ONLY:+--tasks $ONLY} --out results/quality/tasks-$res-1000$SUFFIX.json
}
for step in ${*:-smollm2-262k}; do
  # each step's model by its prefix: src the dense checkpoint, m its name, o the stem of its carves' folders
  case $step in smollm2*) m=smollm2-135m ;; *) m=qwen2.5-coder-0.5b ;; esac
  src=models/$m o=out/${step%%-*}-a50
  case $step in
    smollm2-262k)
      for p in 50 25; do
        carve $src out/smollm2-a$p $p
        tuned $src out/smollm2-a$p out/tasks-s$p-262k 262144
      done
      .venv/bin/python scripts/bench_tasks.py $src out/tasks-s50-262k out/tasks-s25-262k $TASKS \
        --out results/quality/tasks-smollm2-262k-limit100.json ;;
    qwen05-free)
      for p in 50 25; do carve $src out/qwen05-a$p $p; done
      .venv/bin/python scripts/bench_tasks.py $src out/qwen05-a50 out/qwen05-a25 $TASKS \
        --out results/quality/tasks-qwen05-trainingfree-limit100.json ;;
    qwen05-262k)
      for p in 50 25; do
        carve $src out/qwen05-a$p $p
        tuned $src out/qwen05-a$p out/tasks-q$p-262k 262144
      done
      .venv/bin/python scripts/bench_tasks.py $src out/tasks-q50-262k out/tasks-q25-262k $TASKS \
        --out results/quality/tasks-qwen05-262k-limit100.json ;;
    smollm2-1000)
      carve $src $o 50
      carve $src $o-seed1 50 --seed 1
      carve $src out/smollm2-a25 25
      score smollm2-trainingfree $src $o $o-seed1 out/smollm2-a25 ;;
    smollm2-contribution)  # the shared expert by contribution, against the 50% preset and its --seed 1 twin
      carve $src $o 50
      carve $src $o-seed1 50 --seed 1
      carve_contribution $src $o-contribution
      score $step $src $o $o-seed1 $o-contribution ;;
    qwen05-contribution|smollm2-spread-contribution)  # the shared expert by contribution, against the preset as it
      # carves now (spread windows)
      carve $src $o-spread 50
      carve_contribution $src $o-spread-contribution
      score $step $src $o-spread $o-spread-contribution ;;
    smollm2-active75)  # a 75% layout (half of d_ff shared + top-12 of 24 routed on SmolLM2), beside the presets
      sed -e 's/^active = 0.5$/active = 0.75/' -e 's/^shared = 0.25$/shared = 0.5/' configs/active-50.toml \
        > out/levers/active-75.toml
      carve $src out/smollm2-a75 out/levers/active-75
      score $step $src $o out/smollm2-a25 out/smollm2-a75 ;;
    smollm2-dense-layers|qwen05-dense-layers)  # lever 1 at equal compute: the 2 layers of largest carve error kept
      # dense (auto:2), fewer routed elsewhere (SmolLM2: top-10 of 36, 49.4% average active, the preset 50.0%; the
      # 0.5B: top-7 of 28, report.json: 0.515x the dense FFN FLOPs, the preset 0.502x), beside the preset and its
      # --seed 1 twin; transformers and vLLM only
      carve $src $o 50
      carve $src $o-seed1 50 --seed 1
      carve_dense2 $src $o-dense2
      score $step $src $o $o-seed1 $o-dense2 ;;
    qwen05-1000)  # the dense model and the 50% preset first (their file written), then its --seed 1 twin beside them
      carve $src $o 50
      score qwen05-trainingfree $src $o
      carve $src $o-seed1 50 --seed 1
      score qwen05-trainingfree $src $o $o-seed1 ;;
    qwen05-active75|qwen05-active25)  # the 0.5B's active-75 or active-25 preset at 1,000 items, beside the 50% one
      # (its answers cached)
      p=${step##*active}
      carve $src $o 50
      carve $src out/qwen05-a$p $p
      score $step $src $o out/qwen05-a$p ;;
    smollm2-chat|qwen05-chat)  # lever 3: calibrated on half the bundled sample's first tokens, half conversations the
      # model writes itself from its chat template (scripts/chat_text.py), beside the preset and its seed-1 twin
      carve $src $o 50
      carve $src $o-seed1 50 --seed 1
      [ -f out/levers/chat-$m.txt ] || .venv/bin/python scripts/chat_text.py $src out/levers/chat-$m.txt \
        --tokens 12288 --prefix moeify/data/calib_sample.txt --prefix-tokens 8192
      carve $src $o-chat 50 --calib out/levers/chat-$m.txt
      score $step $src $o $o-seed1 $o-chat ;;
    smollm2-genres)  # lever 3's control: half the bundled sample's WikiText, half its other genre (War and Peace),
      # the same share of other text as smollm2-chat, real prose instead of conversations
      carve $src $o 50
      carve $src $o-seed1 50 --seed 1
      sed -n '321,$p' moeify/data/calib_sample.txt > out/levers/war-and-peace.txt  # after the blank line between
      .venv/bin/python scripts/chat_text.py $src out/levers/genres-$m.txt \
        --prefix moeify/data/calib_sample.txt --prefix-tokens 8192 --control out/levers/war-and-peace.txt
      carve $src $o-genres 50 --calib out/levers/genres-$m.txt
      score $step $src $o $o-seed1 $o-genres ;;
    smollm2-spread|qwen05-spread)  # the presets' 16,384 calibration tokens spread over the whole bundled sample
      # (both genres; moeify/formats/text.py calibration_tokens) instead of its head, beside the head-calibrated
      # preset and its seed-1 twin carved before that change (their answers cached)
      for d in $o $o-seed1; do [ -f $d/report.json ] || { echo "needs $d carved before the spread change" >&2; exit 2; }; done
      carve $src $o-spread 50
      score $step $src $o $o-seed1 $o-spread ;;
    smollm2-spread-presets)  # the 75% and 25% presets calibrated as the 50% one now is (spread), beside it
      carve $src $o-spread 50
      carve $src out/smollm2-a75-spread 75
      carve $src out/smollm2-a25-spread 25
      score $step $src $o-spread out/smollm2-a75-spread out/smollm2-a25-spread ;;
    qwen05-spread-active75|qwen05-spread-active25)  # the 0.5B's active-75 or active-25 preset calibrated spread,
      # beside the spread 50% one
      p=${step##*active}
      carve $src $o-spread 50
      carve $src out/qwen05-a$p-spread $p
      score $step $src $o-spread out/qwen05-a$p-spread ;;
    smollm2-chat-spread|qwen05-chat-spread)  # lever 3 on top of the spread windows: calibrated on half the bundled
      # sample, half the model's own conversations (chat_spread_text)
      chat_spread_text $src $m
      carve $src $o-spread 50
      carve $src $o-chat-spread 50 --calib out/levers/chat-spread-$m.txt
      score $step $src $o-spread $o-chat-spread ;;
    smollm2-spread-active75-262k|qwen05-spread-active75-262k)  # the active-75 preset (calibrated spread) tuned on
      # its 262,144 tokens: dense and the tune scored first (their file written), then the training-free carve beside
      # them (the others cached)
      a=out/${step%%-*}-a75-spread
      carve $src $a 75
      tuned $src $a $a-262k 262144
      score $step $src $a-262k
      score $step $src $a $a-262k ;;
    smollm2-spread-524k|smollm2-spread-1m)  # lever 4's tokens: the plain 262,144-token tune (smollm2-spread-262k's)
      # tuned on for 262,144 more, then (1m) 524,288 more again, beside the carve and the shorter tunes (their answers
      # cached by the earlier steps)
      carve $src $o-spread 50
      tuned $src $o-spread $o-spread-262k 262144
      tuned $src $o-spread-262k $o-spread-524k 262144
      outs=($o-spread $o-spread-262k $o-spread-524k)
      if [ $step = smollm2-spread-1m ]; then
        tuned $src $o-spread-524k $o-spread-1m 524288
        outs+=($o-spread-1m)
      fi
      score $step $src "${outs[@]}" ;;
    smollm2-spread-524k-bundled|qwen05-spread-524k-bundled|smollm2-spread-1m-bundled)  # lever 4's tokens on the
      # tune as it ships: the -bundled tune tuned on for 262,144 more (524,288 in all, newly sampled text), then (1m)
      # 524,288 more again, beside the carve and the shorter tunes (their answers cached by the earlier steps)
      flags=(--tune-text bundled:tune_prose.txt)
      carve $src $o-spread 50
      tuned $src $o-spread $o-spread-262k-bundled 262144 "${flags[@]}"
      tuned $src $o-spread-262k-bundled $o-spread-524k-bundled 262144 "${flags[@]}"
      outs=($o-spread $o-spread-262k-bundled $o-spread-524k-bundled)
      if [ $step = smollm2-spread-1m-bundled ]; then
        tuned $src $o-spread-524k-bundled $o-spread-1m-bundled 524288 "${flags[@]}"
        outs+=($o-spread-1m-bundled)
      fi
      score $step $src "${outs[@]}" ;;
    smollm2-contribution-262k-bundled|qwen05-contribution-262k-bundled|smollm2-dense-layers-262k-bundled|\
    qwen05-dense-layers-262k-bundled|smollm2-chat-spread-262k-bundled|qwen05-chat-spread-262k-bundled)
      # levers 2, 1 and 3 tuned: the lever's carve (spread windows) tuned as the preset ships, beside the preset's
      # shipped tune (answers cached by -spread-262k-bundled); retention's pairing reads the lever against it
      flags=(--tune-text bundled:tune_prose.txt)
      carve $src $o-spread 50
      tuned $src $o-spread $o-spread-262k-bundled 262144 "${flags[@]}"
      case $step in
        *-contribution-*) c=$o-spread-contribution; carve_contribution $src $c ;;
        *-dense-layers-*) c=$o-spread-dense2; carve_dense2 $src $c ;;
        *) chat_spread_text $src $m; c=$o-chat-spread
          carve $src $c 50 --calib out/levers/chat-spread-$m.txt ;;
      esac
      tuned $src $c $c-262k-bundled 262144 "${flags[@]}"
      score $step $src $o-spread-262k-bundled $c-262k-bundled ;;
    smollm2-spread-262k*|qwen05-spread-262k*)  # the spread 50% preset tuned
      # on the preset's 262,144 tokens (the bundled sample and 131,072 tokens sampled by the dense model, and since
      # 2026-12-07 the bundled prose: -bundled, in a folder of its own), or with the
      # conversations (-chat) or more real text (-prose) as its tuning text, or with each layer's output matched as
      # well (-hidden), or with attention and norms trained too (-attention), or its routers alone (-routers); all
      # but the conversations beside the plain tune in the same run (a machine moves retention by up to 3 points:
      # compare within one run)
      # -bundled names the preset's tune_text itself: a carve made before 2026-12-07 records none (its tune would
      # read the earlier mix); on a newer carve the flag repeats what its moeify.toml holds
      case $step in *-262k) flags=() ;;
        *-bundled) flags=(--tune-text bundled:tune_prose.txt) ;;
        *-chat) flags=(--tune-text out/levers/conversations-$m.txt)
          [ -f ${flags[1]} ] || .venv/bin/python scripts/chat_text.py $src ${flags[1]} --tokens 12288 ;;
        *-hidden) flags=(--hidden-weight 16) ;; *-attention) flags=(--tune-attention) ;;
        *-prose) flags=(--tune-text ../shared/corpora/war_and_peace/calib_train_200k.txt
          --tune-text ../shared/corpora/wikitext2/train.txt) ;;
        *-routers) flags=(--router-only) ;;
        *) echo "bench_tasks.sh: unknown step $step" >&2; exit 2 ;;
      esac
      carve $src $o-spread 50
      outs=() res=$step
      case $step in *-262k|*-chat|*-bundled) ;; *)
        if [ "${PLAIN:-1}" = 1 ]; then tuned $src $o-spread $o-spread-262k 262144; outs=($o-spread-262k)
        else res=$step-vs-carve; fi ;;
      esac
      tuned $src $o-spread $o-${step#*-} 262144 "${flags[@]}"
      # PLAIN=0: dense and the tune scored first (their file written), then the carve beside them
      if [ "${PLAIN:-1}" = 1 ]; then score $res $src $o-spread "${outs[@]}" $o-${step#*-}; else
        score $res $src $o-${step#*-}
        score $res $src $o-spread $o-${step#*-}
      fi ;;
    *) echo "bench_tasks.sh: unknown step $step (the steps are listed at the top of scripts/bench_tasks.sh)" >&2
       exit 2 ;;
  esac
done
