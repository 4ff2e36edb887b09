"""``memory_summary``: an allocator's statistics as a readable table, laid out
like ``torch.cuda.memory_summary()`` (current, peak, total allocated and
freed of each metric, by pool where the policy keeps pools), then what torch
cannot show: free memory by state (synced, each stream's unsynced, pending),
fragmentation, and how requests were served.

Pure formatting of a ``stats()`` dict, for the simulator's ``Allocator`` and
the CUDA backend alike.

May import: nothing of waterwave.
"""
from __future__ import annotations

# (title, stats key, formatted as bytes?)
_METRICS = [
    ("Allocated memory", "allocated_bytes", True),
    ("Active memory", "active_bytes", True),
    ("Requested memory", "requested_bytes", True),
    ("GPU reserved memory", "reserved_bytes", True),
    ("Non-releasable memory", "inactive_split_bytes", True),
    ("Allocations", "allocation", False),
    ("Active allocs", "active", False),
    ("GPU reserved segments", "segment", False),
    ("Non-releasable allocs", "inactive_split", False),
]
_FIELDS = ["current", "peak", "allocated", "freed"]
_SERVED = ["same_stream", "synced", "promoted", "cross_stream_wait", "new_segment", "after_sync"]
_WIDTH = 75


def format_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps the number at or above 1, as torch's summary does."""
    units = ("B  ", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} {units[i]}" if i == 0 else f"{n:.2f} {units[i]}"


def _cell(value: float, as_bytes: bool) -> str:
    return format_bytes(value) if as_bytes else f"{int(value):,}"


def memory_summary(stats: dict, title: str, policy: str, abbreviated: bool = False) -> str:
    """The table for the ``stats()`` of an allocator running ``policy``.
    ``abbreviated`` leaves out the per-pool rows and the per-stream free
    memory."""
    rule, thin = "=" * _WIDTH, "-" * _WIDTH
    lines = [rule, f" {title}".ljust(_WIDTH), thin,
             f" out of memory: {stats.get('num_ooms', 0):,}  |  device allocation retries: "
             f"{stats.get('num_alloc_retries', 0):,}  |  max_split_size: "
             f"{'unlimited' if stats.get('max_split_size', -1) < 0 else format_bytes(stats['max_split_size'])}",
             rule,
             f" {'Metric':<24}| {'Cur Usage':>11} | {'Peak Usage':>11} | {'Tot Alloc':>11} | "
             f"{'Tot Freed':>11}", thin]
    pools = [] if abbreviated else [p for p in ("large_pool", "small_pool")
                                    if f"allocated_bytes.{p}.current" in stats]
    for name, key, as_bytes in _METRICS:
        if f"{key}.all.current" not in stats:
            continue
        for pool, label in [("all", name)] + [(p, f"      from {p.split('_')[0]} pool")
                                              for p in pools]:
            cells = [_cell(stats.get(f"{key}.{pool}.{f}", 0), as_bytes) for f in _FIELDS]
            lines.append(f" {label:<24}| " + " | ".join(f"{c:>11}" for c in cells))
        lines.append(thin)
    for label, key in (("Oversize allocations", "oversize_allocations"),
                       ("Oversize GPU segments", "oversize_segments")):
        lines.append(f" {label:<24}| " + " | ".join(
            f"{int(stats.get(f'{key}.{f}', 0)):>11,}" for f in _FIELDS))
    lines += [rule, " Free memory by state".ljust(_WIDTH), thin]
    if policy == "pytorch":  # PyTorch's cache: every free block stays with its stream
        lines.append(f" {'cached (its stream only)':<32}"
                     f"{format_bytes(stats.get('synced_free_bytes', 0)):>14}")
    else:
        lines.append(f" {'synced (any stream)':<32}"
                     f"{format_bytes(stats.get('synced_free_bytes', 0)):>14}")
        lines.append(f" {'unsynced (its stream only)':<32}"
                     f"{format_bytes(stats.get('unsynced_free_bytes', 0)):>14}")
    if not abbreviated:
        for stream, n in sorted(stats.get("unsynced_free_bytes_by_stream", {}).items()):
            lines.append(f" {'   stream ' + hex(stream):<32}{format_bytes(n):>14}")
    lines.append(f" {'pending frees (record_stream)':<32}"
                 f"{format_bytes(stats.get('pending_free_bytes', 0)):>14}")
    lines.append(f" {'largest free block':<32}{format_bytes(stats.get('largest_free_block', 0)):>14}")
    lines.append(f" {'fragmentation at peak reserved':<32}"
                 f"{100 * stats.get('fragmentation.at_peak_reserved', 0.0):>13.1f}%")
    lines += [thin, " Requests served".ljust(_WIDTH), thin]
    for s in _SERVED:
        lines.append(f" {s.replace('_', ' '):<32}{int(stats.get(f'served.{s}', 0)):>14,}")
    lines.append(f" {'stream waits':<32}{int(stats.get('num_stream_waits', 0)):>14,}")
    lines.append(f" {'SyncAndCoalesce':<32}{int(stats.get('num_sync_and_coalesce', 0)):>14,}")
    if stats.get("num_page_moves"):
        lines.append(f" {'pages moved (expandable)':<32}{int(stats['num_page_moves']):>14,}")
    lines.append(rule)
    return "\n".join(lines) + "\n"
