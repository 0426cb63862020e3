"""Tiny real models, built from configs at test time and saved as real safetensors checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# Under pytest-xdist (`make test` runs `-n auto`) each worker gets its share of the cores, and so do the processes
# its tests start (OMP_NUM_THREADS is inherited): no worker oversubscribes the machine.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Under `-n N --dist loadgroup` (make test) a group's tests run in one worker, in order. A file is one group (its module
# fixtures, a carved model or a reference torchrun, are built once), except the files whose tests take minutes: their
# tests are dealt into SPLIT[file] groups, so that no worker is left running one long file alone at the end. Those
# files run first; the quick ones fill in.
SPLIT = {"test_bench_gpu.py": 5, "test_tune_stage.py": 2, "test_parallel_runs.py": 2, "test_tune.py": 2,
         "test_train_processes.py": 2}
HEAVY_FIRST = ("test_bench_gpu.py", "test_tune_stage.py", "test_tune_processes.py", "test_parallel_runs.py",
               "test_train_processes.py",
               "test_wheel.py", "test_tune.py", "test_tune_steps.py", "test_tune_memory.py", "test_upcycle.py",
               "test_tasks.py", "test_front_door.py", "test_reliability.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept
    seen: dict[str, int] = {}
    for item in items:
        name = item.path.name
        n = seen[name] = seen.get(name, -1) + 1
        item.add_marker(pytest.mark.xdist_group(f"{name}:{n % SPLIT[name]}" if name in SPLIT else name))


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder that build(folder) fills once per test session, whichever pytest-xdist worker asks for it first (the
    others wait for it, then read it): for read-only fixtures that cost seconds, such as a reference tuning run,
    needed by several groups of tests. Deterministic builds only: any worker could have made it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    root = base / f"built-once-{name}"
    with FileLock(f"{root}.lock"):
        if not (root / ".built").is_file():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            (root / ".built").touch()
    return root


# Real English text bundled in the repo (WikiText-2 training text, CC BY-SA 3.0; see examples/calib/README.md)
CORPUS = Path(__file__).resolve().parents[1] / "examples" / "calib" / "wikitext2_train_sample.txt"


def corpus_text(chars: int = 20000) -> str:
    return CORPUS.read_text()[:chars]


def build_tokenizer(out: Path, text: str | None = None) -> Path:
    """A real byte-level BPE tokenizer (vocab 384: 256 bytes + merges) trained on `text` (default: corpus_text()),
    saved in `out` (also what scripts build their tiny models' tokenizer with)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus_text() if text is None else text], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A real byte-level BPE tokenizer (vocab 256 + merges) trained on a little English text."""
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.08, rms_norm_eps=1e-5)


def build_dense(path: Path, tokenizer_dir: Path | None = None, family: str = "llama", seed: int = 0,
                dtype: torch.dtype = torch.float32, max_shard_size: str | None = None, **overrides) -> Path:
    """Save a random dense Llama/Mistral/Qwen2/Qwen3 with `save_pretrained` (real safetensors, real config)."""
    import transformers

    torch.manual_seed(seed)
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    cfg_cls, model_cls = getattr(transformers, prefix + "Config"), getattr(transformers, prefix + "ForCausalLM")
    cfg = cfg_cls(**{**BASE, **overrides})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms (Qwen3's q/k norms too; Qwen2's q/k/v biases, zero at init) so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
    return path


def load(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    return model.eval(), info


def max_logit_diff(a: Path, b: Path, seq: int = 24, seed: int = 1) -> float:
    dense, _ = load(a)
    moe, info = load(b)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, dense.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (dense(ids).logits - moe(ids).logits).abs().max().item()


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*")):
        h.update(str(f.relative_to(path)).encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def kill_at_step(proc, state: Path, step: int, timeout: float = 120.0) -> None:
    """SIGKILL the tuning process `proc` once its saved state (state.json) has reached `step`; fails the test when
    the run ends first."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(state.read_text())["meta"]["step"] >= step:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.kill()
    proc.wait()


def rewrite(path: Path, edit) -> None:
    """Load a safetensors file, let `edit` change the dict of tensors, save it back (damaging a checkpoint)."""
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_json(path: Path, edit) -> None:
    """Load a JSON file, let `edit` change it in place, write it back."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def lay_out_hub(root: Path, repo: str, files: Path, refs: dict[str, str], only: tuple[str, ...] = ()) -> Path:
    """A Hub cache as huggingface_hub writes it: models--org--name/refs/<revision> holding the commit,
    snapshots/<commit>/ holding the files (all of `files`, or only those named)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    for ref, commit in refs.items():
        (folder / "refs" / ref).write_text(commit)
        snap = folder / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        for f in files.iterdir():
            if not only or f.name in only:
                shutil.copyfile(f, snap / f.name)
    return root
