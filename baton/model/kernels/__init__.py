"""Native CPU kernels, built once per machine at first use, each with a pure-torch fallback.

`greedy_pick` is argmax + log-probability per row in two vectorised passes (torch's CPU argmax
over a 49k vocabulary is ~14x slower than its amax). `paged_decode` reads K/V through the block
table in place (vLLM's and SGLang's CPU decode attention do the same): the torch path must first
gather every request's blocks into a padded copy, which at batch 64 moves three times the KV bytes
the attention needs; `rope_write_decode` adds RoPE and the K/V write to it, one call per layer.
`gemv` is the few-row bf16 matmul that streams weights at the machine's bandwidth (oneDNN reads them
at a fraction of it at batch 1-4); `qgemv` is its int8 (GGUF Q8_0) and 4-bit (Q4_0/Q4_1/Q4_K)
counterpart, with integer dot products. `decode_layers` runs a decode-only step's layers in one call.
`gated_delta_decode` is a Gated DeltaNet layer's decode step (conv, silu, the delta rule) in place on
the rows' state slots, two passes over each state where torch's ops make four.
Each file says what it measured.

The build uses torch's own extension builder (a C++ compiler and ninja are needed) and is cached
under `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), keyed by the source, the
toolchain (with the paths of this checkout and of torch, which torch's build.ninja names) and this
CPU's identity (it is compiled with -march=native, so a build from one CPU model must not be reused
on another: `_cpu_signature` reads the identity lines of every architecture's /proc/cpuinfo,
aarch64's "CPU part" as well as x86's "model name"). Where it cannot be built (no compiler, a slim
image), `load()` returns None and the torch path runs. Whether to use them at all is the runtime's
choice (`RuntimeConfig.native_kernels`, default `BATON_NATIVE_KERNELS`): with it off, nothing calls
`load()`.

A build is serialised by an flock of ours (`baton.lock` in the build folder) around torch's builder.
Torch's own lock is a file that exists while a build runs, and torch waits for it to disappear
forever: a build killed mid-way (SIGTERM during the engine's construction, `docker stop`) leaves it
behind and every later start would spin on it. An flock is released by the kernel when its holder
dies, so it is never stale; and while we hold it no other Baton process is building, so a torch lock
found then is a dead builder's and is removed. Prefill and decode workers starting together still
build once: the second waits for the first's flock and then finds the build cached. The wait is
bounded by `BATON_KERNEL_BUILD_TIMEOUT` seconds (default 900); past it the torch path runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from baton.model import runtime_env

logger = logging.getLogger("baton.model.kernels")

_DIR = Path(__file__).parent
# each includes vec.h; decode_layers.cpp calls the others, so it comes last (one translation unit)
_SOURCES = ("paged_attention.cpp", "pointwise.cpp", "gemv.cpp", "qgemv.cpp", "gated_delta.cpp", "decode_layers.cpp")
_FUNCTIONS = ("paged_decode", "rope_write_decode", "greedy_pick", "add_rms_norm", "add_offset_rms_norm", "silu_mul",
              "gemv", "gemv_pack", "gemv_available", "gemv_kernel", "q8_pack", "q4_pack", "qgemv", "quantize_activations", "q8_available",
              "qgemv_isa", "qgemv_rows", "decode_layers", "onednn_linear", "parallel_threads", "gated_delta_decode",
              "causal_conv_silu", "flush_denormals")
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}

DEFAULT_BUILD_TIMEOUT_S = 900.0
SLOW_BUILD_S = 5.0  # a cached build loads in well under this; past it, torch is compiling
# a wait for another builder said only past this: workers starting together wait a moment for each
# other's load of a cached build every start, which is nothing to report
WAIT_NOTICE_S = 2.0
# /proc/cpuinfo keys that say which CPU this is (what -march=native compiles for), per architecture:
# x86 (vendor_id .. flags), aarch64 (CPU implementer .. Features), RISC-V (isa, uarch, m*id), POWER
# (cpu), MIPS (cpu model), s390 (vendor_id, features), LoongArch (model name, features). Per-core and
# volatile lines (cpu MHz, bogomips, processor, core id, apicid, microcode) are left out: they differ
# between boots or cores of the same machine and would only force needless rebuilds.
_CPU_IDENTITY_KEYS = frozenset({
    "vendor_id", "cpu family", "model", "model name", "stepping", "flags",
    "cpu implementer", "cpu architecture", "cpu variant", "cpu part", "cpu revision", "features",
    "isa", "uarch", "mvendorid", "marchid", "mimpid", "cpu", "cpu model", "vendor", "hardware",
})


@dataclass(frozen=True)
class Extension:
    """What to build: torch's module name (also its build folder under the cache root) and its
    inputs. The kernels are one (`kernels_extension()`); a test builds a tiny one through the same
    locking path."""

    name: str
    cpp_sources: tuple[str, ...]
    functions: tuple[str, ...] | None = None
    extra_cflags: tuple[str, ...] = ()
    extra_ldflags: tuple[str, ...] = ()
    extra_include_paths: tuple[str, ...] = ()
    implicit_headers: bool = True  # False: the sources include what they need (no torch/extension.h)


def _cpu_signature(cpuinfo: str | None = None, machine: str | None = None) -> str:
    """A short hash of this CPU's identity: the architecture plus the identity lines of the first
    processor block of /proc/cpuinfo (one core speaks for the machine, as -march=native reads one)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: the architecture alone (the best there is without cpuinfo)
            cpuinfo = ""
    identity = [f"machine={machine if machine is not None else platform.machine()}"]
    seen: set[str] = set()
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if sep and key in _CPU_IDENTITY_KEYS and key not in seen:
            seen.add(key)
            identity.append(f"{key}={value.strip()}")
    return hashlib.sha256("\n".join(identity).encode()).hexdigest()[:10]


def _compiler() -> str | None:
    """The C++ compiler torch will run (it reads $CXX, else `c++`), resolved through its links so
    that the cache key names the real one (/usr/bin/c++ -> g++-12)."""
    found = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    return os.path.realpath(found) if found else None


def kernels_extension() -> Extension:
    """The native kernels, named by a hash of everything the binary depends on (their source, the
    functions bound, the flags, the compiler, the torch and Python it is built against) and by this
    CPU: two builds of one name must be the same build, or the second recompiles the first."""
    import torch

    sources = tuple((_DIR / name).read_text() for name in _SOURCES)
    # -fopenmp: at::parallel_for is a header template whose `omp parallel` exists only when the
    # extension itself is compiled with OpenMP; without it every kernel ran on one thread whatever
    # --threads said (a Q4 8192x576 matmul at batch 1 on 2 threads: 144 us, now 63 us).
    cflags = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
    ldflags = ("-fopenmp",)
    # the paths torch's build.ninja names (this checkout's sources, this venv's torch): two checkouts
    # sharing one cache under one name rewrote each other's build.ninja, and ninja rebuilt at every start
    toolchain = (f"{_compiler()} torch {torch.__version__} {Path(torch.__file__).parent} python "
                 f"{sys.version_info[:2]} {_DIR}")
    keyed = "\0".join([*sources, (_DIR / "vec.h").read_text(), *_FUNCTIONS, *cflags, *ldflags, toolchain])
    digest = hashlib.sha256(keyed.encode()).hexdigest()[:10]
    return Extension(
        name=f"baton_kernels_{digest}_{_cpu_signature()}",
        cpp_sources=sources,
        functions=_FUNCTIONS,
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        extra_include_paths=(str(_DIR),),
    )


def build_timeout() -> float:
    """Seconds to wait for another process's build of the same extension (BATON_KERNEL_BUILD_TIMEOUT)."""
    raw = os.environ.get("BATON_KERNEL_BUILD_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        logger.warning("BATON_KERNEL_BUILD_TIMEOUT=%r is not a number of seconds: using %.0f", raw,
                       DEFAULT_BUILD_TIMEOUT_S)
        return DEFAULT_BUILD_TIMEOUT_S
    return value


def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built here (then: the torch path)."""
    with _lock:
        if "paged" in _loaded:
            return _loaded["paged"]
        module = None
        try:
            extension = kernels_extension()
        except OSError as exc:  # a broken install (a source file missing): the torch path, and say why
            logger.warning("native kernels' sources cannot be read (%s): the torch path runs", exc)
        else:
            module = build(extension)
        _loaded["paged"] = module
        return module


def loaded() -> ModuleType | None:
    """The kernels if an earlier `load()` built them in this process; never triggers a build."""
    return _loaded.get("paged")


def _put_ninja_on_path() -> None:
    # torch runs `ninja`; the PyPI package puts it next to this interpreter, which need not be on
    # PATH (a venv used without activating it)
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "")
    missing = [d for d in dirs if d and d not in path.split(os.pathsep)]
    if missing:
        os.environ["PATH"] = os.pathsep.join(missing + [path])


def build_directory(ext: Extension) -> Path:
    """Where `ext` is built and cached: `$TORCH_EXTENSIONS_DIR/<name>`, else under torch's per-user
    default root. Passed to torch explicitly, so that the folder we lock is the one it builds in."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root) / ext.name


@contextmanager
def _builder_lock(build_dir: Path, timeout_s: float) -> Iterator[bool]:
    """Hold the exclusive flock of `build_dir` (True), or give up after `timeout_s` (False)."""
    path = build_dir / "baton.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        deadline = started + timeout_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if waiting:  # the wait said it began: say it ended, or the log reads as still waiting
                    logger.info("the other build of %s is over (waited %.0f s)", build_dir.name,
                                time.monotonic() - started)
                break
            except BlockingIOError:  # another process holds it: it is building (or loading) now
                pass
            if time.monotonic() >= deadline:
                yield False
                return
            if not waiting and time.monotonic() - started >= WAIT_NOTICE_S:
                logger.info("another process is building %s: waiting for it (up to %.0f s)", build_dir.name,
                            timeout_s)
                waiting = True
            time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _clear_stale_torch_lock(build_dir: Path) -> None:
    """Remove torch's lock file, which can only be a dead builder's while we hold our flock: every
    Baton builder of this folder takes the flock before torch's lock (torch would wait on it forever)."""
    stale = build_dir / "lock"
    try:
        stale.unlink()
    except FileNotFoundError:
        return
    logger.warning("removed a stale torch build lock %s (a build of the native kernels was killed mid-way); "
                   "building again", stale)


def needs_compile(build_dir: Path, ext: Extension) -> bool:
    """Whether `ext` has no library in `build_dir` yet, so that the build about to run compiles
    (minutes for the kernels at -O3) rather than loads what is there (well under a second)."""
    return not (build_dir / f"{ext.name}.so").is_file()


@contextmanager
def _build_progress(build_dir: Path, ext: Extension) -> Iterator[None]:
    """One line before a compile and one after it, at INFO: a first start spends minutes here, and a
    worker that says nothing meanwhile reads as a hang. A build found cached says nothing. A rebuild
    that `needs_compile` cannot foresee (ninja finds a stale object) is announced once it has run
    for `SLOW_BUILD_S`."""
    started = time.monotonic()
    compiling = needs_compile(build_dir, ext)
    late: threading.Timer | None = None
    if compiling:
        logger.info("building the native CPU kernels (first start on this machine, takes a few minutes) ...")
    else:
        late = threading.Timer(SLOW_BUILD_S, logger.info, args=(
            "building the native CPU kernels again (the cached build is out of date, takes a few minutes) ...",))
        late.daemon = True
        late.start()
    try:
        yield
    finally:
        if late is not None:
            late.cancel()
    # (not reached when the build raised: `build` says that it failed instead)
    elapsed = time.monotonic() - started
    if compiling or elapsed >= SLOW_BUILD_S:
        logger.info("native kernels built in %.0fs", elapsed)


def build(ext: Extension, timeout_s: float | None = None) -> ModuleType | None:
    """Build (or find cached) and import `ext`, or None where it cannot be built: no compiler, a
    build error (logged with its cause), or another process still building it after `timeout_s`
    (default: `build_timeout()`). None means: the torch path runs."""
    if _compiler() is None:
        logger.warning("no C++ compiler: native paged attention disabled (the torch path runs)")
        return None
    timeout_s = build_timeout() if timeout_s is None else timeout_s
    try:
        from torch.utils.cpp_extension import load_inline

        _put_ninja_on_path()
        build_dir = build_directory(ext)
        build_dir.mkdir(parents=True, exist_ok=True)
        with _builder_lock(build_dir, timeout_s) as held:
            if not held:
                logger.warning("another process has held the build lock of %s for over %.0f s (set "
                               "BATON_KERNEL_BUILD_TIMEOUT to wait longer): the torch path runs",
                               build_dir / "baton.lock", timeout_s)
                return None
            _clear_stale_torch_lock(build_dir)
            with _build_progress(build_dir, ext):
                return load_inline(
                    name=ext.name,
                    cpp_sources=list(ext.cpp_sources),
                    functions=list(ext.functions) if ext.functions is not None else None,
                    extra_cflags=list(ext.extra_cflags),
                    extra_ldflags=list(ext.extra_ldflags),
                    extra_include_paths=list(ext.extra_include_paths),
                    build_directory=str(build_dir),
                    no_implicit_headers=not ext.implicit_headers,
                    verbose=False,
                )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback, and say so
        logger.warning("native kernels %s could not be built (%s): the torch path runs", ext.name,
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def main() -> int:
    """`python -m baton.model.kernels`: build (or find) the kernels now and say which path will run."""
    logging.basicConfig(level="INFO", format="%(message)s")
    if not runtime_env.native_kernels():
        print("native kernels: off (BATON_NATIVE_KERNELS); the torch fallback runs")
        return 0
    module = load()
    if module is None:
        print("native kernels: not available here; the torch fallback runs")
    else:
        print(f"native kernels: ready ({module.__file__})")
    return 0
