"""`--model` as a Hugging Face repo id, against a stand-in Hub on loopback (tests/hub_standin.py),
and `--dtype float16`.

The stand-in serves the tiny random-init model (conftest) as `org/tiny`, plus files Baton must not
download. Each process under test runs as a subprocess with its own HF_ENDPOINT / HF_HOME /
HF_HUB_OFFLINE / HF_TOKEN, as a user's would: huggingface_hub reads them when it is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton.llm import LLM
from baton.common.sampling_params import SamplingParams
from tests.hub_standin import COMMIT, HubRepo, HubStandIn
from tests.test_cli import _children_records, _start_serve, _wait_for, baton_cmd, fake_services  # noqa: F401

PROMPT = [5, 100, 2000, 300, 44, 7, 9, 8]
# What Baton needs of the tiny model's repo (tiny_model_dir holds exactly these).
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja"}

# Loads the model by the name given, as the engine (both workers) and the gateway do, and reports.
LOAD_SCRIPT = """
import json, sys
from baton.llm import LLM
from baton.common.sampling_params import SamplingParams
from gateway.__main__ import parse_args
from gateway.tokenizer import PromptTokenizer

llm = LLM(model=sys.argv[1], dtype="float32", num_kv_blocks=64, num_threads=1)
[out] = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
settings = parse_args(["--model", sys.argv[1]])
tokenizer = PromptTokenizer(settings.model_dir)
print(json.dumps({"engine_dir": str(llm.engine.model_dir), "gateway_dir": str(settings.model_dir),
                  "served": list(settings.served_model_names), "tokens": out.outputs[0].token_ids,
                  "hello": tokenizer.encode_text("Hello, world")}))
"""


@pytest.fixture(scope="module")
def hub(tiny_model_dir):
    files = HubRepo.from_dir(tiny_model_dir).files
    assert set(files) == MODEL_FILES
    # Files a real repo carries besides: other formats of the weights, docs, subfolders.
    extra = {"pytorch_model.bin": b"\0" * 1000, "README.md": b"# tiny", "onnx/model.safetensors": b"\0" * 100}
    server = HubStandIn({"org/tiny": HubRepo({**files, **extra}),
                         "org/private": HubRepo(dict(files), token="hf_secret_token")}).start()
    yield server
    server.stop()


@pytest.fixture
def hf_env(hub, tmp_path) -> dict[str, str]:
    """A fresh, empty Hugging Face cache for this test, and the stand-in as the Hub."""
    hub.requests.clear()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE")}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false"}


def run_py(code: str, *args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parents[1])


def load_by_name(name: str, env: dict[str, str]) -> dict:
    result = run_py(LOAD_SCRIPT, name, json.dumps(PROMPT), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def greedy_tokens(model_dir: Path, dtype: str, max_tokens: int = 6) -> list[int]:
    llm = LLM(model=str(model_dir), dtype=dtype, num_kv_blocks=64, num_threads=1)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length"
    return out.outputs[0].token_ids


# ------------------------------------------------------------------ a repo id, then offline

def test_a_repo_id_loads_the_engine_and_the_gateway_tokenizer_then_works_offline(hub, hf_env, tiny_model_dir):
    online = load_by_name("org/tiny", hf_env)
    snapshot = Path(hf_env["HF_HOME"]) / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    # Both the engine (what each worker runs) and the gateway resolved the name to one snapshot.
    assert online["engine_dir"] == online["gateway_dir"] == str(snapshot)
    assert online["served"] == ["org/tiny"]  # served as its name, not as the snapshot's hash
    # Only what Baton reads came over the wire: no .bin, no README, no subfolder.
    assert sorted(hub.downloads()) == sorted(MODEL_FILES)  # each once
    # The same model as the local directory: same greedy tokens, same tokenizer.
    assert online["tokens"] == greedy_tokens(tiny_model_dir, "float32")
    from gateway.tokenizer import PromptTokenizer

    assert online["hello"] == PromptTokenizer(tiny_model_dir).encode_text("Hello, world")

    # Offline: the cached snapshot, and not one request to the Hub.
    seen = len(hub.requests)
    offline = load_by_name("org/tiny", {**hf_env, "HF_HUB_OFFLINE": "1"})
    assert offline == online
    assert len(hub.requests) == seen


def test_a_second_online_start_downloads_nothing_again(hub, hf_env):
    code = "import sys; from baton.common.model_files import resolve_model; print(resolve_model(sys.argv[1]))"
    first = run_py(code, "org/tiny", env=hf_env)
    assert first.returncode == 0, first.stderr
    hub.requests.clear()
    second = run_py(code, "org/tiny", env=hf_env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert hub.downloads() == []  # the cache is current: metadata checks only


def test_a_private_repo_needs_hf_token(hub, hf_env):
    code = "import sys; from baton.common.model_files import resolve_model; print(resolve_model(sys.argv[1]))"
    without = run_py(code, "org/private", env=hf_env)
    assert without.returncode != 0
    assert "has no model repo 'org/private'" in without.stderr and "HF_TOKEN" in without.stderr
    with_token = run_py(code, "org/private", env={**hf_env, "HF_TOKEN": "hf_secret_token"})
    assert with_token.returncode == 0, with_token.stderr
    assert with_token.stdout.strip().endswith(COMMIT)


# ------------------------------------------------------------------ names that are not models

def test_an_unknown_repo_id_is_a_clear_error_from_serve_the_gateway_and_a_worker(hub, hf_env):
    serve = subprocess.run(baton_cmd("serve", "--model", "org/no-such-model"), env=hf_env,
                           capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2
    assert f"{hub.url} has no model repo 'org/no-such-model'" in serve.stderr
    assert "Traceback" not in serve.stderr
    gateway = run_py("import sys; from gateway.__main__ import main; sys.exit(main(sys.argv[1:]))",
                     "--model", "org/no-such-model", env=hf_env)
    assert gateway.returncode == 2
    assert "has no model repo 'org/no-such-model'" in gateway.stderr and "Traceback" not in gateway.stderr
    worker = subprocess.run([sys.executable, "-m", "decode_worker", "--model", "org/no-such-model"],
                            env=hf_env, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 2
    assert "has no model repo 'org/no-such-model'" in worker.stderr and "Traceback" not in worker.stderr


def test_offline_and_not_cached_says_so(hf_env):
    result = subprocess.run(baton_cmd("serve", "--model", "org/tiny"), env={**hf_env, "HF_HUB_OFFLINE": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "HF_HUB_OFFLINE is set and org/tiny is not in the Hugging Face cache" in result.stderr


def test_an_unreachable_hub_says_so(hf_env):
    env = {**hf_env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on the discard port
    result = run_py("import sys; from baton.common.model_files import resolve_model; resolve_model(sys.argv[1])",
                    "org/tiny", env=env)
    assert result.returncode != 0
    assert "http://127.0.0.1:9 could not be reached" in result.stderr


def test_a_path_that_is_neither_a_model_nor_a_repo_id(tmp_path):
    from baton.common.model_files import resolve_model
    from baton.common.hub import ModelNotFoundError

    for name in (str(tmp_path / "nope"), "./not/a/model", str(tmp_path)):  # missing, not a repo id, not a model
        with pytest.raises(ModelNotFoundError, match="is not a model directory .* or a Hugging Face repo id"):
            resolve_model(name)
    with pytest.raises(ModelNotFoundError, match="no such .gguf file"):
        resolve_model(str(tmp_path / "model.gguf"))


def test_a_local_directory_wins_over_a_repo_id_of_the_same_spelling(tiny_model_dir, monkeypatch):
    from baton.common import model_files as fetch

    monkeypatch.chdir(tiny_model_dir.parent)
    name = tiny_model_dir.name  # also a valid repo id
    assert fetch.resolve_model(name) == Path(name)
    assert fetch.model_display_name(name, Path(name)) == name


# ------------------------------------------------------------------ baton serve resolves once

def test_serve_resolves_a_repo_id_once_and_gives_every_child_the_snapshot(fake_services, hf_env, hub):
    env = {**fake_services["env"], **{k: hf_env[k] for k in ("HF_ENDPOINT", "HF_HOME")}}
    proc, out, err = _start_serve(fake_services, "--model", "org/tiny", env=env)  # the last --model wins
    try:
        assert _wait_for(lambda: any("Baton is serving" in line for line in out) or proc.poll() is not None,
                         60), err
        assert proc.poll() is None, "".join(err)
        assert next(line for line in out if "Baton is serving" in line).startswith("Baton is serving org/tiny at")
        records = _children_records(fake_services["logs"])
        snapshot = str(Path(hf_env["HF_HOME"]) / "hub" / "models--org--tiny" / "snapshots" / COMMIT)
        assert len(records) == 3
        # each child's config names the one snapshot (the gateway's as its model_dir)
        assert all(r["config"].get("model", r["config"].get("model_dir")) == snapshot for r in records)
        [gateway] = [r["config"] for r in records if r["argv"][0].endswith(os.path.join("gateway", "__main__.py"))]
        assert gateway["served_model_names"][0] == "org/tiny"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ------------------------------------------------------------------ --dtype float16

@pytest.mark.usefixtures("one_torch_thread")
def test_float16_greedy_decode_runs_and_matches_float32(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float16", num_kv_blocks=64)
    assert llm.engine.dtype == torch.float16
    assert all(p.dtype == torch.float16 for p in llm.engine.runtime.model.parameters())
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    # The tiny model's top logits are far apart (conftest), so half precision picks the same tokens.
    assert out.outputs[0].token_ids == greedy_tokens(tiny_model_dir, "float32", max_tokens=8)


def test_an_unsupported_dtype_is_a_clear_error(tiny_model_dir, capsys):
    with pytest.raises(ValueError, match="unknown dtype 'int8': use auto, float32, bfloat16 or float16"):
        LLM(model=str(tiny_model_dir), dtype="int8", num_kv_blocks=64)
    from baton.cli.cli import build_parser

    assert build_parser().parse_args(["serve", "--dtype", "float16"]).dtype == "float16"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--dtype", "int8"])
    assert exc.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    worker = subprocess.run([sys.executable, "-m", "decode_worker", "--dtype", "int8"], capture_output=True,
                            text=True, timeout=60)
    assert worker.returncode == 2 and "invalid choice: 'int8'" in worker.stderr


def test_serve_passes_float16_to_both_workers():
    from baton.cli.cli import build_parser
    from baton.cli.serve import ThreadPlan, build_child_specs
    from tests.test_cli import child_config

    args = build_parser().parse_args(["serve", "--dtype", "float16"])
    specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2), python="py")
    dtypes = {s.name: child_config(s).dtype for s in specs if s.role != "gateway"}
    assert dtypes == {"prefill_worker[0]": "float16", "decode_worker[0]": "float16"}
