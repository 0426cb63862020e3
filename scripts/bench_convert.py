"""Conversion speed and memory against the disk: copy the checkpoint, then convert it, in one run.

    python scripts/make_synthetic_checkpoint.py /tmp/bench/llama3-8b         # once: a 16 GB Llama-3-8B shape
    python scripts/bench_convert.py /tmp/bench/llama3-8b --work /tmp/bench/work --append BENCHMARKS.md

Times, each from a cold page cache for the source (its pages are dropped with posix_fadvise first) and up
to a final `sync`:
  dd       every file copied with `dd bs=16M`: read and write through user memory, what any converter must
           at least do (the reference the conversion is compared with)
  cp       `cp -r`, which copies inside the kernel (shown for context)
  convert  weight-only `moeify convert` (gate-cluster partition, representative router, --experts 8 --top-k 2)
           as a subprocess; its peak RSS comes from os.wait4 (ru_maxrss of that process)
and, separately, the clustering alone: balanced k-means of one layer's gate_proj rows (d_ff neurons) into 8
and 64 experts plus the router, on the first layers of the checkpoint. The machine may be shared: compare
the ratios measured side by side in one run, not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTION = "## Conversion speed and memory"


def checkpoint_files(src: Path) -> list[Path]:
    return sorted(p for p in src.iterdir() if p.is_file())


def drop_cache(paths) -> None:
    """Drop the (clean) page-cache pages of these files, so the next read comes from the disk."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    if path.exists():
        files = [p for p in path.rglob("*") if p.is_file()]
        drop_cache(files)
        shutil.rmtree(path)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    os.sync()
    return time.perf_counter() - t0


def copy_dd(src: Path, dst: Path, *flags: str) -> None:
    """dd every file; with oflag=direct, the whole 16 MiB blocks go direct and the tail through the page cache
    (O_DIRECT writes need whole disk blocks)."""
    dst.mkdir(parents=True)
    for f in checkpoint_files(src):
        out = dst / f.name
        if not flags:
            subprocess.run(["dd", f"if={f}", f"of={out}", "bs=16M", "status=none"], check=True)
            continue
        blocks = f.stat().st_size // (16 << 20)
        subprocess.run(["dd", f"if={f}", f"of={out}", "bs=16M", f"count={blocks}", "status=none", *flags], check=True)
        subprocess.run(["dd", f"if={f}", f"of={out}", "bs=16M", f"skip={blocks}", f"seek={blocks}", "conv=notrunc",
                        "status=none"], check=True)


def copy_cp(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)


class RssSampler(threading.Thread):
    """Samples a process's VmRSS every `interval` seconds (for the shape of the memory curve)."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval, self.samples, self._halt = pid, interval, [], threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self._halt.is_set():
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.samples.append((time.perf_counter() - t0, int(line.split()[1]) * 1024))
            except (FileNotFoundError, ProcessLookupError):
                return
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_child(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, int, list]:
    """Run cmd, return (seconds up to a final sync, peak RSS bytes of the child, RSS samples)."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        sampler = RssSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop()
    os.sync()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024, sampler.samples


def time_clustering(src: Path, experts: list[int], layers: int, device: str) -> dict[int, float]:
    """Mean seconds per layer of the gate-cluster partition + representative router (what convert runs)."""
    import torch

    from moeify.formats.checkpoint import CheckpointReader
    from moeify.formats.config import ConvertConfig
    from moeify.carving.carve import carve_weight_only

    reader = CheckpointReader(src)
    out = {}
    for n in experts:
        cfg = ConvertConfig(experts=n, top_k=min(2, n), device=device)
        total = 0.0
        for i in range(layers):
            p = f"model.layers.{i}."
            gate, up, down, norm = (reader.get(p + name) for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight",
                                                                       "mlp.down_proj.weight", "post_attention_layernorm.weight"))
            t0 = time.perf_counter()
            carve_weight_only(gate, up, down, norm, cfg)
            if device == "cuda":
                torch.cuda.synchronize()
            total += time.perf_counter() - t0
        out[n] = total / layers
    reader.close()
    return out


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def insert_into_section(path: Path, block: str) -> None:
    """Append `block` at the end of the SECTION of a markdown file (creating the file or section if needed)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n"
    start = text.index(SECTION) + len(SECTION)
    nxt = text.find("\n## ", start)
    end = len(text) if nxt < 0 else nxt + 1
    body = text[start:end].rstrip("\n")
    text = text[:start] + body + "\n\n" + block.rstrip("\n") + "\n" + ("\n" + text[end:] if nxt >= 0 else "")
    path.write_text(text)


def publish(lines: list[str], append: Path | None) -> None:
    """Print the markdown block and, with --append, add it to that file's SECTION."""
    block = "\n".join(lines) + "\n"
    print("\n" + block)
    if append:
        insert_into_section(append, block)
        print(f"appended to {append}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="dense checkpoint (e.g. from scripts/make_synthetic_checkpoint.py)")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench/work"), help="scratch directory (same disk)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--cluster-experts", default="8,64", help="expert counts for the clustering-only timing")
    p.add_argument("--cluster-layers", type=int, default=2, help="layers averaged in the clustering-only timing")
    p.add_argument("--device", default="cpu", help="device for the clustering-only timing and convert --device")
    p.add_argument("--skip-cp", action="store_true", help="skip the cp row")
    p.add_argument("--label", default=None, help="what the checkpoint is (for the table)")
    p.add_argument("--append", type=Path, default=None, help="markdown file to add the result to")
    a = p.parse_args(argv)

    src = a.src.resolve()
    files = checkpoint_files(src)
    size = sum(f.stat().st_size for f in files)
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(work).free < 1.2 * size:
        raise SystemExit(f"{work} needs about {gb(1.2 * size)} GB free")
    label = a.label or src.name
    print(f"{label}: {gb(size)} GB in {len(files)} files; scratch {work}", flush=True)

    rows = []  # (what, seconds, peak rss or None)
    dst = work / "copy"
    remove(dst)
    drop_cache(files)
    t_dd = timed(lambda: copy_dd(src, dst))
    remove(dst)
    rows.append(("copy: dd bs=16M per file (user space, page cache)", t_dd, None))
    print(f"dd copy: {t_dd:.1f} s", flush=True)
    drop_cache(files)
    t_direct = timed(lambda: copy_dd(src, dst, "oflag=direct"))
    remove(dst)
    rows.append(("copy: dd bs=16M oflag=direct (writes bypass the page cache)", t_direct, None))
    print(f"dd oflag=direct copy: {t_direct:.1f} s", flush=True)
    if not a.skip_cp:
        drop_cache(files)
        t_cp = timed(lambda: copy_cp(src, dst))
        remove(dst)
        rows.append(("copy: cp -r (in kernel)", t_cp, None))
        print(f"cp copy: {t_cp:.1f} s", flush=True)

    out = work / "moe"
    remove(out)
    drop_cache(files)
    cmd = [sys.executable, "-m", "moeify.cli.app", "convert", str(src), str(out), "--experts", str(a.experts),
           "--top-k", "2", "--method", "gate-cluster", "--router", "representative", "--device", a.device]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t_conv, rss, samples = run_child(cmd, work / "convert.log", env)
    out_size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    remove(out)
    rows.append((f"moeify convert --experts {a.experts} --top-k 2 (gate-cluster, representative)", t_conv, rss))
    print(f"convert: {t_conv:.1f} s, peak RSS {gb(rss)} GB, output {gb(out_size)} GB", flush=True)

    experts = [int(x) for x in a.cluster_experts.split(",") if x]
    cluster = time_clustering(src, experts, a.cluster_layers, a.device)
    import json

    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for n, sec in cluster.items():
        print(f"clustering + router, {n} experts: {sec:.2f} s/layer ({sec * n_layers:.1f} s for {n_layers} layers)")

    when = time.strftime("%Y-%m-%d %H:%M")
    cpu = f"{os.cpu_count()} cores" + (f", {platform.processor()}" if platform.processor() else "")
    lines = [f"### {label} ({gb(size)} GB, {len(files)} files), {when}, {cpu}", "",
             "```", f"python scripts/bench_convert.py {a.src} --work {a.work} --experts {a.experts}"
             + (f" --device {a.device}" if a.device != "cpu" else ""), "```", "",
             "| step | seconds | GB/s (source bytes) | × dd copy | peak RSS |", "|---|---:|---:|---:|---:|"]
    for what, sec, peak in rows:
        lines.append(f"| {what} | {sec:.1f} | {size / sec / 1e9:.2f} | {sec / t_dd:.2f} | "
                     f"{gb(peak) + ' GB' if peak else '–'} |")
    for n, sec in cluster.items():
        lines.append(f"| clustering + router only, {n} experts, per layer ({a.device}) | {sec:.2f} | – | "
                     f"{sec * n_layers / t_dd:.2f} (× {n_layers} layers) | – |")
    publish(lines, a.append)


if __name__ == "__main__":
    main()
