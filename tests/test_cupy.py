"""waterwave.cupy: CuPy's allocations from the Waterwave allocator.

CuPy's runtime is linked into it statically, so without a GPU nothing of
CuPy that asks for a device runs; its allocator hook does. These tests call
the hook's functions the way CuPy calls them, over the fake driver, with
CuPy's current stream stood in for; the GPU tests run real CuPy arrays.
"""
import ctypes

import pytest
from conftest import MiB, run_python

import waterwave.cuda as wc
import waterwave.cupy as wcp

cupy = pytest.importorskip("cupy")
S1, S2 = 0x1000, 0x2000  # stream handles, as CuPy's Stream.ptr gives them


@pytest.fixture
def hook(fake, monkeypatch):
    wc.configure("waterwave", "", driver=fake.path)
    stream = {"now": S1}
    monkeypatch.setattr(wcp, "current_stream", lambda: stream["now"])
    malloc, free = wcp.functions(cupy)
    return malloc, free, stream


def live_blocks():
    return [b for seg in wc.allocator(0).snapshot() for b in seg["blocks"] if b["state"] == "allocated"]


def test_allocations_go_on_cupys_current_stream(hook):
    malloc, free, stream = hook
    a = malloc(3 * MiB, 0)
    stream["now"] = S2
    b = malloc(1 * MiB, 0)
    ctypes.memset(a, 0xAB, 3 * MiB)  # the fake driver's memory is the host's
    ctypes.memset(b, 0xCD, 1 * MiB)
    assert ctypes.string_at(a + 3 * MiB - 1, 1) == b"\xab"
    streams = {blk["addr"]: blk["stream"] for blk in live_blocks()}
    assert streams == {a: S1, b: S2}
    assert wc.memory_allocated(0) == 4 * MiB
    free(a, 0)  # on S2's turn: the block still goes back on S1, its own stream
    free(b, 0)
    assert wc.memory_allocated(0) == 0
    stats = wc.memory_stats(0)
    assert stats["unsynced_free_bytes_by_stream"].keys() <= {S1, S2}
    wc.check_invariants(0)


def test_out_of_memory_is_cupys_error_with_our_message(hook, fake):
    malloc, _, _ = hook
    held = malloc(600 * MiB, 0)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        malloc(600 * MiB, 0)
    assert isinstance(info.value, MemoryError)
    message = str(info.value)
    assert message.startswith("CUDA out of memory (Waterwave allocator, CuPy): out of memory: "
                              "tried to allocate 600.00 MiB")
    assert "total capacity of 1.00 GiB" in message
    hook[1](held, 0)
    malloc_after = malloc(600 * MiB, 0)  # the allocator went on
    hook[1](malloc_after, 0)


def test_a_bad_free_never_raises_and_is_counted(hook):
    malloc, free, _ = hook
    before = wc.free_errors()[0]
    p = malloc(MiB, 0)
    free(p, 0)
    free(p, 0)  # double free: CuPy frees from destructors, so it must not raise
    free(0xDEAD0000, 0)
    count, last = wc.free_errors()
    assert count == before + 2
    assert "0xdead0000" in last  # the last problem names its pointer


def test_install_sets_cupys_allocator_and_keeps_torchs_settings(fake_path):
    r = run_python(f"""
        import cupy, waterwave as ww, waterwave.cupy as wcp
        ww.install_allocator(config="policy:pytorch", driver={str(fake_path)!r})
        settings = wcp.install()
        print(settings["policy"], wcp.is_installed())
        allocator = cupy.cuda.get_allocator()
        print(type(allocator.__self__).__name__)
        try:
            wcp.install()
        except RuntimeError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == [
        "pytorch True", "PythonFunctionAllocator",
        "waterwave.cupy.install() already ran in this process"]


def test_install_without_cupy_names_the_extra():
    r = run_python("""
        import sys
        sys.modules["cupy"] = None  # as if not installed
        import waterwave.cupy as wcp
        try:
            wcp.install()
        except ImportError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pip install 'waterwave[cupy]'" in r.stdout
