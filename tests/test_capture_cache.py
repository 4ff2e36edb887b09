"""The capture cache (waterwave/sim/capture_cache.py): a library model's
step captured once is read back by the next run, equal to a fresh capture;
a corrupt entry is captured again; a model without a cache key, or a cache
turned off, keeps nothing."""
import logging
import os

import pytest

torch = pytest.importorskip("torch")

from waterwave.sim import capture_cache  # noqa: E402
from waterwave.sim.jobs import JobModel  # noqa: E402


class Builder:
    """A small MLP's (model, inputs, loss) at a batch, counting the builds
    (each build is a capture)."""

    def __init__(self):
        self.builds = 0

    def __call__(self, batch):
        self.builds += 1
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        return net, (torch.randn(batch, 16),), lambda out: out.square().mean()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WATERWAVE_CACHE_DIR", str(tmp_path))
    return tmp_path / "captures"


def test_a_second_run_reads_the_step_the_first_captured(cache):
    first, second = Builder(), Builder()
    fresh = JobModel("mlp", first, b0=8, cache_key="mlp@test").graph_at(24)
    assert first.builds == 2 and len(list(cache.glob("*.json"))) == 2
    again = JobModel("mlp", second, b0=8, cache_key="mlp@test").graph_at(24)
    assert second.builds == 0  # nothing captured: both batches read back
    assert again.to_dict() == fresh.to_dict()
    uncached = JobModel("mlp", Builder(), b0=8).graph_at(24)
    assert uncached.to_dict() == fresh.to_dict()


def test_a_corrupt_entry_is_captured_again_and_rewritten(cache, caplog):
    JobModel("mlp", Builder(), b0=8, cache_key="mlp@test").graph_at(8)
    for path in cache.glob("*.json"):
        path.write_text('{"format": "waterwave-graph", "version": 1, "tensors": [{')
    builder = Builder()
    with caplog.at_level(logging.WARNING, logger="waterwave"):
        g = JobModel("mlp", builder, b0=8, cache_key="mlp@test").graph_at(8)
    assert builder.builds == 2 and "cannot be read" in caplog.text
    again = JobModel("mlp", Builder(), b0=8, cache_key="mlp@test").graph_at(8)
    assert again.to_dict() == g.to_dict()
    assert not list(cache.glob(".partial-*"))


def test_no_key_or_a_cache_turned_off_keeps_nothing(cache, monkeypatch):
    JobModel("mlp", Builder(), b0=8).graph_at(8)
    assert not cache.exists()
    monkeypatch.setenv("WATERWAVE_CAPTURE_CACHE", "off")
    builder = Builder()
    JobModel("mlp", builder, b0=8, cache_key="mlp@test").graph_at(8)
    assert builder.builds == 2 and not cache.exists() and capture_cache.folder() is None


def test_a_cache_that_cannot_be_written_only_warns(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("WATERWAVE_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="waterwave"):
        g = JobModel("mlp", Builder(), b0=8, cache_key="mlp@test").graph_at(8)
    assert len(g.nodes) > 0 and "cannot keep the capture" in caplog.text


def test_the_folder_is_waterwaves_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("WATERWAVE_CACHE_DIR", raising=False)
    assert capture_cache.folder() == type(tmp_path).home() / ".cache" / "waterwave" / "captures"
    monkeypatch.setenv("WATERWAVE_CACHE_DIR", str(tmp_path))
    assert capture_cache.folder() == tmp_path / "captures"


def test_an_entry_names_its_model_batch_and_code():
    a = capture_cache.entry("resnet18@32px", 128)
    assert a.startswith("resnet18_32px-bs128-") and a.endswith(".json")
    assert len({a, capture_cache.entry("resnet18@32px", 256),
                capture_cache.entry("resnet18@224px", 128)}) == 3
    assert os.sep not in capture_cache.entry("../../etc/passwd", 1)
