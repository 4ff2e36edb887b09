"""``waterwave bench alloc --gpu`` (waterwave/tools/gpu_alloc_bench.py).

Without a GPU, both of its paths (PyTorch's raw allocation binding and
torch.empty) still run under Waterwave's policies, natively registered or
pluggably, over the fake driver, with the fake CUDA runtime preloaded: that
drives the whole command, each allocator in its own process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch._C, "_cuda_customAllocator"):
    pytest.skip("needs a CUDA build of torch (it runs on the CPU)", allow_module_level=True)

from waterwave.alloc import torch_bridge  # noqa: E402
from waterwave.tools import gpu_alloc_bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def bench(*args, **env):
    return subprocess.run([sys.executable, "-m", "waterwave", "bench", "alloc", "--pairs", "500",
                           "--repeats", "1", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300, check=False)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="with a GPU, torch.empty would hand out the fake driver's host memory")
def test_each_waterwave_policy_and_registration_is_timed_in_its_own_process(fake_cuda_env,
                                                                           tmp_path):
    """Over the fake runtime and driver PyTorch starts CUDA, so both paths
    run: raw allocations and torch.empty (no kernel touches the memory)."""
    out = tmp_path / "alloc.json"
    names = ["waterwave:pytorch", "waterwave:waterwave", "pluggable:pytorch",
             "pluggable:waterwave"]
    # Without the CUDA headers there is no native registration, and the fake
    # runtime cannot describe a device, so torch.cuda.init() and the tensor
    # path fail; the raw path still runs.
    headers = torch_bridge.cuda_include_dirs() is not None
    paths = ("raw", "raw_current", "tensor", "core") if headers else ("raw", "core")
    if not headers:
        names = names[2:]
    r = bench("--gpu", "--gpu-pairs", "300", "--allocators", ",".join(names), "--out", str(out),
              **fake_cuda_env)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["cases"]  # the CPU-side micro-benchmark ran beside it
    runs = {run["allocator"]: run for run in result["gpu"]}
    assert list(runs) == names
    for name, run in runs.items():
        assert run["backend"] == ("pluggable" if name.startswith("pluggable") else "waterwave")
        assert run["device"] == "fake driver"
        assert set(run["errors"]) == set(gpu_alloc_bench.PATHS) - set(paths)
        assert set(run["cases"]) == set(gpu_alloc_bench.cases())
        for figures in run["cases"].values():
            for path in paths:
                f = figures[path]
                assert 0 < f["min_ns"] <= f["ns_per_pair"] <= f["max_ns"]
    assert f"{names[-1]}  fake driver" in r.stdout
    md = tmp_path / "alloc.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "alloc_report.py"), str(out), str(md)],
                   check=True, capture_output=True)
    report = md.read_text()
    assert "These figures ran over the test suite's fake driver, not a GPU." in report
    raw = runs[names[0]]["cases"]["2MiB"]["raw"]["ns_per_pair"]
    assert f"| {names[0]} | 2MiB | {raw:.0f} (" in report
    core = runs[names[0]]["cases"]["2MiB"]["core"]["ns_per_pair"]
    assert report.count(f" | {core:.0f} (") >= 1
    if headers:  # CUDA started: the fake runtime's current stream is stream 0
        assert all(run["current_stream"] == 0 for run in runs.values())
        assert "The current stream's handle: 0 (0: stream 0 itself" in report


def test_a_wrong_allocator_name_is_one_line():
    r = bench("--gpu", "--allocators", "native,jemalloc")
    assert r.returncode == 2
    assert r.stderr.strip() == ("waterwave bench: unknown allocator 'jemalloc': choose from native, "
                                "cudaMallocAsync, waterwave:pytorch, waterwave:waterwave, "
                                "pluggable:pytorch, pluggable:waterwave")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_without_a_gpu_it_says_so():
    r = bench("--gpu", "--gpu-pairs", "10", "--allocators", "native,waterwave:waterwave")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("waterwave bench alloc --gpu: no allocator could be measured inside PyTorch")
    assert last.endswith("Run it on a machine with a CUDA GPU")


def test_a_worker_refuses_the_wrong_environment():
    with pytest.raises(RuntimeError, match="PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"):
        gpu_alloc_bench.measure("cudaMallocAsync", 10, 1)


def test_cases_are_seeded():
    assert gpu_alloc_bench.cases(3) == gpu_alloc_bench.cases(3) != gpu_alloc_bench.cases(4)
    mixed = gpu_alloc_bench.cases()["window8_mixed"]
    assert min(mixed) >= 512 and max(mixed) <= 1024**2
