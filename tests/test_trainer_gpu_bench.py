"""bench/concurrent/trainer_gpu.py, the GPU measurement of the NodeGroup
pipeline: its trial runs the real ConcurrentTrainer (on CPU tensors here),
its search and report work on any trial results, and without a GPU it says
so."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "concurrent" / "trainer_gpu.py"
TINY = '''
import torch

def build(batch_size):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))
    return net, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)
'''


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trainer_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize("schedule,split", [("lockstep", []), ("waterwave", []),
                                            ("waterwave", ["--split-mib", "0.001"])])
def test_a_trial_trains_every_job_in_its_own_process(tmp_path, schedule, split):
    (tmp_path / "tiny_model.py").write_text(TINY)
    r = subprocess.run([sys.executable, str(SCRIPT), "trial", schedule, "tiny_model:build", "4",
                        "2", "12", "3", "--device", "cpu", *split], capture_output=True,
                       text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.splitlines()[-1])
    assert row["fits"] and row["error"] is None and row["throughput"] > 0
    assert (row["schedule"], row["batch"], row["jobs"], row["steps"]) == (schedule, 4, 2, 3)
    if split:  # the trainer cuts its groups at the size given
        assert row["split_sizes"] == [int(0.001 * 2**20)] * 2


def test_a_trial_that_cannot_build_its_model_does_not_fit(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "trial", "waterwave", "no_such_module:build",
                        "8", "2", "12", "2", "--device", "cpu"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    row = json.loads(r.stdout.splitlines()[-1])
    assert not row["fits"] and "no_such_module" in row["error"]


def test_the_search_and_report_over_trial_results(bench):
    """Trials fit while the jobs' samples stay within 256: alone 256,
    lockstep 128 per job; the pipeline is given 248 per job."""
    calls = []

    def trial(schedule, model, batch, njobs, cap_gib, steps, split_mib=None):
        calls.append((schedule, batch, njobs))
        room = 248 if schedule == "waterwave" and njobs == 2 else 256 // njobs
        return {"schedule": schedule, "batch": batch, "fits": batch <= room,
                "throughput": 1000.0 * njobs if batch <= room else None,
                "peak_reserved_mib": 10.0 * batch}

    result = bench.measure("resnet50", 2, 12.0, 4, say=lambda line: None, trial_fn=trial)
    assert result["alone"]["max_batch"] == 256
    assert result["lockstep"]["max_batch"] == 128 and result["waterwave"]["max_batch"] == 248
    same = result["at_lockstep_batch"]
    assert same["batch"] == 128 and calls[-2:] == [("lockstep", 128, 2), ("waterwave", 128, 2)]
    result.update(gpu="NVIDIA H100 80GB HBM3", torch="2.14.1", date="2026-11-23", seconds=60)
    md = bench.markdown(result)
    assert "2 x resnet50 under 12 GiB" in md and "on one NVIDIA H100 80GB HBM3" in md
    assert "| 2 jobs, waterwave | 248 | 96.9% | 2,000 | 2,480 |" in md
    assert "lockstep 2,000 samples/s, the pipeline 2,000" in md


def test_a_trial_that_crashes_is_one_that_failed(bench, monkeypatch):
    class Done:
        stdout, stderr, returncode = "", "Segmentation fault\n", -11

    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: Done())
    row = bench.run_trial("waterwave", "resnet50", 64, 2, 12.0, 3)
    assert not row["fits"] and "Segmentation fault" in row["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this measures for an hour")
def test_without_a_gpu_the_search_says_so():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 2 and "measures on a GPU" in r.stderr and "Traceback" not in r.stderr
