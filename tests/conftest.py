import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import waterwave as ww
from waterwave import _C
from waterwave.alloc import torch_bridge

# One OpenMP thread in each test process: pytest-xdist runs a worker per
# core, with the sanitizer runs beside them, so a team of several per worker
# only oversubscribes the cores, its idle threads spinning on them (pytest
# took 425 s instead of 455 s). The processes tests start keep torch's
# default (the benchmarks measure with it); a test of teams sets its own; a
# run given OMP_NUM_THREADS keeps it.
import torch  # noqa: E402

if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# One CP-SAT worker in the suite: deterministic searches. (OR-Tools 9.15
# aborts now and then even so; every solve runs in a child process for that:
# waterwave/planner/cpsat_child.py.)
os.environ.setdefault("WATERWAVE_CPSAT_WORKERS", "1")

# Property tests draw the same examples on every run ("gate", the default),
# so that `make test` on a fresh clone passes or fails for the code, not
# for the draw (a fresh clone once drew a kernel of 1.3e-8 µs that no run
# before had). HYPOTHESIS_PROFILE=explore draws new examples each run, to
# look for more; what it finds becomes an @example.
# No deadline and no "too slow" check in either: `make test` runs the
# sanitizer drivers beside the suite, so an example's time says how busy the
# machine is, not whether the code is right.
settings.register_profile("gate", derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
_profile = os.environ.get("HYPOTHESIS_PROFILE", "gate")
if _profile not in ("gate", "explore"):
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={_profile!r}: choose gate (the default: the "
                            "same examples every run) or explore (new examples every run)")
settings.load_profile(_profile)


def pytest_configure(config):
    """One Waterwave cache folder (``WATERWAVE_CACHE_DIR``: the capture cache,
    waterwave/sim/capture_cache.py, and bridges built there) for the whole
    run, fresh: its workers and the processes tests start share it (they
    inherit the environment), and nothing is read from, or left in, the
    user's."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the run's is inherited
        return
    config.waterwave_cache = tempfile.mkdtemp(prefix="waterwave-test-cache-")
    os.environ["WATERWAVE_CACHE_DIR"] = config.waterwave_cache


def pytest_unconfigure(config):
    if getattr(config, "waterwave_cache", None):
        shutil.rmtree(config.waterwave_cache, ignore_errors=True)


MiB = 1024**2
KiB = 1024
ROOT = Path(__file__).resolve().parent.parent


def build_c_library(source: str, out: Path, flags: tuple[str, ...] = ()) -> Path:
    """A test double in C (tests/cpp/fake_*.c), as a shared library."""
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", *flags, "-o", str(out),
                    str(ROOT / source), "-lpthread", "-ldl"], check=True)
    return out


# A budget no test's jobs come near. With it and capture=True the CPU's
# session plans its jobs' steps (captured, cut into node groups, paired) as
# a capturing GPU session does; otherwise it trains them eagerly
# (TrainingSession.captures), and a test of the captured path would compare
# eager with eager.
PLANNING_LIMIT = 1 << 40


@pytest.fixture
def cpu_session_plans():
    """The CPU's training session captures and plans while the test runs."""
    session = ww.training_session("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    yield session
    session.configure(memory_limit=None, capture=False)


@pytest.fixture(scope="session")
def fake_path(tmp_path_factory):
    """The fake CUDA driver: host memory behind the driver API."""
    return build_c_library("tests/cpp/fake_cuda.c", tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so")


@pytest.fixture
def fake(fake_path):
    """A fresh allocator over the fake driver (1 GiB, one device); checks
    afterwards that every byte went back to the driver."""
    lib = ctypes.CDLL(str(fake_path))  # the same handle the backend opens
    lib.fake_cuda_counter.restype = ctypes.c_longlong
    lib.fake_cuda_counter.argtypes = [ctypes.c_char_p]
    lib.fake_cuda_set_capacity.argtypes = [ctypes.c_size_t]
    lib.fake_cuda_set_capacity(1024 * MiB)
    lib.fake_cuda_set_device_count(1)
    lib.fake_cuda_set_idle(0)
    _C.cuda_reset()
    lib.fake_cuda_reset_counters()
    lib.count = lambda name: lib.fake_cuda_counter(name.encode())
    lib.path = str(fake_path)
    yield lib
    lib.fake_cuda_complete_all()
    _C.cuda_reset()
    assert lib.count("bytes_in_use") == 0, "the backend leaked driver memory"


@pytest.fixture(scope="session")
def fake_runtime(tmp_path_factory):
    """The CUDA runtime calls torch makes to start CUDA and allocate;
    preload it (LD_PRELOAD). With the CUDA headers at hand it answers
    cudaGetDeviceProperties too, which torch.cuda.init() needs."""
    headers = torch_bridge.cuda_include_dirs()
    flags = () if headers is None else ("-DFAKE_CUDART_WITH_HEADERS",
                                        *(f"-I{d}" for d in headers))
    return build_c_library("tests/cpp/fake_cudart.c",
                           tmp_path_factory.mktemp("fakecudart") / "libfakecudart.so", flags)


@pytest.fixture(scope="session")
def fake_cuda_env(fake_path, fake_runtime, tmp_path_factory):
    """The environment of a process in which PyTorch starts CUDA without a
    GPU: the fake runtime preloaded, the fake driver found as libcuda.so.1
    (PyTorch opens it by that name), Waterwave told to use it."""
    folder = tmp_path_factory.mktemp("libcuda")
    (folder / "libcuda.so.1").symlink_to(fake_path)
    library_path = os.pathsep.join(filter(None, [str(folder), os.environ.get("LD_LIBRARY_PATH")]))
    return {"LD_PRELOAD": str(fake_runtime), "LD_LIBRARY_PATH": library_path,
            "WATERWAVE_CUDA_DRIVER": str(fake_path)}


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Code in a fresh interpreter: PyTorch swaps its allocator once per process."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120, check=False)


@pytest.fixture(params=["waterwave", "pytorch"])
def policy(request):
    return request.param


def make(policy="waterwave", capacity=1024 * MiB, overhead=1.0, **cfg):
    return ww.Allocator(policy, ww.SimDevice(capacity, overhead), **cfg)


def start_and_join(threads, timeout: float, hang: str) -> None:
    """Start every thread and wait for each up to ``timeout`` seconds; none
    may still run (``hang`` says what that would mean)."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), hang


def assert_same_optimizer_state(expected, got) -> None:
    """Two optimizers' ``state_dict()["state"]`` hold the same entries, each
    close (rtol 1e-5, atol 1e-6 of the entry's largest magnitude, at least
    1e-6): what a trained job's state must be to eager's. The scale: a job
    trained from a thread of its own runs with another OpenMP team than an
    eager loop on the main thread, so its sums round otherwise, and an
    accumulator kept across steps (RMSprop's momentum, at 19 after two steps
    of lr 0.1) carries that rounding at its own magnitude, not at 1."""
    import torch

    sa, sb = expected.state_dict()["state"], got.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            want = torch.as_tensor(sa[k][name])
            scale = float(want.abs().max()) if want.numel() and want.is_floating_point() else 1.0
            torch.testing.assert_close(torch.as_tensor(sb[k][name]), want, rtol=1e-5,
                                       atol=1e-6 * max(1.0, scale), msg=f"{k}.{name}")
