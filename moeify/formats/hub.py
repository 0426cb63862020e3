"""Sources by Hugging Face Hub id: `org/name`, or `org/name@revision` (a branch, tag or commit), wherever a command
takes a checkpoint, resolved to a folder of the local Hub cache through huggingface_hub (which transformers brings).

Only the files a conversion reads are fetched (HUB_FILES: safetensors weights and their index, configs, tokenizer
files, chat template, licence and card), never pickled `.bin` weights; `plan` fetches config.json alone. The Hub's
own settings hold: HF_HUB_CACHE / HF_HOME (where the cache is), HF_HUB_OFFLINE=1 (the cache only, no network),
HF_TOKEN (gated and private models); huggingface_hub shows the download's progress. A path that exists is always a
path: a folder named like an id (`models/qwen`) is read as the folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import MoeifyError
from .families import TOKENIZER_FILES

HUB_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json", *TOKENIZER_FILES, "LICENSE*", "LICENCE*",
             "README.md")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


@dataclass(frozen=True)
class HubSource:
    """A checkpoint named by Hub id, as resolved: its local folder (or config.json, for a plan) and where it came from."""

    repo_id: str
    revision: str | None  # as asked (None: the default branch)
    commit: str  # the snapshot's commit
    path: Path  # the folder in the Hub cache (config_only: its config.json)


def is_hub_id(spec: str | Path) -> bool:
    """`org/name[@revision]` that is not an existing path."""
    text = str(spec)
    return not Path(text).exists() and bool(_HUB_ID.match(text))


def split_id(spec: str) -> tuple[str, str | None]:
    repo, _, revision = str(spec).partition("@")
    return repo, revision or None


def resolve(spec: str | Path, *, config_only: bool = False, what: str = "SRC") -> Path:
    """The local path of a checkpoint given as a path (returned as it is) or a Hub id (fetched into the Hub cache,
    or found there). config_only: only config.json (its path is returned), for what needs no weights."""
    if not is_hub_id(spec):
        return Path(spec)
    return fetch(str(spec), config_only=config_only, what=what).path


def hub_origin(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a folder of the Hub cache (…/models--org--name/snapshots/COMMIT), else None: how an
    output's card names its base model."""
    parts = Path(path).resolve().parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i][len("models--"):].replace("--", "/"), parts[i + 2]
    return None


def fetch(spec: str, *, config_only: bool = False, what: str = "SRC") -> HubSource:
    """A Hub id resolved to its snapshot in the local cache: one clear MoeifyError for a gated, missing, wrong-revision
    or offline-and-uncached model, and for one without safetensors weights."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo, revision = split_id(spec)
    at = f"@{revision}" if revision else ""
    try:
        if config_only:
            path = Path(hf_hub_download(repo, "config.json", revision=revision))
        else:
            path = Path(snapshot_download(repo, revision=revision, allow_patterns=list(HUB_FILES)))
    except GatedRepoError:
        raise MoeifyError(f"{what} {repo} is gated on the Hugging Face Hub: its licence must be accepted first",
                          f"accept it on https://huggingface.co/{repo}, then log in (`hf auth login`) or set "
                          "HF_TOKEN") from None
    except RevisionNotFoundError:
        raise MoeifyError(f"{what} {repo} has no revision {revision!r} on the Hugging Face Hub",
                          f"name a branch, tag or commit it has ({repo}@main), or drop @{revision}") from None
    except RepositoryNotFoundError:
        raise MoeifyError(f"{what} {repo}{at} is neither a folder here nor a model on the Hugging Face Hub",
                          "check the name (org/name); a private model needs HF_TOKEN; a local checkpoint needs "
                          "the path of its folder") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise MoeifyError(f"{what} {repo}{at} is not in the Hub cache ({constants.HF_HUB_CACHE}) and {where}",
                          "fetch it once with network access (the same command does), or pass the folder of a "
                          "local copy") from None
    except EntryNotFoundError:  # (after its subclass above)
        raise MoeifyError(f"{what} {repo}{at} on the Hugging Face Hub has no config.json",
                          "pass a Hugging Face checkpoint (config.json, safetensors weights, tokenizer)") from None
    except OSError as exc:  # an incomplete cached snapshot offline, a full disk, a proxy
        raise MoeifyError(f"{what} {repo}{at}: the Hugging Face Hub download failed ({str(exc).splitlines()[0]})",
                          "retry with network access, or pass the folder of a local copy") from None
    folder = path.parent if config_only else path
    if not config_only and not any(folder.glob("*.safetensors")):
        raise MoeifyError(f"{what} {repo}{at} has no safetensors weights on the Hugging Face Hub (moeify never loads "
                          "pickled .bin weights, which can run code)", "use a revision or a copy with "
                          "*.safetensors weights (transformers' save_pretrained writes them)")
    return HubSource(repo, revision, folder.name, path)
