"""How a sampling step's cost grows with the KV cache: the dense model continues a batch of prompts with a clock on
generate() (moeify.training.sampling.sample_text(step_times=)), and the fit `tune --dry-run` uses
(moeify.training.sampling.sampling_seconds_per_token) is printed beside the measured steps. A benchmark, not CI.

    .venv/bin/python scripts/bench_sampling.py models/smollm2-135m --threads 2 --prompt 16 --new 96
    .venv/bin/python scripts/bench_sampling.py models/smollm2-135m --threads 2 --prompt 440 --new 24   # late steps
    .venv/bin/python scripts/bench_sampling.py models/smollm2-135m --threads 2 --new 496 --cache dynamic  # a window
    .venv/bin/python scripts/bench_sampling.py models/smollm2-135m --threads 2 --new 496 --bf16  # as tune samples
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a dense Hugging Face checkpoint")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64, help="sequences sampled together (tune samples 64)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (tune: 16)")
    ap.add_argument("--new", type=int, default=96, help="tokens to generate")
    ap.add_argument("--window", type=int, default=512, help="the window length the fit is read at (tune: 512)")
    ap.add_argument("--cache", choices=("static", "dynamic"), default="static", help="transformers' KV cache "
                    "(tune: static)")
    ap.add_argument("--bf16", action="store_true", help="sample under bf16 autocast (tune: where tuning runs under "
                    "it, i.e. on CPUs with AVX512-BF16/AMX and on GPUs)")
    ap.add_argument("--device", default="cpu", help="where the model samples (cpu, cuda)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from moeify.training.sampling import sample_text, sampling_seconds_per_token

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval().to(a.device)
    prompts = torch.randint(100, model.config.vocab_size, (a.batch, a.prompt), generator=torch.Generator().manual_seed(0))
    stamps: list = []
    t0, c0 = time.time(), time.process_time()
    with torch.no_grad():
        sample_text(model, prompts, a.new, 0, batch=a.batch, keep_hidden=True, step_times=stamps, cache=a.cache,
                    bf16=a.bf16)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    total, cpu = time.time() - t0, time.process_time() - c0
    steps = [(n, t - t_prev) for (_, t_prev), (n, t) in zip(stamps, stamps[1:])]
    print(f"{a.batch} x {a.new} tokens after {a.prompt}-token prompts: {total:.1f} s ({a.threads} thread(s), "
          f"{a.cache} cache, {'bf16 autocast' if a.bf16 else 'float32'}; CPU {cpu:.1f} s)")
    print(f"{'length':>8} {'ms a step':>10}")
    for n, d in steps[:: max(1, len(steps) // 8)]:
        print(f"{n:8d} {1000 * d:10.1f}")
    decode = sum(d for _, d in steps) / len(steps)
    fit = sampling_seconds_per_token(stamps, a.prompt, a.window)
    print(f"mean step measured {1000 * decode:.1f} ms ({1000 * decode / a.batch:.2f} ms a token); fitted at the mean "
          f"length of a {a.window}-token window from {a.prompt}-token prompts: {1000 * fit:.1f} ms "
          f"({1000 * fit / a.batch:.2f} ms a token)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
