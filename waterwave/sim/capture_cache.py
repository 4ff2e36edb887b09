"""Captured steps kept on disk between runs: ``waterwave simulate`` and the
benchmarks capture the same library models at the same batches run after
run (resnet18 costs seconds a capture, resnet50 more), so a step captured
once is read back next time.

Where: ``captures/`` in Waterwave's cache folder, the one the torch bridge
is built into (``$WATERWAVE_CACHE_DIR``, else ``~/.cache/waterwave``);
``WATERWAVE_CAPTURE_CACHE=off`` keeps nothing. Only steps whose model a
name identifies are kept (a ``JobModel`` with a ``cache_key``: the models
``waterwave.tools.models`` builds by name), never a user's own model file
or builder.

An entry's name digests what the capture depends on: the model's name and
batch, the versions of torch, torchvision and transformers, and the
source of every Waterwave module (an edit to the capture or the graph
captures again). An entry that cannot be read (a file cut short, another
program's file) is captured again and rewritten, with a warning in the
``waterwave`` log; a write goes to a temporary file renamed into place, so
processes capturing side by side never read half a file.

May import: waterwave.graph, waterwave.alloc (the cache folder); the standard library.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from ..alloc.torch_bridge import cache_dir
from ..graph import Graph, GraphError

log = logging.getLogger(__name__)

OFF = "off"
_PACKAGE = Path(__file__).resolve().parent.parent  # waterwave/


def folder() -> Path | None:
    """The cache's folder (see the module's opening); None when it is off."""
    if os.environ.get("WATERWAVE_CAPTURE_CACHE", "").strip().lower() == OFF:
        return None
    return cache_dir() / "captures"


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """The versions of what builds and captures the models, and the source
    of every Waterwave module."""
    h = hashlib.sha256()
    for dist in ("torch", "torchvision", "transformers"):
        try:
            h.update(f"{dist}={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none;".encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def entry(name: str, batch: int) -> str:
    """The file name of ``name``'s step at ``batch``."""
    digest = hashlib.sha256(f"{_code_digest()}|{name}|{batch}".encode()).hexdigest()[:32]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
    return f"{safe}-bs{batch}-{digest}.json"


def captured(name: str, batch: int, capture: Callable[[], Graph]) -> Graph:
    """``name``'s step at ``batch``: read from the cache, else ``capture()``
    and kept there."""
    where = folder()
    if where is None:
        return capture()
    path = where / entry(name, batch)
    if path.exists():
        try:
            return Graph.load(str(path))
        except GraphError as e:
            log.warning("the cached capture %s cannot be read (%s): capturing it again", path, e)
    graph = capture()
    _keep(graph, path)
    return graph


def _keep(graph: Graph, path: Path) -> None:
    """Write ``graph`` to ``path`` atomically; a cache that cannot be
    written (a read-only home, a full disk) costs the next run a capture,
    nothing more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".partial-", suffix=".json")
        os.close(fd)
        try:
            graph.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("cannot keep the capture in %s (%s): the next run captures it again",
                    path.parent, e)
