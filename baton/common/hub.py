"""Models named by a Hugging Face repo id (`--model HuggingFaceTB/SmolLM2-135M-Instruct`).

`huggingface_hub.snapshot_download` fetches only the files Baton reads into the Hugging Face cache
(~/.cache/huggingface/hub; HF_HOME or HF_HUB_CACHE move it), so a model downloaded once is shared
with every other tool that uses that cache. huggingface_hub itself reads HF_ENDPOINT (a mirror or
a private hub), HF_TOKEN (private and gated repos) and HF_HUB_OFFLINE (no request at all: the cached
snapshot or an error). Every failure becomes a `ModelNotFoundError` that says what to do, because
its usual reader is someone who mistyped a name or is offline, not a Python programmer.
"""

from __future__ import annotations

from pathlib import Path

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


def download_model(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id` (downloaded first unless cached and current)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILE_PATTERNS,
                                 ignore_patterns=IGNORE_PATTERNS)
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
    except LocalEntryNotFoundError as exc:
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
    return Path(path)
