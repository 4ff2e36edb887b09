"""The waterwave policy's ``own_segments_first``: a stream takes other
streams' free memory only once the device is out
(``csrc/alloc/waterwave_policy.cpp``, ``docs/design/waterwave-policy.md``), set in
the config or at run time. Random sequences under it, and toggled among
them, are in ``test_state_machine.py``."""
import pytest

import waterwave as ww

MiB = 1 << 20


def freed_on_stream_one(config: str = "", capacity: int = 256 * MiB) -> ww.Allocator:
    """A 40 MiB segment reserved on stream 1, its block freed and synced."""
    a = ww.Allocator("waterwave", ww.SimDevice(capacity, 0.0), config)
    a.free(a.alloc(40 * MiB, 1))
    a.sync_and_coalesce()
    return a


def segments_by_stream(a: ww.Allocator) -> dict[int, int]:
    out: dict[int, int] = {}
    for seg in a.snapshot():
        out[seg["stream"]] = out.get(seg["stream"], 0) + 1
    return out


def test_by_default_a_stream_splits_another_streams_synced_block():
    a = freed_on_stream_one()
    a.alloc(12 * MiB, 2)
    s = a.stats()
    assert s["segment.all.current"] == 1 and s["served.synced"] == 1


def test_own_memory_first_reserves_a_segment_of_its_own():
    a = freed_on_stream_one("own_segments_first:True")
    p = a.alloc(12 * MiB, 2)
    s = a.stats()
    assert s["served.new_segment"] == 2 and s["served.synced"] == 0
    assert segments_by_stream(a) == {1: 1, 2: 1}
    a.free(p)
    a.sync_and_coalesce()
    a.alloc(12 * MiB, 2)  # its own segment's block, again
    assert a.stats()["segment.all.current"] == 2
    a.check_invariants()


def test_own_memory_first_takes_another_streams_memory_once_the_device_is_out():
    # 40 MiB reserved of a 48 MiB device: a 12 MiB segment of its own does not
    # fit, so after a SyncAndCoalesce the request takes stream 1's block.
    a = freed_on_stream_one("own_segments_first:True", capacity=48 * MiB)
    a.alloc(12 * MiB, 2)
    s = a.stats()
    assert s["segment.all.current"] == 1
    assert s["served.after_sync"] == 1 and s["num_ooms"] == 0
    a.check_invariants()


def test_a_stream_takes_the_tightest_of_its_own_segments_blocks():
    a = ww.Allocator("waterwave", ww.SimDevice(512 * MiB, 0.0), "own_segments_first:True")
    mine = [a.alloc(n * MiB, 2) for n in (30, 14)]  # two segments of stream 2
    other = a.alloc(13 * MiB, 1)  # stream 1's, tighter for 13 MiB than either
    for p in (*mine, other):
        a.free(p)
    a.sync_and_coalesce()
    p = a.alloc(13 * MiB, 2)
    owner = {seg["addr"]: seg for seg in a.snapshot()}
    seg = next(s for s in owner.values() if s["addr"] <= p < s["addr"] + s["size"])
    assert seg["stream"] == 2 and seg["size"] == 14 * MiB


def test_largest_free_block_counts_every_streams_segments():
    a = ww.Allocator("waterwave", ww.SimDevice(512 * MiB, 0.0), "own_segments_first:True")
    for n, stream in ((60, 1), (30, 2), (44, 3)):
        a.free(a.alloc(n * MiB, stream))
    a.sync_and_coalesce()
    assert a.stats()["largest_free_block"] == 60 * MiB


@pytest.mark.parametrize("first", [False, True])
def test_changed_at_run_time_the_cached_blocks_stay_served(first):
    a = ww.Allocator("waterwave", ww.SimDevice(512 * MiB, 0.0),
                     "own_segments_first:True" if first else "")
    assert not a.own_segments_first_chosen() or first
    blocks = [a.alloc(n * MiB, s) for n, s in ((30, 1), (8, 2), (22, 1), (3, 3))]
    for p in blocks[::2]:
        a.free(p)
    a.sync_and_coalesce()
    a.set_own_segments_first(not first)
    assert a.own_segments_first_chosen() and a.config.own_segments_first == (not first)
    a.check_invariants()
    before = a.stats()["reserved_bytes.all.current"]
    a.alloc(22 * MiB, 1)  # stream 1's cached block, in whichever order the set keeps
    assert a.stats()["reserved_bytes.all.current"] == before
    a.check_invariants()


def test_the_setting_is_refused_by_name_beside_expandable_segments():
    with pytest.raises(ww.ConfigError, match="own_segments_first and expandable_segments"):
        ww.AllocatorConfig("own_segments_first:True,expandable_segments:True")
    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), "expandable_segments:True")
    with pytest.raises(ww.ConfigError, match="expandable_segments"):
        a.set_own_segments_first(True)
    assert not a.config.own_segments_first  # nothing changed
    assert ww.AllocatorConfig("own_segments_first:True").own_segments_first
    assert "own_segments_first:True" in str(ww.AllocatorConfig(own_segments_first=True))


def test_chosen_in_the_config_true_or_false():
    assert not ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0)).own_segments_first_chosen()
    for text in ("own_segments_first:False", "own_segments_first:True"):
        a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), text)
        assert a.own_segments_first_chosen() and text in str(a.config)


def test_the_gpu_face_sets_it_on_the_devices_allocator(fake):
    from waterwave import _C

    ww.cuda.configure("waterwave", "", driver=fake.path)
    ptr = _C.cuda_malloc(MiB, 0, 0)  # the device's allocator exists
    try:
        assert not ww.cuda.allocator(0).own_segments_first_chosen()
        ww.cuda.set_own_segments_first(True, device=0)
        assert ww.cuda.allocator(0).config.own_segments_first
        assert ww.cuda.allocator(0).own_segments_first_chosen()
        with pytest.raises(TypeError, match="True or False"):
            ww.cuda.set_own_segments_first("yes")
        ww.cuda.set_own_segments_first(False, device="cuda:0")
        assert not ww.cuda.allocator(0).config.own_segments_first
    finally:
        _C.cuda_free(ptr, MiB, 0, 0)


def test_runs_on_one_gpu_hold_it_whatever_handle_each_took(fake):
    """Each ``waterwave.cuda.allocator`` call is a new handle on the device's
    stack: two trainers' runs that overlap keep the setting on until the
    last ends, as the count lives with the stack."""
    from waterwave import _C
    from waterwave.alloc.own_segments import own_segments_for_run

    ww.cuda.configure("waterwave", "", driver=fake.path)
    ptr = _C.cuda_malloc(MiB, 0, 0)
    try:
        first = own_segments_for_run(ww.cuda.allocator(0))
        assert first.__enter__()
        with own_segments_for_run(ww.cuda.allocator("cuda:0")) as on:
            assert on
        assert ww.cuda.allocator(0).config.own_segments_first  # the first run holds it
        first.__exit__(None, None, None)
        assert not ww.cuda.allocator(0).config.own_segments_first
        assert not ww.cuda.allocator(0).own_segments_first_chosen()
    finally:
        _C.cuda_free(ptr, MiB, 0, 0)


def test_the_benchmark_measures_both_settings(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "fragmentation"))
    try:
        import own_segments
    finally:
        sys.path.pop(0)
    assert own_segments.main(["--mixes", "1", "--seed", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "own_segments.json").read_text())
    assert [r["schedule"] for r in data["least_cap"]] == ["sequential", "turns", "lockstep"]
    for r in data["least_cap"]:  # bisected to 2 MiB, each setting on its own
        assert all(r[n] > 0 for n in ("pytorch", "waterwave", "own segments first"))
    (session,) = data["sessions"]
    assert {"session, as it comes", "session, own segments first"} <= set(session)
    report = (tmp_path / "own_segments.md").read_text()
    assert "needs more than PyTorch's" in report and "(simulated)" in report


def test_small_blocks_still_go_to_any_stream():
    """Only the large pool keeps to its own segments: small blocks (2 MiB
    segments) pack across streams as by default."""
    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), "own_segments_first:True")
    a.free(a.alloc(512 << 10, 1))
    a.sync_and_coalesce()
    a.alloc(512 << 10, 2)
    s = a.stats()
    assert s["segment.all.current"] == 1 and s["served.synced"] == 1


def test_a_trainer_run_holds_it_on_and_turns_it_off_after():
    from waterwave.alloc.own_segments import own_segments_for_run

    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0))
    with own_segments_for_run(a) as on:
        assert on and a.config.own_segments_first
        with own_segments_for_run(a) as again:  # a second trainer's run beside it
            assert again
        assert a.config.own_segments_first  # the first run still holds it
        assert not a.own_segments_first_chosen()  # the trainer's, not the user's
    assert not a.config.own_segments_first and not a.own_segments_first_chosen()
    # The user's choice stands, either way; expandable segments need none.
    for config in ("own_segments_first:False", "own_segments_first:True",
                   "expandable_segments:True"):
        chosen = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), config)
        with own_segments_for_run(chosen) as on:
            assert on == (config == "own_segments_first:True")
        assert chosen.config.own_segments_first == (config == "own_segments_first:True")
    # Chosen while a run holds it: kept after the run.
    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0))
    with own_segments_for_run(a):
        a.set_own_segments_first(True)
    assert a.config.own_segments_first and a.own_segments_first_chosen()


def test_a_trainers_run_on_a_gpu_holds_it_and_one_on_the_cpu_does_not(monkeypatch):
    from types import SimpleNamespace

    from waterwave.exec import concurrent

    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0))
    monkeypatch.setattr(concurrent.cuda, "is_installed", lambda: True)
    monkeypatch.setattr(concurrent.cuda, "allocator", lambda device=None: a)

    def member(device):
        return SimpleNamespace(step_fn=SimpleNamespace(
            device=device, params=[SimpleNamespace(device=f"{device}:0")]))

    trainer = object.__new__(concurrent.ConcurrentTrainer)  # _own_segments reads no state
    with trainer._own_segments([member("cuda")]) as on:
        assert on and a.config.own_segments_first
    assert not a.config.own_segments_first
    with trainer._own_segments([member("cpu")]) as on:
        assert not on and not a.config.own_segments_first


def test_each_stream_counts_the_segments_it_reserved_and_the_bytes_allocated_in_them():
    """``own_segments_by_stream``: what a trainer measures of a job's stream
    alone (``JobPlan.segment_spare``: the reserved peak less the allocated
    peak). A block another stream takes in a segment counts to the segment's
    stream; released segments leave it; peaks reset with the others. Each
    figure is given in all and by pool, as ``memory_stats()`` gives them."""
    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), "own_segments_first:True")
    big = a.alloc(12 * MiB, 1)  # a segment of its own size
    small = a.alloc(3 * MiB, 2)  # a 20 MiB large-pool segment, shared by blocks of 1-10 MiB
    tiny = a.alloc(1000, 1)  # a 2 MiB small-pool segment of stream 1's
    own = a.stats()["own_segments_by_stream"]
    assert own[1] == {
        f"{what}_bytes.{pool}{when}": bytes_
        for what, pool, bytes_ in [("reserved", "", 14 * MiB), ("allocated", "", 12 * MiB + 1024),
                                   ("reserved", "small_pool.", 2 * MiB),
                                   ("allocated", "small_pool.", 1024),
                                   ("reserved", "large_pool.", 12 * MiB),
                                   ("allocated", "large_pool.", 12 * MiB)]
        for when in ("current", "peak")}
    a.free(tiny)
    assert own[2]["reserved_bytes.current"] == 20 * MiB
    assert own[2]["allocated_bytes.current"] == 3 * MiB
    a.free(small)
    a.free(big)
    a.sync_and_coalesce()
    other = a.alloc(5 * MiB, 3)  # own memory first: not stream 2's free segment
    own = a.stats()["own_segments_by_stream"]
    assert own[3]["allocated_bytes.current"] == 5 * MiB
    assert own[2]["allocated_bytes.current"] == 0
    a.free(other)
    a.empty_cache()
    a.check_invariants()
    own = a.stats()["own_segments_by_stream"]
    assert all(o["reserved_bytes.current"] == o["allocated_bytes.current"] == 0
               for o in own.values())
    assert own[2]["reserved_bytes.peak"] == 20 * MiB and own[2]["allocated_bytes.peak"] == 3 * MiB
    a.reset_peak_stats()
    assert all(v == 0 for o in a.stats()["own_segments_by_stream"].values() for v in o.values())


def test_a_block_taken_in_another_streams_segment_counts_to_that_stream():
    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0))
    a.free(a.alloc(3 * MiB, 1))
    a.sync_and_coalesce()
    a.alloc(4 * MiB, 2)  # the synced remainder of stream 1's 20 MiB segment
    own = a.stats()["own_segments_by_stream"]
    assert own.keys() == {1}
    assert own[1]["allocated_bytes.current"] == 4 * MiB
    assert own[1]["reserved_bytes.current"] == 20 * MiB
    a.check_invariants()


def test_a_measured_step_reads_its_streams_spare_and_the_trainer_counts_it(monkeypatch):
    """On a GPU under Waterwave's allocator, streams keeping to their own
    segments, a job's measured step reads its stream's own segments after
    each group (``MemoryProbe.own_peaks``), the
    step's spare is the reserved peak less the allocated peak over its
    groups, and a trainer counts the job's peak as its step's bytes and that
    spare; under PyTorch's allocator nothing is read and the peak is
    ``cached_peak``'s; on the CPU, the bytes."""
    from types import SimpleNamespace

    from waterwave.exec import device_segments, job_loop
    from waterwave.pipeline.pairing import JobPlan, SegmentSpare
    from waterwave.pipeline.session_choice import cached_peak

    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), "own_segments_first:True")
    monkeypatch.setattr(job_loop.cuda, "is_installed", lambda: True)
    monkeypatch.setattr(job_loop.cuda, "allocator", lambda device=None: a)
    probe = job_loop.MemoryProbe("cuda:0")
    stream = SimpleNamespace(cuda_stream=7)
    measure = job_loop.Measure(probe, lambda readings, spare: None)
    probe.start()
    first = a.alloc(3 * MiB, 7)  # a 20 MiB segment of stream 7's own
    measure.own.append(probe.own_peaks(stream))
    a.free(first)
    probe.start()
    a.alloc(6 * MiB, 7)
    a.alloc(1000, 7)  # a 2 MiB small-pool segment of its own
    measure.own.append(probe.own_peaks(stream))
    assert measure.own == [(20 * MiB, 3 * MiB, 0, 0), (22 * MiB, 6 * MiB + 1024, 2 * MiB, 1024)]
    assert measure.segment_spare() == SegmentSpare(16 * MiB - 1024, 2 * MiB - 1024)
    assert probe.own_peaks(None) is None  # a job on no stream of its own
    a.set_own_segments_first(False)
    assert probe.own_peaks(stream) is None  # its blocks may sit in other streams' segments
    a.set_own_segments_first(True)
    measure.own.append(None)
    assert measure.segment_spare() is None

    def member(device, spare):
        plan = JobPlan(0, 10 * MiB, [(5 * MiB, 5 * MiB), (-5 * MiB, 0)], segment_spare=spare)
        return SimpleNamespace(pairing_plan=lambda k: plan, step_fn=SimpleNamespace(
            device=device, params=[SimpleNamespace(device=f"{device}:0")]))

    assert device_segments.peak_alone(member("cuda", SegmentSpare(14 * MiB))) == 29 * MiB
    assert device_segments.peak_alone(member("cpu", None)) == 15 * MiB
    monkeypatch.setattr(device_segments.cuda, "is_installed", lambda: False)
    assert device_segments.peak_alone(member("cuda", None)) == cached_peak(15 * MiB)
    # Peaks reserved alone, and only those, are marked so: side by side
    # counts a segment of the small pool the jobs share beside them.
    spare = SegmentSpare(14 * MiB, 1 * MiB)
    assert [device_segments.measured_alone(member(d, s), 0.01).segment_spare
            for d, s in [("cuda", spare), ("cuda", None), ("cpu", None)]] == [spare, None, None]
    monkeypatch.setattr(job_loop.cuda, "is_installed", lambda: False)
    assert job_loop.MemoryProbe("cuda:0").own_peaks(stream) is None  # torch's counters
