"""memory_summary and torch's memory names: the table shows the statistics it
is given, by pool and by free-memory state, for both policies."""
import re

import pytest

import waterwave as ww
from waterwave.alloc.summary import format_bytes, memory_summary

MiB = 1024**2


def row(text: str, label: str) -> list[str]:
    """The cells of the table row that starts with `label`."""
    for line in text.splitlines():
        if line.strip().startswith(label):
            return [c.strip() for c in re.split(r"\|", line)[1:]]
    raise AssertionError(f"no row {label!r} in\n{text}")


def value(text: str, label: str) -> str:
    """What the line that starts with `label` shows after it."""
    for line in text.splitlines():
        if line.strip().startswith(label):
            return line.strip()[len(label):].strip()
    raise AssertionError(f"no line {label!r} in\n{text}")


@pytest.mark.parametrize("n, text", [(0, "0 B  "), (512, "512 B  "), (1536, "1.50 KiB"),
                                     (5 * MiB, "5.00 MiB"), (3 * 1024 * MiB, "3.00 GiB")])
def test_bytes_are_shown_in_the_largest_unit(n, text):
    assert format_bytes(n) == text


def test_pytorch_policy_summary_has_the_pool_rows_and_figures():
    a = ww.Allocator("pytorch")
    p = a.alloc(5 * MiB, stream=1)
    q = a.alloc(100, stream=2)
    a.free(q)
    text = a.memory_summary()
    assert "policy 'pytorch'" in text
    assert row(text, "Allocated memory") == ["5.00 MiB", "5.00 MiB", "5.00 MiB", "512 B"]
    assert row(text, "GPU reserved memory")[0] == "22.00 MiB"  # a 20 MiB and a 2 MiB segment
    assert "from small pool" in text and "from large pool" in text
    assert "cached (its stream only)" in text and "synced (any stream)" not in text
    short = a.memory_summary(abbreviated=True)
    assert "from small pool" not in short
    a.free(p)


def test_waterwave_policy_summary_shows_free_memory_by_stream():
    a = ww.Allocator("waterwave")
    p = a.alloc(5 * MiB, stream=1)
    q = a.alloc(3 * MiB, stream=2)
    a.launch(2, 100.0, [q])
    a.free(q)  # unsynced: stream 2's kernel may still run
    text = a.memory_summary()
    s = a.stats()
    assert value(text, "stream 0x2") == "3.00 MiB"
    assert value(text, "unsynced (its stream only)") == format_bytes(s["unsynced_free_bytes"]).strip()
    assert value(text, "synced (any stream)") == format_bytes(s["synced_free_bytes"]).strip()
    assert "stream 0x2" not in a.memory_summary(abbreviated=True)
    a.free(p)


def test_summary_of_any_stats_dict_leaves_out_what_is_missing():
    text = memory_summary({"allocated_bytes.all.current": 1024}, "t", "waterwave")
    assert row(text, "Allocated memory")[0] == "1.00 KiB"
    assert "GPU reserved memory" not in text
