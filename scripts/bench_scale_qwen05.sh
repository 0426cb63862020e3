#!/bin/bash
# The scale question: both presets carved from the real Qwen2.5-Coder-0.5B (scripts/get_qwen05.py) and
# from SmolLM2-135M (scripts/get_smollm2.py) with the same calibration text, scored on the same four held-out texts
# (first 8,192 tokens, windows of 256, float32; WikiText-2, Shakespeare, GPL-3, and code: Python's argparse.py,
# which no tuning or calibration text contains), training-free and after tuning on 65,536 or 262,144 fresh
# tokens (`moeify tune`, the presets' defaults). Steps run one after another and each writes its result file at once,
# named by what it measured: results/quality/NAME-trainingfree.json (both presets) and
# results/quality/NAME-activeP-TOKENS.json (NAME qwen05 or smollm2, P 50 or 25, TOKENS 65k or 262k):
#     bash scripts/bench_scale_qwen05.sh [STEP...]    (steps: carve, tune, tune262, tune25,
#                                                         tune25_262; default carve tune;
#                                                         MODELS="q s")
set -euo pipefail
cd "$(dirname "$0")/.."
CALIB=../shared/corpora/wikitext2/calib_train_200k.txt
CODE=$(.venv/bin/python -c 'import argparse; print(argparse.__file__)')
TEXTS="../shared/corpora/wikitext2/valid.txt ../shared/corpora/tinyshakespeare/valid.txt /usr/share/common-licenses/GPL-3 $CODE"
declare -A SRC=([q]=models/qwen2.5-coder-0.5b [s]=models/smollm2-135m)
declare -A NAME=([q]=qwen05 [s]=smollm2)
MODELS=${MODELS:-q s}  # q: Qwen2.5-Coder-0.5B, s: SmolLM2-135M
steps=${*:-carve tune}
tune_and_score() {  # MODEL PRESET TOKENS TOKENS_LABEL: tune from the training-free carve, then score
  local out=out/scale-$1$2-$4
  rm -rf $out $out.moeify-tune; cp -r out/scale-$1$2 $out
  /usr/bin/time -v .venv/bin/moeify tune ${SRC[$1]} $out --tokens $3 --json $out.tune.json > $out.tune.log 2>&1
  local label="active-$2, $(printf "%'d" $3) tokens, $1" json=results/quality/${NAME[$1]}-active$2-$4.json
  .venv/bin/python scripts/bench_curve.py ${SRC[$1]} $out --eval $TEXTS --threads 2 --label "$label" --json $json
}
for step in $steps; do for m in $MODELS; do
  case $step in
    carve)  # both presets training-free, then scored
      for p in 50 25; do
        /usr/bin/time -v .venv/bin/moeify convert ${SRC[$m]} out/scale-$m$p --preset configs/active-$p.toml \
          --calib $CALIB --no-tune --overwrite --json out/scale-$m$p.convert.json > out/scale-$m$p.convert.log 2>&1
      done
      .venv/bin/python scripts/bench_curve.py ${SRC[$m]} out/scale-${m}50 out/scale-${m}25 --eval $TEXTS \
        --threads 2 --label "training-free, $m" --json results/quality/${NAME[$m]}-trainingfree.json ;;
    tune)     tune_and_score $m 50 65536 65k ;;    # the 50% preset tuned on 65,536 tokens from its carve
    tune262)  tune_and_score $m 50 262144 262k ;;  # ... on 262,144 tokens (a single run, not a resumed one)
    tune25)   tune_and_score $m 25 65536 65k ;;    # the 25% preset on 65,536 tokens
    tune25_262) tune_and_score $m 25 262144 262k ;;  # ... on 262,144 tokens
  esac
done; done
