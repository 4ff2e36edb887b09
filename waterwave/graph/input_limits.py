"""Limits on what a file from elsewhere may make Waterwave build: the bytes
read (a gzip's decompressed bytes counted as they come, in bounded chunks,
so a small bomb cannot expand whole), the streams a trace or snapshot names
(replay's happens-before clocks take memory quadratic in them) and the bytes
of one block, tensor or buffer (so sums of a few fit in 64 bits). A file
over a limit is refused before it is built, with an error naming the limit
and how to raise it: ``waterwave.set_input_limits(...)`` in Python, or the
environment variables ``WATERWAVE_MAX_FILE_BYTES`` and
``WATERWAVE_MAX_STREAMS``, read when a file is read.

May import: nothing of waterwave.
"""
from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass

GZIP_MAGIC = b"\x1f\x8b"
CHUNK = 1 << 20  # bytes decompressed per call
MAX_LIMIT = 1 << 62


@dataclass(frozen=True)
class InputLimits:
    file_bytes: int = 1 << 30   # a file's bytes, or a gzip's decompressed bytes (1 GiB)
    streams: int = 1024         # distinct streams in a trace or snapshot
    block_bytes: int = 1 << 50  # one block, tensor or buffer (1 PiB)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"input limit {f.name} must be a positive whole number, got "
                                 f"{value!r}")
            if value > MAX_LIMIT:  # a read of limit + 1 bytes must be a size Python can ask for
                raise ValueError(f"input limit {f.name} must be at most 2**62, got {value:,}")


_limits = InputLimits()
_ENVIRONMENT = {"file_bytes": "WATERWAVE_MAX_FILE_BYTES", "streams": "WATERWAVE_MAX_STREAMS"}


def input_limits() -> InputLimits:
    """The limits in force: those set last, with the environment's on top."""
    changes = {}
    for name, var in _ENVIRONMENT.items():
        text = os.environ.get(var, "").strip()
        if text:
            if not (text.isascii() and text.isdigit()) or int(text) <= 0:
                raise ValueError(f"{var} must be a positive whole number, got {text!r}")
            if len(text) > 19 or int(text) > MAX_LIMIT:
                raise ValueError(f"{var} must be at most 2**62 ({MAX_LIMIT:,}), got {text[:30]}")
            changes[name] = int(text)
    return dataclasses.replace(_limits, **changes)


def set_input_limits(**changes: int) -> InputLimits:
    """Change some limits (``file_bytes``, ``streams``, ``block_bytes``) for
    every file read from now on; returns the limits before the change."""
    global _limits
    unknown = set(changes) - {f.name for f in dataclasses.fields(InputLimits)}
    if unknown:
        raise ValueError(f"unknown input limit {', '.join(sorted(unknown))}: the limits are "
                         "file_bytes, streams and block_bytes")
    before, _limits = _limits, dataclasses.replace(_limits, **changes)
    return before


def _too_large(path: str, what: str, limit: int, error: type[ValueError]) -> ValueError:
    return error(f"{path}: {what} more than {limit:,} bytes, the limit for files read: if it "
                 "is genuine, raise it with waterwave.set_input_limits(file_bytes=...) or "
                 "WATERWAVE_MAX_FILE_BYTES")


def read_bytes(path: str, error: type[ValueError], gunzip: bool = False) -> bytes:
    """A file's bytes, refused past ``file_bytes``; with ``gunzip``, a gzip
    file is decompressed chunk by chunk and refused as soon as its content
    passes the limit. OSError if the file cannot be read."""
    limit = input_limits().file_bytes
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise _too_large(path, "the file holds", limit, error)
    if not (gunzip and raw[:2] == GZIP_MAGIC):
        return raw
    out, total = [], 0
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
    data = raw
    try:
        while True:
            piece = inflate.decompress(data, CHUNK)
            total += len(piece)
            if total > limit:
                raise _too_large(path, "the gzip stream decompresses to", limit, error)
            out.append(piece)
            data = inflate.unconsumed_tail
            if inflate.eof:
                break
            if not data and not piece:
                raise error(f"{path}: the gzip stream is truncated; copy the file again")
    except zlib.error as e:
        raise error(f"{path}: the gzip stream is corrupt ({e}); copy the file again") from None
    return b"".join(out)
