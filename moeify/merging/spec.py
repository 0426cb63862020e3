"""A mergekit-moe YAML as `moeify merge --config` reads it: the keys of mergekit's MoEMergeConfig (mergekit/moe/
config.py, mergekit 0.1.5), each honoured with mergekit's meaning or refused in one line that names the key and the
file. What the keys become (moeify.merging.merge, moeify.api.merge):

    base_model         attention, norms, embeddings and the router's input come from it
    experts            one expert per entry: its source_model's FFN; positive_prompts / negative_prompts set its
                       router row (gate modes below); residual_scale multiplies its output (its down_proj)
    gate_mode          hidden (default) | hidden_avg | hidden_last | cheap_embed | random | uniform_random, as
                       mergekit computes them, and moeify's router_input (GATE_MODES)
    experts_per_token  top-k (default 2)
    shared_experts     at most one: an always-on shared expert from its source_model (Qwen2-MoE output)
    architecture       Mixtral | Qwen MoE (Qwen2-MoE) | Qwen3 MoE, matched by prefix as mergekit does ("qwen":
                       Qwen3-MoE for a Qwen3 base, else Qwen2-MoE); DeepSeek MoE is refused (no stock
                       transformers class holds mergekit's DeepSeek layout)
    dtype              float32 | bfloat16 | float16 (mergekit's names, also fp32 / bf16 / fp16)

noise_scale is refused: mergekit adds N(0, noise_scale²) to every weight of the expert; moeify's
`upcycle --symmetry noise` scales its noise to each matrix instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MoeifyError

# gate modes: how each layer's router rows are made (moeify.merging.merge.gate_rows computes them)
GATE_MODES = {
    "hidden": "each expert's prompts through the base: the last token's hidden state entering each layer "
              "(mergekit's default)",
    "hidden_last": "the same as hidden (mergekit's other name for it)",
    "hidden_avg": "the hidden state entering each layer, averaged over the prompt's tokens",
    "cheap_embed": "the prompts' token embeddings summed, the same row in every layer",
    "random": "random rows, N(0, router_std²) (the source's initializer_range)",
    "uniform_random": "random rows, U(±1/√d_model) (torch.nn.Linear's initialisation)",
    "router_input": "moeify: the router's own input (post-attention-norm hidden state), averaged over every token "
                    "of the prompts or --router-text, centred across the experts",
}
PROMPTED = ("hidden", "hidden_last", "hidden_avg", "cheap_embed", "router_input")
# mergekit's output classes (their name() as architecture: matches by prefix) -> --format (None: refused)
OUTPUT_CLASSES = (("Mixtral", "mixtral"), ("DeepSeek MoE", None), ("Qwen MoE", "qwen2_moe"), ("Qwen3 MoE", "qwen3_moe"))
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16"}
TOP_KEYS = ("base_model", "experts", "gate_mode", "dtype", "experts_per_token", "shared_experts", "architecture")
EXPERT_KEYS = ("source_model", "positive_prompts", "negative_prompts", "noise_scale", "residual_scale")


@dataclass
class ExpertSpec:
    """One entry of experts / shared_experts."""

    source: str
    positive: list[str] = field(default_factory=list)
    negative: list[str] = field(default_factory=list)
    residual_scale: float | None = None


@dataclass
class MergeSpec:
    """A mergekit-moe YAML, checked."""

    path: Path
    base: str
    experts: list[ExpertSpec]
    gate_mode: str = "hidden"
    experts_per_token: int = 2
    shared: ExpertSpec | None = None
    formats: tuple[str, ...] = ()  # the output formats architecture names (moeify.merging.spec.output_format)
    dtype: str = "auto"

    @property
    def prompts(self) -> list[tuple[list[str], list[str]]]:
        """(positive, negative) prompts per routed expert."""
        return [(e.positive, e.negative) for e in self.experts]


def _fail(path: Path, what: str, fix: str = "") -> MoeifyError:
    return MoeifyError(f"{path}: {what}", fix or "see `moeify merge --help` for the mergekit-moe keys moeify reads")


def _source(path: Path, value, where: str) -> str:
    if isinstance(value, dict):  # mergekit's ModelReference as a mapping: {model: ..., lora: ...}
        extra = sorted(set(value) - {"model"})
        if extra:
            raise _fail(path, f"{where}.source_model.{extra[0]} is not supported (moeify reads whole checkpoints)",
                        "merge a LoRA into its model first and name the merged folder")
        value = value.get("model")
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, f"{where}.source_model must name a folder or Hub id")
    if "+" in value:
        raise _fail(path, f"{where}.source_model {value!r}: a model+LoRA reference is not supported",
                    "merge the LoRA into its model first and name the merged folder")
    return value.strip()


def _prompts(path: Path, entry: dict, key: str, where: str) -> list[str]:
    value = entry.get(key) or []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise _fail(path, f"{where}.{key} must be a list of strings")
    return list(value)


def _expert(path: Path, entry, where: str) -> ExpertSpec:
    if not isinstance(entry, dict):
        raise _fail(path, f"{where} must be a mapping with a source_model")
    for key in entry:
        if key == "noise_scale":
            raise _fail(path, f"{where}.noise_scale is not supported (mergekit adds absolute noise to every weight)",
                        "leave it out; to make identical experts differ use `moeify upcycle --symmetry noise`")
        if key not in EXPERT_KEYS:
            raise _fail(path, f"{where}.{key} is not a mergekit-moe expert key ({', '.join(EXPERT_KEYS)})")
    if "source_model" not in entry:
        raise _fail(path, f"{where} has no source_model")
    scale = entry.get("residual_scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0):
        raise _fail(path, f"{where}.residual_scale {scale!r} must be a number ≥ 0")
    return ExpertSpec(_source(path, entry["source_model"], where), _prompts(path, entry, "positive_prompts", where),
                      _prompts(path, entry, "negative_prompts", where), None if scale is None else float(scale))


def _architecture(path: Path, value) -> tuple[str, ...]:
    """The output formats an architecture value names: mergekit keeps the output classes whose name starts with it
    ("qwen": Qwen MoE and Qwen3 MoE, then the one the sources fit); () when there is no value (moeify's auto)."""
    if value is None:
        return ()
    name = str(value).lower()
    named = [fmt for cls, fmt in OUTPUT_CLASSES if cls.lower().startswith(name)]
    if named and not any(named):
        raise _fail(path, f"architecture {value!r}: no stock transformers class holds mergekit's DeepSeek MoE "
                    "layout", "use architecture: mixtral, qwen or qwen3")
    if not named:
        raise _fail(path, f"architecture {value!r} names none of {', '.join(c for c, _ in OUTPUT_CLASSES)}")
    return tuple(f for f in named if f)


def output_format(formats: tuple[str, ...], model_type: str, shared: bool) -> str:
    """--format from the architecture's formats and the base's family: Qwen3-MoE for a Qwen3 base when named, else
    Qwen2-MoE when a shared expert is asked for, else the first named (auto when none is)."""
    if not formats:
        return "auto"
    if model_type == "qwen3" and "qwen3_moe" in formats:
        return "qwen3_moe"
    if shared and "qwen2_moe" in formats:
        return "qwen2_moe"
    return next((f for f in formats if f != "qwen3_moe"), formats[0])


def read_merge_spec(path: str | Path) -> MergeSpec:
    """Read and check a mergekit-moe YAML (yaml.safe_load: no tags, no code)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MoeifyError(f"--config {path} does not exist", "name a mergekit-moe YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MoeifyError(f"--config {path} cannot be read ({exc.__class__.__name__})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise _fail(path, f"not valid YAML{where}", "fix the file (mergekit-moe's format: docs/upcycling.md)") from None
    if not isinstance(data, dict):
        raise _fail(path, "is not a mergekit-moe config (a mapping with base_model and experts)")
    for key in data:
        if key not in TOP_KEYS:
            raise _fail(path, f"{key} is not a mergekit-moe key ({', '.join(TOP_KEYS)})")
    if "base_model" not in data:
        raise _fail(path, "has no base_model", "name the model whose attention and norms the MoE keeps")
    experts = data.get("experts")
    if not isinstance(experts, list) or len(experts) < 2:
        raise _fail(path, "experts must list at least 2 entries, one per expert")
    mode = str(data.get("gate_mode", "hidden"))
    if mode not in GATE_MODES:
        raise _fail(path, f"gate_mode {mode!r} is not one of {', '.join(GATE_MODES)}")
    k = data.get("experts_per_token", 2)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(experts):
        raise _fail(path, f"experts_per_token {k!r} must be an integer from 1 to the {len(experts)} experts")
    shared = data.get("shared_experts") or []
    if not isinstance(shared, list) or len(shared) > 1:
        raise _fail(path, "shared_experts must list at most one entry (Qwen2-MoE holds one shared expert)")
    dtype = data.get("dtype")
    if dtype is not None and str(dtype) not in DTYPES:
        raise _fail(path, f"dtype {dtype!r} is not one of float32, bfloat16, float16")
    spec = MergeSpec(path, _source(path, data["base_model"], "base_model"),
                     [_expert(path, e, f"experts[{i}]") for i, e in enumerate(experts)], mode, k,
                     _expert(path, shared[0], "shared_experts[0]") if shared else None,
                     _architecture(path, data.get("architecture")), DTYPES[str(dtype)] if dtype else "auto")
    check_prompts(spec.prompts, mode, path)
    return spec


def check_prompts(prompts: list[tuple[list[str], list[str]]], mode: str, where: str | Path) -> None:
    """A prompted gate mode needs positive prompts for every expert, not the same for all (mergekit's checks)."""
    if mode not in PROMPTED:
        return
    for i, (pos, _neg) in enumerate(prompts):
        if not pos:
            raise MoeifyError(f"{where}: experts[{i}] has no positive_prompts, which gate_mode {mode} needs",
                              "give each expert prompts of what it should get, or use gate_mode random")
    if len({(tuple(p), tuple(n)) for p, n in prompts}) == 1:
        raise MoeifyError(f"{where}: every expert has the same prompts, so gate_mode {mode} cannot tell them apart",
                          "give each expert prompts of what it should get, or use gate_mode random")


__all__ = ["GATE_MODES", "PROMPTED", "OUTPUT_CLASSES", "output_format", "ExpertSpec", "MergeSpec", "read_merge_spec",
           "check_prompts"]
