"""Out of memory inside PyTorch is torch.cuda.OutOfMemoryError, through the
torch bridge (waterwave/alloc/torch_bridge.{py,cpp}) of the pluggable
registration, and through the native one (torch_native.cpp; its other
functions: tests/test_torch_native.py).

Without a GPU, PyTorch's raw allocation binding still runs its real
allocation path and its real exception translation: the fake CUDA runtime
(tests/cpp/fake_cudart.c) answers the runtime calls it makes first, and the
fake driver (tests/cpp/fake_cuda.c) holds the memory. Each case runs in its
own process (one allocator swap per process).
"""
import ctypes
import json

import pytest
from conftest import run_python

from waterwave import _C
from waterwave.alloc import torch_bridge

torch = pytest.importorskip("torch")
if not hasattr(torch._C, "_cuda_customAllocator"):
    pytest.skip("needs a CUDA build of torch (it runs on the CPU)", allow_module_level=True)

MiB = 1024**2


# Halve the request until it fits, as training code halves its batch.
HALVING = """
    import ctypes, json, warnings, torch, waterwave as ww, waterwave.cuda as wc
    from pathlib import Path
    from waterwave.alloc import torch_bridge
    {setup}
    fake = ctypes.CDLL({driver!r})
    fake.fake_cuda_set_capacity.argtypes = [ctypes.c_size_t]
    fake.fake_cuda_set_capacity(256 << 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = ww.install_allocator(policy={policy!r}, driver={driver!r},
                                        registration={registration!r})
    size, errors = 1 << 30, []
    while True:
        try:
            p = torch._C._cuda_cudaCachingAllocator_raw_alloc(size, 0)
            break
        except Exception as e:
            errors.append([type(e).__name__, isinstance(e, torch.cuda.OutOfMemoryError), str(e)])
            size //= 2
    served, allocated = size, wc.memory_allocated(0)
    torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    print(json.dumps(dict(oom_error=settings["oom_error"], errors=errors, served=served,
                          allocated=allocated, after=wc.memory_allocated(0),
                          warnings=[str(w.message) for w in caught])))
"""


def halve(fake_path, fake_runtime, policy="waterwave", setup="", registration="pluggable", **env):
    r = run_python(HALVING.format(driver=str(fake_path), policy=policy, setup=setup,
                                  registration=registration),
                   LD_PRELOAD=str(fake_runtime), **env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("registration", ["pluggable", "native"])
@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_out_of_memory_is_torchs_and_a_halved_request_goes_on(fake_path, fake_runtime, policy,
                                                              registration):
    if registration == "native" and torch_bridge.cuda_include_dirs() is None:
        pytest.skip("the native registration needs the CUDA runtime's headers")
    out = halve(fake_path, fake_runtime, policy, registration=registration)
    assert out["oom_error"] == "torch.cuda.OutOfMemoryError"
    assert out["warnings"] == []
    # 1 GiB and 512 MiB do not fit the 256 MiB device; 256 MiB does.
    assert [e[:2] for e in out["errors"]] == [["OutOfMemoryError", True]] * 2
    assert out["served"] == 256 * MiB and out["allocated"] == 256 * MiB and out["after"] == 0
    message = out["errors"][0][2]
    assert message.startswith("CUDA out of memory (Waterwave allocator). Tried to allocate 1.00 GiB")
    # Our statistics ride along.
    assert "total capacity of 256.00 MiB" in message and f"policy '{policy}'" in message


def test_without_a_compiler_it_warns_and_raises_runtime_error(fake_path, fake_runtime, tmp_path):
    out = halve(fake_path, fake_runtime,
                setup="torch_bridge.INSTALLED_DIR = Path('/nonexistent')",
                CXX="/nonexistent/c++", WATERWAVE_CACHE_DIR=str(tmp_path))
    assert out["oom_error"] == "RuntimeError"
    assert len(out["warnings"]) == 1
    assert "cannot run the C++ compiler '/nonexistent/c++'" in out["warnings"][0]
    assert "install g++ (or set CXX)" in out["warnings"][0]
    kinds = {(e[0], e[1]) for e in out["errors"]}
    assert kinds == {("RuntimeError", False)} and out["served"] == 256 * MiB
    assert "out of memory: tried to allocate 1.00 GiB" in out["errors"][0][2]
    assert list(tmp_path.iterdir()) == []  # no half-built file left behind


def test_bridge_off_is_silent(fake_path, fake_runtime):
    out = halve(fake_path, fake_runtime, WATERWAVE_TORCH_BRIDGE="off")
    assert out["oom_error"] == "RuntimeError" and out["warnings"] == []
    assert out["errors"][0][0] == "RuntimeError"


def test_first_use_builds_into_the_cache_once(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_bridge, "INSTALLED_DIR", tmp_path / "none")
    monkeypatch.setenv("WATERWAVE_CACHE_DIR", str(tmp_path / "cache"))
    path = torch_bridge.load(_C.__file__, torch)
    assert path.parent == tmp_path / "cache" and path.name == torch_bridge.file_name(torch)
    built = path.stat().st_mtime_ns
    assert torch_bridge.load(_C.__file__, torch) == path
    assert path.stat().st_mtime_ns == built  # found, not built again


def test_a_corrupt_cached_bridge_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_bridge, "INSTALLED_DIR", tmp_path / "none")
    monkeypatch.setenv("WATERWAVE_CACHE_DIR", str(tmp_path))
    corrupt = tmp_path / torch_bridge.file_name(torch)
    corrupt.write_bytes(b"\x7fELF truncated")
    path = torch_bridge.load(_C.__file__, torch)
    assert path == corrupt and path.read_bytes()[:4] == b"\x7fELF" and path.stat().st_size > 1000
    assert hasattr(ctypes.CDLL(str(path)), torch_bridge.MALLOC)


def test_an_unwritable_cache_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_bridge, "INSTALLED_DIR", tmp_path / "none")
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("WATERWAVE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(torch_bridge.BridgeUnavailable, match="set WATERWAVE_CACHE_DIR to a writable"):
        torch_bridge.load(_C.__file__, torch)


def test_a_corrupt_installed_bridge_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_bridge, "INSTALLED_DIR", tmp_path)
    (tmp_path / torch_bridge.file_name(torch)).write_bytes(b"not a library")
    with pytest.raises(torch_bridge.BridgeUnavailable, match="reinstall waterwave, or delete"):
        torch_bridge.load(_C.__file__, torch)


def test_build_into_replaces_bridges_for_another_torch(tmp_path):
    stale = tmp_path / f"{torch_bridge.PREFIX}0123456789abcdef.so"
    stale.write_bytes(b"old")
    out = torch_bridge.build_into(tmp_path, torch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


PROBE = """
    import ctypes, json, torch, waterwave as ww
    from waterwave.exec.job_loop import MemoryProbe as _MemoryProbe
    fake = ctypes.CDLL({driver!r})
    fake.fake_cuda_set_capacity.argtypes = [ctypes.c_size_t]
    fake.fake_cuda_set_capacity(256 << 20)
    ww.install_allocator(policy="waterwave", driver={driver!r}, per_process_memory_fraction=0.5)
    alloc, free = (torch._C._cuda_cudaCachingAllocator_raw_alloc,
                   torch._C._cuda_cudaCachingAllocator_raw_delete)
    kept = alloc(16 << 20, 0)  # held before the group: not the group's
    probe = _MemoryProbe(torch.device("cuda", 0))
    start = probe.start()
    a = alloc(4 << 20, 0)
    workspace = alloc(32 << 20, 0)
    free(workspace)
    print(json.dumps(dict(start=start, since=probe.since(start), available=probe.available())))
"""


def test_the_trainers_probe_reads_the_waterwave_allocators_counters(fake_path, fake_runtime):
    """On a GPU the ConcurrentTrainer measures each node group's net bytes
    and rise with this probe; here through PyTorch's real pluggable path
    down to the fake driver: a tensor kept and a workspace freed inside.
    What the allocator can still give is its cap (half of 256 MiB) less the
    20 MiB live, whatever it has cached."""
    r = run_python(PROBE.format(driver=str(fake_path)), LD_PRELOAD=str(fake_runtime))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["start"] == 16 * MiB and out["since"] == [4 * MiB, 36 * MiB]
    assert out["available"] == 128 * MiB - 20 * MiB
