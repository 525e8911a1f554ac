"""The environment variables that choose the forward path, read here and nowhere else.

Each is the default of a `RuntimeConfig` field (baton/model/runtime.py): `load_runtime` passes the
field down to where the choice is made, so a worker's forward path is fixed by its config once,
and the variables keep working for users who set them.

| variable                | values                                   | default | `RuntimeConfig` field | effect |
|-------------------------|------------------------------------------|---------|-----------------------|--------|
| `BATON_BATCH_INVARIANT` | auto, full (1/true/yes/on), matmul, off (0/false/no) | auto | `batch_invariant` | one matmul kernel per projection for every row count ("matmul"), and prefill attention as decode steps do it ("full"), so greedy tokens do not depend on the batch; auto: full wherever the native bf16 matmul runs (`baton.model.linear.batch_invariant_mode`) |
| `BATON_NATIVE_KERNELS`  | 1/true/yes/on, 0/false/no/off            | on      | `native_kernels`      | the native CPU kernels (`baton.model.kernels`: built at first use); off: the torch path everywhere, nothing is compiled |
| `BATON_GEMV_AMX`        | 1/true/yes/on, 0/false/no/off            | on      | `gemv_amx`            | the native bf16 matmul uses AMX tiles where the CPU has them; off: its AVX512-BF16 path (as a CPU without AMX runs) |
| `BATON_TRITON`          | 1/true/yes/on, 0/false/no/off            | off     | `triton`              | CUDA attention through the Triton kernels over the paged pool (`baton.model.triton_attention`); opt-in until checked on a GPU |

Build settings (`BATON_KERNEL_BUILD_TIMEOUT`, `CXX`, `TORCH_EXTENSIONS_DIR`) say how the kernels are
built, not what the forward path is: `baton.model.kernels` reads them where it builds.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("baton.model.runtime_env")

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _switch(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    logger.warning("%s=%r is none of %s or %s: using %s", name, raw, "/".join(_ON), "/".join(_OFF),
                   "on" if default else "off")
    return default


def batch_invariant() -> str | None:
    """`BATON_BATCH_INVARIANT` as written (None when unset: auto); `batch_invariant_mode` reads its spellings."""
    raw = os.environ.get("BATON_BATCH_INVARIANT", "").strip()
    return raw or None


def native_kernels() -> bool:
    """`BATON_NATIVE_KERNELS` (default on)."""
    return _switch("BATON_NATIVE_KERNELS", True)


def gemv_amx() -> bool:
    """`BATON_GEMV_AMX` (default on)."""
    return _switch("BATON_GEMV_AMX", True)


def triton() -> bool:
    """`BATON_TRITON` (default off)."""
    return _switch("BATON_TRITON", False)
