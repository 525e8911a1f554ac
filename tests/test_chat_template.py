"""`--chat-template` (a file or an inline Jinja string) replaces the model's chat template in the
gateway, and `baton serve` passes it through. Observed as a client sees it: the prompt /tokenize
renders for a list of messages, and a chat request's usage.prompt_tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.test_gateway_support import ServerThread

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
RENDERED = "[SYSTEM] Be brief.\n[USER] Hi there\n[ASSISTANT]"


def start(default_model_dir: Path, gw_redis_url: str, *flags: str) -> ServerThread:
    """A gateway built the way `python -m gateway FLAGS` builds it (its own tokenizer, from Settings)."""
    from gateway.__main__ import parse_args
    from gateway.app import create_app

    settings = parse_args(["--model", str(default_model_dir), "--redis-url", gw_redis_url, *flags])
    return ServerThread(create_app(settings)).start()


def rendered_prompt(server: ServerThread) -> str:
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    return httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "plain.jinja"
    path.write_text(TEMPLATE)
    return path


def test_the_models_template_by_default(default_model_dir, gw_redis_url):
    server = start(default_model_dir, gw_redis_url)
    try:
        assert "<|im_start|>user\nHi there<|im_end|>" in rendered_prompt(server)
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["file", "inline"])
def test_chat_template_replaces_the_models(default_model_dir, gw_redis_url, gw_echo_worker, template_file, how):
    server = start(default_model_dir, gw_redis_url, "--chat-template",
                   str(template_file) if how == "file" else TEMPLATE, "--max-batch-total-tokens", "100000")
    try:
        assert rendered_prompt(server) == RENDERED
        # The chat endpoint runs the same template: its prompt is exactly the rendered text's tokens.
        count = httpx.post(f"{server.url}/tokenize", json={"prompt": RENDERED, "add_special_tokens": False},
                           timeout=30).json()["count"]
        chat = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 4}, timeout=30)
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == count
    finally:
        server.stop()


@pytest.mark.parametrize("value, message", [
    ("no/such/template.jinja", "--chat-template 'no/such/template.jinja': no such file"),
    ("{% for m in messages %}{{ m }}", "--chat-template: not a valid Jinja template"),
])
def test_a_bad_chat_template_stops_the_gateway_at_start(default_model_dir, value, message):
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from gateway.__main__ import main; sys.exit(main(sys.argv[1:]))",
         "--model", str(default_model_dir), "--chat-template", value],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_serve_passes_the_template_to_the_gateway_only(template_file, monkeypatch):
    from baton.cli.cli import build_parser
    from baton.cli.serve import ThreadPlan, build_child_specs
    from tests.test_cli import child_config

    monkeypatch.chdir(template_file.parent)

    def gateway_template(*flags: str) -> str | None:
        args = build_parser().parse_args(["serve", *flags])
        specs = build_child_specs(args, Path("/m"), "redis://127.0.0.1:1/0", ThreadPlan([1], [1], cpus=2))
        return child_config(specs[-1]).chat_template

    # the gateway's config holds the template's text, read here (a file relative to the cwd)
    assert gateway_template("--chat-template", template_file.name) == template_file.read_text()
    assert gateway_template("--chat-template", TEMPLATE) == TEMPLATE
    assert gateway_template() is None


def test_serve_refuses_a_bad_template_before_starting_anything(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "baton.cli.cli", "serve", "--model", str(tiny_model_dir),
         "--chat-template", "{% if %}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "not a valid Jinja template" in result.stderr
    assert "redis" not in result.stderr  # nothing was started
