"""``waterwave bench step``: a recorded step replayed through each policy over
the fake driver or the simulated GPU, its host time and device calls per
step counted between the policy and the device."""
import ctypes
import json
import pickle

import pytest

from waterwave import _C
from waterwave.tools import cli, step_bench

SNAPSHOTS = "bench/data/gpu-snapshots"
SOLO = f"{SNAPSHOTS}/r18_solo.pickle.gz"


@pytest.fixture
def fake_driver(fake_path):
    """The suite's fake driver (one per process: the backend loads one
    driver), set up as step_bench.fake_driver sets up its own build."""
    lib = ctypes.CDLL(str(fake_path))
    lib.fake_cuda_set_capacity.argtypes = [ctypes.c_size_t]
    lib.fake_cuda_set_capacity(step_bench.FAKE_CAPACITY)
    lib.fake_cuda_set_idle(1)
    yield str(fake_path)
    lib.fake_cuda_set_idle(0)
    lib.fake_cuda_set_capacity(1 << 30)


def test_the_fake_driver_builds_from_the_checkout(tmp_path):
    path = step_bench.fake_driver(tmp_path)
    assert path.endswith("libfakecuda.so") and (tmp_path / "libfakecuda.so").stat().st_size


def test_json_names_each_policys_time_and_calls_per_step(capsys, monkeypatch, fake_driver):
    monkeypatch.setattr(step_bench, "gpu_driver", lambda: None)  # this machine: no GPU
    monkeypatch.setattr(step_bench, "fake_driver", lambda: fake_driver)
    assert cli.main(["bench", "step", SOLO, "--json", "--steps", "3", "--warmup", "0",
                     "--recorded-steps", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "fake" and set(out["policies"]) == {"waterwave", "pytorch"}
    for r in out["policies"].values():
        assert r["host_ns_per_step"] > 0 and r["min_ns"] <= r["host_ns_per_step"] <= r["max_ns"]
        assert r["driver_calls_per_step"] == pytest.approx(sum(r["calls"].values()))
        # No warm-up: the first replay reserves every segment, each a driver call.
        assert r["calls"]["reserve"] * 3 * 4 == r["device_segments"] > 0


def test_calls_are_counted_between_the_policy_and_the_device(fake_driver):
    """A tiny recording of two streams: the second stream's allocation of
    what the first freed needs a stream wait, and the counts say so; after
    the first replay, the cache serves every step without a reserve."""
    ops = [(True, 0, 1 << 20, 0), (False, 0, 0, 0), (True, 1, 1 << 20, 1), (False, 1, 0, 0)]
    config = _C.AllocatorConfig("")
    cold = _C.bench_step("cuda", fake_driver, ["waterwave"], config, ops, 1, 0)["waterwave"]
    assert cold["calls"]["reserve"] == 1 and cold["device_segments"] == 1
    warm = _C.bench_step("cuda", fake_driver, ["waterwave", "pytorch"], config, ops, 5, 1)
    assert "reserve" not in warm["waterwave"]["calls"]
    # PyTorch's policy keeps a pool per stream: each stream keeps its own block, two segments.
    assert warm["pytorch"]["device_segments"] == 2 and warm["pytorch"]["calls"] == {}
    sim = _C.bench_step("sim", "", ["pytorch"], config, ops, 5, 1)["pytorch"]
    assert sim["driver_calls_per_step"] == 0


def test_the_table_names_the_device_and_says_no_gpu(capsys):
    assert cli.main(["bench", "step", SOLO, "--device", "sim", "--steps", "2",
                     "--recorded-steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "on sim" in out and "waterwave" in out and "pytorch" in out
    assert "no GPU was involved" in out


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], "no GPU here"),
    (["--recorded-steps", "0"], "recorded_steps must be at least 1"),
    (["--config", "max_split_size_mb:banana"], "max_split_size_mb"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, monkeypatch):
    monkeypatch.setattr(step_bench, "gpu_driver", lambda: None)
    assert cli.main(["bench", "step", SOLO, "--device", "sim", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_corrupt_snapshot_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc"}]]}))
    assert cli.main(["bench", "step", str(bad), "--device", "sim"]) == 2
    assert "the snapshot is corrupt" in capsys.readouterr().err


def test_a_recording_of_several_streams_is_refused_on_a_gpu():
    trace = step_bench.from_snapshot(f"{SNAPSHOTS}/r18_2jobs.pickle.gz")
    with pytest.raises(ValueError, match="replaying on a GPU runs one"):
        step_bench.recorded_ops(trace, one_stream=True)
    assert len({s for alloc, _, _, s in step_bench.recorded_ops(trace) if alloc}) == 2
