"""The command line: benchmarks and the demo."""
import json
import subprocess
import sys

import pytest

from waterwave.pipeline.schedules import TRAINER_CONFIG
from waterwave.tools import cli


def test_bench_alloc_json(capsys):
    assert cli.main(["bench", "alloc", "--json", "--pairs", "2000", "--repeats", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    cases = data["cases"]
    names = {c["name"] for c in cases}
    assert names == {"same_stream", "synced_path", "cross_stream", "free_blocks_1k",
                     "free_blocks_16k", "free_blocks_64k"}
    assert {c["policy"] for c in cases} == {"waterwave", "pytorch", "glibc"}
    assert all(c["ns_per_pair"] > 0 for c in cases)
    assert "no GPU" in data["where"]["note"]
    by = {(c["name"], c["policy"]): c for c in cases}
    # Each case exercises the path it is named for.
    assert by[("same_stream", "waterwave")]["served"]["same_stream"] > 2000
    assert by[("synced_path", "waterwave")]["served"]["synced"] > 2000
    assert by[("cross_stream", "waterwave")]["served"]["cross_stream_wait"] > 2000
    assert by[("free_blocks_64k", "waterwave")]["free_blocks"] == 65536


def test_bench_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        cli.main(["bench", "alloc", "--pairs", "0"])


def test_demo_writes_plot_and_numbers(tmp_path, capsys):
    pytest.importorskip("torch")
    assert cli.main(["demo", "--out", str(tmp_path), "--memory-limit", "2GiB", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "batch per job" in out and "simulated" in out
    data = json.loads((tmp_path / "demo.json").read_text())
    assert (tmp_path / "demo_memory.png").stat().st_size > 10_000
    s = data["schedules"]
    assert all(r["hazards"] == 0 for r in s.values())
    # Memory flows between the jobs only under Waterwave's pipeline: it fits
    # a larger batch per job than PyTorch side by side, and lockstep fails there.
    assert s["waterwave"]["max_batch"] > s["lockstep"]["max_batch"] > 0
    assert s["waterwave"]["max_batch"] <= data["sole"]
    assert not data["at_waterwave_batch"]["lockstep"]["ok"]
    assert data["at_waterwave_batch"]["waterwave"]["ok"]
    assert data["at_waterwave_batch"]["sharing"]["ok"]  # large blocks kept whole (cache_splits)


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "waterwave", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "bench" in r.stdout and "demo" in r.stdout


def test_plan_a_saved_graph_as_json(tmp_path, capsys):
    from test_planner import chain

    chain().save(tmp_path / "g.json")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", str(tmp_path / "g.json"), "--strategy", "model", "--time-limit", "5",
                     "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("baseline_peak_bytes", "plan_peak_bytes", "lower_bound_bytes", "solve_seconds"):
        assert key in data
    assert data["lower_bound_bytes"] <= data["plan_peak_bytes"] <= data["baseline_peak_bytes"]
    from waterwave.planner import Plan
    assert Plan.load(out).arena_size == data["plan_peak_bytes"]


def test_plan_a_torchvision_model_with_table_and_plot(tmp_path, capsys):
    pytest.importorskip("torchvision")
    png = tmp_path / "m.png"
    assert cli.main(["plan", "resnet18", "--batch-size", "1", "--strategy", "greedy",
                     "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "baseline peak" in out and "saving" in out and "cuda kernels" in out
    assert png.stat().st_size > 10_000


def test_plan_records_whose_kernels_it_captured(tmp_path, capsys):
    pytest.importorskip("torchvision")
    from waterwave.graph import Graph

    for kernels in ("cuda", "cpu"):
        graph = tmp_path / f"{kernels}.json"
        args = ["plan", "resnet18", "--strategy", "greedy", "--json", "--save-graph", str(graph)]
        assert cli.main(args + (["--kernels", kernels] if kernels == "cpu" else [])) == 0
        assert json.loads(capsys.readouterr().out)["kernels"] == kernels
        assert Graph.load(graph).meta["kernels"] == kernels


def test_plan_takes_a_users_model_as_module_callable(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_net.py").write_text(
        "import torch\n"
        "def build(batch_size):\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),\n"
        "                              torch.nn.Linear(64, 4))\n"
        "    x, y = torch.randn(batch_size, 32), torch.randint(0, 4, (batch_size,))\n"
        "    return net, x, lambda out: torch.nn.functional.cross_entropy(out, y)\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "my_net:build", "--batch-size", "8", "--strategy", "greedy",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # The two Linear layers' weights and biases, and SGD's momentum for each,
    # in 512-byte blocks.
    blocks = sum(-(-4 * n // 512) * 512 for n in (32 * 64, 64, 64 * 4, 4))
    assert data["persistent_bytes"] == 2 * blocks
    assert data["plan_peak_bytes"] >= data["lower_bound_bytes"] > 0


def test_plan_takes_any_transformers_model_by_its_config(capsys):
    pytest.importorskip("transformers")
    spec = "hf:gpt2,n_layer=1,n_embd=64,n_head=2,vocab_size=1000"
    assert cli.main(["plan", spec, "--strategy", "greedy", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"].startswith("hf:gpt2") and data["nodes"] > 10


@pytest.mark.parametrize("argv, says", [
    (["plan", "resnet1000", "--json"], "unknown model 'resnet1000'"),
    (["plan", "/no/such/graph.json"], "No such file"),
    (["plan", "hf:nosuchtype"], "no model type 'nosuchtype'"),
    (["plan", "hf:gpt2,nokey=1"], "'nokey=1' is not key=value"),
    (["plan", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["pack", "/no/such.csv"], "cannot read"),
])
def test_plan_and_pack_answer_bad_input_in_one_line(argv, says, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def run_pack(tmp_path, capsys, text):
    """`waterwave pack` on a CSV: (header, {first column: offset}, stderr)."""
    f = tmp_path / "b.csv"
    f.write_text(text)
    assert cli.main(["pack", str(f), "--time-limit", "5"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    rows = {r.split(",")[0]: int(r.split(",")[4]) for r in lines[1:]}
    return lines[0], rows, captured.err


def test_pack_csv(tmp_path, capsys):
    header, rows, err = run_pack(tmp_path, capsys,
                                 "id,lower,upper,size\na,0,2,1024\nb,1,3,512\nc,2,4,1024\n")
    assert header == "id,lower,upper,size,offset"
    # a and b overlap in time, as do b and c: b must sit apart from both.
    assert rows["b"] >= 1024 or rows["b"] + 512 <= min(rows["a"], rows["c"])
    assert "arena 1536 bytes" in err and "optimal" in err


def test_pack_reads_minimalloc_benchmark_csv(tmp_path, capsys):
    """MiniMalloc's benchmark files name the columns buffer,start,end,size,
    and its reader takes end as the last live step: 0 and 2 are both live at
    10, so all three need their own place."""
    header, rows, err = run_pack(tmp_path, capsys,
                                 "buffer,start,end,size\n0,0,10,4\n1,5,15,4\n2,10,20,4\n")
    assert header == "buffer,start,end,size,offset"
    assert len(set(rows.values())) == 3
    assert "arena 12 bytes" in err and "optimal" in err


def test_minimalloc_ends_are_inclusive_and_written_back_as_read(tmp_path, capsys):
    """Issue 26: a,0,5,4 and b,5,9,4 are both live at 5 in MiniMalloc's
    reading; read half-open they shared offset 0."""
    f = tmp_path / "b.csv"
    f.write_text("buffer,start,end,size\na,0,5,4\nb,5,9,4\n")
    assert cli.main(["pack", str(f)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {r.split(",")[0]: r.split(",") for r in lines[1:]}
    assert rows["a"][4] != rows["b"][4]
    assert rows["a"][:4] == ["a", "0", "5", "4"] and rows["b"][:4] == ["b", "5", "9", "4"]
    f.write_text("id,lower,upper,size\na,0,5,4\nb,5,9,4\n")  # half-open: they may share
    assert cli.main(["pack", str(f)]) == 0
    out = capsys.readouterr()
    assert "arena 4 bytes" in out.err


@pytest.mark.parametrize("text, message", [
    ("x,y\n1,2\n", "columns id,lower,upper,size"),
    ("", "is empty"),
    ("id,lower,upper,size\n", "no buffers"),
    ("id,lower,upper,size\na,0,2\n", "line 2: expected 4 columns"),
    ("id,lower,upper,size\na,0,x,5\n", "must be integers"),
    ("id,lower,upper,size\na,3,3,512\n", "empty lifetime"),
])
def test_pack_bad_csv(tmp_path, capsys, text, message):
    f = tmp_path / "b.csv"
    f.write_text(text)
    assert cli.main(["pack", str(f)]) == 2
    assert message in capsys.readouterr().err


def test_simulate_max_batch_json(capsys, tmp_path):
    pytest.importorskip("torch")
    png = tmp_path / "best.png"
    assert cli.main(["simulate", "resnet18", "resnet18", "--memory-limit", "3GiB", "--max-batch",
                     "--plot", str(png), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plot"] == str(png) and png.stat().st_size > 10_000  # the best schedule's run
    found = data["max_batch"]
    assert data["simulated"] and list(found) == ["lockstep", "phased", "waterwave"]
    sole = data["sole_max_batch"]
    assert sole > 0 and sole % 8 == 0
    for schedule in found.values():
        assert 0 < schedule["max_batch"] <= sole and schedule["hazards"] == 0
        assert schedule["ratio_to_sole"] == round(schedule["max_batch"] / sole, 3)
        assert schedule["peak_reserved"] <= 3 * 2**30
    # Each schedule under its own allocator: PyTorch's jobs under PyTorch's
    # policy, the NodeGroup pipeline under ours, and it fits more.
    assert [found[s]["policy"] for s in found] == ["pytorch", "pytorch", "waterwave"]
    assert found["waterwave"]["config"] == TRAINER_CONFIG
    assert found["waterwave"]["max_batch"] > found["lockstep"]["max_batch"]


def test_simulate_the_nodegroup_pipeline_at_a_batch(capsys):
    """Node-group schedules from the command line, cut at a given split
    size, under their own allocator unless one is given."""
    pytest.importorskip("torch")
    argv = ["simulate", "resnet18", "resnet18", "--memory-limit", "3GiB", "--batch-size", "96",
            "--schedule", "waterwave", "--split-size", "256MiB", "--json"]
    assert cli.main(argv) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["ok"] and ours["hazards"] == 0 and ours["schedule"] == "waterwave"
    assert (ours["policy"], ours["config"]) == ("waterwave", TRAINER_CONFIG)
    assert ours["split_size"] == [256 * 2**20] * 2 and ours["peak_reserved"] <= 3 * 2**30
    assert ours["shared_rounds"] < 1  # the jobs took turns at times
    assert cli.main(argv + ["--policy", "pytorch", "--config", ""]) in (0, 1)
    theirs = json.loads(capsys.readouterr().out)
    assert (theirs["policy"], theirs["config"]) == ("pytorch", "")
    assert cli.main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert TRAINER_CONFIG in out and "256 MiB, 256 MiB" in out  # the cell may wrap after "waterwave,"
    assert cli.main(["simulate", "resnet18", "--batch-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["split_size"] == [None]  # lockstep: no groups


def test_simulate_at_a_batch_with_a_plot(tmp_path, capsys):
    pytest.importorskip("torch")
    png = tmp_path / "jobs.png"
    assert cli.main(["simulate", "resnet18", "resnet18", "--batch-size", "16", "--schedule",
                     "phased", "--policy", "waterwave", "--plot", str(png), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["hazards"] == 0 and data["schedule"] == "phased"
    assert png.stat().st_size > 10_000
    assert 0 < data["gpu_busy"] <= 1 and data["throughput"] > 0
    assert cli.main(["simulate", "resnet18", "resnet18", "--batch-size", "16"]) == 0
    assert "GPU busy, same time" in capsys.readouterr().out
    assert cli.main(["simulate", "resnet18", "--batch-size", "512", "--memory-limit", "1GiB"]) == 1
    assert "out of memory" in capsys.readouterr().out


def test_replay_a_snapshot(tmp_path, capsys):
    from test_trace import SNAPSHOTS

    png = tmp_path / "r.png"
    assert cli.main(["replay", str(SNAPSHOTS / "r18_2jobs.pickle.gz"), "--json", "--plot",
                     str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["peak_reserved"] == 2972 * 2**20 and data["streams"] == 2
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, says", [
    (["replay", "/no/such/file.pickle"], "cannot read"),
    (["simulate", "resnet5"], "unknown model 'resnet5'"),
    (["simulate", "resnet18", "--memory-limit", "twelve"], "cannot read 'twelve' as a size"),
    (["simulate", "resnet18", "--memory-limit", "1TiB"], "cannot read '1TiB'"),
    (["simulate", "resnet18", "--memory-limit", "900GiB"], "not within"),
    (["simulate", "resnet18", "--split-size=0"], "--split-size must be positive"),
    (["simulate", "resnet18", "--config", "bogus:1"], "unrecognized key 'bogus'"),
])
def test_simulate_and_replay_answer_bad_input_in_one_line(argv, says, capsys, tmp_path):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_a_time_limit_must_be_positive_and_finite(value, capsys):
    from waterwave.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(["pack", "missing.csv", "--time-limit", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "seconds" in err and "Traceback" not in err


@pytest.mark.parametrize("source, message", [
    ("def build(batch_size:\n", "importing 'usermod_{n}' failed: SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", "importing 'usermod_{n}' failed: RuntimeError: no GPU"),
    ("def build(batch_size):\n    raise KeyError('width')\n", "build(2) raised KeyError"),
    ("import torch\ndef build(batch_size):\n    m = torch.nn.Linear(4, 3)\n"
     "    return m, (torch.randn(batch_size, 4),), lambda out: out\n", "the loss has shape [2, 3]"),
])
def test_a_user_model_that_fails_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys,
                                                             source, message):
    """module:callable models that do not import, raise, or give a non-scalar
    loss: one line naming the problem, exit code 2 (issue 26)."""
    n = abs(hash(source)) % 10**8
    (tmp_path / f"usermod_{n}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", f"usermod_{n}:build", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert message.format(n=n) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def _untrusted_files(tmp_path):
    """Files an attacker (or a broken disk) could hand the CLI, each with what
    the one-line answer must say (issue 26, items 4 and 5)."""
    import gzip
    import pickle

    def snapshot(name, events):
        path = tmp_path / name
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
        return str(path)

    bomb = tmp_path / "bomb.pickle.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # 64 MiB of zeros in 64 KiB
        for _ in range(64):
            f.write(bytes(1 << 20))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    build = tmp_path / "build.pickle"
    build.write_bytes(b"(}(dS'a'\nI1\nsb.")  # a BUILD opcode on a dict
    wide = tmp_path / "wide.csv"
    wide.write_text("id,lower,upper,size\n" + "a" * 200_000 + ",0,1,512\n")
    many = [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": i} for i in range(2000)]
    huge = [{"action": "alloc", "addr": 1, "size": 2**70, "stream": 0}]
    return [
        (["replay", snapshot("streams.pickle", many)], "more than 1024 streams"),
        (["replay", snapshot("huge.pickle", huge)], "over the limit"),
        (["replay", str(bomb)], "decompresses to more than"),
        (["replay", str(build)], "not a PyTorch memory snapshot"),
        (["replay", str(deep)], "nested too deeply"),
        (["plan", str(deep)], "nested too deeply"),
        (["pack", str(wide)], "not a buffer CSV"),
    ]


def test_untrusted_files_are_refused_in_one_line_within_their_limits(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WATERWAVE_MAX_FILE_BYTES", str(32 << 20))  # below the bomb's content
    for argv, says in _untrusted_files(tmp_path):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)


def test_input_limits_are_overridable_and_checked(tmp_path, capsys, monkeypatch):
    import waterwave as ww

    many = [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": i} for i in range(1100)]
    path = tmp_path / "streams.pickle"
    import pickle

    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [many]}))
    assert cli.main(["replay", str(path), "--json"]) == 2
    monkeypatch.setenv("WATERWAVE_MAX_STREAMS", "2000")
    assert cli.main(["replay", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["streams"] == 1100
    before = ww.set_input_limits(streams=4)
    try:
        assert ww.input_limits().streams == 2000  # the environment's is on top
        monkeypatch.delenv("WATERWAVE_MAX_STREAMS")
        assert ww.input_limits().streams == 4
    finally:
        ww.set_input_limits(**vars(before))
    with pytest.raises(ValueError, match="unknown input limit"):
        ww.set_input_limits(stream=4)
    with pytest.raises(ValueError, match="positive whole number"):
        ww.set_input_limits(file_bytes=-1)
    monkeypatch.setenv("WATERWAVE_MAX_FILE_BYTES", "lots")
    with pytest.raises(ValueError, match="WATERWAVE_MAX_FILE_BYTES"):
        ww.input_limits()


@pytest.mark.parametrize("argv, says", [
    (["plan", "hf:gpt2,n_layer=abc"], "n_layer must be a number"),
    (["plan", "hf:gpt2,n_layer=1.5"], "refused by GPT2Config"),
    (["plan", "hf:gpt2,n_layer=1,n_embd=7"], "embed_dim` must be divisible"),
    (["simulate", "resnet18", "--memory-limit", "1e999"], "cannot read '1e999' as a size"),
    (["simulate", "resnet18", "--memory-limit", "99999999999999999999GiB"],
     "--memory-limit must be positive and below 2^62 bytes"),
])
def test_bad_values_are_one_line(argv, says, capsys):
    if argv[1].startswith("hf:"):
        pytest.importorskip("transformers")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_bug_of_ours_is_one_line_and_its_traceback_is_behind_debug(capsys, monkeypatch):
    def broken(args):
        raise ZeroDivisionError("a slip")

    monkeypatch.setattr(cli, "_pack", broken)
    assert cli.main(["pack", "x.csv"]) == cli.BUG
    err = capsys.readouterr().err.strip()
    assert "internal error" in err and "ZeroDivisionError: a slip" in err and "--debug" in err
    assert len(err.splitlines()) == 1
    for argv in (["--debug", "pack", "x.csv"], ["pack", "x.csv", "--debug"]):
        with pytest.raises(ZeroDivisionError):
            cli.main(argv)


def test_simulate_compares_schedules_by_throughput_with_concurrent_kernels(capsys):
    """Issue 27: --input-size, the sequential and turns schedules, several
    schedules at one batch with each one's throughput and busy share, and
    kernels of different jobs at once where they fit."""
    argv = ["simulate", "resnet18", "resnet18", "--input-size", "32", "--batch-size", "32",
            "--steps", "3", "--schedule", "sequential", "--schedule", "turns", "--schedule",
            "lockstep", "--schedule", "waterwave", "--json"]
    assert cli.main([*argv, "--concurrent-kernels"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["concurrent_kernels"] and out["jobs"] == ["resnet18-32px-bs32"] * 2
    figures = out["by_schedule"]
    assert list(figures) == ["sequential", "turns", "lockstep", "waterwave"]
    # The pipeline's order, chosen by throughput; the others' order is their own.
    assert figures["waterwave"]["order"] in ("bfs", "program") and figures["lockstep"]["order"] is None
    for v in figures.values():
        assert v["ok"] and v["throughput"] > 0 and 0 < v["gpu_busy"] <= 1
    # One after another runs at one job's rate; side by side does better.
    assert figures["lockstep"]["throughput"] > figures["sequential"]["throughput"]
    assert cli.main(["simulate", "bert-base", "--input-size", "32"]) == 2
    assert "input size applies to torchvision" in capsys.readouterr().err
