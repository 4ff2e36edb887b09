"""bench/rounding_spread.py, quick, on the CPU: it runs the float16 Adam
recipe eagerly and through job.train, reports both, and on the CPU
job.train is bit-identical to the eager loop (so its column is all 0),
over steps the scaler skipped and steps it took."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchvision")
ROOT = Path(__file__).resolve().parent.parent


def test_the_quick_run_reports_job_train_bit_identical_on_the_cpu(tmp_path):
    out = tmp_path / "spread.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "rounding_spread.py"), "--device",
                        "cpu", "--quick", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert list(runs) == ["eager", "eager, foreach=True", "job.train"]
    eager, ours = runs["eager"], runs["job.train"]
    assert len(eager["losses"]) == 4 and all(v > 0 for v in eager["losses"])
    scales = eager["scales"]
    assert any(b < a for a, b in zip(scales, scales[1:])), "no step was skipped"
    assert eager["step_counts"], "no step was taken"
    assert ours["losses"] == eager["losses"] and ours["scales"] == eager["scales"]
    assert ours["step_counts"] == eager["step_counts"]
    assert ours["largest_parameter_difference"] == 0.0
    text = out.with_suffix(".md").read_text()
    assert "the CPU" in text and "| job.train | yes |" in text
