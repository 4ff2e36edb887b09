"""The coverage-guided fuzzer (tests/fuzz/fuzz_inputs.py) over every reader
and the allocator, for a few seconds a target, and the inputs it found, as
regular tests (issue 26, item 4)."""
import os
import pickle
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import waterwave as ww
from waterwave.sim import trace

FUZZ = Path(__file__).resolve().parent / "fuzz" / "fuzz_inputs.py"
SECONDS = int(os.environ.get("WATERWAVE_FUZZ_SECONDS", "3"))


@pytest.mark.parametrize("target", ["config", "slots", "snapshot", "trace", "graph", "plan", "csv",
                                    "program"])
def test_the_fuzzer_finds_nothing_in_a_bounded_run(target, tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    # libFuzzer's memory limit reads the peak RSS, which Linux carries across
    # exec from this (forked) test process: 2 GiB on top of ours.
    limit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + 2048
    r = subprocess.run([sys.executable, str(FUZZ), target, f"-max_total_time={SECONDS}", "-seed=1",
                        f"-rss_limit_mb={limit}", f"-artifact_prefix={tmp_path}/", str(corpus)],
                       capture_output=True, text=True, timeout=SECONDS + 120)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Done" in r.stderr and any(corpus.iterdir())


# What the fuzzer found -------------------------------------------------------
def test_a_pickle_naming_a_huge_memo_index_is_refused_in_little_memory(tmp_path):
    """205 bytes whose LONG_BINPUT names memo index 1,298,490,209: the C
    unpickler sized its memo table by it (gigabytes)."""
    path = tmp_path / "memo.pickle"
    path.write_bytes(b"\x80\x04}\x94(\x8c\x08segments\x94]\x94t" + b"r" + (1298490209).to_bytes(4, "little")
                     + b".")
    with pytest.raises(trace.TraceError, match="not a PyTorch memory snapshot"):
        trace.from_snapshot(str(path))


def test_a_pickle_declaring_a_4_gb_bytearray_is_refused(tmp_path):
    path = tmp_path / "bytearray.pickle"
    path.write_bytes(b"\x80\x05\x96" + (0xFFB2F5F2).to_bytes(8, "little") + b"\x00" * 16 + b".")
    with pytest.raises(trace.TraceError, match="bytearray"):
        trace.from_snapshot(str(path))


def test_a_slot_offset_past_2_64_is_a_value_error_naming_it():
    a = ww.Allocator("waterwave", device=ww.SimDevice(1 << 28))
    with pytest.raises(ValueError, match="slot offset"):
        a.set_plan(0, [(8322555, 512), (8059383, 1 << 64)], 1012478732780767239)
    with pytest.raises(ValueError, match="arena"):
        a.set_plan(0, [(512, 0)], -1)


def test_plain_snapshots_still_read_in_full(tmp_path):
    events = [{"action": "alloc", "addr": 4096 * i, "size": 512, "stream": i % 2} for i in range(50)]
    path = tmp_path / "ok.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}, protocol=2))
    assert len(trace.from_snapshot(str(path)).ops) == 50
