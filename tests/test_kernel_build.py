"""Building the native kernels survives what a real start meets: a torch lock file left by a build
that was killed mid-way, two workers building at once, another builder that never finishes; and
the cache key tells CPUs of every architecture apart (issue #20, items 8 and 9).

The builds here are of a one-function pybind11 module (a few seconds, no torch headers) through the
same locking path as the kernels; one test builds the real kernels, in the shared cache that
tests/test_kernels.py uses too (cheap once built)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.model import kernels

needs_compiler = pytest.mark.skipif(kernels._compiler() is None, reason="no C++ compiler here")

NAME = "baton_test_tiny"
TINY_SOURCE = """#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""
# a child process that builds the tiny module and says what it got ("RESULT 5": built and imported)
BUILD = """
import logging, sys
logging.basicConfig(level="INFO", format="%(levelname)s %(message)s")
from baton.model import kernels
ext = kernels.Extension(name=sys.argv[1], cpp_sources=(sys.argv[2],), extra_cflags=("-O0",), implicit_headers=False)
module = kernels.build(ext, timeout_s=float(sys.argv[3]))
print("RESULT", None if module is None else module.add(2, 3), flush=True)
"""


def build_command(wait_s: float = 120) -> list[str]:
    return [sys.executable, "-c", BUILD, NAME, TINY_SOURCE, str(wait_s)]


def child_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "BATON_NATIVE_KERNELS": "1"}


def build_in_child(cache: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """One build in a fresh process; a hang (torch waiting on a stale lock) fails as a timeout."""
    return subprocess.run(build_command(), env=child_env(cache), capture_output=True, text=True, timeout=timeout_s)


def kill_leftovers(cache: Path) -> None:
    """SIGKILL every process still working in `cache`: ninja gives each compiler its own process
    group, so killing the builder's group can leave one running; a stopped container leaves none."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = False
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                cwd = os.readlink(proc / "cwd")
            except OSError:  # exited meanwhile, or not ours to read
                continue
            if str(cache) in cmdline or cwd.startswith(str(cache)):
                found = True
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not found:
            return
        time.sleep(0.1)


# --- item 9: the cache key ------------------------------------------------------------------------

ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: {part}
CPU revision\t: 1

processor\t: 1
BogoMIPS\t: 243.75
CPU part\t: 0xd44
"""

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9654 96-Core Processor
stepping\t: 1
microcode\t: 0xa10113e
cpu MHz\t\t: {mhz}
core id\t\t: 0
apicid\t\t: 0
flags\t\t: fpu vme de pse tsc msr pae avx2 avx512f avx512bw avx512_bf16
bogomips\t: 4792.{mhz}

"""


def test_arm_cpus_that_differ_only_in_their_part_get_different_keys():
    neoverse_n1 = kernels._cpu_signature(ARM.format(part="0xd0c"), machine="aarch64")
    neoverse_v1 = kernels._cpu_signature(ARM.format(part="0xd40"), machine="aarch64")
    assert neoverse_n1 != neoverse_v1
    # the second core's lines do not count: the first block speaks for the machine
    assert kernels._cpu_signature(ARM.format(part="0xd0c").replace("0xd44", "0xd45"), machine="aarch64") == neoverse_n1


def test_volatile_lines_do_not_change_the_key():
    assert kernels._cpu_signature(X86.format(mhz="2400.000"), machine="x86_64") == kernels._cpu_signature(
        X86.format(mhz="3701.234"), machine="x86_64")
    assert kernels._cpu_signature(X86.format(mhz="2400.000"), machine="x86_64") != kernels._cpu_signature(
        X86.format(mhz="2400.000").replace("avx512_bf16", ""), machine="x86_64")


def test_a_cpuinfo_without_known_lines_still_tells_architectures_apart():
    unknown = "processor\t: 0\nbogomips\t: 100.00\n"
    keys = {kernels._cpu_signature(unknown, machine=m) for m in ("x86_64", "aarch64", "riscv64", "ppc64le")}
    assert len(keys) == 4
    assert kernels._cpu_signature("", machine="aarch64") == kernels._cpu_signature(unknown, machine="aarch64")


def test_the_kernels_name_carries_this_cpus_signature():
    assert kernels.kernels_extension().name.endswith("_" + kernels._cpu_signature())


# --- item 8: building past stale locks, concurrently, and with a bounded wait ----------------------

@needs_compiler
def test_a_stale_torch_lock_is_removed_and_the_build_completes(tmp_path):
    stale = tmp_path / NAME / "lock"  # what a builder killed mid-way leaves
    stale.parent.mkdir()
    stale.touch()
    done = build_in_child(tmp_path)
    assert "RESULT 5" in done.stdout, done.stderr
    assert not stale.exists()
    assert "stale torch build lock" in done.stderr


@needs_compiler
def test_two_processes_building_at_once_both_get_the_module(tmp_path):
    procs = [subprocess.Popen(build_command(), env=child_env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for out, err in outputs:
        assert "RESULT 5" in out, err
    assert not (tmp_path / NAME / "lock").exists()


@needs_compiler
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_build_killed_midway_leaves_the_next_one_working(tmp_path, sig):
    lock = tmp_path / NAME / "lock"
    # its own session: the signal goes to the builder and its ninja, as `docker stop` or Ctrl-C sends it
    proc = subprocess.Popen(build_command(), env=child_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None and lock.exists(), "the build never started"
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    kill_leftovers(tmp_path)
    assert lock.exists()  # the killed build left torch's lock behind: the case to survive
    done = build_in_child(tmp_path)
    assert "RESULT 5" in done.stdout, done.stderr
    assert not lock.exists()


@needs_compiler
def test_a_builder_that_never_finishes_is_waited_for_only_so_long(tmp_path, monkeypatch, caplog):
    """Another process holding the build lock past the timeout: the torch path runs, and says why."""
    import fcntl

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = kernels.Extension(name=NAME, cpp_sources=(TINY_SOURCE,), implicit_headers=False)
    build_dir = kernels.build_directory(ext)
    build_dir.mkdir()
    with open(build_dir / "baton.lock", "w") as held:  # a separate open file: flock excludes it as another process
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="baton.model.kernels"):
            assert kernels.build(ext, timeout_s=0.5) is None
        assert time.monotonic() - started < 10
    assert "BATON_KERNEL_BUILD_TIMEOUT" in caplog.text and "the torch path runs" in caplog.text
    assert not (build_dir / f"{NAME}.so").exists()


@needs_compiler
def test_a_compile_is_announced_before_and_timed_after_and_a_cached_build_says_nothing(tmp_path, monkeypatch,
                                                                                       caplog):
    """What a first start shows while a worker compiles (issue #42): one line before, one after."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = kernels.Extension(name=NAME, cpp_sources=(TINY_SOURCE,), extra_cflags=("-O0",), implicit_headers=False)
    build_dir = kernels.build_directory(ext)
    assert kernels.needs_compile(build_dir, ext)
    with caplog.at_level(logging.INFO, logger="baton.model.kernels"):
        assert kernels.build(ext).add(2, 3) == 5
    said = [record.getMessage() for record in caplog.records]
    assert said[0] == "building the native CPU kernels (first start on this machine, takes a few minutes) ..."
    assert len(said) == 2 and re.fullmatch(r"native kernels built in \d+s", said[1]), said
    assert not kernels.needs_compile(build_dir, ext)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="baton.model.kernels"):
        assert kernels.build(ext).add(2, 3) == 5
    assert caplog.records == []  # cached: nothing to say (it loads in well under SLOW_BUILD_S)


@pytest.mark.parametrize("other_build_s, lines", [(0.1, 0), (0.6, 2)], ids=["a moment", "longer"])
def test_a_wait_for_another_builder_says_when_it_is_over(tmp_path, monkeypatch, caplog, other_build_s, lines):
    """A wait past WAIT_NOTICE_S is said when it begins and when it ends; a moment's wait (the other
    worker loading a cached build) is not worth a line."""
    import fcntl
    import threading

    monkeypatch.setattr(kernels, "WAIT_NOTICE_S", 0.3)
    with open(tmp_path / "baton.lock", "w") as held:  # another process's build
        fcntl.flock(held, fcntl.LOCK_EX)
        threading.Timer(other_build_s, fcntl.flock, args=(held, fcntl.LOCK_UN)).start()
        with (caplog.at_level(logging.INFO, logger="baton.model.kernels"),
              kernels._builder_lock(tmp_path, timeout_s=30) as got):
            assert got
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == lines, said
    if lines:
        assert said[0].startswith("another process is building"), said
        assert re.fullmatch(rf"the other build of {tmp_path.name} is over \(waited \d+ s\)", said[1]), said


def test_the_build_timeout_comes_from_the_environment(monkeypatch, caplog):
    monkeypatch.delenv("BATON_KERNEL_BUILD_TIMEOUT", raising=False)
    assert kernels.build_timeout() == kernels.DEFAULT_BUILD_TIMEOUT_S
    monkeypatch.setenv("BATON_KERNEL_BUILD_TIMEOUT", "30")
    assert kernels.build_timeout() == 30.0
    monkeypatch.setenv("BATON_KERNEL_BUILD_TIMEOUT", "soon")
    with caplog.at_level(logging.WARNING, logger="baton.model.kernels"):
        assert kernels.build_timeout() == kernels.DEFAULT_BUILD_TIMEOUT_S
    assert "BATON_KERNEL_BUILD_TIMEOUT='soon'" in caplog.text


@needs_compiler
@pytest.mark.timeout(900)  # a first build of the real kernels at -O3 takes a minute or more
def test_the_real_kernels_build_past_a_stale_lock():
    """`load()` itself, in the shared cache: a stale torch lock planted as a dead builder leaves it
    (under the flock, so that no live build here is disturbed) does not stop the kernels loading."""
    script = """
from baton.model import kernels
ext = kernels.kernels_extension()
build_dir = kernels.build_directory(ext)
build_dir.mkdir(parents=True, exist_ok=True)
with kernels._builder_lock(build_dir, 600) as held:
    assert held
    (build_dir / "lock").touch()
module = kernels.load()
print("RESULT", module is not None and hasattr(module, "paged_decode"), (build_dir / "lock").exists())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=840,
                          env={**os.environ, "BATON_NATIVE_KERNELS": "1"})
    assert "RESULT True False" in done.stdout, done.stderr


def test_no_compiler_means_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    ext = kernels.Extension(name=NAME, cpp_sources=(TINY_SOURCE,), implicit_headers=False)
    with caplog.at_level(logging.WARNING, logger="baton.model.kernels"):
        assert kernels.build(ext) is None
    assert "no C++ compiler" in caplog.text
