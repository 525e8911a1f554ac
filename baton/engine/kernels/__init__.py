"""Native CPU kernels, built once per machine at first use, each with a pure-torch fallback.

`greedy_pick` is argmax + log-probability per row in two vectorised passes (torch's CPU argmax
over a 49k vocabulary is ~14x slower than its amax). `paged_decode` reads K/V through the block
table in place (vLLM's and SGLang's CPU decode attention do the same): the torch path must first
gather every request's blocks into a padded copy, which at batch 64 moves three times the KV bytes
the attention needs; `rope_write_decode` adds RoPE and the K/V write to it, one call per layer.
`gemv` is the few-row bf16 matmul that streams weights at the machine's bandwidth (oneDNN reads them
at a fraction of it at batch 1-4). `decode_layers` runs a decode-only step's layers in one call.
Each file says what it measured.

The build uses torch's own extension builder (a C++ compiler and ninja are needed) and is cached
under `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), keyed by the source and this
CPU's flags (it is compiled with -march=native). Where it cannot be built (no compiler, a slim
image) or `BATON_NATIVE_KERNELS=0`, `load()` returns None and the torch path runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("baton.engine.kernels")

_DIR = Path(__file__).parent
# each includes vec.h; decode_layers.cpp calls the others, so it comes last (one translation unit)
_SOURCES = ("paged_attention.cpp", "pointwise.cpp", "gemv.cpp", "decode_layers.cpp")
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = [line for line in text.splitlines() if line.startswith(("flags", "model name"))][:2]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


def enabled() -> bool:
    return os.environ.get("BATON_NATIVE_KERNELS", "1") not in ("0", "false", "no")


def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built here (then: the torch path)."""
    with _lock:
        if "paged" in _loaded:
            return _loaded["paged"]
        module = None
        if enabled():
            module = _build()
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


def _build() -> ModuleType | None:
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        logger.warning("no C++ compiler: native paged attention disabled (the torch path runs)")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        _put_ninja_on_path()

        sources = [(_DIR / name).read_text() for name in _SOURCES]
        digest = hashlib.sha256("".join([*sources, (_DIR / "vec.h").read_text()]).encode()).hexdigest()[:10]
        return load_inline(
            name=f"baton_kernels_{digest}_{_cpu_signature()}",
            cpp_sources=sources,
            extra_include_paths=[str(_DIR)],
            functions=["paged_decode", "rope_write_decode", "greedy_pick", "add_rms_norm", "silu_mul", "gemv", "gemv_pack", "gemv_available", "decode_layers", "onednn_linear"],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback, and say so
        logger.warning("native paged attention could not be built (%s): the torch path runs",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def main() -> int:
    """`python -m baton.engine.kernels`: build (or find) the kernels now and say which path will run."""
    logging.basicConfig(level="INFO", format="%(message)s")
    module = load()
    if module is None:
        print("native kernels: not available here; the torch fallback runs")
    else:
        print(f"native kernels: ready ({module.__file__})")
    return 0
