"""bench/concurrent/host.py, the NodeGroup pipeline's host cost: its quick
run measures a real barrier and a real pairing and writes its report."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_host_cost_benchmark_measures_and_reports(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "host.py"), "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "concurrent_host.json").read_text())
    assert res["measured"] == "CPU" and "cores" in res["machine"]
    assert {(b["layout"], b["groups_per_job"]) for b in res["barrier"]} == {
        (layout, n) for layout in ("turns", "side by side") for n in (100, 1000)}
    assert all(b["us_per_group"] > 0 for b in res["barrier"])
    # Turns: each job's group in a round of its own, so a run of s steps of
    # 40 groups each takes 80 s rounds.
    assert [(p["steps"], p["rounds"]) for p in res["pairing"]] == [(2, 160), (20, 1600)]
    assert all(0 < p["first_window_ms"] <= p["seconds"] * 1e3 for p in res["pairing"])
    text = (tmp_path / "concurrent_host.md").read_text()
    assert "| 1,000 | turns |" in text and "| 20 | 1,600 |" in text
    assert str(tmp_path / "concurrent_host.md") in r.stdout


def test_the_job_train_benchmark_measures_both_ways_and_reports(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "train_host.py"),
                        "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "train_host.json").read_text())
    assert "cores" in res["machine"]
    assert [(row["model"], row["jobs"]) for row in res["rows"]] == [("mlp", 1), ("mlp", 2)]
    for row in res["rows"]:
        assert row["eager_ms_per_step"] > 0 and row["train_ms_per_step"] > 0
        assert abs(row["ratio"] - row["train_ms_per_step"] / row["eager_ms_per_step"]) < 1e-9
    assert "| mlp | 2 |" in (tmp_path / "train_host.md").read_text()


def test_the_throughput_benchmark_simulates_every_schedule_and_reports(tmp_path):
    """bench/concurrent/throughput.py (issue 27): each schedule's samples per
    second and busy share, simulated with concurrent kernels; a table and a chart."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "throughput.py"),
                        "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "throughput.json").read_text())
    assert res["simulated"] and res["concurrent_kernels"]
    (row,) = res["rows"]
    for s in ("sequential", "turns", "lockstep", "waterwave"):
        assert row[s]["ok"] and row[s]["throughput"] > 0 and 0 < row[s]["gpu_busy"] <= 1
    assert row["lockstep"]["throughput"] > row["sequential"]["throughput"]
    assert "(simulated)" in (tmp_path / "throughput.md").read_text()
    assert (tmp_path / "throughput.png").stat().st_size > 5_000
