"""`moeify verify OUT [--against SRC]`: is a converted checkpoint complete, consistent and faithful?

Cheap checks (headers only; `convert` runs them on its own output before committing it):
- config.json is a mixtral / qwen2_moe / qwen3_moe config, and every tensor it implies is in the shards with the right shape
  and dtype, nothing else is;
- the index agrees with the shard headers (every entry in the named file, every tensor indexed, total_size right,
  no stray shards);
- report.json (when present) has one entry per layer, dense where config.json says so, and a true permutation.

Full checks (read every tensor once): no NaN/Inf anywhere.

Against the source (`--against SRC`):
- every non-FFN tensor equals the source's, cast to the output dtype, bit for bit;
- for each MoE layer, the experts' gate/up rows un-permuted (report.json's `perm`) give back the source
  gate_proj/up_proj bit for bit, and each expert's down_proj is the source's columns times its factor
  (routed: k = top_k when the top-k weights are renormalised (mixtral, qwen3_moe), else N = the number of experts (qwen2_moe
  with norm_topk_prob false); qwen2_moe shared expert: 2), rounded once to the output dtype, bit for bit; added
  q/k/v biases are the source's (Qwen2) or zero (added for a Llama/Mistral) and the shared-expert gate is report.json's constant row; dense layers equal the source;
- logits: both models in float32 (the dense one rounded through the output dtype first), the MoE model with every
  expert active at exactly unit gates (router rows and shared-expert gate zeroed so every gate is 1/N and the shared
  gate 1/2, down_proj times N/k), on a short random input: max |logit difference| ≤ LOGIT_RTOL × max |dense logit|.
  The reference's routed down_proj columns get the one rounding the converter cannot avoid (× k stored in the output
  dtype, exact for a power-of-two k; the bitwise check covers it), so this compares routing and structure, and is
  ~1e-6 when all is well.
Layers whose down_proj was refit (`--compensate`) or whose expert weights were tuned (`--fit-epochs`, report.json
`tuned`) are not the dense FFN by design: those tensors and the logits comparison are skipped and say so; the
structure, the untouched tensors and the permutation are still checked. Likewise a layer whose attention and norms
were tuned (`--tune-attention`, report.json `attention_tuned`).

Written from the config, not from the converter's own tables, so a bug in one is not hidden by the other.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..formats.checkpoint import DTYPE_NAMES, INDEX_NAME, CheckpointReader
from ..errors import MoeifyError

LOGIT_RTOL = 1e-3
MAX_LISTED = 20  # problems listed per check before "... and N more"
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class VerifyResult:
    path: Path
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # one line per check that ran
    skipped: list[str] = field(default_factory=list)  # one line per check that could not run, and why
    max_logit_diff: float | None = None
    logit_scale: float | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"path": str(self.path), "ok": self.ok, "problems": self.problems, "checked": self.checked,
                "skipped": self.skipped, "max_logit_diff": self.max_logit_diff, "logit_scale": self.logit_scale}


# ------------------------------------------------------------------------------------------------ the layout


@dataclass(frozen=True)
class MoeLayout:
    """What config.json of a Mixtral / Qwen2-MoE checkpoint implies about its tensors."""

    fmt: str
    n_layers: int
    hidden: int
    n_experts: int
    top_k: int
    expert_width: int
    shared_width: int  # 0 for mixtral
    dense_width: int  # qwen2_moe intermediate_size (dense layers)
    dense_layers: tuple[int, ...]
    dtype: torch.dtype | None
    tied: bool
    shapes: dict[str, tuple[int, ...]]  # every tensor name -> shape, in layer order
    renormalize: bool = True  # top-k weights renormalised (Mixtral; Qwen2-MoE with norm_topk_prob)

    @property
    def routed_factor(self) -> int:
        """The routed experts' down_proj factor for unit gates: top_k when renormalised, else n_experts."""
        return self.top_k if self.renormalize else self.n_experts

    def is_dense(self, layer_idx: int) -> bool:
        return layer_idx in self.dense_layers

    def expert_names(self, layer_idx: int, expert_idx: int) -> tuple[str, str, str]:
        return expert_names(self.fmt, layer_idx, expert_idx)

    def router_name(self, layer_idx: int) -> str:
        return f"model.layers.{layer_idx}.{'block_sparse_moe' if self.fmt == 'mixtral' else 'mlp'}.gate.weight"


def expert_names(fmt: str, layer_idx: int, expert_idx: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one routed expert."""
    if fmt == "mixtral":
        p = f"model.layers.{layer_idx}.block_sparse_moe.experts.{expert_idx}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer_idx}.mlp.experts.{expert_idx}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def read_layout(out: Path) -> MoeLayout:
    """Parse OUT/config.json (MoeifyError if it cannot be read at all)."""
    from ..formats.families import read_config

    raw = read_config(out)
    fmt = raw.get("model_type")
    if fmt not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        raise MoeifyError(f"{out}/config.json: model_type {fmt!r} is not a format moeify writes",
                          "verify checks mixtral, qwen2_moe and qwen3_moe checkpoints")
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    cls = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}[fmt]
    try:
        cfg = cls.from_dict({k: v for k, v in raw.items() if k != "auto_map"})
    except Exception as exc:  # transformers raises many types for bad values
        raise MoeifyError(f"{out}/config.json could not be read as a {fmt} config: {exc}") from None
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok",
            "intermediate_size", "num_local_experts" if fmt == "mixtral" else "num_experts"]
    if fmt == "qwen2_moe":
        keys += ["moe_intermediate_size", "shared_expert_intermediate_size"]
    for key in keys:
        value = getattr(cfg, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MoeifyError(f"{out}/config.json: {key} must be a non-negative integer, got {value!r}")
    h, n_layers, heads, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size
    kv = cfg.num_key_value_heads or heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    tied = bool(cfg.tie_word_embeddings)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    dtype = DTYPE_NAMES.get(dtype_name) if isinstance(dtype_name, str) else None
    if fmt == "mixtral":
        n_experts, width, shared, dense_width, dense_layers = cfg.num_local_experts, cfg.intermediate_size, 0, 0, ()
    else:
        n_experts, width = cfg.num_experts, cfg.moe_intermediate_size
        shared = cfg.shared_expert_intermediate_size if fmt == "qwen2_moe" else 0
        dense_width = cfg.intermediate_size
        step = cfg.decoder_sparse_step or 1
        dense_layers = tuple(i for i in range(n_layers) if i in (cfg.mlp_only_layers or []) or n_experts == 0
                             or (i + 1) % step != 0)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    q, kvd = heads * head_dim, kv * head_dim
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kvd, h), p + "self_attn.v_proj.weight": (kvd, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)})
        if fmt == "qwen2_moe" and cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kvd,),
                           p + "self_attn.v_proj.bias": (kvd,)})
        if fmt == "qwen3_moe":
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
        if i in dense_layers:
            m = p + "mlp."
            shapes.update({m + "gate_proj.weight": (dense_width, h), m + "up_proj.weight": (dense_width, h),
                           m + "down_proj.weight": (h, dense_width)})
            continue
        m = p + ("block_sparse_moe." if fmt == "mixtral" else "mlp.")
        shapes[m + "gate.weight"] = (n_experts, h)
        for e in range(n_experts):
            g, u, d = expert_names(fmt, i, e)
            shapes.update({g: (width, h), u: (width, h), d: (h, width)})
        if fmt == "qwen2_moe":
            shapes.update({m + "shared_expert.gate_proj.weight": (shared, h), m + "shared_expert.up_proj.weight": (shared, h),
                           m + "shared_expert.down_proj.weight": (h, shared), m + "shared_expert_gate.weight": (1, h)})
    shapes["model.norm.weight"] = (h,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    return MoeLayout(fmt, n_layers, h, n_experts, cfg.num_experts_per_tok, width, shared, dense_width, dense_layers,
                     dtype, tied, shapes, renormalize=fmt == "mixtral" or bool(cfg.norm_topk_prob))


def _listed(problems: list[str], what: str) -> list[str]:
    if len(problems) <= MAX_LISTED:
        return problems
    return problems[:MAX_LISTED] + [f"... and {len(problems) - MAX_LISTED} more {what}"]


# ------------------------------------------------------------------------------------------- cheap checks


def check_structure(out: str | Path) -> tuple[list[str], MoeLayout | None, CheckpointReader | None]:
    """Config, index, shard headers and report.json, without reading tensor data. Returns (problems, layout, reader)."""
    out = Path(out)
    try:
        layout = read_layout(out)
    except MoeifyError as exc:
        return [str(exc)], None, None
    try:
        reader = CheckpointReader(out, allow_nonfinite=True)
    except MoeifyError as exc:
        return [str(exc)], layout, None
    problems = _check_index(out, reader) + _check_tensors(layout, reader) + _check_report(out, layout)
    return problems, layout, reader


def _check_index(out: Path, reader: CheckpointReader) -> list[str]:
    problems = []
    index_path = out / INDEX_NAME
    shards = {p.name for p in out.glob("*.safetensors")}
    if not index_path.is_file():
        return problems  # a single model.safetensors (the reader refuses several without an index)
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    for name, file in weight_map.items():
        got = reader.file_of.get(name)
        if got is None:
            problems.append(f"{INDEX_NAME} lists {name} in {file}, but that shard has no such tensor")
        elif got.name != file:
            problems.append(f"{INDEX_NAME} says {name} is in {file}, but it is in {got.name}")
    for name, path in reader.file_of.items():
        if name not in weight_map:
            problems.append(f"tensor {name} in {path.name} is not in {INDEX_NAME}")
    total = index.get("metadata", {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
    actual = sum(t.nbytes for t in reader.tensors.values())
    if total is not None and total != actual:
        problems.append(f"{INDEX_NAME} metadata total_size is {total}, the shards hold {actual} bytes of tensors")
    for stray in sorted(shards - set(weight_map.values())):
        problems.append(f"{stray} is not referenced by {INDEX_NAME} (a stray shard: loaders ignore it)")
    return _listed(problems, "index problems")


def _check_tensors(layout: MoeLayout, reader: CheckpointReader) -> list[str]:
    problems = []
    dtypes = {t.dtype for t in reader.tensors.values()}
    if layout.dtype is None and len(dtypes) > 1:
        problems.append(f"tensors have mixed dtypes {sorted(map(str, dtypes))} and config.json names none")
    for name, shape in layout.shapes.items():
        info = reader.tensors.get(name)
        if info is None:
            problems.append(f"tensor {name} is missing (config.json implies shape {list(shape)})")
        elif info.shape != shape:
            problems.append(f"tensor {name} has shape {list(info.shape)}, config.json implies {list(shape)}")
        elif layout.dtype is not None and info.dtype != layout.dtype:
            problems.append(f"tensor {name} has dtype {info.dtype}, config.json says {layout.dtype}")
    extra = [n for n in reader.tensors if n not in layout.shapes and not (layout.tied and n == "lm_head.weight")]
    problems += [f"tensor {n} is in {reader.file_of[n].name} but config.json implies no such tensor" for n in extra]
    return _listed(problems, "tensor problems")


def read_report(out: Path) -> dict | None:
    path = out / "report.json"
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MoeifyError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("layers"), list):
        raise MoeifyError(f"{path} has no 'layers' list")
    return report


def real_width(report: dict | None, layout: MoeLayout) -> int:
    """Neurons per routed expert; moeify pads experts with zero neurons (report.json has the unpadded width)."""
    width = (report or {}).get("expert_width")
    return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else layout.expert_width


def _check_report(out: Path, layout: MoeLayout) -> list[str]:
    try:
        report = read_report(out)
    except MoeifyError as exc:
        return [str(exc)]
    if report is None:
        return []
    layers = report["layers"]
    if report.get("construction") in ("upcycle", "merge"):
        from .verify_upcycle import check_report

        return check_report(report, layout.n_layers, layout.n_experts, layout.top_k)
    problems = []
    if [entry.get("layer") if isinstance(entry, dict) else None for entry in layers] != list(range(layout.n_layers)):
        return [f"report.json lists layers that are not 0..{layout.n_layers - 1} in order"]
    width = real_width(report, layout)
    if width > layout.expert_width:
        return [f"report.json expert_width {width} is wider than config.json's expert width {layout.expert_width}"]
    d_ff = layout.n_experts * width + layout.shared_width
    for entry in layers:
        i = entry["layer"]
        if bool(entry.get("dense")) != layout.is_dense(i):
            problems.append(f"report.json says layer {i} is {'dense' if entry.get('dense') else 'MoE'}, "
                            f"config.json says {'dense' if layout.is_dense(i) else 'MoE'}")
            continue
        if entry.get("dense"):
            continue
        perm = entry.get("perm")
        if not isinstance(perm, list) or sorted(perm) != list(range(d_ff)):
            problems.append(f"report.json layer {i}: 'perm' is not a permutation of the {d_ff} neurons")
        elif entry.get("shared_neurons", 0) != layout.shared_width:
            problems.append(f"report.json layer {i}: {entry.get('shared_neurons')} shared neurons, "
                            f"config.json says {layout.shared_width}")
    return _listed(problems, "report problems")


# ------------------------------------------------------------------------------------------------ full checks


def check_values(reader: CheckpointReader, progress: Progress | None = None) -> list[str]:
    """Read every tensor once (shard by shard); list those with NaN/Inf."""
    names = sorted(reader.tensors, key=lambda n: (str(reader.file_of[n]), n))
    for done, name in enumerate(names, 1):
        reader.get(name)
        if progress:
            progress("checking values", done, len(names))
    reader.close()
    return _listed([f"tensor {n} has {c} NaN/Inf value(s)" for n, c in reader.nonfinite.items()], "non-finite tensors")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN with the same payload; +0 != -0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def check_weights_against(out: Path, layout: MoeLayout, reader: CheckpointReader, src: Path, *,
                          allow_pickle: bool = False, progress: Progress | None = None) -> tuple[list[str], list[str]]:
    """Bit-for-bit comparison of OUT's tensors with the source's. Returns (problems, skipped notes)."""
    from ..formats.families import check_source_tensors, load_source

    report = read_report(out)
    if report is None:
        return [f"{out}/report.json is missing: without the permutations the experts cannot be compared with {src}"], []
    source = load_source(src)
    src_reader = CheckpointReader(source.path, allow_pickle=allow_pickle, allow_nonfinite=True)
    check_source_tensors(source, src_reader.tensors)
    d_ff = layout.n_experts * real_width(report, layout) + layout.shared_width
    if source.d_ff != d_ff or source.n_layers != layout.n_layers or source.hidden != layout.hidden:
        return [f"{out} does not fit {src}: source has {source.n_layers} layers, hidden {source.hidden}, d_ff "
                f"{source.d_ff}; output has {layout.n_layers} layers, hidden {layout.hidden}, d_ff {d_ff}"], []
    dtype = layout.dtype or reader.tensors["model.embed_tokens.weight"].dtype
    problems: list[str] = []
    skipped: list[str] = []

    def same_as_source(out_name: str, src_name: str | None = None) -> None:
        expected = src_reader.get(src_name or out_name).to(dtype)
        if not _same(reader.get(out_name), expected):
            problems.append(f"tensor {out_name} differs from the source's {src_name or out_name}")

    def is_zero(name: str) -> None:
        if reader.get(name).count_nonzero():
            problems.append(f"tensor {name} should be all zeros (moeify adds it only for the format)")

    same_as_source("model.embed_tokens.weight")
    for i, entry in enumerate(report["layers"]):
        p = f"model.layers.{i}."
        if entry.get("attention_tuned"):
            skipped.append(f"layer {i}: attention and norms tuned (--tune-attention), not compared with the source")
        else:
            for name in (n + ".weight" for n in source.attention_tensors):  # Qwen3's q/k norms too
                same_as_source(p + name)
        for name in ("q_proj.bias", "k_proj.bias", "v_proj.bias"):
            if p + "self_attn." + name in layout.shapes:  # a Qwen2 source's own biases; zeros added for a Llama's
                (same_as_source if source.qkv_bias else is_zero)(p + "self_attn." + name)
        src_g, src_u, src_d = (src_reader.get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
        if layout.is_dense(i):
            for n, t in (("gate", src_g), ("up", src_u), ("down", src_d)):
                if not _same(reader.get(p + f"mlp.{n}_proj.weight"), t.to(dtype)):
                    problems.append(f"tensor {p}mlp.{n}_proj.weight (a dense layer) differs from the source")
        else:
            problems += _check_moe_layer(layout, reader, i, entry, real_width(report, layout), src_g, src_u, src_d,
                                         dtype, skipped)
        if progress:
            progress("comparing with the source", i + 1, layout.n_layers)
    same_as_source("model.norm.weight")
    if "lm_head.weight" in layout.shapes:
        same_as_source("lm_head.weight", "model.embed_tokens.weight" if source.tied else "lm_head.weight")
    reader.close()
    src_reader.close()
    return _listed(problems, "differences"), skipped


def _check_moe_layer(layout: MoeLayout, reader: CheckpointReader, i: int, entry: dict, w: int, src_g: torch.Tensor,
                     src_u: torch.Tensor, src_d: torch.Tensor, dtype: torch.dtype, skipped: list[str]) -> list[str]:
    """w: neurons per routed expert; the tensors may be padded beyond it with zero neurons."""
    perm = torch.tensor(entry["perm"], dtype=torch.long)
    n_shared = layout.shared_width
    m = f"model.layers.{i}.mlp."
    groups = []  # (gate name, up name, down name, neuron ids, down factor), in perm order
    if layout.fmt == "qwen2_moe":
        groups.append((m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight",
                       m + "shared_expert.down_proj.weight", perm[:n_shared], 2))
    for e in range(layout.n_experts):
        groups.append((*layout.expert_names(i, e), perm[n_shared + e * w: n_shared + (e + 1) * w],
                       layout.routed_factor))
    problems = []
    for e in range(layout.n_experts):  # zero padding neurons add silu(0) * 0 = 0
        g, u, d = layout.expert_names(i, e)
        if reader.get(g)[w:].count_nonzero() or reader.get(u)[w:].count_nonzero() or reader.get(d)[:, w:].count_nonzero():
            problems.append(f"layer {i} expert {e}: the padding neurons beyond the first {w} are not zero")
    inv = torch.argsort(perm)
    tuned = set(entry.get("tuned", ()))
    if tuned:
        names = ', '.join(t if t == "router" else f'{t}_proj' for t in sorted(tuned))
        skipped.append(f"layer {i}: {names} tuned (--fit-epochs / --tune-tokens), "
                       "not compared with the source")
    for kind, col in (("gate", 0), ("up", 1)):
        if kind in tuned:
            continue
        rebuilt = torch.cat([reader.get(g[col])[:len(g[3])] for g in groups])[inv]  # un-permute, source order
        if not _same(rebuilt, src_g.to(dtype) if kind == "gate" else src_u.to(dtype)):
            problems.append(f"layer {i}: the experts' {kind} rows un-permuted differ from the source {kind}_proj")
    if entry.get("compensated") and "down" not in tuned:
        skipped.append(f"layer {i}: down_proj was refit (--compensate), not compared with the source")
    elif "down" not in tuned:
        for _, _, d, idx, factor in groups:
            expected = (src_d[:, idx].float() * factor).to(dtype)
            if not _same(reader.get(d)[:, :len(idx)], expected):
                problems.append(f"tensor {d} is not the source down_proj columns × {factor}")
    if layout.fmt == "qwen2_moe":  # older outputs (no shared_gate in report.json) have a zero gate
        c = entry.get("shared_gate", 0.0)
        if not torch.equal(reader.get(m + "shared_expert_gate.weight").float(), torch.full((1, layout.hidden), float(c))):
            problems.append(f"tensor {m}shared_expert_gate.weight should be the constant row {c:g} of report.json "
                            "(sigmoid ~ 1/2 is what down_proj × 2 assumes)")
    return problems


# ------------------------------------------------------------------------------------------------ logits


@torch.no_grad()
def compare_logits(out: Path, src: Path, layout: MoeLayout, report: dict | None, *, seq_len: int = 16,
                   batch: int = 2, seed: int = 0) -> tuple[float, float]:
    """(max |logit diff|, max |dense logit|) with every expert active at unit gates; both models in float32.

    The dense model's weights are rounded through the output dtype, as the converter rounded them, so it holds
    exactly the values the converter started from. One model is resident at a time.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = layout.dtype or torch.float32
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()  # exact for bf16/fp16 sources
    k = layout.routed_factor
    # The converter stores the routed experts' down_proj × k (top_k, or N without renormalisation) in the output
    # dtype: one rounding, exact only for a power-of-two k (the bitwise check covers it). Give the reference the same weights, so that the logits
    # compare the structure (permutation, routing, gates) and nothing else.
    rounded_down = {}
    for entry in (report or {}).get("layers", []):
        if entry.get("dense"):
            continue
        routed = torch.tensor(entry["perm"][layout.shared_width:], dtype=torch.long)
        w = dense.get_submodule(f"model.layers.{entry['layer']}.mlp.down_proj").weight
        rounded_down[entry["layer"]] = (routed, (w[:, routed] * k).to(dtype).float() / k)
    for param in dense.parameters():
        param.copy_(param.to(dtype).float())  # the rounding to the output dtype that every tensor got
    for i, (routed, cols) in rounded_down.items():
        dense.get_submodule(f"model.layers.{i}.mlp.down_proj").weight[:, routed] = cols
    vocab = dense.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    ref = dense(ids).logits
    del dense
    cfg = AutoConfig.from_pretrained(out)
    cfg.num_experts_per_tok = layout.n_experts
    moe = AutoModelForCausalLM.from_pretrained(out, config=cfg, dtype=torch.float32).eval()
    routers = experts = 0
    for path, module in moe.named_modules():
        name = type(module).__name__
        if path.endswith("shared_expert_gate"):
            module.weight.zero_()  # sigmoid(0): the shared gate exactly 1/2 (written as a tiny constant row)
        elif name.endswith("TopKRouter"):
            module.weight.zero_()  # softmax over zeros: every gate exactly 1/N
            module.top_k = layout.n_experts
            routers += 1
        elif name.endswith("Experts") and isinstance(getattr(module, "down_proj", None), torch.Tensor):
            module.down_proj.mul_(layout.n_experts / k)  # down_proj carries k for gates of 1/k
            experts += 1
    n_moe = layout.n_layers - len(layout.dense_layers)
    if routers != n_moe or experts != n_moe:
        raise RuntimeError(f"found {routers} routers and {experts} expert blocks in the loaded model, expected {n_moe}")
    got = moe(ids).logits
    return (got - ref).abs().max().item(), ref.abs().max().item()


# ------------------------------------------------------------------------------------------------ entry point


def verify_checkpoint(out: str | Path, against: str | Path | None = None, *, values: bool = True,
                      logits: bool = True, allow_pickle: bool = False, seq_len: int = 16,
                      progress: Progress | None = None) -> VerifyResult:
    """Run the checks; problems are collected, not raised. MoeifyError only when OUT cannot be examined at all."""
    out = Path(out)
    if not out.is_dir():
        raise MoeifyError(f"{out} is not a directory", "pass the output directory of moeify convert")
    result = VerifyResult(out)
    problems, layout, reader = check_structure(out)
    result.problems += problems
    if layout is None or reader is None:
        return result
    result.checked.append(f"config.json, index and shard headers: {len(reader.tensors)} tensors, "
                          f"{len(set(reader.file_of.values()))} shard(s)")
    if values:
        result.problems += check_values(reader, progress)
        result.checked.append("every tensor read: no NaN/Inf" if not reader.nonfinite else "every tensor read")
    if against is None:
        return result
    if problems:
        result.skipped.append(f"comparison with {against}: skipped because the structure checks failed")
        return result
    against = Path(against)
    report = read_report(out) or {}
    if report.get("construction") in ("upcycle", "merge"):
        return _verify_upcycle(result, out, against, report, layout, reader, logits, allow_pickle, seq_len, progress)
    diffs, skipped = check_weights_against(out, layout, reader, against, allow_pickle=allow_pickle, progress=progress)
    result.problems += diffs
    result.skipped += skipped
    result.checked.append(f"weights against {against}: non-FFN tensors and un-permuted experts bit for bit")
    if not logits:
        return result
    if any(entry.get("compensated") or entry.get("tuned") for entry in report.get("layers", [])):
        result.skipped.append("logits: FFN weights were refit (--compensate) or tuned (--fit-epochs / --tune-tokens), so the MoE model "
                              "is not the dense one by design; not compared")
        return result
    diff, scale = compare_logits(out, against, layout, report, seq_len=seq_len)
    result.max_logit_diff, result.logit_scale = diff, scale
    tol = LOGIT_RTOL * max(scale, 1e-6)
    if not math.isfinite(diff) or diff > tol:
        result.problems.append(f"logits with every expert active differ from {against}'s by {diff:.3g} "
                               f"(allowed {tol:.3g} = {LOGIT_RTOL:g} × max |logit| {scale:.3g})")
    result.checked.append(f"logits, all {layout.n_experts} experts active, float32: max |diff| {diff:.3g} "
                          f"(≤ {tol:.3g})")
    return result


def _verify_upcycle(result: VerifyResult, out: Path, against: Path, report: dict, layout: MoeLayout,
                    reader: CheckpointReader, logits: bool, allow_pickle: bool, seq_len: int,
                    progress: Progress | None) -> VerifyResult:
    """An upcycled output against its source (moeify.evaluation.verify_upcycle)."""
    from .verify_upcycle import EXACT_SYMMETRY, check_against, compare_logits as streamed_logits, logits_problem

    dtype = layout.dtype or reader.tensors["model.embed_tokens.weight"].dtype
    problems, checked, skipped = check_against(out, against, report, layout.fmt, dtype, reader,
                                               allow_pickle=allow_pickle, progress=progress)
    result.problems += _listed(problems, "differences")
    result.checked += checked
    result.skipped += skipped
    if not logits:
        return result
    if report.get("construction") == "merge" or report.get("settings", {}).get("symmetry") not in EXACT_SYMMETRY:
        result.skipped.append("logits: the experts differ from the source's FFN by design (a merge, or copies made "
                              "to differ on purpose); not compared")
        return result
    diff, scale = streamed_logits(out, against, seq_len=seq_len)
    result.max_logit_diff, result.logit_scale = diff, scale
    problem = logits_problem(diff, scale, LOGIT_RTOL, against)
    if problem:
        result.problems.append(problem)
    result.checked.append(f"logits, top-{layout.top_k} of {layout.n_experts} routed as written, float32, a decoder "
                          f"layer at a time: max |diff| {diff:.3g}")
    return result


__all__ = ["VerifyResult", "MoeLayout", "read_layout", "check_structure", "check_values", "check_weights_against",
           "compare_logits", "verify_checkpoint", "LOGIT_RTOL"]
