"""Source families (llama, mistral, qwen2, qwen3) and target formats (mixtral, qwen2_moe, qwen3_moe).

Tensor-name templates, config translation, and what each target can represent exactly.
Facts checked against transformers 5.23 (see shared FORMATS.md):
- Mixtral renormalises its top-k softmax weights; Qwen2-MoE does only when `norm_topk_prob`. We write
  `norm_topk_prob: false`, because llama.cpp's qwen2moe graph never renormalises (it ignores the key), so the
  selected gates are ~1/N there and in transformers/vLLM alike (see `routed_factor`).
- Qwen2-MoE's shared expert is scaled by sigmoid(shared_expert_gate(x)); llama.cpp computes that sigmoid as
  silu(z)/z, NaN at z = 0, so the gate is a tiny constant row rather than zeros (see router.shared_gate_value).
- Qwen3-MoE is Qwen3's attention (RMSNorm of each head's q and k) with a softmax top-k router and no shared expert.
  We write `norm_topk_prob: true`, as its released models have it and llama.cpp's qwen3moe graph always computes
  (renormalised top-k weights, like Mixtral's), so the routed down_proj carries the factor k.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import DTYPE_NAMES, TensorInfo
from ..errors import MoeifyError
from ..maths.moe_block import RENORMALISED

SOURCE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# transformers' classes of each source family: (config, decoder layer, rotary embedding), in models/<family>/
FAMILY_CLASSES = {"llama": ("LlamaConfig", "LlamaDecoderLayer", "LlamaRotaryEmbedding"),
                  "mistral": ("MistralConfig", "MistralDecoderLayer", "MistralRotaryEmbedding"),
                  "qwen2": ("Qwen2Config", "Qwen2DecoderLayer", "Qwen2RotaryEmbedding"),
                  "qwen3": ("Qwen3Config", "Qwen3DecoderLayer", "Qwen3RotaryEmbedding")}
# q/k/v projections with a bias: Qwen2's attention always has them (its config has no switch); a Llama/Mistral with
# attention_bias = true is refused (no bias-free target would be exact, and none of their checkpoints has them)
BIAS_TENSORS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# Each decoder layer's attention projections and RMSNorm weights (`NAME.weight`), in the order the output is written:
# copied from the source, or tuned with --tune-attention.
ATTENTION_TENSORS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "post_attention_layernorm")
QK_NORM_TENSORS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3: RMSNorm weights of each head's q and k (head_dim,)


def attention_tensors(model_type: str) -> tuple[str, ...]:
    """A dense family's per-layer attention and norm weights (`NAME.weight`): ATTENTION_TENSORS, and Qwen3's q/k norms."""
    return ATTENTION_TENSORS + (QK_NORM_TENSORS if model_type == "qwen3" else ())
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx", "olmoe", "granitemoe", "jamba",
             "phimoe", "jetmoe", "switch_transformers", "gpt_oss", "llama4", "glm4_moe")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers that some old checkpoints saved


@dataclass(frozen=True)
class SourceModel:
    """A dense Llama/Mistral/Qwen2/Qwen3 checkpoint, described by its config (no weights loaded)."""

    path: Path
    raw: dict  # config.json as found
    model_type: str
    hidden: int
    d_ff: int
    n_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype: torch.dtype | None  # from config; None when the config does not say
    rope_parameters: dict
    sliding_window: int | None
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2), carried into the output
    qk_norm: bool = False  # RMSNorm of each head's q and k (Qwen3), carried into the output (Qwen3-MoE)

    @property
    def attention_tensors(self) -> tuple[str, ...]:
        """Each decoder layer's attention and norm weights (`NAME.weight`), copied from the source (or tuned)."""
        return attention_tensors(self.model_type)

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        h, f, q, kv = self.hidden, self.d_ff, self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab, h), "model.norm.weight": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab, h)
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            })
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if self.qk_norm:
                shapes.update({p + name + ".weight": (self.head_dim,) for name in QK_NORM_TENSORS})
        return shapes


def read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not path.exists():
        raise MoeifyError(f"{path} does not exist", "pass the directory of a Hugging Face checkpoint")
    if not path.is_dir():
        raise MoeifyError(f"{path} is not a directory", "pass the directory holding config.json and *.safetensors")
    if not cfg_path.is_file():
        raise MoeifyError(f"{cfg_path} not found", "pass the directory of a Hugging Face checkpoint (with config.json)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MoeifyError(f"{cfg_path} is not valid JSON ({exc})", "fix or re-download config.json") from None
    if not isinstance(raw, dict):
        raise MoeifyError(f"{cfg_path} is not a JSON object")
    return raw


def attention_shape(cfg) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a transformers Llama/Mistral config: no num_key_value_heads means
    one per query head, no head_dim means hidden / heads."""
    heads = cfg.num_attention_heads
    return heads, cfg.num_key_value_heads or heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def load_source(path: str | Path) -> SourceModel:
    path = Path(path)
    raw = read_config(path)
    model_type = raw.get("model_type")
    moe_key = next((k for k in ("num_local_experts", "num_experts") if raw.get(k)), None)
    if model_type in MOE_TYPES or moe_key:
        what = f"model_type {model_type!r}" if model_type in MOE_TYPES else f"{model_type!r} with {moe_key} = {raw[moe_key]}"
        raise MoeifyError(f"{path}/config.json: {what} is already a Mixture-of-Experts model",
                          "moeify converts dense llama/mistral/qwen2/qwen3 checkpoints")
    if model_type not in SOURCE_TYPES:
        raise MoeifyError(f"{path}/config.json: model_type {model_type!r} is not supported",
                          f"supported dense sources: {', '.join(SOURCE_TYPES)}")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise MoeifyError(f"{path}/config.json: {flag}=true cannot be represented in Mixtral, Qwen2-MoE or "
                              "Qwen3-MoE", "only bias-free llama/mistral/qwen3 checkpoints (and qwen2, whose q/k/v "
                              "biases Qwen2-MoE holds) are supported")
    # Let transformers standardise rope (legacy rope_theta/rope_scaling -> rope_parameters) and defaults.
    cls = family_config(model_type)
    try:
        cfg = cls.from_dict({k: v for k, v in raw.items() if k not in ("auto_map",)})
    except Exception as exc:  # transformers raises many types for bad values
        raise MoeifyError(f"{path}/config.json could not be read as a {model_type} config: {exc}") from None
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = getattr(cfg, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise MoeifyError(f"{path}/config.json: {key} must be a positive integer, got {value!r}")
    heads, kv, head_dim = attention_shape(cfg)
    dtype_name = raw.get("torch_dtype") or raw.get("dtype")
    sliding = raw.get("sliding_window") if model_type == "mistral" else None
    if model_type in ("qwen2", "qwen3") and cfg.sliding_window is not None:  # no released Qwen2/2.5/3 has it
        target = "Qwen2-MoE" if model_type == "qwen2" else "Qwen3-MoE"
        raise MoeifyError(f"{path}/config.json: use_sliding_window = true (sliding windows from layer "
                          f"{cfg.max_window_layers} on) is not supported: {target} engines read those fields "
                          "differently (transformers: every other layer below max_window_layers)",
                          "convert a checkpoint with use_sliding_window = false (every released Qwen2 / 2.5 / 3)")
    return SourceModel(
        path=path, raw=raw, model_type=model_type, hidden=cfg.hidden_size, d_ff=cfg.intermediate_size,
        n_layers=cfg.num_hidden_layers, heads=heads, kv_heads=kv, head_dim=head_dim, vocab=cfg.vocab_size,
        tied=bool(cfg.tie_word_embeddings), dtype=DTYPE_NAMES.get(dtype_name) if isinstance(dtype_name, str) else None,
        rope_parameters=dict(cfg.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}),
        sliding_window=sliding, qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
    )


def family_classes(model_type: str) -> tuple[type, type, type]:
    """transformers' (config, decoder layer, rotary embedding) classes of a source family (FAMILY_CLASSES)."""
    import importlib

    _, layer, rotary = FAMILY_CLASSES[model_type]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return family_config(model_type), getattr(modeling, layer), getattr(modeling, rotary)


def family_config(model_type: str) -> type:
    """transformers' config class of a source family, without its modeling module (~2 s of imports that reading a
    config does not need: the layers are imported where they run, e.g. on the upcycle check's thread)."""
    import importlib

    return getattr(importlib.import_module("transformers"), FAMILY_CLASSES[model_type][0])


def read_source_config(path: str | Path) -> SourceModel:
    """A dense source from a checkpoint directory or from a config.json file (any file name); weights not needed."""
    path = Path(path)
    if path.is_dir() or not path.exists():
        return load_source(path)
    if path.name == "config.json":
        return load_source(path.parent)
    # A config saved under another name: parse it from a scratch directory, report errors against the real file.
    with tempfile.TemporaryDirectory(prefix="moeify-plan-") as tmp:
        shutil.copyfile(path, Path(tmp) / "config.json")
        try:
            src = load_source(tmp)
        except MoeifyError as exc:
            what = exc.what.replace(f"{tmp}/config.json", str(path)).replace(tmp, str(path))
            raise MoeifyError(what, exc.hint) from None
    return dataclasses.replace(src, path=path)


def check_source_tensors(src: SourceModel, tensors: dict[str, TensorInfo]) -> None:
    """Every expected tensor present with the expected shape; nothing unknown. Fails before any work."""
    expected = src.expected_tensors()
    for name, shape in expected.items():
        info = tensors.get(name)
        if info is None:
            raise MoeifyError(f"tensor {name} is missing from {src.path}", "the checkpoint is incomplete; re-download it")
        if info.shape != shape:
            raise MoeifyError(f"tensor {name} in {src.path} has shape {list(info.shape)}, config.json implies {list(shape)}",
                              "config.json and the weights disagree; re-download the checkpoint")
        if not info.dtype.is_floating_point:
            raise MoeifyError(f"tensor {name} in {src.path} has dtype {info.dtype}; expected floating point weights",
                              "quantized checkpoints are not supported; use the bf16/fp16/fp32 release")
    extra = [n for n in tensors if n not in expected and not n.endswith(IGNORED_SUFFIXES)
             and not (src.tied and n == "lm_head.weight")]
    if extra:
        raise MoeifyError(f"{src.path} has {len(extra)} tensor(s) a {src.model_type} model does not have, e.g. {extra[0]}",
                          "this layout is not supported (quantized or a different architecture?)")


# ------------------------------------------------------------------------------------------ target formats


def legacy_rope(rope_parameters: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) keys for readers older than transformers 5."""
    params = dict(rope_parameters)
    theta = float(params.pop("rope_theta", 10000.0))
    if params.get("rope_type", "default") == "default":
        return theta, None
    scaling = dict(params)
    scaling.setdefault("type", scaling.get("rope_type"))
    return theta, scaling


def target_format(src: SourceModel, requested: str, *, shared: bool, dense_layers: bool = False,
                  shared_fix: str = "leave out the shared expert") -> str:
    """The one format choice every stage makes: Qwen3-MoE for a Qwen3 source (its q/k norms; no stock class holds
    them with a shared expert), Qwen2-MoE for Qwen2 (its q/k/v biases), else Mixtral unless a shared expert or a
    dense layer needs Qwen2-MoE (`auto`); a requested format that cannot hold the source or the layout is refused.
    shared_fix: the hint when a Qwen3 source is asked for a shared expert (each stage names its own flags)."""
    if src.qk_norm:
        if shared:
            raise MoeifyError(f"{src.path} is a Qwen3 model: Qwen3-MoE, the one stock class with its q/k norms, has no "
                              "shared expert", shared_fix)
        if requested not in ("auto", "qwen3_moe"):
            raise MoeifyError(f"--format {requested} cannot hold the q/k norms of {src.path} (qwen3)",
                              "use --format qwen3_moe (or auto)")
        return "qwen3_moe"
    if requested == "qwen3_moe":
        raise MoeifyError(f"--format qwen3_moe needs a Qwen3 source; {src.path} is {src.model_type} (its attention "
                          "has no q/k norms)", "use --format mixtral or qwen2_moe (or auto)")
    if src.qkv_bias:
        if requested == "mixtral":
            raise MoeifyError(f"--format mixtral cannot hold the q/k/v biases of {src.path} ({src.model_type})",
                              "use --format qwen2_moe (or auto)")
        return "qwen2_moe"
    if requested == "mixtral" and shared:
        raise MoeifyError("--format mixtral has no shared expert", "use --format qwen2_moe (or auto)")
    if requested == "auto":
        return "qwen2_moe" if shared or dense_layers else "mixtral"
    return requested


def target_config(src: SourceModel, fmt: str, *, experts: int, top_k: int, expert_width: int, shared_width: int,
                  dense_layers: tuple[int, ...], dtype: torch.dtype, tied: bool, renormalise: bool = False) -> dict:
    """config.json for the output, built by the transformers config class, plus legacy rope keys. renormalise: a
    Qwen2-MoE with norm_topk_prob true (an upcycle's copies need it; a carve writes false, as llama.cpp computes)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "bos_token_id",
            "eos_token_id", "pad_token_id", "attention_dropout")
    base = {k: src.raw[k] for k in keep if k in src.raw}
    base.update(num_key_value_heads=src.kv_heads, head_dim=src.head_dim, tie_word_embeddings=tied,
                rope_parameters=dict(src.rope_parameters), num_experts_per_tok=top_k)
    if fmt == "mixtral":
        cfg = MixtralConfig(**base, intermediate_size=expert_width, num_local_experts=experts,
                            sliding_window=src.sliding_window)
        arch = "MixtralForCausalLM"
    elif fmt == "qwen2_moe":
        layer_types = ["sliding_attention" if src.sliding_window else "full_attention"] * src.n_layers
        cfg = Qwen2MoeConfig(**base, intermediate_size=src.d_ff, moe_intermediate_size=expert_width,
                             shared_expert_intermediate_size=shared_width, num_experts=experts, norm_topk_prob=renormalise,
                             mlp_only_layers=list(dense_layers), decoder_sparse_step=1, qkv_bias=True,
                             use_sliding_window=bool(src.sliding_window), sliding_window=src.sliding_window,
                             max_window_layers=src.n_layers, layer_types=layer_types)
        arch = "Qwen2MoeForCausalLM"
    elif fmt == "qwen3_moe":  # no shared expert (validated earlier); q/k norms and head_dim as the Qwen3 source's
        cfg = Qwen3MoeConfig(**base, intermediate_size=src.d_ff, moe_intermediate_size=expert_width,
                             num_experts=experts, norm_topk_prob=True, mlp_only_layers=list(dense_layers),
                             decoder_sparse_step=1, attention_bias=False, use_sliding_window=False)
        arch = "Qwen3MoeForCausalLM"
    else:  # validated earlier
        raise ValueError(fmt)
    out = cfg.to_dict()
    if fmt == "qwen3_moe" and "num_local_experts" in out:  # transformers >= 5.2x renames it; the released Qwen3-MoE
        out["num_experts"] = out.pop("num_local_experts")  # configs, llama.cpp's converter and older readers say this
    out["architectures"] = [arch]
    out["dtype"] = str(dtype).removeprefix("torch.")
    out["torch_dtype"] = out["dtype"]  # older readers
    out["rope_theta"], out["rope_scaling"] = legacy_rope(src.rope_parameters)
    out.pop("transformers_version", None)
    return out


def renormalises(fmt: str) -> bool:
    """Whether the format's top-k softmax weights are renormalised over the chosen experts as we write it: Mixtral
    always, Qwen3-MoE with `norm_topk_prob: true`; our Qwen2-MoE not (`norm_topk_prob: false`)."""
    return fmt in RENORMALISED


def routed_factor(fmt: str, experts: int, top_k: int) -> int:
    """Multiplier of the routed experts' down_proj for unit gates: the selected softmax weights are ~1/top_k when
    the format renormalises them (Mixtral, Qwen3-MoE), ~1/experts when it does not (our Qwen2-MoE)."""
    return top_k if renormalises(fmt) else experts


def ffn_tensor_names(fmt: str, layer_idx: int, experts: int, dense: bool, shared: bool) -> list[str]:
    """Output names of one layer's FFN tensors, in the order the converter writes them."""
    if fmt == "mixtral":
        p = f"model.layers.{layer_idx}.block_sparse_moe."
        names = [p + "gate.weight"]
        for e in range(experts):
            names += [f"{p}experts.{e}.w1.weight", f"{p}experts.{e}.w3.weight", f"{p}experts.{e}.w2.weight"]
        return names
    p = f"model.layers.{layer_idx}.mlp."
    if dense:
        return [p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"]
    names = [p + "gate.weight"]
    for e in range(experts):
        names += [f"{p}experts.{e}.gate_proj.weight", f"{p}experts.{e}.up_proj.weight", f"{p}experts.{e}.down_proj.weight"]
    if fmt == "qwen2_moe":  # Qwen3-MoE has no shared expert
        names += [p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight",
                  p + "shared_expert.down_proj.weight", p + "shared_expert_gate.weight"]
    return names


def attention_infos(src: SourceModel, tensors: dict[str, TensorInfo], fmt: str, layer_idx: int,
                    dtype: torch.dtype) -> list[TensorInfo]:
    """Layer layer_idx's attention and norm tensors in the output (shapes from the source's headers `tensors`), and
    the format's q/k/v biases: what writer.write_attention writes."""
    p = f"model.layers.{layer_idx}."
    out = [TensorInfo(p + n, dtype, tensors[p + n].shape) for n in (t + ".weight" for t in src.attention_tensors)]
    return out + [TensorInfo(n, dtype, shape) for n, shape in attention_extras(fmt, src, layer_idx)]


def attention_extras(fmt: str, src: SourceModel, layer_idx: int) -> list[tuple[str, tuple[int, ...]]]:
    """The target's q/k/v biases (Qwen2-MoE has them): the source's own for a Qwen2 source, zeros for a Llama's."""
    if fmt != "qwen2_moe":
        return []
    p = f"model.layers.{layer_idx}.self_attn."
    q, kv = src.heads * src.head_dim, src.kv_heads * src.head_dim
    return [(p + "q_proj.bias", (q,)), (p + "k_proj.bias", (kv,)), (p + "v_proj.bias", (kv,))]
