"""PyTorch's memory snapshot, from Waterwave's allocators: the dict (and the
pickle) ``torch.cuda.memory._snapshot()`` / ``_dump_snapshot`` produce, so
PyTorch's memory viewer (https://pytorch.org/memory_viz) and
``python -m torch.cuda._memory_viz trace_plot|segment_plot|stats`` open it,
and ``waterwave.trace.from_snapshot`` reads it back.

Segments come from the allocator's ``snapshot()`` (an expandable segment as
one segment per mapped run, as PyTorch shows it); ``device_traces`` from its
memory history (``record_memory_history``). No stack frames are recorded: the
allocator runs below Python.

May import: nothing of waterwave.
"""
from __future__ import annotations

import pickle
from typing import Any

_BLOCK_STATE = {"allocated": "active_allocated", "pending_free": "active_pending_free"}
DEFAULT_MAX_ENTRIES = 1_000_000


def history_settings(enabled: Any, max_entries: int) -> tuple[bool, int]:
    """torch's ``enabled`` values (True/False/None, "all", "state") and a
    positive ``max_entries``, as (on, max_entries); a clear error otherwise."""
    if enabled not in (True, False, None, "all", "state"):
        raise ValueError(f"record_memory_history: enabled={enabled!r}; use True, False, None, "
                         "'all' or 'state'")
    if not isinstance(max_entries, int) or max_entries < 1:
        raise ValueError(f"record_memory_history: max_entries must be a positive int, got "
                         f"{max_entries!r}")
    return enabled not in (False, None), max_entries


def torch_segments(segments: list[dict], device: int) -> list[dict]:
    """The allocator's ``snapshot()`` in PyTorch's segment format."""
    out = []
    for seg in segments:
        blocks = [{"address": b["addr"], "size": b["size"], "requested_size": b["requested"],
                   "state": _BLOCK_STATE.get(b["state"], "inactive"), "frames": []}
                  for b in seg["blocks"]]
        out.append({
            "device": device, "address": seg["addr"], "total_size": seg["size"],
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
            "requested_size": sum(b["requested_size"] for b in blocks
                                  if b["state"] != "inactive"),
            "stream": seg["stream"], "segment_type": seg["pool"], "segment_pool_id": (0, 0),
            "is_expandable": seg.get("expandable", False), "frames": [], "blocks": blocks,
        })
    return out


def torch_trace(history: list[dict]) -> list[dict]:
    """The allocator's memory history as one device's ``device_traces`` entry."""
    return [{**e, "frames": []} for e in history]


def build(segments_by_device: dict[int, list[dict]], history_by_device: dict[int, list[dict]]
          ) -> dict:
    """The snapshot dict over devices 0..max (devices without an allocator get empty traces)."""
    n = max([*segments_by_device, *history_by_device], default=-1) + 1
    segments = [s for d in sorted(segments_by_device)
                for s in torch_segments(segments_by_device[d], d)]
    return {"segments": segments,
            "device_traces": [torch_trace(history_by_device.get(d, [])) for d in range(n)]}


def dump(snapshot: dict, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
