"""One copy of a GGUF's repacked weights per machine, shared by every worker through the page cache.

Each worker used to repack the GGUF's blocks into the native kernels' layout (`q8_pack` /
`q4_pack`, kernels/qgemv.cpp) in its own memory: N workers on one machine held N private copies of
the model. Instead the first worker to load a file writes the packed projections once to
`$BATON_CACHE/packed/<key>.bin` (with an index, `<key>.json`), and every worker, the first included,
maps that file read-only (`numpy.memmap(mode="r")`: MAP_SHARED, PROT_READ) and hands the kernels
views of it. The pages are the page cache's: clean, shared by all the processes that map them
(PSS divides them among the mappers) and never copied, since nothing writes to them (a write
would fault: the mapping is read-only).

The key is a hash of what decides the bytes: the GGUF's content key (baton.common.gguf_key: its
header and the ends of every tensor's data), the kernels' layout version (`LAYOUT_VERSION`, bumped
when qgemv.cpp's pack changes) and the model's projection slots. A worker that finds a complete
index for its key maps the file and repacks nothing; two workers starting at once take a file lock,
so one writes and the other waits and maps. `BATON_PACKED_CACHE=off` keeps the private copies (a
read-only or full cache disk does too, said in the log).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("baton.model.packed_cache")

LAYOUT_VERSION = 2  # of q8_pack's [NS, K/32, 1280] and q4_pack's [NS, K/32, 640] byte streams
ALIGN = 4096  # each pack starts on a page: the kernels stream it from its first byte
ENV = "BATON_PACKED_CACHE"


@dataclass
class PackedSlot:
    """One projection slot as the cache records it: the kernels' pack (None: a dense slot)."""

    label: str  # the GGUF types it was made from ("Q8_0", "Q4_K+Q6_K", "dense"): the load's log
    scheme: str | None = None  # "q8_0" | "q4" (QuantizedLinear.SCHEMES)
    out_features: int = 0
    in_features: int = 0
    packed: torch.Tensor | None = None  # uint8 [NS, K/32, bytes]
    input_order: list[int] | None = None  # QuantizedLinear.input_order: the input's order (None: as is)


def packed_dir() -> Path:
    from baton.common.model_files import cache_root

    return cache_root() / "packed"


def enabled() -> bool:
    return os.environ.get(ENV, "on").strip().lower() not in ("0", "off", "false", "no")


def cache_key(gguf_path: Path, layout: dict[str, Any]) -> str:
    """The file name stem for `gguf_path`'s packs under the kernels' layout and the model's slots."""
    from baton.common.gguf_key import gguf_content_key

    material = json.dumps({"gguf": gguf_content_key(gguf_path), "layout_version": LAYOUT_VERSION, **layout},
                          sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


class SharedPacks:
    """The cache file of one key: `locked()` around `read()` or the repack and `write()`."""

    def __init__(self, key: str, directory: Path | None = None) -> None:
        self.directory = directory or packed_dir()
        self.data_path = self.directory / f"{key}.bin"
        self.index_path = self.directory / f"{key}.json"

    @contextmanager
    def locked(self) -> Iterator[None]:
        """One process repacks and writes at a time; the others wait, then map what it wrote."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(self.directory / f"{self.data_path.stem}.lock", "a")  # noqa: SIM115
        except OSError as exc:  # a read-only cache: no file to share, so nothing to wait for
            logger.warning("no shared packed weights in %s (%s): this worker keeps its own copy", self.directory, exc)
            yield
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def read(self, expected_slots: int) -> list[PackedSlot] | None:
        """The slots mapped from the file, or None where there is no complete one (then: repack)."""
        try:
            index = json.loads(self.index_path.read_text())
            if index.get("layout_version") != LAYOUT_VERSION or len(index["slots"]) != expected_slots:
                return None
            if self.data_path.stat().st_size != index["size"]:
                return None
            mapped = self._map()
            slots = []
            for entry in index["slots"]:
                packed = None
                if entry.get("scheme") is not None:
                    start, shape = int(entry["offset"]), tuple(int(s) for s in entry["shape"])
                    packed = mapped[start:start + int(np.prod(shape))].view(*shape)
                order = entry.get("input_order")
                slots.append(PackedSlot(entry["label"], entry.get("scheme"), int(entry.get("out_features", 0)),
                                        int(entry.get("in_features", 0)), packed,
                                        None if order is None else [int(i) for i in order]))
            return slots
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not isinstance(exc, FileNotFoundError):
                logger.warning("%s: unreadable (%s): repacking", self.index_path, exc)
            return None

    def write(self, slots: Iterable[PackedSlot]) -> list[PackedSlot] | None:
        """Write the packs as `slots` yields them (index last: an index names a complete file) and
        return them mapped from it, or None where the disk refused (the caller then keeps private
        packs). A generator's packs can be freed as soon as they are written: the repack streams
        into the file (`gguf_weights`), so no worker holds all its private packs at once."""
        entries, offset = [], 0
        tmp = self.data_path.with_suffix(f".bin.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as out:
                for slot in slots:
                    entry: dict[str, Any] = {"label": slot.label, "scheme": slot.scheme}
                    if slot.packed is not None:
                        offset = -(-offset // ALIGN) * ALIGN
                        out.seek(offset)
                        out.write(memoryview(slot.packed.contiguous().numpy()).cast("B"))
                        entry.update(offset=offset, shape=list(slot.packed.shape),
                                     out_features=slot.out_features, in_features=slot.in_features,
                                     input_order=slot.input_order)
                        offset += slot.packed.numel()
                    entries.append(entry)
                out.truncate(offset)
            os.replace(tmp, self.data_path)
            index = {"layout_version": LAYOUT_VERSION, "size": offset, "slots": entries}
            tmp_index = self.index_path.with_suffix(f".json.tmp{os.getpid()}")
            tmp_index.write_text(json.dumps(index) + "\n")
            os.replace(tmp_index, self.index_path)
        except OSError as exc:
            logger.warning("could not write the packed weights to %s (%s): this worker keeps its own copy "
                           "(set %s=off to stop trying)", self.data_path, exc, ENV)
            return None
        finally:
            tmp.unlink(missing_ok=True)  # gone already where it was renamed; else a partial file
        return self.read(len(entries))

    def _map(self) -> torch.Tensor:
        """The whole file as a read-only uint8 tensor over a shared mapping (no copy)."""
        if self.data_path.stat().st_size == 0:
            return torch.empty(0, dtype=torch.uint8)
        array = np.memmap(self.data_path, dtype=np.uint8, mode="r")
        with warnings.catch_warnings():  # torch warns that it cannot write to it: nothing does
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array)
