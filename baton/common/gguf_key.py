"""`gguf_content_key(path)`: what ties a converted directory to the GGUF file it was made from.

A GGUF file is a header, then its tensors' data. The header holds every metadata key/value (the
architecture's hyperparameters, the whole tokenizer with its merges, the chat template) and every
tensor's name, shape, type and data offset. The key is a SHA-256 of:
- the file's size,
- the whole header (every byte before the data region, alignment padding included),
- the first and last `SAMPLE_BYTES` of every tensor's data (a tensor's data runs from its offset to
  the next tensor's, or to the end of the file).
So another tokenizer, template, name, hyperparameter, quantization type or layout changes the key,
and so does other weights: a fine-tune or a requantization changes every tensor, so the bytes at each
tensor's two ends. Only an edit confined to the middle of tensors (hand-patched bytes) would keep it;
hashing the whole file would catch that too, but costs a full read (about a minute for 20 GB), on
every start. For the default model (98 MB, a 1.8 MB header, 272 tensors) it reads about 4 MB.

A file that does not parse as GGUF v2/v3 (v1, big-endian, truncated) is keyed by a hash of all of
it: slower, never wrong.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from pathlib import Path

SAMPLE_BYTES = 4096
KEY_SCHEME = "gguf-header+tensor-ends-v1"  # in the key: a later scheme never matches an old key
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")


class _Header:
    """A cursor over a GGUF file's header that skips values and keeps what the key needs."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        length = self.take("<Q")
        if self.pos + length > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        value = self.buf[self.pos:self.pos + length]
        self.pos += length
        return value

    def skip_value(self, kind: int) -> None:
        if kind in _FIXED:
            self.pos += _FIXED[kind]
        elif kind == _STRING:
            length = self.take("<Q")  # (not `pos += take()`: that adds to the pos from before the take)
            self.pos += length
        elif kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _FIXED:
                self.pos += _FIXED[item] * count
            elif item == _STRING:  # a tokenizer's tokens and merges (~100k strings): a tight loop
                pos, buf, length_at = self.pos, self.buf, _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length_at(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")
        if self.pos > len(self.buf):
            raise ValueError("a value runs past the end of the file")


def _data_layout(buf: mmap.mmap) -> tuple[int, list[int]]:
    """(where the data region starts, each tensor's absolute data offset); ValueError if not GGUF v2/v3."""
    header = _Header(buf)
    if buf[:4] != b"GGUF" or header.take("<4xI") not in (2, 3):
        raise ValueError("not a little-endian GGUF v2/v3 file")
    num_tensors, num_kv = header.take("<Q"), header.take("<Q")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(num_kv):
        key, kind = header.string(), header.take("<I")
        if key == b"general.alignment" and kind == 4:
            alignment = struct.unpack_from("<I", buf, header.pos)[0] or _DEFAULT_ALIGNMENT
        header.skip_value(kind)
    offsets = []
    for _ in range(num_tensors):
        header.string()  # name: hashed with the header
        num_dims = header.take("<I")
        header.pos += 8 * num_dims + 4  # the dims, the type
        offsets.append(header.take("<Q"))
    data_start = -(-header.pos // alignment) * alignment
    if data_start > len(buf):
        raise ValueError("the header runs past the end of the file")
    return data_start, [data_start + offset for offset in offsets]


_memo: dict[tuple[str, int, int, int, int], str] = {}


def gguf_content_key(path: Path) -> str:
    """The content key of the GGUF file at `path` (see the module doc): `scheme:sha256 hex`.
    Remembered per process while the file's inode, size, mtime and ctime stay (any write changes
    the ctime, which no one can set back), since a start asks for it several times."""
    stat = Path(path).stat()
    seen = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if seen not in _memo:
        _memo[seen] = _content_key(Path(path))
    return _memo[seen]


def _content_key(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        digest.update(size.to_bytes(8, "little"))
        if size == 0:
            return f"{KEY_SCHEME}:{digest.hexdigest()}"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                data_start, offsets = _data_layout(buf)
            except (ValueError, struct.error):
                for start in range(0, size, 1 << 24):  # not a GGUF we can parse: all of it
                    digest.update(buf[start:start + (1 << 24)])
                return f"whole-file:{digest.hexdigest()}"
            digest.update(buf[:data_start])
            ends = sorted({data_start, size} | {min(o, size) for o in offsets})
            for start, end in zip(ends, ends[1:]):
                digest.update(buf[start:min(end, start + SAMPLE_BYTES)])
                digest.update(buf[max(start, end - SAMPLE_BYTES):end])
    return f"{KEY_SCHEME}:{digest.hexdigest()}"
