"""The text a command reads and the token windows it scores: `--data`/`--eval` files (.txt, .jsonl, the bundled
sample), the tokenizer (every model must share the reference's), whole texts tokenized without transformers' long-text
warning, and the standard sliding windows of perplexity (window j covers tokens [j·stride, j·stride + seq_len) and
scores only the tokens no earlier window scored). Used by eval, calibration and inspect."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MoeifyError

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "wikitext2_valid_sample.txt"
SAMPLE_NAMES = ("sample", "bundled")  # `--data sample` / `--eval sample` mean the bundled sample


# ---------------------------------------------------------------------------------------------- data


def read_documents(path: Path, what: str, hint: str) -> str:
    """The text of one file: plain UTF-8 text, or a .jsonl file's `text` fields (one JSON object a line) joined by
    blank lines. what: how errors name it ("--data", "calibration file"); hint: what to do about a missing or
    unreadable file. The one reader of text files (evaluation data, calibration, router and check text)."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MoeifyError(f"{what} {path} not found", hint) from None
    except UnicodeDecodeError as exc:
        raise MoeifyError(f"{what} {path} cannot be read: not UTF-8 text ({exc.reason} at byte {exc.start})",
                          hint) from None
    except OSError as exc:
        raise MoeifyError(f"{what} {path} cannot be read ({exc.__class__.__name__})", hint) from None
    if path.suffix.lower() != ".jsonl":
        return raw
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MoeifyError(f"{what} {path}:{n} is not valid JSON ({exc.msg})",
                              "each line must be {\"text\": \"...\"}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise MoeifyError(f"{what} {path}:{n} is not a JSON object with a string 'text' field",
                              "each line must be {\"text\": \"...\"}")
        docs.append(obj["text"])
    return "\n\n".join(d for d in docs if d.strip())


def read_text(data: str | Path | None) -> tuple[str, str]:
    """(text, label) of `--data` (read_documents). None (or 'sample') is the bundled WikiText-2 validation sample."""
    if data is None or (str(data) in SAMPLE_NAMES and not Path(data).exists()):
        return SAMPLE.read_text(encoding="utf-8"), f"bundled sample ({SAMPLE.name})"
    raw = read_documents(Path(data), "--data", "give a readable UTF-8 .txt or .jsonl file, or omit --data for the "
                         "bundled sample")
    if not raw.strip():
        raise MoeifyError(f"--data {data} is empty (no text to evaluate)", "give a file with text in it")
    return raw, str(data)


def load_tokenizer(path: Path, hint: str = "copy the source model's tokenizer files (tokenizer.json, "
                   "tokenizer_config.json) into it"):
    """A checkpoint's own tokenizer: its local files only, never remote code. The one tokenizer loader."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/TypeError for what is missing
        raise MoeifyError(f"{path}: cannot load a tokenizer ({first_line(exc)})", hint) from None


def check_same_tokenizer(ref, ref_path: Path, tok, path: Path, probe: str) -> None:
    """Every model must read the same token ids: equal vocabularies and equal ids on a probe of the data."""
    a, b = ref.get_vocab(), tok.get_vocab()
    if a != b:
        only_a = len(a.keys() - b.keys())
        detail = (f"vocab sizes {len(a)} vs {len(b)}" if len(a) != len(b)
                  else f"{only_a} tokens differ" if only_a else "same tokens with different ids")
        raise MoeifyError(f"{path} has a different tokenizer than {ref_path} ({detail})",
                          "all models must share the reference model's tokenizer")
    if ref(probe, verbose=False)["input_ids"] != tok(probe, verbose=False)["input_ids"]:
        raise MoeifyError(f"{path} tokenizes the data differently than {ref_path} (same vocab, different merges or "
                          "normalisation)", "all models must share the reference model's tokenizer")


class _DropLongSequenceWarning(logging.Filter):
    """transformers warns when a text has more tokens than the model's context ("Token indices sequence length is
    longer than the specified maximum sequence length ..."). moeify tokenizes whole texts and cuts them into
    windows, so that warning is expected and misleading; every other tokenizer message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer")


def encode_text(tokenizer, text: str, **kwargs) -> list[int]:
    """tokenizer(text)["input_ids"] of a long text, without the too-long-sequence warning (and only that one)."""
    log = logging.getLogger("transformers.tokenization_utils_base")
    quiet = _DropLongSequenceWarning()
    log.addFilter(quiet)
    try:
        return tokenizer(text, **kwargs)["input_ids"]
    finally:
        log.removeFilter(quiet)


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    ids = encode_text(tokenizer, text)
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------ calibration text


def read_texts(files: list[str | Path]) -> str:
    """Calibration (or router, check) text: the files' documents (read_documents) joined by blank lines."""
    parts = [read_documents(Path(f), "calibration file", "pass existing, readable UTF-8 .txt or .jsonl files to "
                            "--calib") for f in files]
    text = "\n\n".join(parts)
    if not text.strip():
        raise MoeifyError(f"calibration data in {', '.join(map(str, files))} is empty", "pass files with English text")
    return text


def source_tokenizer(src_path: Path):
    """The checkpoint's own tokenizer for calibration (load_tokenizer, with calibration's way out)."""
    return load_tokenizer(src_path, "calibration needs the checkpoint's tokenizer files (tokenizer.json): copy them "
                          "into it, or pass --weight-only to carve from the weights alone")


def text_windows(src_path: Path, files: list[str | Path], seq_len: int) -> torch.Tensor:
    """Every whole window of seq_len tokens of the files' text, (n, seq_len) (possibly n = 0)."""
    ids = encode_text(source_tokenizer(src_path), read_texts(files), add_special_tokens=False)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def calibration_tokens(src_path: Path, files: list[str | Path], n_tokens: int,
                       seq_len: int) -> tuple[torch.Tensor, int]:
    """Tokenize with the checkpoint's own tokenizer; return ((n_seq, seq_len) windows covering n_tokens, the
    number of tokens in the text).

    n_tokens 0 (no --calib-tokens): as many whole windows as the text fills, up to CALIB_TOKENS_CAP tokens.
    An explicit n_tokens larger than the text is an error. Fewer windows than the text fills are spread evenly
    over all of it (every file and genre of a mixed text read, not its head alone)."""
    from .config import CALIB_TOKENS_CAP

    text = read_texts(files)
    ids = encode_text(source_tokenizer(src_path), text, add_special_tokens=False)
    if n_tokens and n_tokens < seq_len:
        raise MoeifyError(f"--calib-tokens {n_tokens} is less than one window of --calib-seq-len {seq_len}")
    n_seq = (n_tokens or min(len(ids), CALIB_TOKENS_CAP)) // seq_len
    if n_seq < 1 or len(ids) < n_seq * seq_len:
        fits = len(ids) // seq_len * seq_len
        hint = (f"add text to --calib or lower --calib-tokens (to at most {fits})" if fits else
                f"add text to --calib (it is shorter than one window of --calib-seq-len {seq_len}) "
                f"or lower --calib-seq-len (to at most {len(ids)})")
        what = (f"calibration text has {len(ids)} tokens, fewer than --calib-tokens {n_tokens}" if n_tokens else
                f"calibration text has {len(ids)} tokens, fewer than one window of --calib-seq-len {seq_len}")
        raise MoeifyError(what, hint)
    whole = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    return whole[spread(n_seq, whole.shape[0])], len(ids)


def spread(n: int, total: int) -> torch.Tensor:
    """n indices of range(total), evenly spaced from 0 (all of them, in order, when n == total)."""
    return torch.arange(n) * total // n


def first_windows(src_path: Path, text: str, tokens: int, flag: str, seq: int = 64) -> torch.Tensor:
    """(n, seq) windows of the first `tokens` tokens of `text` (the file(s) of `flag`) in the checkpoint's own
    tokenizer, made before any work, so that a missing tokenizer or too short a text fails first."""
    ids = encode_text(source_tokenizer(src_path), text, add_special_tokens=False)[:tokens]
    if len(ids) < seq:
        raise MoeifyError(f"{flag} has {len(ids)} tokens, fewer than one window of {seq}", f"give {flag} a longer text")
    return torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)


# ------------------------------------------------------------------------------------------- windows


@dataclass(frozen=True)
class Window:
    begin: int  # token positions [begin, end)
    end: int
    new_from: int  # offset in the window of its first new token (0 for the first window)

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def scored(self) -> int:  # positions scored: new tokens that have a predecessor in the window
        return self.length - max(self.new_from, 1)


def make_windows(n_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """The standard sliding-window perplexity windows (as in the transformers perplexity guide)."""
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + seq_len, n_tokens)
        new = end - prev_end
        w = Window(begin, end, (end - begin) - new)
        if w.scored > 0:
            windows.append(w)
        prev_end = end
        if end == n_tokens:
            break
    return windows


def batch_windows(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of equal shape (length, new_from) in batches of at most batch_size (no padding)."""
    batches: list[list[Window]] = []
    for w in windows:
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and (last[0].length, last[0].new_from) == (w.length, w.new_from):
            last.append(w)
        else:
            batches.append([w])
    return batches


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
