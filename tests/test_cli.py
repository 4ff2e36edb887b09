"""The command line: benchmarks and the demo."""
import json
import subprocess
import sys

import pytest

from waterwave import cli, _C


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
    assert cli.main(["demo", "--out", str(tmp_path), "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "peak reserved" in out and "simulated" in out
    data = json.loads((tmp_path / "demo.json").read_text())
    assert (tmp_path / "demo_memory.png").stat().st_size > 10_000
    w, p = data["waterwave"], data["pytorch"]
    assert w["hazards"] == 0 and p["hazards"] == 0
    # Memory flows between the jobs only under the waterwave policy.
    assert w["served"]["cross_stream_wait"] + w["served"]["promoted"] > 0
    assert w["peak_reserved_bytes"] < p["peak_reserved_bytes"]
    assert w["smallest_capacity_bytes"] <= p["smallest_capacity_bytes"]


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "waterwave.cli", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "bench" in r.stdout and "demo" in r.stdout
