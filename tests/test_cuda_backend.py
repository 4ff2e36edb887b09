"""The CUDA driver backend and PyTorch's entry points, against a fake driver.

The fake (tests/cpp/fake_cuda.c) is real host memory behind the driver API:
the tests write through every pointer the allocator hands out, so an
overlap or a block handed out twice shows up as corrupted bytes. Its events
stay pending until the test completes them, which drives the cross-stream
paths. The driver is loaded once per process, so every test here shares it.
"""
import ctypes
import random
import sys
from pathlib import Path

import pytest
from conftest import run_python

import waterwave as ww
import waterwave.cuda as wc
from waterwave import _C
from waterwave.alloc.torch_bridge import cuda_include_dirs

MiB = 1024**2
ROOT = Path(__file__).resolve().parent.parent
S1, S2 = 0x1000, 0x2000  # stream handles (opaque to the allocator)


def use(fake, policy="waterwave", **cfg):
    wc.configure(policy, "", driver=fake.path, **cfg)


def fill(ptr: int, size: int, byte: int) -> None:
    ctypes.memset(ptr, byte, size)


def intact(ptr: int, size: int, byte: int) -> bool:
    return ctypes.string_at(ptr, size) == bytes([byte]) * size


def test_entry_points_are_exported_for_pytorch():
    """CUDAPluggableAllocator looks the hooks up by name with ctypes."""
    lib = ctypes.CDLL(_C.__file__)
    for name in (wc.MALLOC, wc.FREE, wc.RECORD_STREAM, wc.EMPTY_CACHE):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def test_malloc_free_through_the_c_abi(fake, policy):
    """The calls PyTorch makes, made the way it makes them."""
    use(fake, policy)
    lib = ctypes.CDLL(_C.__file__)
    malloc = lib.waterwave_cuda_malloc
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.waterwave_cuda_free
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    p = malloc(3 * MiB, 0, S1)
    assert p and p % 512 == 0
    fill(p, 3 * MiB, 0xAB)  # real memory behind it
    s = wc.memory_stats(0)
    assert s["allocated_bytes.all.current"] == 3 * MiB
    assert s["num_device_alloc"] == fake.count("alloc") == 1
    free(p, 3 * MiB, 0, S1)
    assert wc.memory_stats(0)["allocated_bytes.all.current"] == 0
    assert malloc(3 * MiB, 0, S1) == p  # cached: no second cuMemAlloc
    assert fake.count("alloc") == 1
    free(p, 3 * MiB, 0, S1)
    assert malloc(0, 0, S1) is None  # size 0: a null pointer, like native
    wc.check_invariants(0)


def test_driver_calls_run_in_the_primary_context(fake):
    """The fake refuses memory calls without a current context, as the real
    driver does; the backend makes the primary context current and gives the
    caller's back."""
    use(fake)
    assert fake.fake_cuda_current_device() == -1
    p = _C.cuda_malloc(5 * MiB, 0, S1)
    assert p and fake.count("alloc") == 1
    assert fake.fake_cuda_current_device() == -1
    _C.cuda_free(p, 5 * MiB, 0, S1)


def test_cross_stream_reuse_waits_on_the_free_event(fake):
    """waterwave policy: a block freed on stream 1 goes to stream 2 behind
    an event recorded on stream 1 (an asynchronous wait, the host never
    blocks), or without a wait once a query finds that event complete."""
    use(fake)
    size = 20 * MiB  # a whole segment: no synced remainder to take instead
    p = _C.cuda_malloc(size, 0, S1)
    _C.cuda_free(p, size, 0, S1)
    q = _C.cuda_malloc(size, 0, S2)  # stream 1 still busy: wait on its event
    s = wc.memory_stats(0)
    assert q == p and s["served.cross_stream_wait"] == 1
    assert fake.count("stream_wait") == 1 and fake.count("event_sync") == 0
    _C.cuda_free(q, size, 0, S2)
    fake.fake_cuda_set_idle(1)
    r = _C.cuda_malloc(size, 0, S1)  # stream 2 idle: promoted by a query
    s = wc.memory_stats(0)
    assert r == p and s["served.promoted"] == 1 and fake.count("stream_wait") == 1
    _C.cuda_free(r, size, 0, S1)


def test_record_stream_hook_delays_reuse(fake):
    """pytorch policy: a block used on another stream is reusable only once
    the event recorded at free time has completed."""
    use(fake, "pytorch")
    size = 4 * MiB
    p = _C.cuda_malloc(size, 0, S1)
    _C.cuda_record_stream(p, S2)
    _C.cuda_free(p, size, 0, S1)
    assert fake.count("event_record") == 1
    q = _C.cuda_malloc(size, 0, S1)
    assert q != p  # p waits on stream 2's event
    fake.fake_cuda_complete_all()
    _C.cuda_free(q, size, 0, S1)
    r = _C.cuda_malloc(size, 0, S1)
    assert r in (p, q)
    _C.cuda_free(r, size, 0, S1)
    with pytest.raises(ww.PointerError, match="no Waterwave allocator holds"):
        _C.cuda_record_stream(0xDEAD000, S2)


def test_a_free_naming_no_device_finds_the_owner_and_never_raises(fake):
    """waterwave_cuda_free_owned, the native registration's DataPtr deleter:
    with one device in use its stack frees directly; with two, the one that
    holds the pointer does; an unknown pointer is counted, not raised."""
    use(fake)
    fake.fake_cuda_set_device_count(2)
    lib = ctypes.CDLL(_C.__file__)
    lib.waterwave_cuda_free_owned.argtypes = [ctypes.c_void_p]
    before = wc.free_errors()[0]
    p = _C.cuda_malloc(MiB, 0, S1)
    lib.waterwave_cuda_free_owned(p)  # one device: no search
    assert wc.memory_allocated(0) == 0
    p, q = _C.cuda_malloc(MiB, 0, S1), _C.cuda_malloc(2 * MiB, 1, S1)
    lib.waterwave_cuda_free_owned(q)  # two devices: device 1 holds it
    lib.waterwave_cuda_free_owned(p)
    assert wc.memory_allocated(0) == wc.memory_allocated(1) == 0
    lib.waterwave_cuda_free_owned(0xDEAD000)
    count, last = wc.free_errors()
    assert count == before + 1 and "0xdead000" in last.lower()


def test_out_of_memory_names_the_numbers_and_recovers(fake, policy):
    use(fake, policy)
    fake.fake_cuda_set_capacity(64 * MiB)
    p = _C.cuda_malloc(40 * MiB, 0, S1)
    with pytest.raises(ww.OutOfMemoryError, match="out of memory"):
        _C.cuda_malloc(40 * MiB, 0, S1)
    _C.cuda_free(p, 40 * MiB, 0, S1)
    q = _C.cuda_malloc(40 * MiB, 0, S1)  # the cached block serves it
    _C.cuda_free(q, 40 * MiB, 0, S1)
    wc.check_invariants(0)


def test_driver_errors_are_reported_with_their_name(fake):
    use(fake)
    fake.fake_cuda_fail_next_alloc(700)
    with pytest.raises(RuntimeError, match=r"cuMemAlloc failed: CUDA_ERROR_ILLEGAL_ADDRESS \(700\)"):
        _C.cuda_malloc(MiB, 0, S1)
    p = _C.cuda_malloc(MiB, 0, S1)  # nothing was lost
    _C.cuda_free(p, MiB, 0, S1)
    wc.check_invariants(0)


def test_bad_frees_never_raise_into_pytorch(fake):
    """PyTorch frees from destructors: a bad free is reported, not thrown."""
    use(fake)
    p = _C.cuda_malloc(MiB, 0, S1)
    before, _ = wc.free_errors()
    _C.cuda_free(p + 512, MiB, 0, S1)
    _C.cuda_free(p, MiB, 0, S1)
    _C.cuda_free(p, MiB, 0, S1)  # double free
    _C.cuda_free(p, MiB, 5, S1)  # a device with no allocator
    count, last = wc.free_errors()
    assert count == before + 3
    assert "device 5" in last
    wc.check_invariants(0)


def test_each_device_has_its_own_allocator(fake):
    fake.fake_cuda_set_device_count(2)
    use(fake)
    a = _C.cuda_malloc(MiB, 0, S1)
    b = _C.cuda_malloc(MiB, 1, S1)
    assert _C.cuda_devices() == [0, 1]
    assert wc.memory_stats(1)["allocated_bytes.all.current"] == MiB
    _C.cuda_free(a, MiB, 0, S1)
    _C.cuda_free(b, MiB, 1, S1)
    with pytest.raises(RuntimeError, match="no CUDA device 2: the driver sees 2"):
        _C.cuda_malloc(MiB, 2, S1)


def test_configuration_is_checked_and_frozen_once_used(fake, monkeypatch):
    with pytest.raises(ww.ConfigError, match="max_split_size_mb"):
        wc.configure("waterwave", "max_split_size_mb:lots", driver=fake.path)
    with pytest.raises(ww.ConfigError, match="unknown allocator policy 'fastest'"):
        wc.configure("fastest", driver=fake.path)
    monkeypatch.setenv("WATERWAVE_ALLOC_CONF", "policy:pytorch,max_split_size_mb:200")
    settings = wc.configure(driver=fake.path)
    assert settings["policy"] == "pytorch" and "max_split_size_mb:200" in str(settings["config"])
    p = _C.cuda_malloc(MiB, 0, S1)
    with pytest.raises(ww.ConfigError, match="already in use"):
        wc.configure("waterwave", driver=fake.path)
    with pytest.raises(ww.ConfigError, match="free every tensor first"):
        _C.cuda_reset()
    _C.cuda_free(p, MiB, 0, S1)


def test_settings_take_the_policy_out_and_keep_bracketed_values():
    assert _C.parse_settings("roundup_power2_divisions:[256:1,>:4],policy:pytorch") == (
        "pytorch", ww.AllocatorConfig("roundup_power2_divisions:[256:1,>:4]"))
    assert _C.parse_settings("") == (None, ww.AllocatorConfig())


def test_the_env_policy_serves_the_simulator_too(monkeypatch):
    """One WATERWAVE_ALLOC_CONF for both: its policy entry is not a config key."""
    monkeypatch.setenv("WATERWAVE_ALLOC_CONF", "policy:pytorch,max_split_size_mb:200")
    a = ww.Allocator()
    assert a.policy == "pytorch" and "max_split_size_mb:200" in str(a.config)
    assert ww.Allocator("waterwave").policy == "waterwave"  # an argument wins


def test_plan_on_the_cuda_backend(fake):
    """A plan's allocations land at arena + offset; a deviation falls back
    for the rest of the step; the plan cannot go while its blocks live."""
    use(fake)
    slots = [(2 * MiB, 0), (MiB, 2 * MiB), (2 * MiB, 0)]
    wc.set_plan(slots, 3 * MiB, device=0, stream=S1, scope="device")
    wc.begin_step(0)
    arena = wc.plan_stats(0)["arena"]
    a = _C.cuda_malloc(2 * MiB, 0, S1)
    b = _C.cuda_malloc(MiB, 0, S1)
    assert (a, b) == (arena, arena + 2 * MiB)
    fill(a, 2 * MiB, 1)
    fill(b, MiB, 2)
    _C.cuda_free(a, 2 * MiB, 0, S1)
    c = _C.cuda_malloc(2 * MiB, 0, S1)  # slot 2 reuses slot 0's bytes
    assert c == arena and intact(b, MiB, 2)
    wc.begin_step(0)
    d = _C.cuda_malloc(3 * MiB, 0, S1)  # not the plan's size: deviation
    st = wc.plan_stats(0)
    assert st["deviations"] == 1 and "asks for" in st["last_deviation"] and st["planned"] == 3
    assert not (arena <= d < arena + 3 * MiB)
    with pytest.raises(ww.ConfigError, match="still in use"):
        wc.clear_plan(0)
    for p, n in ((b, MiB), (c, 2 * MiB), (d, 3 * MiB)):
        _C.cuda_free(p, n, 0, S1)
    wc.clear_plan(0)
    assert not wc.has_plan(0)


def test_a_recorded_step_becomes_an_exact_plan(fake):
    """What the trainer does on a GPU: record one step's allocations, pack
    their lifetimes, and serve the next steps from that plan: every
    allocation planned, the arena at the trace's peak of live bytes."""
    use(fake)
    rng = random.Random(3)
    sizes = [rng.choice([512, 4096, MiB, 3 * MiB]) for _ in range(40)]
    # A step: allocate in order, free each block a few allocations later.
    frees_after = {i: min(len(sizes) - 1, i + rng.randint(0, 5)) for i in range(len(sizes))}

    def one_step():
        live = {}
        for i, n in enumerate(sizes):
            live[i] = _C.cuda_malloc(n, 0, S1)
            fill(live[i], n, i)
            for j in [j for j, k in frees_after.items() if k == i and j in live]:
                assert intact(live[j], sizes[j], j)
                _C.cuda_free(live.pop(j), sizes[j], 0, S1)
        assert not live

    wc.start_recording(0, stream=S1)
    one_step()
    trace = wc.stop_recording(0)
    assert [t[0] for t in trace] == sizes and all(f > a for _, a, f in trace)
    slots, arena, info = ww.planner.plan_from_trace(trace)
    assert info["status"] == "optimal" and arena == info["bound"]
    wc.set_plan(slots, arena, device=0, stream=S1, scope="device")
    for _ in range(3):
        wc.begin_step(0)
        one_step()
    wc.begin_step(0)
    st = wc.plan_stats(0)
    assert st["planned"] == 3 * len(sizes)
    assert st["fallback"] == st["deviations"] == 0
    wc.clear_plan(0)


def test_a_recorded_run_replays_on_the_simulator_as_it_ran(fake, tmp_path):
    """A run recorded from its first allocation under the pytorch policy,
    replayed through the same policy on the simulated device, reserves what
    the CUDA backend reserved: the simulator's baseline holds for what a GPU
    records (bench/gpu.py replays real training steps this way)."""
    from waterwave.planner.baseline import replay_trace

    use(fake, "pytorch")
    rng = random.Random(11)
    wc.start_recording(0, stream=S1)
    live = []
    for _ in range(2000):  # up to 1 GiB: free at random, and whenever 400 MiB are live
        if live and (rng.random() < 0.45 or sum(n for _, n in live) > 400 * MiB):
            p, size = live.pop(rng.randrange(len(live)))
            _C.cuda_free(p, size, 0, S1)
        else:
            size = rng.choice([512, 3000, 200_000, MiB + 512, 3 * MiB, 11 * MiB, 40 * MiB])
            live.append((_C.cuda_malloc(size, 0, S1), size))
    trace = wc.stop_recording(0)
    for p, size in live:
        _C.cuda_free(p, size, 0, S1)
    ran = wc.memory_stats(0)
    replayed = replay_trace(trace, "pytorch")
    assert replayed.peak_reserved == ran["reserved_bytes.all.peak"]
    assert replayed.peak_allocated == ran["allocated_bytes.all.peak"]

    # bench/gpu.py keeps such a trace beside its results and reports the replay.
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu
    finally:
        sys.path.pop(0)
    out = tmp_path / "gpu.json"
    row = {"model": "random", "mode": "pytorch", "peak_reserved": ran["reserved_bytes.all.peak"],
           "trace_file": gpu.save_trace(str(out), "random", "pytorch", trace)}
    lines = gpu.trace_rows([row], str(tmp_path))
    reserved = f"{ran['reserved_bytes.all.peak'] / MiB:,.0f}"
    assert lines == [f"| random | `pytorch` | {len(trace)} | {reserved} | {reserved} | "
                     f"{replayed.ideal_peak / MiB:,.0f} | - |"]


def test_random_run_never_hands_out_memory_twice(fake, policy):
    """Random allocations, frees, record_streams and event completions on
    three streams; every live block holds its own byte pattern, checked at
    free, and the invariants hold after every step."""
    use(fake, policy)
    rng = random.Random(7)
    streams = [S1, S2, 0x3000]
    live = {}  # ptr -> (size, stream, byte)
    for step in range(3000):
        r = rng.random()
        if r < 0.5 or not live:
            size = rng.choice([512, 4096, 200_000, MiB, 3 * MiB, 12 * MiB])
            stream = rng.choice(streams)
            p = _C.cuda_malloc(size, 0, stream)
            assert p not in live
            byte = step % 251
            fill(p, size, byte)
            live[p] = (size, stream, byte)
        elif r < 0.9:
            p = rng.choice(list(live))
            size, stream, byte = live.pop(p)
            assert intact(p, size, byte), f"step {step}: block {p:#x} was overwritten"
            _C.cuda_free(p, size, 0, stream)
        elif r < 0.95:
            _C.cuda_record_stream(rng.choice(list(live)), rng.choice(streams))
        else:
            fake.fake_cuda_complete_all()
        wc.check_invariants(0)
    for p, (size, stream, byte) in live.items():
        assert intact(p, size, byte)
        _C.cuda_free(p, size, 0, stream)


@pytest.mark.parametrize("driver, message", [
    ("/nonexistent/libcuda.so.1", "cannot load the CUDA driver /nonexistent/libcuda.so.1"),
    ("libm.so.6", "has no symbol cuInit"),  # a library, but not a CUDA driver
])
def test_missing_driver_is_a_clear_error(driver, message):
    r = run_python("""
        from waterwave import _C
        try:
            _C.cuda_malloc(1024, 0, 0)
        except RuntimeError as e:
            print(e)
    """, WATERWAVE_CUDA_DRIVER=driver)
    assert message in r.stdout


def test_install_allocator_registers_with_pytorch(fake_path):
    """Without a GPU PyTorch still accepts the swap and routes
    torch.cuda.empty_cache to us (tensors: tests/test_torch_native.py)."""
    pytest.importorskip("torch")
    r = run_python(f"""
        import torch, waterwave as ww, waterwave.cuda as wc
        from waterwave import _C
        settings = ww.install_allocator(config="policy:pytorch", driver={str(fake_path)!r})
        print(settings["policy"], torch.cuda.memory.get_allocator_backend())
        p = _C.cuda_malloc(1 << 20, 0, 0)
        _C.cuda_free(p, 1 << 20, 0, 0)
        print(wc.memory_stats(0)["segment.all.current"])
        torch._C._cuda_emptyCache()  # PyTorch's reset hook: our empty_cache
        print(wc.memory_stats(0)["segment.all.current"])
        try:
            ww.install_allocator()
        except RuntimeError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # Natively where it builds (the CUDA headers at hand), else pluggable.
    assert lines[0] == "pytorch " + ("waterwave" if cuda_include_dirs() else "pluggable")
    assert lines[1:3] == ["1", "0"]
    assert "already installed" in lines[3]


# ---- Expandable segments over the driver's virtual memory calls. ----

def use_expandable(fake, policy):
    fake.fake_cuda_set_vmm(1)
    fake.fake_cuda_fail_vmm.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    wc.configure(policy, "expandable_segments:True", driver=fake.path)


def test_expandable_segments_map_pages_through_the_driver(fake, policy):
    use_expandable(fake, policy)
    ptrs = {}
    for k, size in enumerate([512, 3 * MiB, 30 * MiB, 45 * MiB]):
        stream = S1 if k % 2 else S2
        p = _C.cuda_malloc(size, 0, stream)
        fill(p, size, k + 1)  # the pages are readable and writable
        ptrs[p] = (size, stream, k + 1)
    assert fake.count("vmm_create") == fake.count("vmm_map") == fake.count("vmm_set_access") > 0
    assert fake.count("alloc") == 0  # no cuMemAlloc: every byte is mapped pages
    for p, (size, stream, byte) in ptrs.items():
        assert intact(p, size, byte)
        _C.cuda_free(p, size, 0, stream)
    fake.fake_cuda_complete_all()
    wc.empty_cache()
    assert fake.count("vmm_unmap") == fake.count("vmm_release") == fake.count("vmm_create")
    assert fake.count("vmm_handles_live") == 0 and fake.count("bytes_in_use") == 0
    wc.check_invariants(0)


@pytest.mark.parametrize("call", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
@pytest.mark.parametrize("code", [2, 999])  # out of memory; anything else
def test_a_map_failing_partway_leaks_nothing_and_never_aborts(fake, policy, call, code):
    """pytorch/pytorch#188008: there, a failed map mid-growth terminated the
    process. Here an out-of-memory answer fails the growth cleanly and the
    policy's retry maps again; any other error fails the request with the
    driver's error. Either way what was mapped stays usable and accounted,
    and nothing leaks."""
    use_expandable(fake, policy)
    fake.fake_cuda_fail_vmm(call.encode(), 2, code)  # the third call of it fails
    size = 70 * MiB  # several pages under both policies
    if code == 2:
        p = _C.cuda_malloc(size, 0, S1)
        assert wc.memory_stats(0)["num_alloc_retries"] + wc.memory_stats(0)["num_oom_retries"] >= 1
        _C.cuda_free(p, size, 0, S1)
    else:
        with pytest.raises(RuntimeError, match=f"{call} failed|cuMemMap/cuMemSetAccess failed"):
            _C.cuda_malloc(size, 0, S1)
    wc.check_invariants(0)
    # What the driver holds is exactly what the allocator counts as reserved.
    reserved = wc.memory_stats(0)["reserved_bytes.all.current"]
    assert fake.count("bytes_in_use") == reserved
    assert fake.count("vmm_handles_live") == fake.count("vmm_handles_mapped")
    p = _C.cuda_malloc(size, 0, S1)  # the next try succeeds
    fill(p, size, 7)
    assert intact(p, size, 7)
    _C.cuda_free(p, size, 0, S1)
    fake.fake_cuda_complete_all()
    wc.empty_cache()
    assert fake.count("bytes_in_use") == 0 and fake.count("vmm_handles_live") == 0


def test_waterwave_policy_moves_idle_pages_through_the_driver(fake):
    use_expandable(fake, "waterwave")
    p = _C.cuda_malloc(60 * MiB, 0, S1)
    _C.cuda_free(p, 60 * MiB, 0, S1)
    fake.fake_cuda_complete_all()  # stream 1's work is done
    wc.sync_and_coalesce(0)
    q = _C.cuda_malloc(40 * MiB, 0, S2)
    r = _C.cuda_malloc(40 * MiB, 0, S2)
    fill(q, 40 * MiB, 1)
    fill(r, 40 * MiB, 2)
    assert intact(q, 40 * MiB, 1) and intact(r, 40 * MiB, 2)
    stats = wc.memory_stats(0)
    assert stats["num_page_moves"] == 10
    assert fake.count("bytes_in_use") == stats["reserved_bytes.all.current"] == 80 * MiB
    # A moved page is unmapped and mapped again: the same handle, no new one.
    assert fake.count("vmm_map") == fake.count("vmm_create") + 10
    for ptr in (q, r):
        _C.cuda_free(ptr, 40 * MiB, 0, S2)
    wc.check_invariants(0)


def test_expandable_segments_need_the_drivers_virtual_memory(fake):
    fake.fake_cuda_set_vmm(0)
    try:
        wc.configure("waterwave", "expandable_segments:True", driver=fake.path)
        with pytest.raises(ww.ConfigError, match="virtual memory management"):
            _C.cuda_malloc(MiB, 0, S1)
    finally:
        fake.fake_cuda_set_vmm(1)


def test_torch_names_and_the_summary_on_the_cuda_backend(fake, policy):
    use(fake, policy)
    p = _C.cuda_malloc(3 * MiB, 0, S1)
    s = wc.memory_stats(0)
    assert wc.memory_allocated(0) == s["allocated_bytes.all.current"] == 3 * MiB
    assert wc.memory_reserved("cuda:0") == s["reserved_bytes.all.current"] == fake.count("bytes_in_use")
    torch = pytest.importorskip("torch")
    assert wc.memory_reserved(torch.device("cuda", 0)) == wc.memory_reserved("cuda")
    text = wc.memory_summary(0)
    assert f"device 0, policy '{policy}'" in text and "Allocated memory" in text
    assert "3.00 MiB" in text
    _C.cuda_free(p, 3 * MiB, 0, S1)
    assert wc.memory_allocated(0) == 0


def test_device_memory_and_the_memory_fraction_by_torchs_names(fake):
    """``mem_get_info`` is the driver's view: cached memory counts as used;
    ``get_per_process_memory_fraction`` is the allocator's cap."""
    use(fake, per_process_memory_fraction=0.25)
    assert wc.mem_get_info(0) == (1024 * MiB, 1024 * MiB)  # the fixture's capacity
    assert wc.get_per_process_memory_fraction("cuda:0") == 0.25
    p = _C.cuda_malloc(3 * MiB, 0, S1)
    _C.cuda_free(p, 3 * MiB, 0, S1)
    reserved = wc.memory_reserved(0)
    assert reserved >= 3 * MiB and wc.mem_get_info(0) == (1024 * MiB - reserved, 1024 * MiB)


def test_snapshots_from_the_cuda_backend_open_in_torchs_memory_viz(fake, policy, tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz")
    from waterwave.sim.trace import from_snapshot
    use(fake, policy)
    wc.record_memory_history(max_entries=1000, device=0)
    ptrs = [(_C.cuda_malloc(n, 0, s), n, s) for n, s in [(3 * MiB, S1), (512, S2), (30 * MiB, S1)]]
    for p, n, s in ptrs:
        _C.cuda_free(p, n, 0, s)
    path = tmp_path / "cuda.pickle"
    wc.dump_snapshot(str(path))
    import pickle
    snap = pickle.loads(path.read_bytes())
    trace = snap["device_traces"][0]
    assert [e["action"] for e in trace].count("alloc") == 3
    assert {e["stream"] for e in trace if e["action"] == "alloc"} == {S1, S2}
    assert sum(g["total_size"] for g in snap["segments"]) == fake.count("bytes_in_use")
    assert "total_reserved" in mv.segsum(snap)
    assert len(from_snapshot(str(path)).ops) == 6  # three allocations, three frees
    wc.record_memory_history(enabled=False, device=0)


def test_a_cuda_device_is_served_by_the_same_allocator_class(fake):
    """One bound stack: waterwave.cuda's functions are calls on the device's
    waterwave.Allocator, the stack PyTorch's entry points allocate from."""
    use(fake, "pytorch", max_split_size_mb=200)
    p = _C.cuda_malloc(3 * MiB, 0, S1)
    a = wc.allocator(0)
    assert isinstance(a, ww.Allocator) and a.cuda_device == 0 and a.device is None
    assert a.policy == "pytorch" and a.config == ww.AllocatorConfig(max_split_size_mb=200)
    assert a.stats() == wc.memory_stats(0)
    assert a.stats()["allocated_bytes.all.current"] == 3 * MiB
    assert a.allocation_size(p) == 3 * MiB
    with pytest.raises(ww.ConfigError, match="needs a simulated device"):
        a.launch(S1, 1.0, [p])
    with pytest.raises(ww.ConfigError, match="needs a simulated device"):
        a.hazards()
    q = a.alloc(MiB, S2)  # the same stack, from Python
    assert wc.memory_allocated(0) == 4 * MiB
    a.free(q)
    _C.cuda_free(p, 3 * MiB, 0, S1)
    assert "device 0" in wc.memory_summary(0)


def test_a_held_allocator_outlives_a_reset_safely(fake):
    use(fake)
    old = wc.allocator(0)
    p = old.alloc(MiB, S1)
    old.free(p)
    _C.cuda_reset()  # nothing live: the runtime drops its stacks
    q = old.alloc(MiB, S1)  # the held stack still works, over its own segments
    new = wc.allocator(0)
    assert new.stats()["allocated_bytes.all.current"] == 0
    assert old.stats()["allocated_bytes.all.current"] == MiB
    old.free(q)
    old.check_invariants()
    del old  # gives its cache back to the driver
    new.check_invariants()


@pytest.mark.parametrize("device", ["cpu", "cuda:x", -1, True, "gpu"])
def test_a_device_that_is_not_cuda_is_a_clear_error_not_device_0(device):
    import waterwave.cuda as wc

    with pytest.raises(ValueError, match="not a CUDA device"):
        wc.memory_allocated(device)

