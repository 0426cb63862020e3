"""Which serving engines run a planned output layout, and which run it slowly: the guard rails of `convert`,
`convert --dry-run` and `plan`.

Each verdict is a fact measured or read off the engine's code (BENCHMARKS.md "Serving correctness: transformers, vLLM,
llama.cpp"; ../shared/FORMATS.md):
- llama.cpp sizes a model's compute graph at max(1024, 8 x its tensor count) nodes (`graph_max_nodes`,
  src/llama-context.cpp) and its MoE block adds a view and an add node per used expert per layer, so a top-k above
  about 20 overflows it and aborts (`GGML_ASSERT(obj_new)`) whatever the model size: measured, top-24 and top-32
  abort, top-16 runs (llama.cpp 2026-10, SmolLM2-135M and a 1B Llama shape).
- llama.cpp's qwen2moe graph has no tied output (`missing tensor 'output.weight'`), no dense (`mlp_only_layers`)
  layers, and wants a shared expert. Its qwen3moe takes a tied output (the embedding duplicated) and no dense layers
  either (every layer's experts are required tensors; src/models/qwen3moe.cpp).
- Qwen3-MoE (transformers, vLLM, llama.cpp) has no shared expert: convert refuses one for a Qwen3 source.
- llama.cpp quantizes a row only when its length is a multiple of the block (32 for Q8_0/Q4_0, 256 for K-quants);
  an expert down_proj row is the expert width, else it falls back to a wider type (finally F16).
- vLLM's Qwen2-MoE assumes head_dim = hidden / heads (it cuts the q/k/v/o weights to that size without an error:
  measured wrong by 5.7 in log-probability), and without a shared expert it builds no `shared_expert` module, so the
  empty `shared_expert.*` tensors transformers needs stop its loader ("There is no module or parameter named
  'model.layers.0.mlp.shared_expert'"; vLLM 0.32 on CPU, scripts/check_vllm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("transformers", "vllm", "llama.cpp")
LLAMACPP_MAX_TOPK = 16  # the largest top-k measured to run (24 and 32 abort); see the module docstring


@dataclass(frozen=True)
class EngineNote:
    engine: str
    fails: bool  # True: the engine cannot load or run the output; False: it runs, slower or larger
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.engine}: {'fails' if self.fails else 'runs'}: {self.what} ({self.fix})"


def engine_notes(fmt: str, top_k: int, experts: int, shared_width: int, padded_width: int, tied_out: bool,
                 dense_layers: int, head_dim: int, hidden: int, heads: int, qkv_bias: bool = False,
                 renormalised: bool = False, upcycle: str | None = None) -> list[EngineNote]:
    """What each engine says of a planned layout (empty: every engine runs it as well as its width allows).
    qkv_bias: the source has q/k/v biases (Qwen2), so Mixtral is no way out. renormalised: a Qwen2-MoE written with
    norm_topk_prob true (an upcycle), which llama.cpp's qwen2moe does not honour. upcycle: "upcycle" or "merge", whose
    flags the fixes then name (--shared-width, --granularity; a merge's shared expert is its YAML's shared_experts),
    not convert's."""
    notes = []
    mixtral = "" if qkv_bias else "use --format mixtral or "
    shared_fix = {"upcycle": "--shared-width W", "merge": "name one in the YAML's shared_experts"
                  }.get(upcycle or "", "--shared S")
    if fmt == "qwen2_moe" and renormalised:
        notes.append(EngineNote("llama.cpp", True, "its qwen2moe never renormalises the top-k weights (it ignores "
                                "norm_topk_prob), so the copies' outputs are scaled by their share of the softmax and "
                                "the model is not the source there", f"{mixtral}serve it with transformers or vLLM "
                                "(both honour norm_topk_prob)"))
    if top_k > LLAMACPP_MAX_TOPK:
        notes.append(EngineNote("llama.cpp", True, f"top-k {top_k} overflows its compute graph (more than "
                                f"{LLAMACPP_MAX_TOPK} experts per token abort with GGML_ASSERT(obj_new))",
                                f"use --top-k ≤ {LLAMACPP_MAX_TOPK}: fewer, wider slices (a smaller --granularity)"
                                if upcycle else
                                f"use --top-k ≤ {LLAMACPP_MAX_TOPK}: fewer, wider experts (e.g. --experts "
                                f"{max(2, experts * LLAMACPP_MAX_TOPK // top_k)} --top-k {LLAMACPP_MAX_TOPK}) or a "
                                "shared expert"))
    if fmt == "qwen2_moe":
        if tied_out:
            notes.append(EngineNote("llama.cpp", True, "its qwen2moe has no tied output (missing output.weight)",
                                    "pass --untie-embeddings"))
        if dense_layers:
            notes.append(EngineNote("llama.cpp", True, "its qwen2moe has no dense (mlp_only_layers) layers",
                                    "leave out --dense-layers"))
        if not shared_width:
            notes.append(EngineNote("llama.cpp", True, "its qwen2moe expects a shared expert",
                                    f"{mixtral}{shared_fix}"))
            notes.append(EngineNote("vllm", True, "its Qwen2-MoE builds no shared expert at "
                                    "shared_expert_intermediate_size 0 and refuses the checkpoint's empty "
                                    "shared_expert tensors", f"{mixtral}{shared_fix}"))
        if head_dim * heads != hidden:
            fix = "use --format mixtral" if not qkv_bias else "serve it with transformers or llama.cpp"
            if shared_width and not qkv_bias:  # the Mixtral layout with the same share of neurons active, top-k within llama.cpp's
                slices = shared_width / padded_width
                share = (top_k + slices) / (experts + slices)
                fix = (f"use --format mixtral --shared 0 --experts {round(LLAMACPP_MAX_TOPK / share)} --top-k "
                       f"{LLAMACPP_MAX_TOPK} (the same {share:.0%} active), or --target transformers,llama.cpp")
            notes.append(EngineNote("vllm", True, f"its Qwen2-MoE assumes head_dim = hidden / heads "
                                    f"({hidden // heads}), the source has {head_dim}", fix))
    if fmt == "qwen3_moe":
        if dense_layers:
            notes.append(EngineNote("llama.cpp", True, "its qwen3moe has no dense (mlp_only_layers) layers",
                                    "leave out --dense-layers"))
        if shared_width:
            share = (top_k + shared_width / padded_width) / (experts + shared_width / padded_width)
            n, k = same_share_layout(shared_width + experts * padded_width, share)
            notes.append(EngineNote("transformers", True, "Qwen3-MoE (the one stock class with Qwen3's q/k norms) "
                                    "has no shared expert", f"--format qwen3_moe --shared 0 --experts {n} --top-k {k}:"
                                    f" the same {share:.0%} active"))
    if padded_width % 32:
        notes.append(EngineNote("llama.cpp", False, f"expert width {padded_width} is not a multiple of 32: Q8_0/Q4_0 "
                                "fall back to a wider type for the experts",
                                "a --granularity whose slices are multiples of 32" if upcycle else
                                "--pad-experts-to 32, or fewer experts"))
    return notes


def same_share_layout(d_ff: int, share: float, max_top_k: int = LLAMACPP_MAX_TOPK) -> tuple[int, int]:
    """(experts, top-k) without a shared expert, top-k = max_top_k, with about `share` of d_ff active: the divisor
    of d_ff nearest max_top_k / share (experts of a width quantized kernels take first: 256, 128, 32)."""
    want = max_top_k / share
    divisors = [n for n in range(max_top_k + 1, 257) if d_ff % n == 0] or [max_top_k * 2]

    def cost(n: int) -> tuple:  # within 2 points of the share first, then the widest quantum, then the nearest
        width = d_ff // n
        return (abs(max_top_k / n - share) > 0.02, -next((q for q in (256, 128, 32) if width % q == 0), 1), abs(n - want))
    return min(divisors, key=cost), max_top_k


def blocking(notes: list[EngineNote], targets: tuple[str, ...]) -> list[EngineNote]:
    """The notes that stop a conversion for the named targets."""
    return [n for n in notes if n.fails and n.engine in targets]


def refuse_blocked(notes: list[EngineNote], targets: tuple[str, ...], force: bool) -> None:
    """MoeifyError for the first note that stops a --target engine, unless --force."""
    from ..errors import MoeifyError

    stop = blocking(notes, targets)
    if stop and not force:
        n = stop[0]
        raise MoeifyError(f"--target {n.engine}: {n.engine} cannot run this layout: {n.what}",
                          f"{n.fix}; or pass --force to write it anyway")


__all__ = ["refuse_blocked", "ENGINES", "LLAMACPP_MAX_TOPK", "EngineNote", "engine_notes", "blocking", "same_share_layout"]
