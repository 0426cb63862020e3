"""The two terms of `moeify tune --hidden-weight`'s loss at step 0 on a real carve: the next-token KL to the dense
model and the layers' output error (moeify.training.hidden.layer_match), with each term's gradient norm on the
experts and the cosine between the two gradients, so that a weight can be chosen that gives them a known pull
(docs/tuning.md "What tuning does"). Both models in float32 through transformers, on windows of the bundled sample:

    python scripts/layer_match_scale.py models/smollm2-135m out/smollm2-a50-spread \\
        --json results/tuning/layer-match-scale-smollm2-active50.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeify.formats.config import BUNDLED_CALIB  # noqa: E402
from moeify.formats.text import text_windows  # noqa: E402
from moeify.training.hidden import LayerOutputs, layer_match  # noqa: E402


def measure(src: Path, out: Path, windows: list[int], seq: int) -> dict:
    from transformers import AutoModelForCausalLM

    ids = text_windows(src, [BUNDLED_CALIB], seq)[windows]
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    moe = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad(), LayerOutputs(dense) as want:
        target = dense(ids).logits.float()
    for p in moe.parameters():
        p.requires_grad_(False)
    experts = [p for n, p in moe.named_parameters() if ".experts." in n or n.endswith("experts.gate_up_proj")
               or n.endswith("experts.down_proj")]
    for p in experts:
        p.requires_grad_(True)
    with LayerOutputs(moe) as got:
        logits = moe(ids).logits.float()
    kl = F.kl_div(logits.log_softmax(-1), target.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    match = layer_match(got.outputs, want.outputs)
    g_kl = torch.autograd.grad(kl, experts, retain_graph=True)
    g_match = torch.autograd.grad(match, experts)
    n_kl = torch.sqrt(sum(g.pow(2).sum() for g in g_kl)).item()
    n_match = torch.sqrt(sum(g.pow(2).sum() for g in g_match)).item()
    cos = (sum((a * b).sum() for a, b in zip(g_kl, g_match)) / (n_kl * n_match)).item()
    per_layer = [((a.float() - b).pow(2).sum(-1) / b.pow(2).sum(-1)).mean().item()
                 for a, b in zip(got.outputs, want.outputs)]
    return {"kl_nats": kl.item(), "layer_match": match.item(), "layer_match_per_layer": per_layer,
            "grad_norm_kl": n_kl, "grad_norm_layer_match": n_match, "grad_ratio_kl_over_match": n_kl / n_match,
            "grad_cosine": cos, "expert_tensors": len(experts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--windows", default="3,60", help="indices of the bundled sample's windows scored")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t = time.time()
    result = {"what": "step-0 KL and layer-output error of a carve against its dense source, their gradient norms on "
                      "the experts and the cosine between the gradients (float32)",
              "src": args.src.name, "out": args.out.name, "windows": [int(w) for w in args.windows.split(",")],
              "seq": args.seq, "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    result.update(measure(args.src, args.out, result["windows"], args.seq))
    result["seconds"] = round(time.time() - t, 1)
    print(f"KL {result['kl_nats']:.4f} nats, layer error {result['layer_match']:.4f}, gradient ratio "
          f"{result['grad_ratio_kl_over_match']:.1f}, cosine {result['grad_cosine']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
