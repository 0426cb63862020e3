"""The student's MoE block, forward + backward, with each kernel (moeify/maths/moe_block.py): the masked dense products
(every neuron, the unchosen ones times 0) against the grouped ones (torch._grouped_mm over the chosen experts only),
at the presets' layouts, bf16 autocast, side by side in one process (rounds alternate; the best of --rounds).

    .venv/bin/python scripts/bench_moe_kernels.py --threads 1 --json results/tuning/moe-kernels-cpu.json
    .venv/bin/python scripts/bench_moe_kernels.py --device cuda --tokens 65536 --json ...

Layouts (hidden, experts, expert width, shared width, top-k): SmolLM2-135M's 50% and 25% presets as they resolve
(36 x 32 + 384 shared, top-12; 42 x 32 + 192, top-6) and Llama-3-8B's (hidden 4,096, d_ff 14,336: 42 x 256 +
3,584, top-14; 49 x 256 + 1,792, top-7; `moeify plan`). Wall and CPU seconds; on a GPU, synchronised wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

LAYOUTS = {"smollm2 active-50": (576, 36, 32, 384, 12), "smollm2 active-25": (576, 42, 32, 192, 6),
           "llama3-8b active-50": (4096, 42, 256, 3584, 14), "llama3-8b active-25": (4096, 49, 256, 1792, 7)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens a forward + backward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layouts", default="smollm2 active-50,smollm2 active-25", help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from test_moe_block import block

    cuda = args.device.startswith("cuda")
    rows = {}
    for name in args.layouts.split(","):
        d, n_exp, width, shared, k = LAYOUTS[name]
        moe = block("qwen2_moe", shared, n_exp=n_exp, width=width, d=d, top_k=k, shared_gate=0.01).to(args.device)
        x = torch.randn(args.tokens // 512 or 1, min(512, args.tokens), d, device=args.device)
        times: dict[str, list] = {"masked": [], "grouped": []}
        for r in range(args.rounds + 1):  # the first round warms up
            for kernel in times:
                moe.kernel = kernel
                if cuda:
                    torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.process_time()
                xx = x.clone().requires_grad_(True)
                with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):
                    y = moe(xx)
                y.float().sum().backward()
                if cuda:
                    torch.cuda.synchronize()
                if r:
                    times[kernel].append((time.perf_counter() - t0, time.process_time() - c0))
                moe.zero_grad(set_to_none=True)
        best = {kk: min(v) for kk, v in times.items()}
        active = (shared + k * width) / (shared + n_exp * width)
        rows[name] = {"active": active, **{f"{kk} wall_s": v[0] for kk, v in best.items()},
                      **{f"{kk} cpu_s": v[1] for kk, v in best.items()},
                      "grouped / masked (wall)": best["grouped"][0] / best["masked"][0]}
        print(f"{name:22s} active {active:.0%}: masked {best['masked'][0] * 1e3:8.2f} ms, grouped "
              f"{best['grouped'][0] * 1e3:8.2f} ms (x {rows[name]['grouped / masked (wall)']:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                         "threads": torch.get_num_threads(), "tokens": args.tokens,
                                         "torch": torch.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
