"""The benchmarks' quick runs: bench/concurrent/host.py (the NodeGroup
pipeline's host cost: a real barrier and a real pairing), train_host.py
(job.train against eager loops), throughput.py and trials_per_hour.py (the
schedules simulated with kernels side by side); each measures and reports."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def torch_threads() -> int:
    """The team a fresh process's PyTorch starts with."""
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                       capture_output=True, text=True, check=True)
    return int(r.stdout)


def test_the_job_train_benchmark_measures_both_ways_and_reports(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "train_host.py"),
                        "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "train_host.json").read_text())
    assert "cores" in res["machine"]
    assert [(row["model"], row["jobs"], row["teams"]) for row in res["rows"]] == [
        ("mlp", 1, "default"), ("mlp", 2, "default"), ("mlp", 2, "split")]
    for row in res["rows"]:
        assert row["eager_ms_per_step"] > 0 and row["train_ms_per_step"] > 0
        assert abs(row["ratio"] - row["train_ms_per_step"] / row["eager_ms_per_step"]) < 1e-9
        assert row["train_page_faults_per_step"] >= 0 and row["eager_context_switches_per_step"] >= 0
    assert {row["malloc"] for row in res["rows"]} == {"default"}  # --quick: glibc as it is
    two = res["rows"][1]  # two jobs: eager loops from a thread each are measured too
    assert two["eager_threads_ms_per_step"] > 0
    assert abs(two["ratio_to_eager_threads"]
               - two["train_ms_per_step"] / two["eager_threads_ms_per_step"]) < 1e-9
    assert "eager_threads_ms_per_step" not in res["rows"][0]
    assert "| mlp | 2 | default | default |" in (tmp_path / "train_host.md").read_text()
    # Split teams: two threads share the cores; the loops one after another keep them all.
    cores = os.cpu_count()
    split = res["rows"][2]
    assert split["train_team"] == split["eager_threads_team"] == max(1, cores // 2)
    assert split["eager_team"] == two["eager_team"] == two["train_team"] == torch_threads()
    # --quick measures in its own process; a full run measures each in a fresh one, so:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "train_host.py"),
                        "--one", "mlp", "2", "1", "train", "split"], capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    fresh = json.loads(r.stdout.strip().splitlines()[-1])
    assert fresh["seconds"] > 0 and fresh["team"] == max(1, cores // 2)


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


def test_the_trials_per_hour_benchmark_runs_a_pruned_search_three_ways(tmp_path):
    """bench/concurrent/trials_per_hour.py (issue 27): a successive-halving
    search one trial at a time, side by side and through the pipeline."""
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import trials_per_hour

    epochs = trials_per_hour.halving_epochs(32, 5)
    assert sum(epochs) == 96 and sorted(epochs, reverse=True) == epochs
    assert epochs.count(16) == 2 and epochs.count(1) == 16
    # The search itself: two slots at twice the rate of one finish in half the time.
    one = trials_per_hour.search([1, 1, 1, 1], 1, {1: (100.0, 0.5)})
    two = trials_per_hour.search([1, 1, 1, 1], 2, {1: (100.0, 0.5), 2: (200.0, 1.0)})
    assert two["hours"] == pytest.approx(one["hours"] / 2) and two["gpu_busy"] == pytest.approx(1.0)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "trials_per_hour.py"),
                        "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "trials_per_hour.json").read_text())
    runs = res["runs"]
    assert res["simulated"] and len(runs) == 3
    for v in runs.values():
        assert v["trials_per_hour"] > 0 and 0 < v["gpu_busy"] <= 1
    assert runs["2 side by side (PyTorch)"]["trials_per_hour"] > runs["one at a time"]["trials_per_hour"]


def test_the_search_benchmark_runs_optuna_in_simulated_time_and_counts_what_failed():
    """bench/concurrent/search.py (issue 41, part 4): real Optuna (TPE, a
    median pruner) asked and told in simulated time, K trials at a time at
    the rate the simulator gives that many; a trial that starts where the
    way cannot hold one more fails with out of memory."""
    pytest.importorskip("optuna")
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import search as bench

    family = bench.Family("tiny", "mlp", 0, 64, None, epochs=3, epoch_samples=1000)

    def rate(samples_per_s, busy=0.5, peak=1 << 30):
        return {"samples_per_s": samples_per_s, "gpu_busy": busy, "peak_reserved": peak,
                "ran": None}

    one = bench.search(family, 8, 1, {1: rate(100.0)})
    two = bench.search(family, 8, 2, {1: rate(100.0), 2: rate(200.0, 1.0, 2 << 30)})
    assert one["ooms"] == two["ooms"] == 0 and one["trained"] == two["trained"] == 8
    # The same search (the same trials, pruned alike) at twice the rate.
    assert two["trials_per_hour"] == pytest.approx(2 * one["trials_per_hour"])
    assert two["peak_reserved_gib"] == 2.0 and two["gpu_busy"] == pytest.approx(1.0)
    assert one["best"] == two["best"] and 0 < one["minutes_to_best"] <= one["minutes"]
    # Two do not fit: every trial that starts beside a running one fails.
    crowded = bench.search(family, 8, 2, {1: rate(100.0), 2: rate(None)})
    assert crowded["ooms"] > 0 and crowded["ooms"] + crowded["trained"] == 8
    assert bench.accuracy(0.05, 1e-5, 3) == bench.accuracy(0.05, 1e-5, 3)
    lines = bench.table({"trials": 8, "slots": 2, "families": {
        "tiny": {"family": "tiny", "ways": {"one at a time": one, "crowded": crowded}}}})
    assert any(line.startswith("| crowded |") and f"| {crowded['ooms']} |" in line
               for line in lines)


def test_a_ways_process_keeps_the_pythonpath_it_was_given(monkeypatch):
    """make gpu-check installs Optuna into a folder on PYTHONPATH: each way's
    process (search_measured, trial_cost) keeps it, behind the repository.
    On an H200 the four ways failed with "No module named 'optuna'" when
    the children's PYTHONPATH was the repository alone."""
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import search_measured

    monkeypatch.setenv("PYTHONPATH", "/extras/site")
    path = search_measured.child_env()["PYTHONPATH"].split(os.pathsep)
    assert path == [str(ROOT), "/extras/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert search_measured.child_env()["PYTHONPATH"] == str(ROOT)


def test_the_measured_search_runs_each_way_and_reports(tmp_path):
    """bench/concurrent/search_measured.py, as make gpu-check runs it on a
    GPU (each way in a process of its own), here on the CPU with tiny
    settings (the ways in one process): every way trains its trials (real
    training, the synthetic curve's values) and is reported."""
    pytest.importorskip("optuna")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "search_measured.py"),
                        "--device", "cpu", "--trials", "2", "--jobs", "2", "--epochs", "1",
                        "--steps", "1", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "search_measured_small.json").read_text())
    assert "CPU" in res["measured"]
    assert [row["way"] for row in res["rows"]] == [
        "one at a time", "side by side (PyTorch)", "ww.sharing", "job.train",
        "job.train (captured)"]
    for row in res["rows"]:
        assert row["trained"] + row["ooms"] == 2 and row["ooms"] == 0
        assert row["trials_per_hour"] > 0 and row["jobs"] == (1 if row["way"] == "one at a time"
                                                               else 2)
    assert "| job.train |" in (tmp_path / "search_measured_small.md").read_text()
    assert res["cap_bytes"] is None and all(row["oom_messages"] == [] for row in res["rows"])
    assert all(row["gpu_busy"] is None for row in res["rows"])  # no GPU, no busy share
    # A GPU run's report names its cap and what each way's first failures said.
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import search_measured

    res.update(measured="a GPU", family="memory-bound", cap_bytes=12 << 30)
    res["rows"][2].update(ooms=1, oom_messages=["CUDA out of memory. Tried to allocate 2 MiB"],
                          gpu_busy=0.456)
    text = search_measured.markdown(res)
    assert "| GPU busy |" in text and text.count(" | 46% |") == 1 and " | - |" in text
    # Where NVML cannot be read (here: no GPU), the busy share is unknown, not 0.
    import torch

    sampler = search_measured.BusySampler(torch.device("cpu"), period=0.01)
    time.sleep(0.1)
    assert sampler.stop() is None and sampler.failed
    assert "under one cap on what the process reserves" in text and "(12 GiB" in text
    assert "- ww.sharing: CUDA out of memory. Tried to allocate 2 MiB" in text


def test_the_trial_cost_benchmark_times_a_search_cold_or_warm():
    """bench/concurrent/trial_cost.py's search in this process, both modes:
    a time for the whole search, cold or warm (after a trial of another
    structure, off the clock); the search's nine structures."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import trial_cost

    assert {(w, d) for w, d, _ in trial_cost.configs(9)} == {
        (w, d) for w in (64, 128, 256) for d in (1, 2, 3)}
    for mode in trial_cost.MODES:
        for warm in (False, True):
            assert trial_cost.run_mode(mode, trials=2, epochs=1, jobs=2, warm=warm) > 0


def test_the_trial_cost_benchmark_times_every_mode_in_one_process(tmp_path):
    """``--in-process``: every mode's search in the benchmark's own process,
    after a warm-up each, the modes taking turns; the report says so and
    gives each mode at 1 and at ``--jobs`` trials at once."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import trial_cost

    assert trial_cost.main(["--trials", "2", "--epochs", "1", "--jobs", "2", "--repeats", "2",
                            "--in-process", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "trial_cost_in_process.json").read_text())
    assert report["in_process"] and report["repeats"] == 2
    assert {(r["jobs"], r["mode"]) for r in report["rows"]} == {
        (j, m) for j in (1, 2) for m in trial_cost.MODES}
    assert all(len(r["runs_s"]) == 2 and r["median_s"] > 0 for r in report["rows"])
    assert "--in-process" in (tmp_path / "trial_cost_in_process.md").read_text()


def test_the_step_cost_benchmark_times_each_way_and_each_phase(tmp_path):
    """bench/concurrent/step_cost.py with tiny settings, in this process:
    microseconds a step of the bare loop, ``job.train`` and a shared
    ``job.train``; and with ``--phases``, each phase of a step in a job's
    sharing block with its pass boundary called and without. Settings
    under 1 are refused."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import step_cost

    assert step_cost.main(["--width", "16", "--steps", "3", "--rounds", "2",
                           "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_cost.json").read_text())
    assert set(report["ways"]) == set(step_cost.WAYS)
    assert all(row["median_us"] > 0 for row in report["ways"].values())
    assert step_cost.main(["--width", "16", "--steps", "2", "--rounds", "1", "--threads", "2",
                           "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_cost_2_threads.json").read_text())
    assert report["threads"] == 2 and set(report["ways"]) == set(step_cost.WAYS)
    assert step_cost.main(["--width", "16", "--rounds", "2", "--phases",
                           "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_cost_phases.json").read_text())
    assert set(report["medians_us"]) == {"boundary", "none"}
    called, none = report["medians_us"]["boundary"], report["medians_us"]["none"]
    assert len(called) == len(step_cost.PHASES) and called[0] > none[0]  # the boundary's call
    with pytest.raises(SystemExit):
        step_cost.main(["--rounds", "0", "--out", str(tmp_path)])


def test_the_step_instructions_benchmark_counts_between_its_switches(tmp_path, monkeypatch):
    """bench/concurrent/step_instructions.py: a way's process switches
    callgrind's counting on after its warm calls and off after the counted
    ones; a profile's total is read from its totals line, and a file with
    none is refused; the report divides each way's count by its steps and
    sets it against the bare loop's; without valgrind it says what to
    install. (valgrind itself runs a way for minutes: the benchmark's run,
    not the suite's.)"""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench" / "concurrent"))
    import step_instructions as si

    events = []
    real_call = si.train_call

    def train(*args):
        events.append("step")
        return real_call(*args)
    with monkeypatch.context() as patch:
        patch.setattr(si, "train_call", train)
        patch.setattr(si.subprocess, "run", lambda cmd, **k: events.append(tuple(cmd)))
        si.child("job.train", 16, 30, calls=2)  # more steps than the data's 22 batches
    pid = str(os.getpid())
    assert events == ["step"] * si.WARM_CALLS + [("callgrind_control", "-i", "on", pid)] + [
        "step"] * 2 + [("callgrind_control", "-i", "off", pid)]

    assert si.instructions("events: Ir\nsummary: 0\nfl=x\n0 5\ntotals: 123456\n") == 123456
    with pytest.raises(ValueError, match="no totals"):
        si.instructions("events: Ir\n")

    monkeypatch.setattr(si, "counted", lambda way, *a: {"bare": 2000, "job.train": 1800,
                                                         "shared": 2600, "planned": 2200}[way])
    monkeypatch.setattr(si.shutil, "which", lambda tool: "/usr/bin/" + tool)
    assert si.main(["--steps", "10", "--calls", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_instructions.json").read_text())
    assert report["per_step"] == {"bare": 100, "job.train": 90, "shared": 130, "planned": 110}
    text = (tmp_path / "step_instructions.md").read_text()
    assert "+30.00%" in text and "+10.00%" in text

    monkeypatch.setattr(si.shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit):
        si.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        si.main(["--calls", "0", "--out", str(tmp_path)])


def test_the_state_fit_benchmark_counts_the_trials_each_way_trained(tmp_path):
    """bench/concurrent/state_fit.py with tiny settings: under a limit that
    holds every trial's state, each way trains them all, each run in a
    process of its own, and the report says so; a limit that is no number
    of MiB is refused."""
    pytest.importorskip("torch")
    script = str(ROOT / "bench" / "concurrent" / "state_fit.py")
    r = subprocess.run([sys.executable, script, "--limits", "200", "--trials", "2", "--steps",
                        "2", "--repeats", "1", "--widths", "64", "32", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "state_fit_64_32.json").read_text())  # one width a trial
    assert res["widths"] == [64, 32]
    assert [(run["way"], run["trained"]) for run in res["runs"]] == [
        ("ww.sharing", 2), ("job.train", 2), ("one after another", 2)]
    assert all(run["first_error"] is None for run in res["runs"])
    assert "| job.train | 200 | 2 |" in (tmp_path / "state_fit_64_32.md").read_text()
    bad = subprocess.run([sys.executable, script, "--limits", "0"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "positive number of MiB" in bad.stderr
    bad = subprocess.run([sys.executable, script, "--widths", "0"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "positive number of units" in bad.stderr


def test_the_session_fit_benchmark_counts_the_choices_below_the_best_and_the_edge(tmp_path):
    """bench/concurrent/session_fit.py: the session's choice (a trainer's on a
    GPU) and one from the peaks only against the plain schedules under
    random caps, and side by side capped
    at exactly what a trainer counts for it (it fits) and at the bytes
    reserved alone (two MLP 4096x2 at batch 256 ran out there)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "session_fit.py"),
                        "--draws", "4", "--seeds", "11", "--edge-draws", "12", "--edge-seeds",
                        "5", "--check-steps", "20", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "session_fit.json").read_text())
    caps, edge = res["random_caps"], res["edge"]
    assert res["simulated"] and 0 < caps["a_plain_schedule_fits"] <= 4
    assert caps["ways"].keys() == {"session", "peaks only"}
    for c in caps["ways"].values():
        assert c["below"] + c["oom"] <= caps["a_plain_schedule_fits"]
        assert c["side_by_side_from_peaks"] <= caps["a_plain_schedule_fits"]
        assert c["side_by_side_probe_ran_out"] <= c["side_by_side_probed"]
        assert c["ran_out_by_check_steps"] <= c["side_by_side_from_probe"]
    assert caps["ways"]["peaks only"]["side_by_side_probed"] == 0
    assert edge["mixes"] == 12 and edge["need"]["oom"] == 0
    assert 0 <= edge["sum"]["oom"] <= edge["mixes"]
    assert "| what a trainer counts for it" in (tmp_path / "session_fit.md").read_text()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "session_fit.py"),
                        "--draws", "-1"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2 and "--draws and --edge-draws must be 0 or more" in r.stderr


def test_the_pairing_fit_benchmark_counts_each_rules_plans_and_what_ran_out(tmp_path):
    """bench/concurrent/pairing_fit.py: paired rounds' budget with and
    without a part-empty segment a job kept back, running free with a
    margin or the jobs' segment spares, over random mixes."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "pairing_fit.py"),
                        "--draws", "6", "--seed", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "pairing_fit.json").read_text())
    assert res["simulated"] and 0 < res["a_plain_schedule_fits"] <= 6
    for counts in res["rules"].values():
        assert counts["fits"] + counts["past_budget"] == res["a_plain_schedule_fits"]
        assert counts["fits_oom"] <= counts["fits"]
        assert counts["past_budget_oom"] <= counts["past_budget"]
        assert counts["trainer_probe_oom"] <= counts["fits"]
    # Keeping segments back plans past the budget more often, and a plan
    # that keeps to it did not run out.
    rules = res["rules"]
    assert rules.keys() == {"bytes", "segments", "spares"}
    assert rules["segments"]["past_budget"] >= rules["bytes"]["past_budget"]
    assert rules["segments"]["fits_oom"] == rules["spares"]["fits_oom"] == 0
    assert rules["spares"]["trainer_probe_oom"] == rules["spares"]["trainer_oom"] == 0
    assert "each job's segment spare measured alone (`spares`) |" in (
        tmp_path / "pairing_fit.md").read_text()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "concurrent" / "pairing_fit.py"),
                        "--draws", "0"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2 and "--draws must be at least 1" in r.stderr
