"""Traces: PyTorch snapshots and captured steps, saved, loaded and replayed."""
import gzip
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.sim.jobs import JobModel, capture_step  # noqa: E402
from waterwave.sim.kernels import NONE, KernelModel, measure  # noqa: E402
from waterwave.sim.trace import Op, Trace, TraceError  # noqa: E402
from waterwave.tools import models  # noqa: E402

SNAPSHOTS = Path(__file__).resolve().parent.parent / "bench" / "data" / "gpu-snapshots"
MiB = 1 << 20
# Native PyTorch on the H100, as bench/data/gpu-snapshots/README.md lists them.
H100 = {"r18_solo": (1486, 876), "r18_2jobs": (2972, 1729), "r50_phased": (13408, 10547)}


@pytest.mark.parametrize("name", sorted(H100))
def test_each_snapshot_replays_to_the_gpus_peaks(name):
    t = ww.trace.from_snapshot(str(SNAPSHOTS / f"{name}.pickle.gz"))
    s = t.replay("pytorch")
    reserved, allocated = H100[name]
    assert s["reserved_bytes.all.peak"] == reserved * MiB
    assert abs(s["allocated_bytes.all.peak"] / MiB - allocated) < 1  # the README rounds
    assert s["hazards"] == []
    assert len(t.streams) == (1 if name == "r18_solo" else 2)


def test_a_plain_pickle_reads_as_the_gzipped_one(tmp_path):
    raw = gzip.decompress((SNAPSHOTS / "r18_solo.pickle.gz").read_bytes())
    (tmp_path / "s.pickle").write_bytes(raw)
    a = ww.trace.from_snapshot(str(tmp_path / "s.pickle"))
    b = ww.trace.from_snapshot(str(SNAPSHOTS / "r18_solo.pickle.gz"))
    assert a.to_dict()["ops"] == b.to_dict()["ops"]


def test_bad_snapshots_are_clear_errors_naming_the_file(tmp_path):
    good = (SNAPSHOTS / "r18_solo.pickle.gz").read_bytes()
    cases = {
        "truncated.pickle.gz": (good[: len(good) // 2], "truncated"),
        "truncated.pickle": (gzip.decompress(good)[:5000], "truncated"),
        "noise.pickle": (b"\x80\x04not a pickle at all", "not a PyTorch memory snapshot"),
        "foreign.pickle": (pickle.dumps({"hello": 1}), "no 'device_traces'"),
        "code.pickle": (pickle.dumps({"device_traces": [[]], "x": OrderedDict()}), "plain data"),
        "empty.pickle": (pickle.dumps({"device_traces": [[]]}), "holds no allocations"),
        "bad_event.pickle": (pickle.dumps({"device_traces": [[{"action": "alloc"}]]}), "corrupt"),
    }
    for file, (data, says) in cases.items():
        path = tmp_path / file
        path.write_bytes(data)
        with pytest.raises(TraceError, match=says) as e:
            ww.trace.from_snapshot(str(path))
        assert str(path) in str(e.value)
    with pytest.raises(TraceError, match="cannot read"):
        ww.trace.from_snapshot(str(tmp_path / "missing.pickle"))
    with pytest.raises(TraceError, match="no trace for device 3"):
        ww.trace.from_snapshot(str(SNAPSHOTS / "r18_solo.pickle.gz"), device=3)


def test_blocks_live_before_recording_are_allocated_first(tmp_path):
    events = [{"action": "free_requested", "addr": 4096, "size": 1000, "stream": 7},
              {"action": "alloc", "addr": 8192, "size": 512, "stream": 9},
              {"action": "free_requested", "addr": 8192, "size": 512, "stream": 9}]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [events]}))
    t = ww.trace.from_snapshot(str(path))
    assert [op.name for op in t.ops][0] == "alloc (before recording)"
    assert t.meta["stream_ids"] == [7, 9] and t.streams == [0, 1]
    assert t.replay()["allocated_bytes.all.current"] == 0


@pytest.fixture(scope="module")
def r18():
    return JobModel("resnet18", lambda b: models.build("resnet18", b))


def test_a_captured_step_becomes_an_eager_trace(r18, tmp_path):
    t = r18.trace_at(16, "H100-80GB", KernelModel.load())
    phases = [op.phase for op in t.ops]
    assert phases[0] == "forward" and "backward" in phases and phases[-1] == "optimizer"
    assert phases == sorted(phases, key=("forward", "backward", "optimizer").index)
    assert all(op.gpu_us > 0 for op in t.ops) and t.meta["batch_size"] == 16
    # The batch and the weights come first; momentum and the cuBLAS workspaces lazily.
    assert [at for *_, at in t.persistent][:2] == [-1, -1] and max(at for *_, at in t.persistent) > 0
    t.save(tmp_path / "t.json")
    back = Trace.load(str(tmp_path / "t.json"))
    assert back.to_dict() == t.to_dict()
    s = back.replay("waterwave", steps=2)
    assert s["hazards"] == [] and s["allocated_bytes.all.peak"] >= t.peak_live() * 0.99


def test_the_eager_trace_frees_at_scheduling_time_and_tracks_uses(r18):
    t = r18.trace_at(8, "A100-80GB")
    freed = [b for op in t.ops for b in op.free]
    allocated = [b for op in t.ops for b, _ in op.alloc]
    assert sorted(freed) == sorted(allocated)  # a step leaves nothing behind
    # Each block is freed by the operator that uses it last, which lists it
    # among its kernel's uses only until then.
    last = {b: k for k, op in enumerate(t.ops) for b in op.free}
    for k, op in enumerate(t.ops):
        assert all(last.get(b, len(t.ops)) >= k for b in op.use)


def test_the_linear_batch_model_equals_a_capture_at_that_batch(r18):
    direct = capture_step("resnet18", 24, lambda b: models.build("resnet18", b))
    scaled = r18.graph_at(24)
    assert [t.size for t in scaled.tensors] == [t.size for t in direct.tensors]
    assert [n.flops for n in scaled.nodes] == [n.flops for n in direct.nodes]
    assert r18.linear


def test_measured_workspaces_come_from_the_snapshot(r18):
    g = capture_step("resnet18", 32, lambda b: models.build("resnet18", b))
    found = measure(ww.trace.from_snapshot(str(SNAPSHOTS / "r18_solo.pickle.gz")), g)
    convs = [n for n in g.nodes if n.op.startswith("aten.convolution")]
    with_ws = [n for n in convs if found.get(n.name, {}).get("workspaces")]
    assert len(with_ws) >= 35
    assert found["convolution"]["workspaces"] == [122065920]  # the H100's, for the 7x7 stem
    k = KernelModel({"resnet18": {"batch": 32, "nodes": found}})
    stem = next(n for n in g.nodes if n.name == "convolution")
    assert k.workspaces(g, stem, "resnet18", 64) == [244131840]  # twice the batch, twice the bytes
    assert NONE.workspaces(g, stem, "resnet18", 32) == []


def test_a_corrupt_trace_file_is_a_clear_error(tmp_path):
    t = Trace("t", [Op("a", alloc=[(1, 512)]), Op("b", free=[1])])
    t.validate()
    for bad, says in ((Trace("t", [Op("b", free=[1])]), "frees block 1"),
                      (Trace("t", [Op("a", alloc=[(1, 512)]), Op("a", alloc=[(1, 512)])]),
                       "allocates block 1 again"),
                      (Trace("t", [Op("a", phase="sideways")]), "bad stream, phase")):
        path = tmp_path / "bad.json"
        bad.save(str(path))
        with pytest.raises(TraceError, match=says):
            Trace.load(str(path))
    (tmp_path / "x.json").write_text('{"format": "waterwave-trace", "version": 1, "name": 3}')
    with pytest.raises(TraceError, match="corrupt"):
        Trace.load(str(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text('{"format": "waterwave-graph", "version": 1}')
    with pytest.raises(TraceError, match="not a waterwave trace"):
        Trace.load(str(tmp_path / "y.json"))
