"""Regression tests for bad inputs a probe found mishandled (issue 40): each
names the class it guards. Inputs that once hung run in a subprocess with a
time bound, so a regression fails the test instead of stalling the suite."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import waterwave as ww
from waterwave.tools import cli

MiB = 1 << 20


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


# 1. Memory handed out twice on a huge simulated device.

@pytest.mark.parametrize("capacity", [2**64 - 1, 2**63, 2**60, 2**57])
def test_a_simulated_device_too_large_for_its_address_space_is_refused(capacity):
    with pytest.raises(ValueError, match="address space holds: give at most 2\\*\\*56"):
        ww.SimDevice(capacity)


def test_two_allocators_on_the_largest_simulated_device_never_share_memory():
    d = ww.SimDevice(ww.SimDevice.max_capacity, 0.0)
    grown = ww.Allocator("waterwave", d, "expandable_segments:True")
    plain = ww.Allocator("waterwave", d)
    a, b = grown.alloc(MiB), plain.alloc(MiB)
    assert abs(a - b) >= MiB
    grown.check_invariants()
    plain.check_invariants()


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_a_huge_growth_maps_its_pages_at_once_and_gives_them_back(policy):
    """2**50 bytes of 20 MiB pages mapped one call at a time took minutes and
    tens of GB of host memory; now a run of pages is one call."""
    d = ww.SimDevice(ww.SimDevice.max_capacity, 0.0)
    a = ww.Allocator(policy, d, "expandable_segments:True")
    start = time.perf_counter()
    for size in [1 << 43, 1 << 50, 1 << 55]:
        p = a.alloc(size)
        assert d.mapped_bytes() >= size
        a.check_invariants()
        a.free(p)
        a.empty_cache()
        assert d.mapped_bytes() == 0
    assert time.perf_counter() - start < 10
    # Pages of one run still go back one by one: a small allocation beside a
    # freed huge one leaves the rest of the run mapped only while cached.
    big = a.alloc(1 << 40)
    small = a.alloc(MiB)
    a.free(big)
    a.empty_cache()
    assert 0 < d.mapped_bytes() < 1 << 30
    a.free(small)
    a.empty_cache()
    assert d.mapped_bytes() == 0
    a.check_invariants()


def test_the_simulator_maps_runs_that_unmap_page_by_page():
    d = ww.SimDevice(64 * MiB, 0.0)
    page = 2 * MiB
    base = d.reserve_address(48 * page)
    assert d.map_pages(base, page, 8) == 8
    assert d.mapped_bytes() == 8 * page
    d.unmap(base + 3 * page, page)           # one page out of the run
    d.remap(base + 4 * page, base + 12 * page, page)
    with pytest.raises(ValueError, match="not whole mappings"):
        d.unmap(base + 3 * page, page)       # gone already
    with pytest.raises(ValueError, match="not whole mappings"):
        d.unmap(base, 2 * page)              # two allocations, not one
    d.unmap_pages(base, page, 3)
    d.unmap_pages(base + 5 * page, page, 3)
    d.unmap(base + 12 * page, page)
    assert d.mapped_bytes() == 0
    # Out of memory partway: the pages that fit stay mapped.
    assert d.map_pages(base, page, 40) == 32
    d.unmap_pages(base, page, 32)
    d.release_address(base, 48 * page)


# 2. Hangs.

def test_a_roundup_bound_past_the_last_slot_parses_at_once():
    code = """
        import waterwave as ww
        c = ww.AllocatorConfig("roundup_power2_divisions:[9223372036854775808:8]")
        print(c)
    """
    r = run_python(code, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "32768:8" in r.stdout  # the last slot (32 GiB and up) takes it


def test_ctrl_c_stops_the_allocator_benchmark_at_once():
    code = """
        import signal, threading, os, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive run
        from waterwave.tools import cli
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        code = cli.main(["bench", "alloc", "--pairs", "200000000", "--repeats", "1"])
        print(code, round(time.monotonic() - start, 1))
    """
    r = run_python(code, timeout=60)
    code, took = r.stdout.split()
    assert code == "130", r.stdout + r.stderr
    assert float(took) < 10
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("seed", ["-1", "18446744073709551616", "one"])
def test_a_benchmark_seed_out_of_range_is_one_line(seed, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "alloc", "--seed", seed])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "Traceback" not in err
