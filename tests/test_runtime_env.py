"""The forward path's switches are `RuntimeConfig` fields: the BATON_* variables are their defaults,
read in one place (baton/model/runtime_env.py), and `load_runtime` passes them down; `baton plan`
states them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from baton.model import runtime_env
from baton.model.runtime import RuntimeConfig, load_runtime

ROOT = Path(__file__).resolve().parent.parent
SWITCHES = {"BATON_BATCH_INVARIANT": "batch_invariant", "BATON_NATIVE_KERNELS": "native_kernels",
            "BATON_GEMV_AMX": "gemv_amx", "BATON_TRITON": "triton"}


def test_the_variables_are_the_config_defaults_and_an_explicit_field_wins(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    config = RuntimeConfig(Path("/m"))
    assert (config.batch_invariant, config.native_kernels, config.gemv_amx, config.triton) == (None, True, True, False)
    for name, value in (("BATON_BATCH_INVARIANT", "matmul"), ("BATON_NATIVE_KERNELS", "0"),
                        ("BATON_GEMV_AMX", "no"), ("BATON_TRITON", "1")):
        monkeypatch.setenv(name, value)
    config = RuntimeConfig(Path("/m"))
    assert (config.batch_invariant, config.native_kernels, config.gemv_amx, config.triton) == ("matmul", False, False,
                                                                                              True)
    assert RuntimeConfig(Path("/m"), native_kernels=True, triton=False).native_kernels is True


def test_an_unknown_spelling_keeps_the_default_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("BATON_TRITON", "perhaps")
    assert runtime_env.triton() is False
    assert "BATON_TRITON='perhaps'" in caplog.text


def test_only_runtime_env_reads_the_forward_path_variables():
    """No module below the runtime reads a switch behind the config's back (C++ included)."""
    readers = []
    for path in [*(ROOT / "baton").rglob("*.py"), *(ROOT / "baton").rglob("*.cpp"), *(ROOT / "baton").rglob("*.h")]:
        text = path.read_text(encoding="utf-8")
        if path.suffix != ".py" and "getenv(" in text:
            readers.append(str(path.relative_to(ROOT)))
        for name in SWITCHES:
            if re.search(rf"environ(\.get)?[\[(]\s*[\"']{name}[\"']", text) and path.name != "runtime_env.py":
                readers.append(f"{path.relative_to(ROOT)}: {name}")
    assert readers == []
    table = runtime_env.__doc__ or ""
    assert all(f"`{name}`" in table and f"`{field}`" in table for name, field in SWITCHES.items())


def test_native_kernels_off_builds_nothing_and_the_plan_says_so(tiny_model_dir, monkeypatch):
    from baton.model import kernels

    def no_build():
        raise AssertionError("the native kernels were asked for with native_kernels=False")

    monkeypatch.setattr(kernels, "load", no_build)
    runtime = load_runtime(RuntimeConfig(tiny_model_dir, dtype="bfloat16", quantization="int8", native_kernels=False,
                                         batch_invariant="matmul"))
    assert runtime.model.path == "torch"
    plan = runtime.plan_report()
    assert "native kernels: off" in plan and "batch invariance: matmul" in plan and "Triton attention: off" in plan


@pytest.mark.parametrize("amx", [True, False])
def test_the_amx_choice_reaches_the_native_matmul(tiny_model_dir, amx):
    from baton.model import kernels

    native = kernels.load()
    if native is None or native.gemv_kernel("") != "amx":
        pytest.skip("the native matmul runs on AMX only on a CPU with AMX")
    try:
        load_runtime(RuntimeConfig(tiny_model_dir, dtype="bfloat16", gemv_amx=amx))
        assert native.gemv_kernel("") == ("amx" if amx else "avx512bf16")
    finally:
        native.gemv_kernel("amx")
