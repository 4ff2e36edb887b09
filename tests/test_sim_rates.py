"""``waterwave.sim.rates.added_steps_rate``: the rate over steps added to
every job, checked against runs whose times are known, and its refusals."""
import pytest

pytest.importorskip("torch")

from waterwave.sim.multijob import SimResult  # noqa: E402
from waterwave.sim.rates import added_steps_rate  # noqa: E402


def result(steps: int, elapsed_us: float, ok: bool = True, jobs=("a", "b")) -> SimResult:
    return SimResult(ok, "waterwave", "turns", "H100-80GB", None, list(jobs), [64, None], steps,
                     elapsed_us=elapsed_us if ok else None)


def test_the_samples_of_the_added_steps_over_the_time_they_add():
    # Two jobs, batches 64 and (unknown) 1: 8 more steps each in 2 ms.
    assert added_steps_rate(result(4, 10_000.0), result(12, 12_000.0)) == pytest.approx(
        65 * 8 / 0.002)


def test_a_run_out_of_memory_has_no_rate():
    assert added_steps_rate(result(4, 10_000.0), result(12, 0.0, ok=False)) is None
    assert added_steps_rate(result(4, 0.0, ok=False), result(12, 12_000.0)) is None


def test_runs_of_other_jobs_or_not_longer_are_refused():
    with pytest.raises(ValueError, match="the same jobs, the second longer"):
        added_steps_rate(result(12, 12_000.0), result(4, 10_000.0))
    with pytest.raises(ValueError, match="the same jobs"):
        added_steps_rate(result(4, 10_000.0), result(12, 12_000.0, jobs=("a", "c")))
