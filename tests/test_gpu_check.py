"""`make gpu-check` (bench/gpu_check.py): refuses to run without a GPU, and
names every GPU test and GPU benchmark it runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_it_runs_the_sharing_tests_and_searches_first_then_every_other_gpu_test_and_benchmark(
        tmp_path):
    """What the project is for first, so that one 10-minute call measures it
    (the whole GPU suite ran past 7 minutes on an H200): the sharing tests,
    trials per hour, then the other GPU tests and every GPU benchmark."""
    commands = [" ".join(c[1:]) for _, c in gpu_check.parts(tmp_path)]
    tests = [c for c in commands if c.startswith("-m pytest")]
    assert commands[0] in tests and "-m gpu" in commands[0] and commands[0].endswith("-k sharing")
    assert all(c.startswith("bench/concurrent/search_measured.py") for c in commands[1:3])
    assert commands[3] in tests and commands[3].endswith("-k not sharing") and len(tests) == 2
    assert all("--durations=0" in c for c in tests)  # each test's time in its log
    benches = {c.split()[0] for c in commands if c not in tests}
    assert {"bench/gpu.py", "bench/concurrent/gpu.py", "bench/concurrent/trainer_gpu.py",
            "bench/concurrent/search_measured.py"} <= benches
    assert any(c.startswith("-m waterwave bench alloc --gpu") for c in commands)
    # --tests: both test parts narrowed by pytest -k (the others' commands unchanged).
    chosen = [" ".join(c[1:]) for _, c in gpu_check.parts(tmp_path, "resnet18")]
    assert chosen[0].endswith("-k (sharing) and (resnet18)")
    assert chosen[3].endswith("-k (not sharing) and (resnet18)")
    assert [c for c in chosen if not c.startswith("-m pytest")] == [
        c for c in commands if c not in tests]
    # --benchmarks-only (make bench-gpu): no tests; --only pytest: both test parts.
    all_parts = gpu_check.parts(tmp_path)
    assert not any(c[1:3] == ["-m", "pytest"] for _, c in gpu_check.chosen(all_parts, True, None))
    assert [n for n, _ in gpu_check.chosen(all_parts, False, ["pytest"])] == [
        gpu_check.SHARING_TESTS, gpu_check.OTHER_TESTS]
    # --only sharing: the sharing tests alone, not the other tests' part too.
    assert [n for n, _ in gpu_check.chosen(all_parts, False, ["sharing"])] == [
        gpu_check.SHARING_TESTS]


def stand_in(monkeypatch, scripts: dict) -> None:
    """gpu_check on a stand-in GPU whose parts are ``scripts`` (name ->
    Python code), each run by this interpreter."""
    pytest.importorskip("torch")
    monkeypatch.setattr(gpu_check, "device_name", lambda: "a stand-in GPU")
    monkeypatch.setattr(gpu_check, "parts", lambda out, tests=None: [
        (name, [sys.executable, "-c", code]) for name, code in scripts.items()])


def run_stand_in(monkeypatch, tmp_path, scripts: dict, *args: str) -> tuple[int, dict | None]:
    """gpu_check's exit code and its report, run on ``stand_in(scripts)``
    with ``args`` after ``--out tmp_path``."""
    stand_in(monkeypatch, scripts)
    code = gpu_check.main(["--out", str(tmp_path), *args])
    report = tmp_path / "gpu_check.json"
    return code, json.loads(report.read_text()) if report.exists() else None


def test_each_part_is_reported_and_the_budget_stops_what_runs_past_it(tmp_path, monkeypatch):
    code, report = run_stand_in(monkeypatch, tmp_path, {
        "quick": "pass",
        "broken": "raise SystemExit(3)",
        "slow": "import time; print('a first figure', flush=True); time.sleep(60)",
        "late": "pass",
    }, "--budget-min", "0.1")
    assert code == 1
    assert report["device"] == "a stand-in GPU"
    assert [p["status"] for p in report["parts"]] == [
        "passed", "failed (exit 3)", "stopped: budget spent", "not run: budget spent"]
    assert report["parts"][2]["seconds"] < 30
    assert "a stand-in GPU" in (tmp_path / "gpu_check.md").read_text()
    # What a part stopped by the budget printed comes back in its log.
    assert (tmp_path / "gpu_part_slow.log").read_text() == "a first figure\n"
    assert not (tmp_path / "gpu_part_late.log").exists()


def test_a_test_part_left_nothing_to_run_is_no_failure(tmp_path, monkeypatch):
    """--tests narrows both test parts: one it leaves no test (pytest's exit
    5) says so, and the check still passes; the tests' log is its own."""
    empty = tmp_path / "test_nothing.py"
    empty.write_text("def test_one():\n    pass\n")
    pytest.importorskip("torch")
    monkeypatch.setattr(gpu_check, "device_name", lambda: "a stand-in GPU")
    monkeypatch.setattr(gpu_check, "parts", lambda out, tests=None: [
        (gpu_check.SHARING_TESTS, [sys.executable, "-m", "pytest", "-q", "-p",
                                   "no:cacheprovider", str(empty)]),
        (gpu_check.OTHER_TESTS, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 "-k", "nothing_is_called_this", str(empty)])])
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out)]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert [p["status"] for p in report["parts"]] == ["passed", gpu_check.NO_TESTS]
    assert "1 passed" in (out / "gpu_tests_sharing.log").read_text()
    assert "deselected" in (out / "gpu_tests.log").read_text()


def test_pack_brings_every_file_back_as_one_after_each_part(tmp_path, monkeypatch):
    """--pack: the device tool brings 8 files of $OUT back at most, so every
    file under --out goes into one .tgz, rewritten after each part (a call
    stopped from outside keeps what the parts before wrote)."""
    import tarfile

    out, pack = tmp_path / "results", tmp_path / "back" / "gpu_check.tgz"
    pack.parent.mkdir()
    code, report = run_stand_in(monkeypatch, out, {
        f"part {k}": f"open({str(out / f'figures_{k}.json')!r}, 'w').write('{{}}')"
        for k in range(9)}, "--pack", str(pack))
    assert code == 0 and len(report["parts"]) == 9
    with tarfile.open(pack) as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {f"figures_{k}.json" for k in range(9)} <= names
    assert {"gpu_check.json", "gpu_check.md", "gpu_part_part_8.log"} <= names
    assert list(pack.parent.iterdir()) == [pack]  # no partial file left beside it
    inside = out / "gpu_check.tgz"  # a pack inside --out leaves itself out
    run_stand_in(monkeypatch, out, {"one": "pass", "two": "pass"}, "--pack", str(inside))
    with tarfile.open(inside) as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert "gpu_check.json" in names and not any(n.startswith("gpu_check.tgz") for n in names)


def test_only_runs_the_parts_named_and_refuses_a_word_no_part_holds(tmp_path, monkeypatch, capsys):
    code, report = run_stand_in(monkeypatch, tmp_path, {
        "GPU tests (pytest -m gpu)": "raise SystemExit(1)",
        "concurrent jobs under 12 GiB": "print('ran')",
        "ConcurrentTrainer's largest batch": "print('ran too')",
        "training under each allocator": "raise SystemExit(1)",
    }, "--only", "CONCURRENT")
    assert code == 0
    assert [p["part"] for p in report["parts"]] == [
        "concurrent jobs under 12 GiB", "ConcurrentTrainer's largest batch"]
    assert (tmp_path / "gpu_part_concurrent_jobs_under_12_gib.log").read_text() == "ran\n"
    assert gpu_check.main(["--out", str(tmp_path / "b"), "--only", "concurent"]) == 2
    err = capsys.readouterr().err
    assert "--only concurent: no part's name holds that" in err and "training under" in err
    assert not (tmp_path / "b").exists()


def probe_wheel(where: Path) -> Path:
    """A minimal wheel holding one module, ``ww_probe_mod``."""
    import zipfile

    where.mkdir()
    wheel = where / "ww_probe-1.0-py3-none-any.whl"
    files = {"ww_probe_mod.py": "VALUE = 7\n",
             "ww_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: ww-probe\nVersion: 1.0\n",
             "ww_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
                                             "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "ww_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in {**files, "ww_probe-1.0.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    return wheel


def test_missing_extras_install_from_carried_wheels_for_every_part(tmp_path, monkeypatch):
    """The GPU machines reach no index: the wheels `make gpu-wheels` left go
    into a site directory that every part's PYTHONPATH starts with; without
    them the report names what is missing and how to bring it."""
    monkeypatch.setattr(gpu_check, "EXTRAS", {"ww_probe_mod": "bring its wheel"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    site = tmp_path / "site"
    assert gpu_check.install_extras(tmp_path / "none", site) == [
        "ww_probe_mod (not importable: bring its wheel)"]
    assert "PYTHONPATH" not in gpu_check.child_env(site) or str(site) not in \
        gpu_check.child_env(site)["PYTHONPATH"]
    probe_wheel(tmp_path / "wheels")
    # A wheel of what is installed here already stays out: it would shadow it.
    assert [w.name for w in gpu_check.not_installed(
        [Path("pytest-1.0-py3-none-any.whl"), tmp_path / "wheels" / "ww_probe-1.0-py3-none-any.whl"])
    ] == ["ww_probe-1.0-py3-none-any.whl"]
    assert gpu_check.install_extras(tmp_path / "wheels", site) == []
    env = gpu_check.child_env(site)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    r = subprocess.run([sys.executable, "-c", "import ww_probe_mod; print(ww_probe_mod.VALUE)"],
                       env=env, capture_output=True, text=True)
    assert r.stdout.strip() == "7", r.stderr


def test_every_part_finds_waterwave_where_it_was_built(tmp_path, monkeypatch):
    """On the GPU machines waterwave is built in place, not installed: a part
    run as a script (whose own directory is bench/..., not the root) finds it
    through the repository on its PYTHONPATH, after the carried wheels."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = gpu_check.child_env(tmp_path / "absent")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(gpu_check.ROOT)]
    (tmp_path / "site").mkdir()
    env = gpu_check.child_env(tmp_path / "site")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "site"), str(gpu_check.ROOT)]


def test_the_training_benchmark_reports_the_median_of_interleaved_runs_and_their_spread():
    """bench/gpu.py runs each allocator --repeats times, taking turns, and
    keeps one row per allocator: the median of the runs' medians, each run's,
    the spread, and whether every run trained alike."""
    import importlib.util

    # By its path: another test's bench/concurrent on sys.path holds a gpu.py too.
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)

    def run(ms, losses=(2.0, 1.5), **more):
        return {"model": "resnet18", "mode": "waterwave", "step_ms_median": ms,
                "losses": list(losses), "peak_reserved": 1 << 30, **more}

    row = gpu.combine_runs([run(10.0, trace_file="t.json"), run(12.0), run(11.0),
                            {"error": "exit 1: out of memory", "mode": "waterwave"},
                            run(11.5, losses=(2.0, 1.4))])
    assert row["step_ms_median"] == 11.25 and row["step_ms_runs"] == [10.0, 12.0, 11.0, 11.5]
    assert row["step_ms_spread"] == round(2.0 / 11.25, 4)
    assert row["trace_file"] == "t.json" and row["runs"] == 5 and row["failed_runs"] == 1
    assert row["same_losses_every_run"] is False
    failed = gpu.combine_runs([{"error": "exit 1", "mode": "native"}])
    assert failed["error"] == "exit 1" and failed["failed_runs"] == 1
    assert gpu._ms(row) == "11.25 (±18%)"
    # Against native run by run (the k-th runs shared a round of turns): the
    # median ratio; a round where either failed is left out.
    native = [run(10.0), run(10.0), {"error": "exit 1"}, run(12.0), run(11.0)]
    mine = [run(11.0), run(9.0), run(50.0), run(12.6), {"error": "exit 1"}]
    paired = gpu.paired_to_native(mine, native)
    assert paired == {"to_native_paired": 1.05, "to_native_rounds": [1.1, 0.9, 1.05]}
    assert gpu.paired_to_native([{"error": "x"}], native) == {}
