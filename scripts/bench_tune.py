"""Cost of recovery tuning per 1,024 tokens, as ratios to a plain dense forward + backward over the same tokens.

    .venv/bin/python scripts/bench_tune.py models/smollm2-135m --threads 1 --repeats 3

Measured side by side in one process, round-robin over the rows (the machine is noisy; ratios are what transfer;
medians of --repeats rounds after an untimed one): a dense
forward + backward with the usual next-token cross-entropy (what pretraining or a LoRA step costs), one tuning step
of moeify.training.distill (teacher forward, student forward + backward, chunked KL, Adam) on a carved student (the layout of
--experts/--top-k; the partition is random: the cost does not depend on it), the same step on sampled text whose
teacher targets the sampling kept (no teacher forward), the mix of the two at --generated, the teacher pass (one
teacher forward of a real window, computed once before tuning, so the loop runs only "targets kept" steps) and the
loop plus the teacher pass at --generated (how `moeify tune` runs since the teacher pass), and sampling 1,024 tokens of tuning
text from the dense model (moeify.training.sampling.sample_text, batch 64, 112 new tokens after 16: shorter contexts than
the 512 of real tuning windows, so a lower bound). Wall and CPU seconds for each. The teacher's modules are frozen
as moeify freezes them, so the student's steps compute no weight gradients for the head, embeddings or attention
it shares with the teacher (until 2026-11-26 this bench left them trainable and overstated the step by ~18%).
"targets kept, KL unfused": the same step with the KL's softmax part eager instead of compiled (moeify.training.kl.kl_and_diff);
"float32 logits" (under bf16 autocast): the KL's two logit products in float32 (DistillSettings.kl_logits
"float32"; the default runs them in bf16 where autocast is on).
--quick: the rows of how `moeify tune` runs (dense, the loop's step fused and unfused, the teacher pass).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeify.training import distill  # noqa: E402
from moeify.training.distill import DistillSettings, accumulate_kl, final_hidden, share_frozen  # noqa: E402
from moeify.maths.moe_block import MaskedMoE  # noqa: E402
from moeify.maths.numerics import tuning_autocast  # noqa: E402
from moeify.training.sampling import sample_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-windows", type=int, default=DistillSettings(tokens=0).micro_windows,
                    help="windows per forward + backward of a tuning step (moeify's default: %(default)s)")
    ap.add_argument("--generated", type=float, default=0.5, help="share of sampled tuning text, whose teacher "
                    "targets are kept from sampling (the presets': %(default)s)")
    ap.add_argument("--quick", action="store_true", help="only the dense steps, the kept-targets step (the KL fused "
                    "and unfused) and the teacher pass: how moeify tune runs, without the older rows")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    dense = copy.deepcopy(teacher)  # trains every weight, as a dense training step does
    for p in teacher.parameters():  # frozen, as moeify.tuning.load_teacher leaves it: the modules the student shares
        p.requires_grad_(False)     # with it (head, embeddings, attention) get no weight gradients in moeify either
    student = copy.deepcopy(teacher)
    gen = torch.Generator().manual_seed(0)
    d_ff = teacher.config.intermediate_size
    for layer in student.model.layers:
        m = layer.mlp
        labels = torch.randperm(d_ff, generator=gen) % args.experts
        router = torch.randn(args.experts, teacher.config.hidden_size, generator=gen)
        layer.mlp = MaskedMoE(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, router, 1e-3, labels, args.top_k)
    for p in student.parameters():
        p.requires_grad_(False)
    params = [p for layer in student.model.layers for p in layer.mlp.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-6)
    ids = torch.randint(0, teacher.config.vocab_size, (1024 // args.seq_len, args.seq_len), generator=gen)
    ctx, bf16 = tuning_autocast("cpu", DistillSettings(tokens=0).autocast)
    share_frozen(teacher, student, train_attention=False, lowp=torch.bfloat16 if bf16 else None)  # as convert does

    def dense_step():  # float32
        dense.zero_grad(set_to_none=True)
        dense(ids, labels=ids).loss.backward()

    def dense_step_autocast():  # under the autocast tuning runs with (bf16 where the CPU or GPU has it)
        dense.zero_grad(set_to_none=True)
        with ctx:
            loss = dense(ids, labels=ids).loss
        loss.backward()

    settings = DistillSettings(tokens=0, micro_windows=args.micro_windows)

    def tune_step():  # what moeify.training.distill does per step
        opt.zero_grad(set_to_none=True)
        accumulate_kl(teacher, student, ids, student.lm_head.weight, ctx, settings)
        opt.step()

    with torch.no_grad(), ctx:  # the teacher's targets, as the sampling keeps them for the text it samples (float16)
        kept = [h for h in final_hidden(teacher, ids).to(torch.float16)]

    def tune_step_kept(step_settings=settings):  # the same step on sampled windows: the teacher's forward is skipped
        opt.zero_grad(set_to_none=True)
        accumulate_kl(teacher, student, ids, student.lm_head.weight, ctx, step_settings, kept)
        opt.step()

    prompts = torch.randint(0, teacher.config.vocab_size, (64, 16), generator=gen)

    def tune_step_kept_unfused():  # the same, the KL's softmax part eager (not compiled)
        saved = dict(distill._FUSED)
        distill._FUSED["fn"] = None
        try:
            tune_step_kept()
        finally:
            distill._FUSED.clear()
            distill._FUSED.update(saved)

    def sample():
        sample_text(dense, prompts, 112, 0)  # 64 x 112 = 7 x 1,024 new tokens (convert samples before tuning)

    def teacher_forward():  # the teacher pass: one float32 forward of a real window, once per window a run draws
        with torch.no_grad(), ctx:
            for w in ids.split(max(1, settings.micro_windows)):
                final_hidden(teacher, w).float()

    rows = {}
    dense_rows = (("dense forward + backward (CE)", dense_step),) + (
        (("dense fwd + bwd (CE), bf16 autocast", dense_step_autocast),) if bf16 else ())
    f32_settings = DistillSettings(tokens=0, micro_windows=args.micro_windows, kl_logits="float32")

    def tune_step_kept_f32():  # kl_logits "float32": the KL's logit products in float32
        tune_step_kept(f32_settings)

    kept_rows = (("tuning step, targets kept", tune_step_kept),
                 ("tuning step, targets kept, KL unfused", tune_step_kept_unfused)) + (
        (("tuning step, targets kept, float32 logits", tune_step_kept_f32),) if bf16 else ())
    teacher_row = (("teacher pass (forward)", teacher_forward),)
    runs = dense_rows + kept_rows + teacher_row if args.quick else dense_rows + (
        ("tuning step (KL distillation)", tune_step),) + kept_rows + teacher_row + (
        ("sampling tuning text", sample),)
    walls, cpus = {name: [] for name, _ in runs}, {name: [] for name, _ in runs}
    for r in range(args.repeats + 1):  # round-robin (round 0 untimed): a slow minute of the machine hits every row
        for name, fn in runs:
            w, c = time.perf_counter(), time.process_time()
            fn()
            if r:
                walls[name].append(time.perf_counter() - w)
                cpus[name].append(time.process_time() - c)
    for name, fn in runs:
        w, c = (sorted(x[name])[len(x[name]) // 2] for x in (walls, cpus))
        rows[name] = (w / 7, c / 7) if fn is sample else (w, c)
    g = args.generated
    if not args.quick:
        rows[f"tuning step, {g:.0%} sampled text"] = tuple(
            (1 - g) * a + g * b for a, b in zip(rows["tuning step (KL distillation)"], rows["tuning step, targets kept"]))
    # with the teacher pass the loop never runs the teacher: every step is a "targets kept" step, and the real windows a
    # run draws cost one teacher forward each, once (the teacher pass; at most once per token when a run makes one
    # pass or fewer over its real text, as the presets do)
    for kept_name, suffix in zip((k for k, _ in kept_rows), ("", ", KL unfused", ", float32 logits")):
        rows[f"tuning + teacher pass, {g:.0%} sampled{suffix}"] = tuple(
            a + (1 - g) * b for a, b in zip(rows[kept_name], rows["teacher pass (forward)"]))
    base = rows["dense fwd + bwd (CE), bf16 autocast" if bf16 else "dense forward + backward (CE)"][0]  # like for like
    print(f"{args.model.name}, {args.experts} experts top-{args.top_k}, {args.threads} thread(s), micro-batches of {args.micro_windows} window(s), bf16 autocast "
          f"{'on' if bf16 else 'off'}; per 1,024 tokens (median of {args.repeats})")
    print(f"| {'what':34s} | wall s | CPU s | × dense fwd+bwd{' (bf16)' if bf16 else ''} |\n|{'-' * 36}|-------:|------:|---:|")
    for name, (w, c) in rows.items():
        print(f"| {name:34s} | {w:6.2f} | {c:5.2f} | {w / base:.2f} |")
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS of this process (teacher, dense copy, student's FFNs, Adam state): {peak:.2f} GB")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "experts": args.experts, "top_k": args.top_k,
                                         "bf16": bf16, "repeats": args.repeats, "quick": args.quick,
                                         "rows": {k: {"wall": w, "cpu": c} for k, (w, c) in rows.items()},
                                         "rounds_wall": walls}, indent=1) + "\n")


if __name__ == "__main__":
    main()
