#!/bin/bash
# Granularity on real models (issue 45): the same preset carved at finer and coarser slices of d_ff, with the same
# calibration text, scored on the same four held-out texts as the scale runs (scripts/bench_scale_qwen05.sh: first
# 8,192 tokens, windows of 256, float32; WikiText-2, Shakespeare, GPL-3, Python's argparse.py), training-free and
# after tuning on 65,536 fresh tokens (`moeify tune`, the presets' defaults). Each step writes its result file at once
# under results/granularity/:
#     bash scripts/bench_granularity.sh STEP...      e.g.  q25-76 q25-76-tune q25-64 s25-96 layers
# A step is MODEL PRESET - SLICES [-tune]: q = Qwen2.5-Coder-0.5B (d_ff 4,864), s = SmolLM2-135M (d_ff 1,536);
# 25 or 50 (configs/active-25.toml, active-50.toml); slices = routed + shared experts, each d_ff / slices wide.
# SLICES ending in n: the layout the preset resolves to without a shared expert (what a Qwen3 source gets: Qwen3-MoE
# has none; issue 44), e.g. q50-32n, s25-48n: SmolLM2 into Mixtral (top-k weights renormalised, as Qwen3-MoE does),
# the 0.5B into Qwen2-MoE with --shared 0 (Mixtral cannot hold its q/k/v biases; Qwen2-MoE does not renormalise).
# SLICES 19 (the 0.5B) and 24 (SmolLM2): widths 256 and 64, twice the presets' (issue 54: K-quant width 256 against
# 128 at 1B+ shapes), the counts the [layout] rules give at that slice count (outside the presets' ×2 window).
# `layers` summarises the per-layer errors of every carve made so far (scripts/layer_errors.py).
# `decode` times greedy decoding of each layout against dense (scripts/bench_serve.py: weight-only carves, 1 thread;
# run it alone on an idle machine): llama.cpp Q8_0 and f16 (the 0.5B, SmolLM2) and Q8_0 (the 1.1B Llama shape of
# BENCHMARKS "Serving speed", synthetic weights in build/l1b), and transformers float32; results/granularity/decode-*.json.
# Where the preset's own shared share would need top-k > 16 (llama.cpp's limit), the shared expert takes the
# difference (same active share, top-16): q25-152, q50-76 and s50-96.
set -euo pipefail
cd "$(dirname "$0")/.."
CALIB=../shared/corpora/wikitext2/calib_train_200k.txt
CODE=$(.venv/bin/python -c 'import argparse; print(argparse.__file__)')
TEXTS="../shared/corpora/wikitext2/valid.txt ../shared/corpora/tinyshakespeare/valid.txt /usr/share/common-licenses/GPL-3 $CODE"
THREADS=${THREADS:-2}
RESULTS=results/granularity
declare -A SRC=([q]=models/qwen2.5-coder-0.5b [s]=models/smollm2-135m)
declare -A NAME=([q]=qwen05 [s]=smollm2)
# MODEL PRESET SLICES -> "routed shared top-k"
declare -A LAYOUT=(
  [q-25-38]="33 5 5"  [q-25-64]="56 8 8"    [q-25-76]="66 10 9"   [q-25-152]="130 22 16"
  [q-50-38]="28 10 9" [q-50-64]="48 16 16"  [q-50-76]="54 22 16"
  [s-25-48]="42 6 6"  [s-25-64]="56 8 8"    [s-25-96]="84 12 12"
  [s-50-48]="36 12 12" [s-50-64]="48 16 16" [s-50-96]="64 32 16"
  [q-25-19]="17 2 3"  [q-50-19]="14 5 5"    [s-25-24]="21 3 3"    [s-50-24]="18 6 6"
  [q-50-32n]="32 0 16" [q-25-38n]="38 0 10" [s-50-32n]="32 0 16" [s-25-48n]="48 0 12"
)
mkdir -p $RESULTS out
score() {  # OUT LABEL JSON
  local m=$1; shift
  .venv/bin/python scripts/bench_curve.py ${SRC[$m]} "$1" --eval $TEXTS --threads $THREADS --label "$2" --json "$3"
}
# the layouts timed by `decode`, per model: each preset's K-quant, Q8_0 and bf16 resolutions (--serve) and 96 x 16
declare -A DECODE=([qwen05]=s5e33k5,s10e66k9,s8e56k8,s10e28k9,s16e48k16 [l1b]=s4e28k4,s8e56k8,s8e24k8,s16e48k16
                   [smollm2]=s6e42k6,s8e56k8,s12e84k12,s12e36k12,s16e48k16,s32e64k16)
decode() {
  [ -f build/l1b/config.json ] || .venv/bin/python scripts/make_synthetic_checkpoint.py build/l1b --hidden 2048 \
    --intermediate 8192 --layers 16 --heads 32 --kv-heads 8 --vocab 49152 --dtype bfloat16 --tokenizer ${SRC[s]}
  [ -x build/llvenv/bin/python ] || { python3 -m venv build/llvenv && build/llvenv/bin/pip install -q xllamacpp; }
  local ll="--no-transformers --llamacpp-python build/llvenv/bin/python --work build/serve --rounds 5 --threads 1"
  local -A path=([qwen05]=${SRC[q]} [smollm2]=${SRC[s]} [l1b]=build/l1b)
  for m in qwen05 l1b smollm2; do
    .venv/bin/python scripts/bench_serve.py ${path[$m]} --layouts ${DECODE[$m]} $ll --outtype q8_0 \
      --json $RESULTS/decode-$m-llamacpp-q8_0.json
  done
  for m in qwen05 smollm2; do
    .venv/bin/python scripts/bench_serve.py ${path[$m]} --layouts ${DECODE[$m]} $ll --outtype f16 \
      --json $RESULTS/decode-$m-llamacpp-f16.json
  done
  for m in qwen05 smollm2 l1b; do
    local extra=""; [ $m = l1b ] && extra="--rounds 2 --prompt-tokens 64 --new-tokens 16"
    .venv/bin/python scripts/bench_serve.py ${path[$m]} --layouts ${DECODE[$m]} --threads 1 --work build/serve $extra \
      --json $RESULTS/decode-$m-transformers.json
  done
}
# `kquants`: what experts of 128 cost in llama.cpp's K-quants against 256 (issue 54): each preset's 256- and 128-wide
# layouts at the 1.1B shape (d_ff 8,192: 32 x 256 against 64 x 128) and the 25% preset at the Llama-3-8B widths (8
# layers, d_ff 14,336: 56 x 256 against 112 x 128; at 50% 112 slices would need top-28), weight-only carves of synthetic
# weights (SmolLM2's tokenizer, vocab 49,152), converted to f16 GGUF and llama-quantize'd to Q4_K_M: the file's size,
# the tensors that fell back and to which type, decode tokens/s at 1 thread (run it alone on an idle machine).
kquants() {
  [ -f build/l1b/config.json ] || .venv/bin/python scripts/make_synthetic_checkpoint.py build/l1b --hidden 2048 \
    --intermediate 8192 --layers 16 --heads 32 --kv-heads 8 --vocab 49152 --dtype bfloat16 --tokenizer ${SRC[s]}
  [ -f build/l8b-8/config.json ] || .venv/bin/python scripts/make_synthetic_checkpoint.py build/l8b-8 --layers 8 \
    --vocab 49152 --tokenizer ${SRC[s]}
  [ -x build/llvenv/bin/python ] || { python3 -m venv build/llvenv && build/llvenv/bin/pip install -q xllamacpp; }
  local ll="--no-transformers --llamacpp-python build/llvenv/bin/python --work build/serve --rounds 5 --threads 1"
  .venv/bin/python scripts/bench_serve.py build/l1b --layouts s4e28k4,s8e56k8,s8e24k8,s16e48k16 $ll --outtype f16 \
    --quantize Q4_K_M --json $RESULTS/decode-l1b-llamacpp-q4_k_m.json
  .venv/bin/python scripts/bench_serve.py build/l8b-8 --layouts s7e49k7,s14e98k14 $ll --outtype f16 \
    --quantize Q4_K_M --json $RESULTS/decode-l8b-llamacpp-q4_k_m.json
}
for step in "$@"; do
  if [ "$step" = kquants ]; then
    kquants
    continue
  fi
  if [ "$step" = decode ]; then
    decode
    continue
  fi
  if [ "$step" = layers ]; then
    .venv/bin/python scripts/layer_errors.py $(ls -d out/gran-*/ | grep -v -- '-tune' | grep -v moeify-tune) \
      --json $RESULTS/layer-errors.json
    continue
  fi
  IFS=- read -r mp u tune <<< "$step"
  m=${mp:0:1}; p=${mp:1}
  key=$m-$p-$u
  [ -n "${LAYOUT[$key]:-}" ] || { echo "unknown step $step (known: ${!LAYOUT[*]})" >&2; exit 2; }
  read -r n s k <<< "${LAYOUT[$key]}"
  out=out/gran-$m$p-$u
  width=$(( $( [ $m = q ] && echo 4864 || echo 1536 ) / ${u%n} ))
  label="active-$p, ${u%n} x $width (shared $s + top-$k of $n), ${NAME[$m]}"
  [ "$s" = 0 ] && label="active-$p without a shared expert, ${u%n} x $width (top-$k of $n), ${NAME[$m]}"
  if [ -z "$tune" ]; then
    fmt=""
    [ "$s" = 0 ] && [ $m = s ] && fmt="--format mixtral"
    [ "$s" = 0 ] && [ $m = q ] && fmt="--force"  # llama.cpp's qwen2moe wants a shared expert: a measurement only
    /usr/bin/time -v .venv/bin/moeify convert ${SRC[$m]} $out --preset configs/active-$p.toml --experts $n \
      --shared $s --top-k $k $fmt --calib $CALIB --no-tune --overwrite --json $out.convert.json > $out.convert.log 2>&1
    score $m $out "training-free, $label" $RESULTS/${NAME[$m]}-active$p-${u%n}x$width$([ "$s" = 0 ] && echo -noshared)-trainingfree.json
  else
    t=out/gran-$m$p-$u-tune
    rm -rf $t $t.moeify-tune; cp -r $out $t
    /usr/bin/time -v .venv/bin/moeify tune ${SRC[$m]} $t --tokens 65536 --json $t.tune.json > $t.tune.log 2>&1
    score $m $t "65,536 tokens, $label" $RESULTS/${NAME[$m]}-active$p-${u%n}x$width$([ "$s" = 0 ] && echo -noshared)-65k.json
  fi
done
