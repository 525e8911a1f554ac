"""One GGUF file of a Hub repo (`--model owner/repo:Q8_0`, `hf.co/owner/repo:Q8_0`, `--model owner/repo
--gguf-file NAME.gguf`), against the stand-in Hub on loopback (tests/hub_standin.py), and the name a GGUF
is served under: the file's own model name, not its converted directory's.

The repo holds tiny GGUFs (tests/test_gguf_source.write_tiny_gguf) under several quantization tags, a
split one and a vision projector, as real GGUF repos do: only the file asked for may be downloaded.
Each resolution runs in a subprocess with its own HF_ENDPOINT / HF_HOME / BATON_CACHE, as a user's
would (huggingface_hub reads them when it is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_standin import COMMIT, HubRepo, HubStandIn
from tests.test_cli import baton_cmd
from tests.test_gguf_source import write_tiny_gguf

REPO = "org/tiny-GGUF"
RESOLVE = """
import json, sys
from baton.common.model_files import gguf_source, model_display_name, resolve_model
gguf_file = sys.argv[2] or None
model_dir = resolve_model(sys.argv[1], gguf_file)
print(json.dumps({"dir": str(model_dir), "source": str(gguf_source(model_dir)),
                  "name": model_display_name(sys.argv[1], model_dir, gguf_file)}))
"""


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> dict[str, bytes]:
    where = tmp_path_factory.mktemp("ggufs")
    write_tiny_gguf(where / "named.gguf", name="Tiny Llama")
    write_tiny_gguf(where / "other.gguf", eos_token_id=2, name="Tiny Llama")
    return {"named": (where / "named.gguf").read_bytes(), "other": (where / "other.gguf").read_bytes()}


@pytest.fixture(scope="module")
def hub(gguf_bytes):
    files = {"tiny-Q8_0.gguf": gguf_bytes["named"], "tiny-F32.gguf": gguf_bytes["other"],
             "tiny-Q4_K_M-00001-of-00002.gguf": b"\0" * 64, "tiny-Q4_K_M-00002-of-00002.gguf": b"\0" * 64,
             "mmproj-tiny-f16.gguf": b"\0" * 64, "README.md": b"# tiny GGUFs"}
    server = HubStandIn({REPO: HubRepo(files)}).start()
    yield server
    server.stop()


@pytest.fixture
def env(hub, tmp_path) -> dict[str, str]:
    hub.requests.clear()
    base = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE")}
    return {**base, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
            "BATON_CACHE": str(tmp_path / "baton-cache"), "TOKENIZERS_PARALLELISM": "false"}


def resolve(model: str, env: dict[str, str], gguf_file: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RESOLVE, model, gguf_file], env=env, capture_output=True,
                          text=True, timeout=180, cwd=Path(__file__).resolve().parents[1])


def resolved(model: str, env: dict[str, str], gguf_file: str = "") -> dict:
    result = resolve(model, env, gguf_file)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_repo_colon_quant_downloads_that_file_alone_serves_it_by_its_name_and_works_offline(hub, env):
    snapshot = Path(env["HF_HOME"]) / "hub" / "models--org--tiny-GGUF" / "snapshots" / COMMIT
    got = resolved(f"hf.co/{REPO}:q8_0", env)  # Ollama's spelling, the tag in any case
    assert hub.downloads() == ["tiny-Q8_0.gguf"]  # not the other quantizations, not the split parts
    assert got["source"] == str(snapshot / "tiny-Q8_0.gguf")  # the loader reads the downloaded file
    assert got["name"] == "tiny"  # its file's name without the quantization, not the directory's name
    assert (Path(got["dir"]) / "config.json").is_file() and not list(Path(got["dir"]).glob("*.safetensors"))

    seen = len(hub.requests)
    offline = resolved(f"{REPO}:Q8_0", {**env, "HF_HUB_OFFLINE": "1"})  # llama.cpp's spelling
    assert offline == got
    assert len(hub.requests) == seen  # the cached file, not one request


def test_gguf_file_names_the_file_of_the_repo(hub, env):
    got = resolved(REPO, env, gguf_file="tiny-F32.gguf")
    assert hub.downloads() == ["tiny-F32.gguf"]
    assert Path(got["source"]).name == "tiny-F32.gguf"
    assert json.loads((Path(got["dir"]) / "config.json").read_text())["eos_token_id"] == 2  # that file's

    missing = resolve(REPO, env, gguf_file="tiny-Q2_K.gguf")
    assert missing.returncode != 0
    assert "org/tiny-GGUF has no file 'tiny-Q2_K.gguf'; its GGUF files: " in missing.stderr
    assert "tiny-Q8_0.gguf" in missing.stderr


def test_a_quantization_the_repo_lacks_lists_the_ones_it_has_and_a_split_file_is_refused(hub, env):
    missing = resolve(f"{REPO}:Q5_K_M", env)
    assert missing.returncode != 0
    # the projector's f16 is not a model's quantization
    assert "org/tiny-GGUF has no GGUF file for 'Q5_K_M'; its quantizations: F32, Q4_K_M, Q8_0" in missing.stderr
    split = resolve(f"{REPO}:Q4_K_M", env)
    assert split.returncode != 0
    assert "split GGUFs are not supported yet" in split.stderr
    assert hub.downloads() == []  # nothing downloaded for either


def test_serve_refuses_a_missing_quantization_before_loading_anything(hub, env):
    result = subprocess.run(baton_cmd("serve", "--model", f"{REPO}:IQ4_XS", "--port", "0"), env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "has no GGUF file for 'IQ4_XS'; its quantizations: F32, Q4_K_M, Q8_0" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_takes_gguf_file():
    from baton.cli.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", REPO, "--gguf-file", "tiny-F32.gguf"])
    assert (args.model, args.gguf_file) == (REPO, "tiny-F32.gguf")


# ------------------------------------------------------------------ the served name of a GGUF

def test_a_local_gguf_is_served_by_its_file_name_without_the_quantization(tmp_path, monkeypatch):
    from baton.common.model_files import model_display_name, resolve_model

    monkeypatch.setenv("BATON_CACHE", str(tmp_path / "cache"))
    named = tmp_path / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(named, name="Tiny Llama")  # a display name (spaces): no id a client could send
    assert model_display_name(str(named), resolve_model(str(named))) == "tiny-llama"
    unnamed = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    write_tiny_gguf(unnamed, name=None)
    model_dir = resolve_model(str(unnamed))
    assert model_dir.name == "SmolLM2-135M-Instruct.Q4_1-converted"
    assert model_display_name(str(unnamed), model_dir) == "SmolLM2-135M-Instruct"


def test_the_default_model_keeps_its_name():
    from baton.common.model_files import DEFAULT_MODEL_NAME, default_model_dir, model_display_name

    # made from a GGUF whose general.name is another spelling: served as before, by the flag or without
    assert model_display_name(None, default_model_dir()) == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert model_display_name(str(default_model_dir()), default_model_dir()) == DEFAULT_MODEL_NAME


def test_a_tag_matches_whole_tags_only_and_several_files_for_one_tag_ask_for_gguf_file():
    from baton.common.hub import ModelNotFoundError, pick_gguf

    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m.Q8_0.gguf", "sub/m-IQ4_XS.gguf", "README.md"]
    assert pick_gguf("o/r", files, "q4_k_s") == "m-Q4_K_S.gguf"
    assert pick_gguf("o/r", files, "IQ4_XS") == "sub/m-IQ4_XS.gguf"
    with pytest.raises(ModelNotFoundError, match="no GGUF file for 'Q4_K'; its quantizations: IQ4_XS, Q4_K_M, Q4_K_S"):
        pick_gguf("o/r", files, "Q4_K")  # not whichever of Q4_K_M and Q4_K_S comes first
    with pytest.raises(ModelNotFoundError, match=r"several GGUF files for 'Q8_0' .*name one with --gguf-file"):
        pick_gguf("o/r", files + ["m-v2.Q8_0.gguf"], "Q8_0")
