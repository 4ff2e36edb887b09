"""Snapshots in PyTorch's format from Waterwave's allocators: read by
torch.cuda._memory_viz (what PyTorch's memory viewer runs) and by
waterwave.trace.from_snapshot; the history is bounded by max_entries.
The CUDA backend's side is in test_cuda_backend.py."""
import base64
import pickle
import random
import re
import subprocess
import sys

import pytest

import waterwave as ww
from waterwave.sim.trace import from_snapshot

mv = pytest.importorskip("torch.cuda._memory_viz")
MiB = 1024**2


def workload(a, steps=200, seed=3):
    """Random allocations and frees on three streams, kernels touching them."""
    rng = random.Random(seed)
    live = []
    for _ in range(steps):
        if live and rng.random() < 0.45:
            p, s = live.pop(rng.randrange(len(live)))
            a.launch(s, rng.uniform(0, 50), [p])
            a.free(p)
        else:
            s = rng.randrange(3)
            live.append((a.alloc(rng.choice([512, 70_000, 3 * MiB, 25 * MiB]), s), s))
    return live


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
def test_snapshot_opens_in_torchs_memory_viz(policy, config, tmp_path):
    a = ww.Allocator(policy, config=config)
    a.record_memory_history(max_entries=100_000)
    workload(a)
    path = tmp_path / "snap.pickle"
    a.dump_snapshot(str(path))
    snap = pickle.loads(path.read_bytes())
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed"} <= actions
    assert ("segment_map" if config else "segment_alloc") in actions
    s = a.stats()
    assert sum(seg["total_size"] for seg in snap["segments"]) == s["reserved_bytes.all.current"]
    assert sum(seg["allocated_size"] for seg in snap["segments"]) == s["allocated_bytes.all.current"]
    # What PyTorch's viewer and its command line run on a snapshot.
    assert "total_reserved" in mv.segsum(snap)
    for page in (mv.trace_plot(snap), mv.segment_plot(snap)):  # the viewer, with the data in it
        assert "MemoryViz.js" in page
        embedded = re.search(r'"base64": "([^"]+)"', page).group(1)
        assert pickle.loads(base64.b64decode(embedded)) == snap
    assert len(mv.trace(snap).splitlines()) > len(snap["device_traces"][0])


def test_torchs_command_line_reads_the_dump(tmp_path):
    a = ww.Allocator("waterwave")
    a.record_memory_history()
    workload(a, steps=60)
    path = tmp_path / "snap.pickle"
    a.dump_snapshot(str(path))
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "total_reserved" in r.stdout


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_a_recorded_run_comes_back_as_a_trace_with_the_same_peak(policy, tmp_path):
    a = ww.Allocator(policy)
    a.record_memory_history()
    for p, _ in workload(a, steps=300):
        a.free(p)
    path = tmp_path / "snap.pickle"
    a.dump_snapshot(str(path))
    trace = from_snapshot(str(path))
    again = trace.replay(policy)
    assert again["allocated_bytes.all.peak"] == a.stats()["allocated_bytes.all.peak"]


def test_history_keeps_the_newest_max_entries_and_stops_when_disabled():
    a = ww.Allocator("waterwave")
    a.record_memory_history(max_entries=5)
    ptrs = [a.alloc(1024 * (k + 1)) for k in range(10)]
    trace = a.memory_snapshot()["device_traces"][0]
    assert len(trace) == 5
    assert [e["addr"] for e in trace if e["action"] == "alloc"][-1] == ptrs[-1]
    a.record_memory_history(enabled=False)
    a.free(ptrs[0])
    assert a.memory_snapshot()["device_traces"][0] == []


def test_out_of_memory_is_in_the_history():
    a = ww.Allocator("pytorch", ww.SimDevice(64 * MiB, 0.0))
    a.record_memory_history()
    with pytest.raises(ww.OutOfMemoryError):
        a.alloc(100 * MiB)
    (oom,) = [e for e in a.memory_snapshot()["device_traces"][0] if e["action"] == "oom"]
    assert oom["size"] == 100 * MiB and oom["device_free"] == 64 * MiB


@pytest.mark.parametrize("enabled, max_entries, message", [
    ("yes", 10, "enabled='yes'"), (True, 0, "max_entries must be a positive int")])
def test_bad_history_settings_are_clear_errors(enabled, max_entries, message):
    with pytest.raises(ValueError, match=message):
        ww.Allocator("waterwave").record_memory_history(enabled, max_entries)
