"""Models named by a Hugging Face repo id (`--model HuggingFaceTB/SmolLM2-135M-Instruct`).

`huggingface_hub.snapshot_download` fetches only the files Baton reads into the Hugging Face cache
(~/.cache/huggingface/hub; HF_HOME or HF_HUB_CACHE move it), so a model downloaded once is shared
with every other tool that uses that cache. huggingface_hub itself reads HF_ENDPOINT (a mirror or
a private hub), HF_TOKEN (private and gated repos) and HF_HUB_OFFLINE (no request at all: the cached
snapshot or an error). Every failure becomes a `ModelNotFoundError` that says what to do, because
its usual reader is someone who mistyped a name or is offline, not a Python programmer.

A GGUF repo is named with its quantization (`owner/repo:Q4_K_M`, as llama.cpp's `-hf` and Ollama's
`hf.co/owner/repo:Q4_K_M` take it) or with the file's name (`--gguf-file`): `download_gguf` lists
the repo's files, picks that one GGUF and downloads it alone with `hf_hub_download`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

# What Baton loads: the config, the safetensors weights (sharded or not), the tokenizer in any of
# its formats and the chat template. Not *.bin / *.pt / *.gguf / ONNX copies of the same weights,
# which often outweigh the safetensors many times over.
MODEL_FILE_PATTERNS = [
    "config.json", "generation_config.json",
    "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
]
# The patterns are fnmatch patterns, whose `*` crosses "/": without this, a repo's subfolders
# (other sizes, other formats: `onnx/model.safetensors`, `original/...`) would be downloaded too.
IGNORE_PATTERNS = ["*/*"]


class ModelNotFoundError(FileNotFoundError):
    """--model names neither a usable local model nor a model that can be fetched."""


def looks_like_repo_id(name: str) -> bool:
    """`owner/name` or a bare `name`, as the Hub spells them (so not a path like ./x or /a/b)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


@contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's failures as `ModelNotFoundError`s that say what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    try:
        yield
    except GatedRepoError as exc:  # a subclass of RepositoryNotFoundError: first
        raise ModelNotFoundError(
            f"{repo_id} is gated on {endpoint}: accept its conditions on its page, then set HF_TOKEN "
            f"to a token of that account") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local model directory, and {endpoint} has no model repo {repo_id!r} "
            f"(a private one needs HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(f"{endpoint} has {repo_id} but no revision {revision!r}") from exc
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        # Offline (HF_HUB_OFFLINE) or the endpoint unreachable, and no complete cached snapshot.
        if constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE is set"
        else:
            cause = exc.__cause__ or exc
            reason = f"{endpoint} could not be reached ({type(cause).__name__}: {cause})"
        raise ModelNotFoundError(
            f"{reason} and {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"download it once while online") from exc
    except HfHubHTTPError as exc:
        raise ModelNotFoundError(f"downloading {repo_id} from {endpoint} failed: {exc}") from exc


def download_model(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id` (downloaded first unless cached and current)."""
    from huggingface_hub import snapshot_download

    with _hub_errors(repo_id, revision):
        path = snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILE_PATTERNS,
                                 ignore_patterns=IGNORE_PATTERNS)
    return Path(path)


# ------------------------------------------------------------------ one GGUF of a repo

# A GGUF repo holds one file per quantization, named `<model>-<TAG>.gguf` or `<model>.<TAG>.gguf`
# (Q4_K_M, Q8_0, IQ4_XS, BF16, ...), some of them split into `-00001-of-00003.gguf` parts, and
# often the vision projector (`mmproj-*.gguf`), which is not a model.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_QUANT_TAG = re.compile(r"(?:^|[-._])((?:I?Q\d[A-Za-z0-9_]*)|BF16|F16|F32)(?:-\d{5}-of-\d{5})?\.gguf$",
                        re.IGNORECASE)


def gguf_quant_tag(filename: str) -> str | None:
    """The quantization tag a GGUF's file name carries (`Q4_K_M` of `x-Q4_K_M.gguf`), if any."""
    match = _QUANT_TAG.search(PurePosixPath(filename).name)
    return match.group(1) if match else None


def _model_ggufs(files: list[str]) -> list[str]:
    return sorted(f for f in files if f.lower().endswith(".gguf")
                  and not PurePosixPath(f).name.lower().startswith("mmproj"))


def pick_gguf(repo_id: str, files: list[str], quant: str) -> str:
    """The one model GGUF of `files` whose name carries `quant` (case-insensitive, as a whole tag:
    Q4_K picks neither Q4_K_M nor Q4_K_S), or a ModelNotFoundError that lists what the repo has."""
    ggufs = _model_ggufs(files)
    tag = re.compile(rf"(?:^|[^A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    chosen = [f for f in ggufs if tag.search(PurePosixPath(f).name)]
    if not chosen:
        tags = sorted({t.upper() for f in ggufs if (t := gguf_quant_tag(f))})
        has = f"its quantizations: {', '.join(tags)}" if tags else (
            f"its GGUF files: {', '.join(ggufs)}" if ggufs else "no .gguf file at all")
        raise ModelNotFoundError(f"{repo_id} has no GGUF file for {quant!r}; {has}")
    whole = [f for f in chosen if not _SPLIT.search(f)]
    if not whole:
        parts = ", ".join(chosen[:3]) + (", ..." if len(chosen) > 3 else "")
        raise ModelNotFoundError(
            f"{repo_id}'s {quant} GGUF is split into parts ({parts}): "
            "split GGUFs are not supported yet; merge them with llama.cpp's `llama-gguf-split --merge` "
            "and serve the merged file")
    if len(whole) > 1:
        raise ModelNotFoundError(f"{repo_id} has several GGUF files for {quant!r} ({', '.join(whole)}): "
                                 "name one with --gguf-file")
    return whole[0]


def _cached_files(repo_id: str, revision: str | None) -> list[str]:
    """The files of `repo_id`'s cached snapshot (offline: what a listing would have said)."""
    from huggingface_hub import constants

    repo_dir = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    ref = repo_dir / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else (revision or "")
    snapshot = repo_dir / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        return []
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def download_gguf(repo_id: str, quant: str | None = None, filename: str | None = None,
                  revision: str | None = None) -> Path:
    """One GGUF file of the Hub repo `repo_id` in the Hugging Face cache: `filename`, or the one whose
    name carries the quantization tag `quant` (`repo:Q4_K_M`, as llama.cpp's `-hf` and Ollama's
    `hf.co/` take it). Only that file is downloaded, never the repo's other quantizations."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    with _hub_errors(repo_id, revision):
        if constants.HF_HUB_OFFLINE:
            files = _cached_files(repo_id, revision)
            if not files:
                raise ModelNotFoundError(f"HF_HUB_OFFLINE is set and {repo_id} is not in the Hugging Face cache "
                                         f"({constants.HF_HUB_CACHE}); download it once while online")
        else:
            files = HfApi().list_repo_files(repo_id, revision=revision)
        if filename is None:
            if quant is None:
                raise ValueError("download_gguf needs a quantization tag or a file name")
            filename = pick_gguf(repo_id, files, quant)
        elif files and filename not in files:
            ggufs = _model_ggufs(files)
            raise ModelNotFoundError(f"{repo_id} has no file {filename!r}; its GGUF files: "
                                     f"{', '.join(ggufs) if ggufs else 'none'}")
        elif _SPLIT.search(filename):
            raise ModelNotFoundError(f"{filename} is one part of a split GGUF: split GGUFs are not supported "
                                     "yet; merge them with `llama-gguf-split --merge` and serve the merged file")
        path = hf_hub_download(repo_id, filename, revision=revision)
    return Path(path)
