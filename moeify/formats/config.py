"""ConvertConfig: every setting of a conversion, resolved from a TOML preset and CLI flags (flags win)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import MoeifyError
from .layout import Layout, layout_from_table, needs_resolution, resolve_into

METHODS = ("contiguous", "random", "gate-cluster", "activation", "coactivation")
ROUTERS = ("mean-gate", "representative", "fitted")
CALIB_METHODS = ("activation", "coactivation")  # need calibration data
# Chosen by scripts/bench_quality.py (BENCHMARKS.md): the defaults of a calibrated conversion (with --calib, or the
# bundled sample) for whatever the flags do not set. The corrected feed was chosen on the real model (SmolLM2).
CALIBRATED_DEFAULTS = {"method": "activation", "router": "fitted", "compensate": True, "calib_feed": "corrected"}
BUNDLED_CALIB = Path(__file__).resolve().parents[1] / "data" / "calib_sample.txt"  # see moeify/data/README.md
BUNDLED_PROSE = BUNDLED_CALIB.parent / "tune_prose.txt"  # the presets' --tune-text (moeify/data/README.md)
BUNDLED_TEXT = "bundled:"  # how a recipe names a text moeify ships: bundled:calib_sample.txt (moeify/data/)
TEXT_KEYS = ("calib", "tune_text", "stats")  # settings that name files: a recipe names them portably (recipe_name)
FEEDS = ("dense", "moe", "corrected")
SHARED_BY = ("rate", "contribution")  # how a calibrated partition picks the shared expert's neurons
DEVICES = ("auto", "cpu", "cuda")
FORMATS = ("auto", "mixtral", "qwen2_moe", "qwen3_moe")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# keys of earlier moeify.toml files, renamed since ("tune" now means only the whole-model recovery tuning)
LEGACY_KEYS = {"tune_epochs": "fit_epochs", "tune_lr": "fit_lr"}
CALIB_TOKENS_CAP = 65536  # calibration tokens used when --calib-tokens is not given (fewer if the text is shorter)


@dataclass(frozen=True)
class ConvertConfig:
    experts: int = 8  # routed experts per layer
    top_k: int = 2  # routed experts active per token
    shared: int = 0  # always-on width, in units of one expert
    shared_by: str = "rate"  # the shared expert's neurons (calibrated partitions): rate, the most often active
    # (CMoE); contribution, the largest mean |activation| x ||W_down[:, i]|| (each neuron's share of the output)
    method: str = "gate-cluster"  # how neurons are grouped into experts
    router: str = "representative"  # how router rows are built
    format: str = "auto"  # mixtral | qwen2_moe | qwen3_moe | auto (mixtral unless shared experts / dense layers need
    # qwen2_moe; the source decides too: a Qwen2's biases need qwen2_moe, a Qwen3's q/k norms qwen3_moe)
    dense_layers: tuple[int, ...] = ()  # layers whose FFN stays dense (qwen2_moe, qwen3_moe)
    gate_tolerance: float = 1e-3  # bound on the relative error of every unit gate (sets the router scale)
    seed: int = 0
    kmeans_iters: int = 8  # Lloyd iterations of balanced k-means
    dtype: str = "auto"  # output dtype; auto keeps the source dtype
    max_shard_bytes: int = 5_000_000_000
    pad_experts_to: int = 8  # zero-pad every routed expert's width to a multiple of this (exact; 128/256 for quantized serving)
    untie_embeddings: bool = False  # write an explicit lm_head copy for tied sources
    targets: tuple[str, ...] = ()  # serving engines the output must run in (convert refuses layouts they cannot load)
    dense_auto: int = 0  # keep this many most-sensitive layers dense (measured on calibration data)
    # calibration
    calib: tuple[str, ...] = ()  # .txt / .jsonl files
    calib_tokens: int = 0  # 0: all of the calibration text, up to CALIB_TOKENS_CAP
    calib_seq_len: int = 512
    calib_feed: str = "dense"  # next layer's calibration input: dense layer output or the carved layer's output;
    # corrected: the carved layer's output, and each layer is fitted to restore the dense model's residual stream
    compensate: bool = False  # ridge refit of down_proj under the actual routing
    stats: str = ""  # reuse neuron statistics saved by an earlier calibrated conversion
    device: str = "auto"
    # layer-local tuning (each carved FFN towards its target output on its cached calibration inputs)
    fit_epochs: int = 0  # passes over the calibration tokens; 0 = off
    fit_lr: float = 0.01  # Adam step size relative to each tensor's RMS
    # whole-model distillation towards the dense model's next-token distributions (moeify/training/distill.py)
    tune_tokens: int = 0  # training tokens (fresh windows of the tuning text); 0 = off
    tune_model_lr: float = 0.003  # Adam step size relative to each tensor's RMS
    tune_router: bool = True  # also train the routers (and their temperature)
    tune_attention: bool = False  # also train attention projections and RMSNorm weights (written to OUT)
    tune_generated: float = 0.5  # share of the tuning windows sampled from the dense model itself
    tune_text: tuple[str, ...] = ()  # extra tuning text besides --calib and the bundled broad sample
    # a preset's layout as shares of d_ff (moeify/formats/layout.py): resolved per model into experts/shared/top_k
    layout: Layout | None = None

    @property
    def needs_calibration(self) -> bool:
        return (self.method in CALIB_METHODS or self.router == "fitted" or self.compensate or self.dense_auto > 0
                or self.fit_epochs > 0 or self.tune_tokens > 0)

    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        return "qwen2_moe" if (self.shared > 0 or self.dense_layers or self.dense_auto) else "mixtral"

    def validate(self) -> None:
        """Checks that need no checkpoint. Checkpoint-dependent checks live in convert.plan_conversion."""
        for name in ("experts", "top_k", "shared", "seed", "kmeans_iters", "max_shard_bytes", "calib_tokens",
                     "calib_seq_len", "dense_auto", "fit_epochs", "pad_experts_to", "tune_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise MoeifyError(f"--{_flag(name)} must be an integer, got {value!r}")
        for name in ("gate_tolerance", "fit_lr", "tune_model_lr", "tune_generated"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise MoeifyError(f"--{_flag(name)} must be a number, got {value!r}")
        for name in ("untie_embeddings", "compensate", "tune_router", "tune_attention"):
            if not isinstance(getattr(self, name), bool):
                raise MoeifyError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.stats, str) or not all(isinstance(f, str) for f in (*self.calib, *self.tune_text)):
            raise MoeifyError(f"calib must be a list of file names and stats a file name, got {self.calib!r}, {self.stats!r}")
        if self.layout is not None:
            self.layout.validate()
        if self.experts < 1:
            raise MoeifyError(f"--experts must be ≥ 1, got {self.experts}")
        if self.shared < 0:
            raise MoeifyError(f"--shared must be ≥ 0, got {self.shared}")
        if not 1 <= self.top_k <= self.experts:
            raise MoeifyError(
                f"--top-k must be between 1 and --experts ({self.experts}), got {self.top_k}",
                "top-k is the number of routed experts each token uses",
            )
        if self.kmeans_iters < 1:
            raise MoeifyError(f"--kmeans-iters must be ≥ 1, got {self.kmeans_iters}")
        if self.pad_experts_to < 8 or self.pad_experts_to % 8:
            raise MoeifyError(f"--pad-experts-to must be a positive multiple of 8, got {self.pad_experts_to}",
                              "8 (the default) keeps rows 16-byte aligned; 128 or 256 suit quantized serving (see --dry-run)")
        if self.max_shard_bytes < 1:
            raise MoeifyError(f"--max-shard-size must be positive, got {self.max_shard_bytes} bytes")
        if not (0.0 < self.gate_tolerance < 1.0):
            raise MoeifyError(f"--gate-tolerance must be in (0, 1), got {self.gate_tolerance}")
        from .engines import ENGINES

        for t in self.targets:
            _check_choice("target", t, ENGINES)
        _check_choice("method", self.method, METHODS)
        _check_choice("router", self.router, ROUTERS)
        _check_choice("format", self.format, FORMATS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("calib_feed", self.calib_feed, FEEDS)
        _check_choice("shared_by", self.shared_by, SHARED_BY)
        _check_choice("device", self.device, DEVICES)
        if self.needs_calibration and not self.calib:
            what = ("--method " + self.method if self.method in CALIB_METHODS else "--router fitted"
                    if self.router == "fitted" else "--compensate" if self.compensate else "--fit-epochs"
                    if self.fit_epochs else "--tune-tokens" if self.tune_tokens else "--dense-layers auto:M")
            raise MoeifyError(f"{what} needs calibration data", "pass --calib FILE (.txt or .jsonl)")
        if self.calib_tokens < 0 or self.calib_seq_len < 2:
            raise MoeifyError("--calib-tokens must be ≥ 1 (0: all the text, up to 65,536) and --calib-seq-len ≥ 2")
        if self.fit_epochs < 0:
            raise MoeifyError(f"--fit-epochs must be ≥ 0, got {self.fit_epochs}")
        if not 0.0 < self.fit_lr < 1.0:
            raise MoeifyError(f"--fit-lr must be in (0, 1) (a step size relative to each weight's RMS), got {self.fit_lr}")
        if self.tune_tokens < 0:
            raise MoeifyError(f"--tune-tokens must be ≥ 0 (0: no whole-model tuning), got {self.tune_tokens}")
        if not 0.0 < self.tune_model_lr < 1.0:
            raise MoeifyError(f"--tune-model-lr must be in (0, 1) (a step size relative to each weight's RMS), "
                              f"got {self.tune_model_lr}")
        if not 0.0 <= self.tune_generated < 1.0:
            raise MoeifyError(f"--tune-generated must be in [0, 1) (the share of tuning windows the dense model "
                              f"samples itself), got {self.tune_generated}")
        if self.dense_auto < 0:
            raise MoeifyError(f"--dense-layers auto:M needs M ≥ 0, got {self.dense_auto}")
        if any((not isinstance(i, int)) or i < 0 for i in self.dense_layers):
            raise MoeifyError(f"--dense-layers must be non-negative layer indices, got {list(self.dense_layers)}")
        fmt = self.resolved_format()
        if fmt == "mixtral" and self.shared > 0:
            raise MoeifyError("--format mixtral cannot hold shared experts", "use --format qwen2_moe (or auto)")
        if fmt == "mixtral" and (self.dense_layers or self.dense_auto):
            raise MoeifyError("--format mixtral cannot keep layers dense", "use --format qwen2_moe (or auto)")
        if fmt == "qwen3_moe" and self.shared > 0:
            raise MoeifyError("--format qwen3_moe cannot hold shared experts (Qwen3-MoE has none)",
                              "pass --shared 0 (or --format qwen2_moe for a Llama/Mistral/Qwen2 source)")


# --weight-only: each setting that needs calibration text, and what it becomes without text
WEIGHT_ONLY = {"method": "gate-cluster", "router": "representative", "compensate": False, "fit_epochs": 0,
               "tune_tokens": 0}


def _needs_text(key: str, value) -> bool:
    """Whether `key = value` needs calibration text (ConvertConfig.needs_calibration, one setting at a time)."""
    return bool(value) and (key == "method" and value in CALIB_METHODS or key == "router" and value == "fitted"
                            or key in ("compensate", "fit_epochs", "tune_tokens", "calib")
                            or key == "dense_layers" and str(value).startswith("auto:"))


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise MoeifyError(f"--{_flag(name)} {value!r} is not one of: {', '.join(choices)}")


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '300MiB' -> 314572800, '1000' -> 1000 (bytes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*", str(text).upper())
    if not m:
        raise MoeifyError(f"--max-shard-size {text!r} is not a size", "write e.g. 5GB, 500MB, 2GiB or a byte count")
    number, unit = float(m.group(1)), (m.group(2) or "B")
    unit = unit if unit.endswith("B") else unit + "B"
    powers = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(number * powers[unit])


def parse_layers(text: str | list | tuple | None) -> tuple[int, ...]:
    if text is None or text == "":
        return ()
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    try:
        return tuple(sorted({int(str(i).strip()) for i in items}))
    except ValueError:
        raise MoeifyError(f"--dense-layers {text!r} is not a comma-separated list of layer indices", "e.g. 0,31") from None


DEFAULT_PRESET = "active-50"  # what `moeify convert SRC OUT` carves when no layout is given (README "Converting")


def preset_dir() -> Path | None:
    """Where the named presets are: the installed package's moeify/presets/ (the wheel takes them from configs/,
    pyproject.toml's package-dir), else configs/ beside the package (a checkout, an editable install)."""
    here = Path(__file__).resolve().parents[1]  # the moeify package
    for d in (here / "presets", here.parent / "configs"):
        if d.is_dir() and any(d.glob("*.toml")):
            return d
    return None


def preset_names() -> list[str]:
    d = preset_dir()
    return sorted(f.stem for f in d.glob("*.toml")) if d else []


def preset_path(preset: str | Path) -> Path:
    """A preset by name (`active-50`, as the package ships it) or by path (a TOML file: yours, or an earlier output's
    moeify.toml). A path that exists wins over a name."""
    path = Path(preset)
    if path.is_file():
        return path
    d = preset_dir()
    name = path.name[:-5] if path.name.endswith(".toml") else path.name
    if d is not None and (d / f"{name}.toml").is_file() and (len(path.parts) == 1 or path.parent.name == "configs"):
        return d / f"{name}.toml"
    names = ", ".join(preset_names()) or "none installed"
    raise MoeifyError(f"preset {preset} not found (the presets: {names})",
                      "name one, e.g. --preset active-50, or pass a TOML file (an earlier output's moeify.toml works)")


def load_preset(path: str | Path) -> dict:
    path = preset_path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MoeifyError(f"preset {path} is not valid TOML: {exc}") from None
    known = {f.name for f in dataclasses.fields(ConvertConfig)}
    data = {k.replace("-", "_"): v for k, v in data.items()}
    data.pop("provenance", None)  # the record that OUT/moeify.toml carries; not a setting
    data.pop("tuning", None)  # the tuning history that OUT/moeify.toml carries; not a setting
    for old, new in LEGACY_KEYS.items():  # moeify.toml of outputs written before the rename
        if old in data:
            data.setdefault(new, data.pop(old))
    _where_recorded(path, data)
    if "layout" in data:
        data["layout"] = layout_from_table(data["layout"], f"preset {path}")
    unknown = sorted(set(data) - known - {"max_shard_size"})
    if unknown:
        raise MoeifyError(f"preset {path} has unknown key(s): {', '.join(unknown)}", f"known keys: {', '.join(sorted(known))}")
    return data


def text_path(f: str | Path) -> str:
    """A text file's path as the settings hold it (and OUT/report.json records it): absolute, so that `moeify tune
    OUT` finds it from any directory (a path relative to where convert ran would not be); bundled:NAME is the file
    moeify ships."""
    f = str(f)
    if f.startswith(BUNDLED_TEXT):
        shipped = BUNDLED_CALIB.parent / f[len(BUNDLED_TEXT):]
        if not shipped.is_file():
            raise MoeifyError(f"{f}: moeify ships no such text",
                              f"the bundled texts are {recipe_name(BUNDLED_CALIB)} and {recipe_name(BUNDLED_PROSE)}")
        return str(shipped)
    return os.path.abspath(f) if Path(f).exists() else f


def recipe_name(f: str | Path) -> str:
    """A file as a recipe (OUT/moeify.toml, the card) names it: a text moeify ships as bundled:NAME, any other file
    by its name alone, so that the recipe repeats on another machine and shows nothing of this one's folders."""
    path = Path(f)
    return BUNDLED_TEXT + path.name if path.parent == BUNDLED_CALIB.parent else path.name


def _where_recorded(preset: Path, data: dict) -> None:
    """An output's moeify.toml names its files by name alone: where they were is in report.json beside it. A name
    not found from here is taken from there, so `moeify tune OUT` (which reads OUT/moeify.toml) runs anywhere."""
    report = preset.parent / "report.json"
    if preset.name != "moeify.toml" or not report.is_file():
        return
    try:
        settings = json.loads(report.read_text()).get("settings", {})
    except ValueError:
        return
    for key in TEXT_KEYS:
        recorded = settings.get(key) or []
        recorded = {Path(f).name: f for f in ([recorded] if isinstance(recorded, str) else recorded)}
        names = data.get(key)
        if isinstance(names, str):
            data[key] = recorded.get(names, names) if names and not Path(names).exists() else names
        elif isinstance(names, list):
            data[key] = [recorded.get(f, f) if isinstance(f, str) and not Path(f).exists() else f for f in names]


def resolve_preset(values: dict, d_ff: int, qk_norm: bool = False, *, given: dict | None = None,
                   notes: list[str] | None = None, serve: str | None = None) -> dict:
    """values (a preset merged with flags) with experts/shared/top_k resolved from its [layout] for this d_ff:
    - serve: the serving format the widths must suit (moeify.formats.layout.SERVE_QUANTA), in place of the preset's quanta;
    - a target that holds no shared expert (a Qwen3 source: Qwen3-MoE; --format mixtral) gets the same active share
      without one (unless --shared was given: then the conversion refuses it), and a note says so.
    given: the flags given explicitly. Both `moeify convert` and `moeify plan` resolve so."""
    from .layout import SERVE_QUANTA, serve_quanta

    given = given or {}
    lay = values["layout"]
    if serve is not None:
        lay = lay.for_serving(serve_quanta(serve))
        values["layout"] = lay
    if lay.shared > 0 and (qk_norm or values.get("format") == "mixtral") and given.get("shared") is None:
        values["layout"] = dataclasses.replace(lay, shared=0.0)  # Qwen3-MoE and Mixtral have none
        if qk_norm and given.get("format") is None:
            values["format"] = "qwen3_moe"  # the one stock class with Qwen3's q/k norms
    values = resolve_into(values, d_ff)
    if serve is not None:
        values["layout"] = dataclasses.replace(values["layout"], resolved=f"--serve {serve} "
                                               f"({SERVE_QUANTA[serve][2]}): {values['layout'].resolved}")
    if lay.shared > 0 and values["layout"].shared == 0 and notes is not None:
        target = "Qwen3-MoE (the one stock class with Qwen3's q/k norms)" if qk_norm else "Mixtral"
        notes.append(f"{target} holds no shared expert: the preset's {lay.active:.0%} active resolves without "
                     f"one, to top-{values['top_k']} of {values['experts']} routed experts (README \"Presets "
                     "without a shared expert\" says what that costs)")
    return values


def build_config(preset: str | Path | None = None, default_calib: bool = False, source=None,
                 weight_only: bool = False, notes: list[str] | None = None, serve: str | None = None,
                 **flags) -> ConvertConfig:
    """Merge a preset with flags (flags that are None fall back to the preset, then to the defaults).
    default_calib: calibrate on the bundled sample (BUNDLED_CALIB) when neither preset nor flags name a text
    (the command line's default; `--weight-only` turns it off).
    source: the dense checkpoint (directory or config.json) or its d_ff: needed when the preset states its layout
    as shares ([layout], moeify/formats/layout.py) and the flags do not give every count; the counts are resolved for it.
    weight_only (`--weight-only`): carve from the weights alone: the preset's settings that need calibration text
    give way to their weight-only counterparts (WEIGHT_ONLY; each replacement said in `notes`), and a flag that
    needs text contradicts it. serve (`--serve`): the serving format the preset's layout is resolved for
    (resolve_preset)."""
    values = load_preset(preset) if preset else {}
    if weight_only:
        if values.get("calib") and notes is not None:
            notes.append(f"--weight-only: the preset's calib = {_toml_value(values['calib'])} is not read")
        values.pop("calib", None)
        for key, off in WEIGHT_ONLY.items():
            if flags.get(key) is None and _needs_text(key, values.get(key)):
                if notes is not None:
                    notes.append(f"--weight-only: the preset's {key} = {_toml_value(values[key])} becomes "
                                 f"{_toml_value(off)}")
                values[key] = off
        given = [k for k, v in flags.items() if v is not None and _needs_text(k, v)]
        if given:
            raise MoeifyError(f"--weight-only and --{_flag(given[0])} {flags[given[0]]} contradict each other "
                              "(it needs calibration text)", "drop one of them")
    values.update({k: v for k, v in flags.items() if v is not None})
    if needs_resolution(values):
        if source is None:
            raise MoeifyError(f"preset {preset} states its layout as shares of d_ff ([layout]): the expert counts "
                              "depend on the model", "give the source checkpoint (the command line does), or pass "
                              "--experts, --shared and --top-k")
        if isinstance(source, int):
            d_ff, qk_norm = source, False
        else:
            from .families import read_source_config

            model = read_source_config(source)
            d_ff, qk_norm = model.d_ff, model.qk_norm
        values = resolve_preset(values, d_ff, qk_norm, given=flags, notes=notes, serve=serve)
    elif serve is not None:
        raise MoeifyError(f"--serve {serve} chooses among a preset's layouts; this conversion has none to choose",
                          "pass a preset (e.g. --preset active-50), or drop --serve")
    if default_calib and not values.get("calib"):
        values["calib"] = (str(BUNDLED_CALIB),)
    if isinstance(values.get("calib"), (str, Path)):
        values["calib"] = (values["calib"],)  # calib = "file.txt" in a preset
    if isinstance(values.get("targets"), str):
        values["targets"] = tuple(t.strip() for t in values["targets"].split(",") if t.strip())
    if values.get("targets") is not None:
        values["targets"] = tuple(values["targets"])
    if isinstance(values.get("tune_text"), (str, Path)):
        values["tune_text"] = (values["tune_text"],)
    if values.get("tune_text") is not None:
        values["tune_text"] = tuple(text_path(f) for f in values["tune_text"])
    if values.get("stats"):
        values["stats"] = text_path(values["stats"])
    if values.get("calib"):
        values["calib"] = tuple(text_path(f) for f in values["calib"])
        for key, value in CALIBRATED_DEFAULTS.items():
            values.setdefault(key, value)
    if isinstance(values.get("dense_layers"), str) and values["dense_layers"].startswith("auto:"):
        try:
            values["dense_auto"] = int(values.pop("dense_layers")[5:])
        except ValueError:
            raise MoeifyError("--dense-layers auto:M needs an integer M, e.g. auto:2") from None
    if "max_shard_size" in values:
        values["max_shard_bytes"] = parse_size(values.pop("max_shard_size"))
    if "dense_layers" in values:
        values["dense_layers"] = parse_layers(values["dense_layers"])
    cfg = ConvertConfig(**values)
    cfg.validate()
    return cfg


def config_to_dict(cfg: ConvertConfig) -> dict:
    """Resolved settings as JSON-ready values (report.json, convert --json)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


def config_to_toml(cfg: ConvertConfig, extra: dict | None = None) -> str:
    """Resolved settings as TOML (written to OUT/moeify.toml; usable again as --preset). Files are named as a recipe
    names them (recipe_name), the source by its Hub id or folder name: no path of this machine."""
    lines = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in TEXT_KEYS and value:
            value = recipe_name(value) if isinstance(value, str) else tuple(recipe_name(v) for v in value)
        if f.name != "layout":
            lines.append(f"{f.name} = {_toml_value(value)}")
    if cfg.layout is not None:
        lines.append("")
        lines.append("[layout]  # the preset's layout as shares of d_ff; the counts above were resolved from it")
        lines.extend(f"{f.name} = {_toml_value(getattr(cfg.layout, f.name))}" for f in dataclasses.fields(cfg.layout))
    if extra:
        lines.append("")
        lines.append("[provenance]")
        lines.extend(f"{k} = {_toml_value(_source_name(v) if k == 'source' else v)}" for k, v in extra.items())
    return "\n".join(lines) + "\n"


def _source_name(source: str) -> str:
    """The dense source as a recipe names it: its Hub id (org/name, @revision), else its folder's name."""
    from .hub import hub_origin

    origin = hub_origin(Path(source))
    return f"{origin[0]}@{origin[1]}" if origin else Path(source).name or source


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


__all__ = ["ConvertConfig", "build_config", "config_to_dict", "config_to_toml", "load_preset", "parse_size", "parse_layers"]
