"""The native registration (waterwave/alloc/torch_native.{py,cpp}): Waterwave
as PyTorch's own CUDA caching allocator, so that PyTorch's memory functions
work unchanged, called as users call them.

Without a GPU: torch's CUDA build starts CUDA over the fake runtime
(tests/cpp/fake_cudart.c, preloaded) and the fake driver (fake_cuda.c,
found as libcuda.so.1), so torch.cuda.init(), torch.empty on "cuda" and
every torch.cuda memory function run PyTorch's real code down to Waterwave.
No kernel runs: tensors are made and freed, never filled. Each case runs in
its own process (one allocator per process).
"""
import json
import os
import textwrap

import pytest
from conftest import run_python

from waterwave.alloc import torch_bridge

torch = pytest.importorskip("torch")
if not hasattr(torch._C, "_cuda_customAllocator"):
    pytest.skip("needs a CUDA build of torch (it runs on the CPU)", allow_module_level=True)
if torch_bridge.cuda_include_dirs() is None:
    pytest.skip("the native registration needs the CUDA runtime's headers (a CUDA toolkit)",
                allow_module_level=True)

MiB = 1 << 20
PRELUDE = """
    import ctypes, json, os, warnings, torch, waterwave as ww, waterwave.cuda as wc
    settings = ww.install_allocator(policy={policy!r}, registration="native")
"""


def run(fake_cuda_env, code: str, policy: str = "waterwave", **env) -> dict:
    r = run_python(textwrap.dedent(PRELUDE.format(policy=policy)) + textwrap.dedent(code),
                   **fake_cuda_env, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_torchs_memory_functions_give_waterwaves_figures(fake_cuda_env, policy):
    out = run(fake_cuda_env, """
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        y = torch.empty(1000, dtype=torch.uint8, device="cuda")
        stats, ours = torch.cuda.memory_stats(), wc.memory_stats(0)
        keys = [k for k in stats if ".all." in k or "." not in k]
        seen = dict(
            backend=torch.cuda.get_allocator_backend(), registration=settings["registration"],
            same=[k for k in keys if k in ours and stats[k] == ours[k]],
            differ={k: (stats[k], ours[k]) for k in keys if k in ours and stats[k] != ours[k]},
            allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
            ours_reserved=wc.memory_reserved(0),
            summary=torch.cuda.memory_summary())
        del x
        seen["peak_after_free"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seen["peak_after_reset"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_accumulated_memory_stats()
        seen["accumulated"] = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
        torch.cuda.empty_cache()
        seen["reserved_after_empty"] = torch.cuda.memory_reserved()
        print(json.dumps(seen))
    """, policy)
    assert out["backend"] == "waterwave" and out["registration"] == "native"
    assert out["differ"] == {} and "allocated_bytes.all.peak" in out["same"]
    assert "reserved_bytes.all.current" in out["same"] and "num_device_alloc" in out["same"]
    assert out["allocated"] == 3 * MiB + 1024 and out["reserved"] == out["ours_reserved"] > 0
    assert "PyTorch CUDA memory summary" in out["summary"]
    assert out["peak_after_free"] == 3 * MiB + 1024 and out["peak_after_reset"] == 1024
    assert out["accumulated"] == 0
    assert 0 < out["reserved_after_empty"] < out["reserved"]  # the small block's segment stays


def test_fraction_raw_alloc_record_stream_and_cudnns_question(fake_cuda_env):
    out = run(fake_cuda_env, """
        torch.cuda.init()
        native = ctypes.CDLL(ww.alloc.pluggable._installed)
        native.waterwave_native_cache_info.restype = ctypes.c_size_t
        free, total = wc.mem_get_info(0)
        before = native.waterwave_native_cache_info(0)
        torch.cuda.set_per_process_memory_fraction(0.25)
        seen = dict(fraction=torch.cuda.get_per_process_memory_fraction(),
                    ours=wc.get_per_process_memory_fraction(0), total=total,
                    workspace_before=before)
        p = torch.cuda.caching_allocator_alloc(5 << 20)
        seen["raw"] = torch.cuda.memory_allocated()
        torch.cuda.caching_allocator_delete(p)
        seen["raw_after"] = torch.cuda.memory_allocated()
        seen["workspace_cached"] = native.waterwave_native_cache_info(0)
        s = torch.cuda.Stream()
        x = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
        x.record_stream(s)
        del x
        seen["pending"] = wc.memory_stats(0)["pending_free_bytes"] if "pending_free_bytes" in \\
            wc.memory_stats(0) else None
        try:
            torch.empty(total // 2, dtype=torch.uint8, device="cuda")  # over the quarter
        except torch.cuda.OutOfMemoryError as e:
            seen["capped"] = str(e)
        print(json.dumps(seen))
    """)
    assert out["fraction"] == out["ours"] == 0.25
    # cuDNN sizes its benchmark's workspace by this: the device's free memory
    # at first, then no less than the largest cached block.
    assert out["workspace_before"] > 0 and out["workspace_cached"] >= 5 * MiB
    assert out["raw"] == 5 * MiB and out["raw_after"] == 0
    assert "out of memory" in out["capped"].lower()


def test_out_of_memory_is_torchs_and_calls_its_observers(fake_cuda_env):
    out = run(fake_cuda_env, """
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(
            lambda device, alloc, device_total, device_free: seen.append(
                [device, alloc, device_total, device_free]))
        kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError as e:
            message = str(e)
        print(json.dumps(dict(message=message, seen=seen, total=wc.mem_get_info(0)[1],
                              ooms=torch.cuda.memory_stats()["num_ooms"])))
    """)
    assert out["message"].startswith("CUDA out of memory (Waterwave allocator). Tried to allocate")
    assert len(out["seen"]) == 1
    device, allocated, total, free = out["seen"][0]
    assert device == 0 and allocated == 1 * MiB and total == out["total"] and 0 < free <= total
    assert out["ooms"] == 1


def test_memory_history_and_snapshots_with_stack_frames(fake_cuda_env, tmp_path):
    path = tmp_path / "snapshot.pickle"
    out = run(fake_cuda_env, f"""
        import pickle
        torch.cuda.memory._record_memory_history(max_entries=1000)
        def make_a_tensor():
            return torch.empty(1 << 20, device="cuda")
        x = make_a_tensor()
        y = torch.empty(10, device="cuda")
        del y
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._dump_snapshot({str(path)!r})
        with open({str(path)!r}, "rb") as f:
            dumped = pickle.load(f)
        blocks = [b for s in snap["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"]
        trace = snap["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        print(json.dumps(dict(
            blocks=[[b["size"], [f["name"] for f in b["frames"]]] for b in blocks],
            actions=[e["action"] for e in trace],
            alloc_frames=[f["name"] for e in trace if e["action"] == "alloc"
                          for f in e.get("frames", [])],
            enabled_after=torch._C._cuda_isHistoryEnabled(),
            dumped_segments=len(dumped["segments"]))))
    """)
    assert [size for size, _ in out["blocks"]] == [4 * MiB]
    assert "make_a_tensor" in out["blocks"][0][1]  # the Python frame that allocated it
    assert "make_a_tensor" in out["alloc_frames"]
    assert out["actions"][:2] == ["segment_alloc", "alloc"] and "free_requested" in out["actions"]
    assert out["enabled_after"] is False and out["dumped_segments"] >= 1


def test_what_has_no_meaning_here_is_a_clear_error(fake_cuda_env):
    out = run(fake_cuda_env, """
        seen = {}
        x = torch.empty(1 << 20, device="cuda")
        for name, call in [("ipc", lambda: x.untyped_storage()._share_cuda_()),
                           ("use_on_oom", lambda: torch.cuda.MemPool(use_on_oom=True)),
                           ("restore", lambda: torch._C._cuda_setCheckpointPoolState(
                               0, torch._C._cuda_getCheckpointState(0, (0, 12345)), [], [])),
                           ("disable", lambda: torch._C._cuda_cudaCachingAllocator_enable(False))]:
            try:
                call()
                seen[name] = "no error"
            except Exception as e:
                seen[name] = f"{type(e).__name__}: {e}"
        print(json.dumps(seen))
    """)
    assert "IPC handles) is not supported by the Waterwave allocator" in out["ipc"]
    assert "use_on_oom=True) is not supported" in out["use_on_oom"]
    assert "cannot restore memory pool (0, 12345) to a checkpoint: it is not there" in out["restore"]
    assert "cannot be switched off" in out["disable"]


# A graph capture begun on a side stream; `error` says how it ended.
CAPTURE = """
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(s):
            g.capture_begin()
        error = "no error"
    except RuntimeError as e:
        error = str(e)
"""

# The fake driver's count of calls a capture refuses (fake_cuda.c): each
# would have invalidated a real capture.
VIOLATIONS = """
    fake = ctypes.CDLL(os.environ["WATERWAVE_CUDA_DRIVER"])
    fake.fake_cuda_capture_violations.restype = ctypes.c_longlong
"""


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_a_cuda_graph_captures_into_a_private_pool_and_replays(fake_cuda_env, policy):
    """torch.cuda.graph as users write it: the capture's allocations come
    from a pool of its own, reused in stream order within the capture; a
    block used on the capturing stream (record_stream) or allocated on it
    and freed during the capture is freed only after, when its events may
    be recorded; no allocator call breaks the capture's rules; the pool's
    memory goes back once the graph and its outputs are gone."""
    out = run(fake_cuda_env, textwrap.dedent(VIOLATIONS) + textwrap.dedent("""
        x = torch.empty(1 << 20, device="cuda")            # before: the device's own
        used = torch.empty(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_side = torch.empty(1 << 20, device="cuda")
        before = torch.cuda.memory_allocated()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            a = torch.empty(1 << 20, device="cuda")
            a_ptr = a.data_ptr()
            del a
            b = torch.empty(1 << 20, device="cuda")         # a's block again
            used.record_stream(torch.cuda.current_stream())
            del used, on_side                                # held until the capture ends
            during = torch.cuda.memory_allocated()
            with torch.cuda.stream(torch.cuda.default_stream()):
                beside = torch.empty(1 << 20, device="cuda")  # another stream: not the pool's
            del beside
        pool = g.pool()
        segments = torch.cuda.memory_snapshot(pool)
        everything = torch.cuda.memory_snapshot()
        seen = dict(
            violations=fake.fake_cuda_capture_violations(), reused=b.data_ptr() == a_ptr,
            before=before, during=during, after=torch.cuda.memory_allocated(),
            pool_segments=len(segments),
            pool_ids=sorted({tuple(s["segment_pool_id"]) for s in everything}),
            pool_holds_b=any(s["address"] <= b.data_ptr() < s["address"] + s["total_size"]
                             for s in segments),
            pool_holds_x=any(s["address"] <= x.data_ptr() < s["address"] + s["total_size"]
                             for s in segments),
            uses=torch._C._cuda_getPoolUseCount(0, pool) if hasattr(
                torch._C, "_cuda_getPoolUseCount") else None)
        g.replay()
        g.replay()
        c = torch.empty(3 << 20, device="cuda")
        del c
        reserved = torch.cuda.memory_reserved()
        del g                                                # the pool is released ...
        seen["reserved_with_output"] = torch.cuda.memory_reserved()
        del b                                                # ... and goes once b does
        seen["reserved_after"] = torch.cuda.memory_reserved()
        seen["reserved"] = reserved
        seen["pools_after"] = sorted({tuple(s["segment_pool_id"])
                                      for s in torch.cuda.memory_snapshot()})
        seen["violations_after"] = fake.fake_cuda_capture_violations()
        print(json.dumps(seen))
    """), policy)
    assert out["violations"] == 0 and out["violations_after"] == 0
    assert out["reused"] and out["pool_holds_b"] and not out["pool_holds_x"]
    assert out["pool_segments"] == 1 and len(out["pool_ids"]) == 2  # (0, 0) and the graph's
    assert out["before"] == 12 * MiB
    assert out["during"] == 16 * MiB   # x, used and on_side held, b in the pool
    assert out["after"] == 8 * MiB     # x and b
    assert out["reserved_with_output"] == out["reserved"]
    assert out["reserved_after"] < out["reserved"] and out["pools_after"] == [[0, 0]]


def test_mempool_and_use_mem_pool(fake_cuda_env):
    """torch.cuda.MemPool and use_mem_pool: the current thread's allocations
    go to the pool, counted in torch's figures; the pool's snapshot shows
    its segments only; deleting the pool gives its memory back."""
    out = run(fake_cuda_env, """
        torch.cuda.memory._record_memory_history(max_entries=1000)
        pool = torch.cuda.MemPool()
        seen = dict(uses_before=pool.use_count())
        with torch.cuda.use_mem_pool(pool):
            t = torch.empty(1 << 20, device="cuda")
            seen["uses_inside"] = pool.use_count()
        u = torch.empty(1 << 20, device="cuda")
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        seen["traced"] = [e["action"] for e in trace
                          if e["addr"] in (t.data_ptr(), u.data_ptr()) and e["action"] == "alloc"]
        times = [e["time_us"] for e in trace]
        seen["in_time_order"] = times == sorted(times)
        segments = pool.snapshot()
        seen.update(
            uses_after=pool.use_count(), allocated=torch.cuda.memory_allocated(),
            pool_segments=len(segments),
            holds_t=any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"]
                        for s in segments),
            holds_u=any(s["address"] <= u.data_ptr() < s["address"] + s["total_size"]
                        for s in segments),
            live_check=torch._C._cuda_checkPoolLiveAllocations(0, pool.id, {t.data_ptr()}),
            live_check_wrong=torch._C._cuda_checkPoolLiveAllocations(0, pool.id, set()))
        reserved = torch.cuda.memory_reserved()
        del t
        seen["reserved_pool_alive"] = torch.cuda.memory_reserved() == reserved
        del pool
        seen["reserved_after"] = torch.cuda.memory_reserved()
        seen["reserved"] = reserved
        print(json.dumps(seen))
    """)
    assert out["uses_before"] == 1 and out["uses_inside"] == 2 and out["uses_after"] == 1
    assert out["traced"] == ["alloc", "alloc"] and out["in_time_order"]  # the pool's and u's
    assert out["allocated"] == 8 * MiB and out["pool_segments"] == 1
    assert out["holds_t"] and not out["holds_u"]
    assert out["live_check"] is True and out["live_check_wrong"] is False
    assert out["reserved_pool_alive"] and out["reserved_after"] < out["reserved"]


def test_a_pool_restored_to_its_checkpoint_as_cuda_graph_trees_do(fake_cuda_env):
    """torch.compile's CUDA graph trees checkpoint a pool after each
    recording and restore it before recording mid-path: the pool's blocks
    become the checkpoint's again at their addresses, torch's binding hands
    the live tensors their memory back, and every later free is clean."""
    out = run(fake_cuda_env, """
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            a = torch.empty(1 << 18, device="cuda")
            b = torch.empty(3 << 18, device="cuda")
        state = torch._C._cuda_getCheckpointState(0, pool.id)
        ptrs = dict(a=a.data_ptr(), b=b.data_ptr())
        sizes = dict(a=a.untyped_storage().nbytes(), b=b.untyped_storage().nbytes())
        # As after replays: the pool has a's and b's blocks back, while their
        # data lives on in storages made from pointers, owning nothing.
        for t in (a, b):
            torch._C._free_And_Remove_DeleterFn(t.untyped_storage()._cdata)
        del a, b
        a, b = (torch._C._construct_storage_from_data_pointer(ptrs[k], torch.device("cuda", 0),
                                                              sizes[k]) for k in "ab")
        with torch.cuda.use_mem_pool(pool):
            c = torch.empty(1 << 18, device="cuda")          # a's block, now c's
        seen = dict(c_took_a=c.data_ptr() == ptrs["a"],
                    standard_a=torch._C._has_Standard_Deleter(a._cdata))
        torch._C._cuda_setCheckpointPoolState(0, state, [c.untyped_storage()._cdata],
                                              [a._cdata, b._cdata])
        seen.update(
            live_is_checkpoint=torch._C._cuda_checkPoolLiveAllocations(
                0, pool.id, {ptrs["a"], ptrs["b"]}),
            a_owned=torch._C._has_Standard_Deleter(a._cdata),
            c_owned=torch._C._has_Standard_Deleter(c.untyped_storage()._cdata),
            allocated=torch.cuda.memory_allocated())
        del a, b, c
        seen.update(allocated_after=torch.cuda.memory_allocated(), errors=wc.free_errors()[0],
                    live_after=torch._C._cuda_checkPoolLiveAllocations(0, pool.id, set()))
        print(json.dumps(seen))
    """)
    assert out["c_took_a"] and out["standard_a"] is False
    assert out["live_is_checkpoint"] and out["a_owned"] and not out["c_owned"]
    assert out["allocated"] == 4 * MiB
    assert out["allocated_after"] == 0 and out["errors"] == 0 and out["live_after"]


def test_auto_falls_back_to_the_pluggable_registration_and_says_why(fake_cuda_env, tmp_path):
    """No compiler and nothing built yet: "auto" registers through torch's
    pluggable allocator with one warning naming the reason; "native" asked
    for by name is an error instead."""
    code = """
        import ctypes, json, warnings, torch, waterwave as ww, waterwave.cuda as wc
        from pathlib import Path
        from waterwave.alloc import torch_bridge
        torch_bridge.INSTALLED_DIR = Path("/nonexistent")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                settings = ww.install_allocator(registration={registration!r})
            except RuntimeError as e:
                print(json.dumps(dict(error=str(e))))
                raise SystemExit(0)
        x = torch.empty(1 << 20, device="cuda")
        print(json.dumps(dict(registration=settings["registration"], backend=wc.registration(),
                              torch_backend=torch.cuda.get_allocator_backend(),
                              warnings=[str(w.message) for w in caught],
                              allocated=wc.memory_allocated(0))))
    """
    env = {**fake_cuda_env, "CXX": "/nonexistent/c++", "WATERWAVE_CACHE_DIR": str(tmp_path),
           "WATERWAVE_TORCH_BRIDGE": "off"}
    r = run_python(textwrap.dedent(code.format(registration="auto")), **env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["registration"] == out["backend"] == "pluggable"
    assert out["torch_backend"] == "pluggable" and out["allocated"] == 4 * MiB
    assert len(out["warnings"]) == 1
    assert "the native registration could not be built" in out["warnings"][0]
    assert "cannot run the C++ compiler '/nonexistent/c++'" in out["warnings"][0]
    r = run_python(textwrap.dedent(code.format(registration="native")), **env)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "the native registration is not available" in out["error"]


def test_a_torch_whose_allocator_interface_differs_falls_back(fake_cuda_env, tmp_path):
    """A compiler that fails, as one does on a torch whose CUDAAllocator
    differs from the one torch_native.cpp implements: a warning with the
    compiler's message, the pluggable registration, never an error."""
    compiler = tmp_path / "c++"
    compiler.write_text("#!/bin/sh\necho \"error: 'cacheInfo' marked 'override', but does not "
                        "override\" >&2\nexit 1\n")
    compiler.chmod(0o755)
    code = """
        import json, warnings, torch, waterwave as ww
        from pathlib import Path
        from waterwave.alloc import torch_bridge
        torch_bridge.INSTALLED_DIR = Path("/nonexistent")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            settings = ww.install_allocator()
        print(json.dumps(dict(registration=settings["registration"],
                              warnings=[str(w.message) for w in caught])))
    """
    r = run_python(textwrap.dedent(code), **fake_cuda_env, CXX=str(compiler),
                   WATERWAVE_CACHE_DIR=str(tmp_path / "cache"), WATERWAVE_TORCH_BRIDGE="off")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["registration"] == "pluggable"
    assert "does not override" in out["warnings"][0]
    assert not any(p.suffix == ".tmp" for p in (tmp_path / "cache").iterdir())


def test_the_registration_is_named_and_checked(fake_cuda_env):
    r = run_python("import waterwave as ww; ww.install_allocator(registration='fast')",
                   **fake_cuda_env)
    assert r.returncode != 0 and "registration must be one of auto, native, pluggable" in r.stderr
    env = {**fake_cuda_env, "WATERWAVE_TORCH_REGISTRATION": "pluggable"}
    r = run_python("import json, waterwave as ww; s = ww.install_allocator(); "
                   "print(json.dumps(s['registration']))", **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == "pluggable"
    assert os.environ.get("WATERWAVE_TORCH_REGISTRATION") is None


def test_the_pluggable_registration_follows_the_fraction_and_refuses_graphs(fake_cuda_env):
    """Under torch's pluggable allocator too: set_per_process_memory_fraction
    reaches Waterwave (torch would drop it silently), and a graph capture is
    refused before it begins rather than run without a private pool."""
    r = run_python(textwrap.dedent("""
        import json, torch, waterwave as ww, waterwave.cuda as wc
        settings = ww.install_allocator(registration="pluggable")
        torch.cuda.init()
        torch.cuda.set_per_process_memory_fraction(0.25)
    """) + textwrap.dedent(CAPTURE) + textwrap.dedent("""
        print(json.dumps(dict(registration=settings["registration"], error=error,
                              fraction=wc.get_per_process_memory_fraction(0))))
    """), **fake_cuda_env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["registration"] == "pluggable" and out["fraction"] == 0.25
    assert "need private memory pools" in out["error"]
