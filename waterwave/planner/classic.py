"""The classic planners, as baselines (seeds 001, 002, 003; reference 6.4).

Both keep program order and assign *storages* rather than offsets; a storage
is then a contiguous block, so the arena is the sum of storage sizes.

``mxnet``: reference-count simulation. An operator whose output may
overwrite an input (pointwise, same size) takes that input's storage when
this is the input's last use (in-place). Otherwise a freed storage is reused
if its size lies in [size, size * match_range), else one in
[size / match_range, size) that grows to the request; else a new storage.

``paddle``: liveness by dataflow analysis over the linear op list (live_in /
live_out), in-place as above, and a reuse pool: a dead variable's storage
serves a new output if it is at least as large (best fit).
"""
from __future__ import annotations

import bisect

from ..graph import Graph


def _result(g: Graph, storage_of: dict[int, int], storage_size: dict[int, int]):
    """Lay storages out back to back after the persistent block."""
    base = g.persistent_bytes()
    offsets = {}
    cursor = 0
    for t in g.tensors:
        if t.persistent and t.size:
            offsets[t.id] = cursor
            cursor += t.size
    start = {}
    for sid in sorted(storage_size):
        start[sid] = cursor
        cursor += storage_size[sid]
    for tid, sid in storage_of.items():
        offsets[tid] = start[sid]
    assert cursor == base + sum(storage_size.values())
    return offsets, cursor


def _take_in_place(g: Graph, node, out: int, storage_of: dict, inplace: list,
                   free_to_take) -> int | None:
    """The storage of the first of ``node``'s in-place candidates its output
    ``out`` may take the place of (held in a storage, not persistent, of the
    output's size, and no longer needed by anyone else, as
    ``free_to_take(input)``, each planner's own liveness, says), the pair
    noted in ``inplace``; None if there is none."""
    size = g.tensors[out].size
    for inp in node.inplace_ok:
        if (inp in storage_of and not g.tensors[inp].persistent and g.tensors[inp].size == size
                and free_to_take(inp)):
            inplace.append((out, inp))
            return storage_of[inp]
    return None


def _place_outputs(g: Graph, node, storage_of: dict, storage_size: dict, inplace: list,
                   reuse, free_to_take):
    """Each of ``node``'s outputs that has bytes gets a storage: an input's
    in place where ``free_to_take`` allows (``_take_in_place``), else
    ``reuse(size)``'s (a dead storage, or None), else a new one. Yields
    (output, storage, whether the storage is newly taken up)."""
    for out in node.outputs:
        size = g.tensors[out].size
        if size == 0:
            continue
        sid = _take_in_place(g, node, out, storage_of, inplace, free_to_take)
        fresh = sid is None
        if fresh:
            sid = reuse(size)
            if sid is None:
                sid = len(storage_size)
                storage_size[sid] = size
        storage_of[out] = sid
        yield out, sid, fresh


def _input_storages(g: Graph):
    """Graph inputs occupy storages from the start: (storage_of, storage_size)."""
    storage_of: dict[int, int] = {}
    storage_size: dict[int, int] = {}
    for t in g.tensors:
        if t.kind == "input" and t.size:
            storage_of[t.id] = len(storage_size)
            storage_size[len(storage_size)] = t.size
    return storage_of, storage_size


def mxnet_plan(g: Graph, match_range: int = 16):
    order = list(range(len(g.nodes)))
    keep = set(g.meta.get("outputs", []))
    remaining = [len(g.consumers(t.id)) for t in g.tensors]
    storage_of, storage_size = _input_storages(g)
    users_of_storage = {sid: 1 for sid in storage_size}  # live tensors on a storage
    free: list[tuple[int, int]] = []  # (size, storage id), sorted
    inplace = []

    def release(sid):
        bisect.insort(free, (storage_size[sid], sid))

    def reuse(size: int) -> int | None:
        i = bisect.bisect_left(free, (size, -1))
        if i < len(free) and free[i][0] < size * match_range:
            return free.pop(i)[1]
        if i > 0 and free[i - 1][0] * match_range > size:
            sid = free.pop(i - 1)[1]
            storage_size[sid] = size  # grows to the largest request served
            return sid
        return None

    for v in order:
        node = g.nodes[v]
        for out, sid, fresh in _place_outputs(
                g, node, storage_of, storage_size, inplace, reuse,
                lambda t: remaining[t] == 1 and t not in keep
                and users_of_storage[storage_of[t]] == 1):
            if fresh:
                users_of_storage[sid] = 0
            users_of_storage[sid] += 1
        dying = []
        for inp in node.inputs:
            remaining[inp] -= 1
            if remaining[inp] == 0 and inp in storage_of and inp not in keep:
                dying.append(inp)
        for out in node.outputs:
            if remaining[out] == 0 and out in storage_of and out not in keep:
                dying.append(out)
        for t in dying:
            sid = storage_of[t]
            users_of_storage[sid] -= 1
            if users_of_storage[sid] == 0:
                release(sid)
    offsets, arena = _result(g, storage_of, storage_size)
    return order, offsets, arena, inplace


def paddle_plan(g: Graph):
    order = list(range(len(g.nodes)))
    n = len(order)
    keep = set(g.meta.get("outputs", []))
    # Liveness: live_out[i] = union of live_in of successors in the linear
    # order; live_in[i] = uses[i] | (live_out[i] - defs[i]). One backward
    # pass suffices for a straight-line program.
    uses = [set(t for t in g.nodes[v].inputs if not g.tensors[t].persistent) for v in order]
    defs = [set(g.nodes[v].outputs) for v in order]
    live_out = [set() for _ in range(n)]
    live_in = [set() for _ in range(n)]
    for i in reversed(range(n)):
        live_out[i] = set(live_in[i + 1]) if i + 1 < n else set(keep)
        live_in[i] = uses[i] | (live_out[i] - defs[i])
    storage_of, storage_size = _input_storages(g)
    holders: dict[int, set[int]] = {sid: {t} for t, sid in storage_of.items()}
    pool: list[tuple[int, int]] = []  # (size, storage id) of dead storages
    inplace = []

    def reuse(size: int) -> int | None:
        j = bisect.bisect_left(pool, (size, -1))
        return pool.pop(j)[1] if j < len(pool) else None

    for i, v in enumerate(order):
        node = g.nodes[v]
        for out, sid, fresh in _place_outputs(
                g, node, storage_of, storage_size, inplace, reuse,
                lambda t: t not in live_out[i] and holders[storage_of[t]] == {t}):
            if fresh:
                holders[sid] = set()
            holders[sid].add(out)
        # Variables dead after this op return their storage to the pool.
        for t in (uses[i] | defs[i]) - live_out[i]:
            if t in storage_of and t not in keep:
                sid = storage_of[t]
                holders[sid].discard(t)
                if not holders[sid]:
                    bisect.insort(pool, (storage_size[sid], sid))
                    holders[sid] = {-1}  # pooled; replaced when reused
    offsets, arena = _result(g, storage_of, storage_size)
    return order, offsets, arena, inplace
