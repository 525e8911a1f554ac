"""Every flag of the gateway, the workers and `baton serve` can come from a BATON_* variable, as
TGI's and llama.cpp's do; the command line wins; a bad value is a usage error naming the variable."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from baton.common.env_flags import apply_env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--max-queue-wait", type=float, default=30.0, help="seconds")
    p.add_argument("--strict-api", action="store_true")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--model", required=True)
    return p


def test_variables_set_defaults_and_flags_win():
    env = {"BATON_MAX_QUEUE_WAIT": "5", "BATON_STRICT_API": "yes", "BATON_SERVED_MODEL_NAME": "a, b c",
           "BATON_LOG_FORMAT": "json", "BATON_MODEL": "/m"}
    p = parser()
    apply_env(p, env)
    args = p.parse_args([])
    assert (args.max_queue_wait, args.strict_api, args.served_model_name, args.log_format, args.model) == (
        5.0, True, ["a", "b", "c"], "json", "/m")
    assert p.parse_args(["--max-queue-wait", "7", "--model", "/x"]).max_queue_wait == 7.0
    assert "[set by BATON_MAX_QUEUE_WAIT]" in p.format_help()
    p = parser()
    apply_env(p, {"BATON_STRICT_API": "off", "BATON_MAX_QUEUE_WAIT": ""})  # empty: unset
    args = p.parse_args(["--model", "m"])
    assert args.strict_api is False and args.max_queue_wait == 30.0


@pytest.mark.parametrize("name,value,message", [
    ("BATON_MAX_QUEUE_WAIT", "soon", "BATON_MAX_QUEUE_WAIT='soon'"),
    ("BATON_STRICT_API", "maybe", "expected one of 1, true"),
    ("BATON_LOG_FORMAT", "xml", "expected one of text, json"),
])
def test_a_bad_value_is_a_usage_error_naming_the_variable(name, value, message, capsys):
    p = parser()
    with pytest.raises(SystemExit) as exc:
        apply_env(p, {name: value})
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_real_commands_read_their_variables(monkeypatch):
    from gateway.__main__ import parse_args

    monkeypatch.setattr("baton.common.model_files.resolve_model", lambda model: "/models/Some-Model")
    monkeypatch.setenv("BATON_MAX_QUEUE_WAIT", "3.5")
    monkeypatch.setenv("BATON_SERVED_MODEL_NAME", "alpha,beta")
    settings = parse_args([])
    assert settings.max_queue_wait == 3.5 and settings.served_model_names == ("alpha", "beta")
    from baton.cli.cli import build_parser

    monkeypatch.setenv("BATON_DECODE_WORKERS", "3")
    args = build_parser().parse_args(["serve"])
    assert args.decode_workers == 3
    # the workers: a bad value stops them with the variable's name, before any model is loaded
    env = {"BATON_NUM_KV_BLOCKS": "many", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "decode_worker"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "BATON_NUM_KV_BLOCKS='many'" in done.stderr


def test_baton_serve_keeps_one_process_identity_out_of_its_children(monkeypatch, tmp_path):
    from baton.cli.supervisor import ChildSpec, Supervisor

    monkeypatch.setenv("BATON_WORKER_ID", "same-for-all")
    monkeypatch.setenv("BATON_MAX_NUM_SEQS", "7")
    out = tmp_path / "env.txt"
    script = (f"import os; open({str(out)!r}, 'w').write("
              "f\"{os.environ.get('BATON_WORKER_ID')} {os.environ.get('BATON_MAX_NUM_SEQS')}\")")
    sup = Supervisor(log=lambda line: None)
    proc = sup.start(ChildSpec("w", [sys.executable, "-c", script], role="decode"))
    assert proc.wait(timeout=30) == 0
    sup.stop_all()
    assert out.read_text().split() == ["None", "7"]  # the id is not inherited; other settings are
