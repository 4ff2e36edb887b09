"""Proof of exactness (issue 24, item 5): for random combinations of
optimizer, hyperparameters (changed between steps too, as a scheduler
would), gradient clipping, mixed precision, data (a short last batch too), a
per-step warm-up scheduler
and schedule, every job trained beside
others (1, 2 or 4 at once) ends with the losses, parameters and optimizer
state of plain eager PyTorch training it alone on the same batches in the
same order."""
import pytest
from conftest import assert_same_optimizer_state
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.pipeline import SCHEDULES  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda ps, h: torch.optim.SGD(ps, lr=h["lr"], momentum=h["momentum"],
                                         weight_decay=h["wd"], nesterov=h["nesterov"],
                                         maximize=h["maximize"]),
    "adam": lambda ps, h: torch.optim.Adam(ps, lr=h["lr"] / 10, weight_decay=h["wd"],
                                           amsgrad=h["amsgrad"], maximize=h["maximize"]),
    "adamw": lambda ps, h: torch.optim.AdamW(ps, lr=h["lr"] / 10, weight_decay=h["wd"],
                                             amsgrad=h["amsgrad"], maximize=h["maximize"]),
    "rmsprop": lambda ps, h: torch.optim.RMSprop(ps, lr=h["lr"] / 10, momentum=h["momentum"],
                                                 weight_decay=h["wd"], maximize=h["maximize"]),
    "adagrad": lambda ps, h: torch.optim.Adagrad(ps, lr=h["lr"], weight_decay=h["wd"],
                                                 lr_decay=h["momentum"] / 10,
                                                 maximize=h["maximize"]),
    "adamax": lambda ps, h: torch.optim.Adamax(ps, lr=h["lr"] / 10, weight_decay=h["wd"],
                                               maximize=h["maximize"]),
    "nadam": lambda ps, h: torch.optim.NAdam(ps, lr=h["lr"] / 10, weight_decay=h["wd"],
                                             decoupled_weight_decay=h["momentum"] > 0,
                                             maximize=h["maximize"]),
    "radam": lambda ps, h: torch.optim.RAdam(ps, lr=h["lr"] / 10, weight_decay=h["wd"],
                                             decoupled_weight_decay=h["momentum"] > 0,
                                             maximize=h["maximize"]),
}
loss_fn = torch.nn.functional.cross_entropy


@st.composite
def job_specs(draw):
    momentum = draw(st.sampled_from([0.0, 0.9]))
    return {
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "hyper": {"lr": draw(st.sampled_from([0.01, 0.1])), "momentum": momentum,
                  "wd": draw(st.sampled_from([0.0, 1e-3])),
                  "nesterov": momentum > 0 and draw(st.booleans()),
                  "amsgrad": draw(st.booleans()), "maximize": draw(st.booleans())},
        "clip": draw(st.sampled_from([{}, {"clip_grad_norm": 0.1}, {"clip_grad_value": 0.02},
                                      {"clip_grad_norm": 0.1, "clip_grad_norm_type": float("inf")},
                                      {"clip_grad_norm": 0.1, "clip_grad_norm_type": 1.0}])),
        "width": draw(st.sampled_from([8, 24])),
        "batches": draw(st.integers(1, 3)),
        "batch_size": draw(st.sampled_from([4, 6])),
        "lr_scale": draw(st.sampled_from([1.0, 0.5, 3.0])),  # applied at the change
        "short_last": draw(st.booleans()),  # a last batch of fewer samples, as a DataLoader's
        "autocast": draw(st.sampled_from([None, "bfloat16"])),  # mixed precision
        "warmup": draw(st.booleans()),  # a per-step scheduler (Job's step_schedulers)
        "fine_tune": draw(st.booleans()),  # first layer frozen, then thawed (test_session)
    }


def model_and_data(k, spec):
    torch.manual_seed(100 + k)
    model = torch.nn.Sequential(torch.nn.Linear(12, spec["width"]), torch.nn.Tanh(),
                                torch.nn.Linear(spec["width"], 3))
    g = torch.Generator().manual_seed(200 + k)
    sizes = [spec["batch_size"]] * spec["batches"]
    if spec.get("short_last"):
        sizes.append(spec["batch_size"] - 3)
    data = [(torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g))
            for n in sizes]
    return model, data


def precision(spec):
    """The eager loop's autocast block, if the spec trains in mixed precision."""
    import contextlib

    if spec.get("autocast") is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, spec["autocast"]))


def job_settings(spec) -> dict:
    """The Job's settings for a spec: clipping, and mixed precision."""
    dtype = spec.get("autocast")
    return {**spec["clip"], "autocast_dtype": None if dtype is None else getattr(torch, dtype)}


def warmups(opt, spec) -> list:
    """The spec's per-step schedulers of ``opt``: a linear warm-up, or none."""
    if not spec.get("warmup"):
        return []
    return [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)]


def change_lr(opt, spec):
    for group in opt.param_groups:
        group["lr"] *= spec["lr_scale"]


def eager_step(model, opt, spec, x, y) -> float:
    """One eager training step as the spec trains: autocast, clipping."""
    opt.zero_grad()
    with precision(spec):
        loss = loss_fn(model(x), y)
    loss.backward()
    if "clip_grad_value" in spec["clip"]:
        torch.nn.utils.clip_grad_value_(model.parameters(), spec["clip"]["clip_grad_value"])
    if "clip_grad_norm" in spec["clip"]:
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"]["clip_grad_norm"],
                                       norm_type=spec["clip"].get("clip_grad_norm_type", 2.0))
    opt.step()
    return loss.item()


def eager(model, spec, data, steps, change_at):
    opt = OPTIMIZERS[spec["optimizer"]](model.parameters(), spec["hyper"])
    schedulers = warmups(opt, spec)
    losses = []
    for i in range(steps):
        if i == change_at:
            change_lr(opt, spec)
        losses.append(eager_step(model, opt, spec, *data[i % len(data)]))
        for s in schedulers:
            s.step()
    return losses, opt


def assert_trains_as_eager(job, losses, eager_opt, got_losses) -> None:
    """The job's losses, parameters and optimizer state are eager's."""
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=1e-6)
    ours = job.optimizer
    for a, b in zip([p for g in eager_opt.param_groups for p in g["params"]],
                    [p for g in ours.param_groups for p in g["params"]]):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)
    assert_same_optimizer_state(eager_opt, ours)


@settings(max_examples=12)
@given(specs=st.lists(job_specs(), min_size=1, max_size=4).filter(lambda s: len(s) in (1, 2, 4)),
       schedule=st.sampled_from(sorted(SCHEDULES)), steps=st.integers(1, 4), data=st.data())
def test_jobs_together_train_exactly_as_each_alone(specs, schedule, steps, data):
    change_at = data.draw(st.integers(1, steps), label="learning rates change before step")
    expected, jobs = [], []
    for k, spec in enumerate(specs):
        model, batches = model_and_data(k, spec)
        expected.append(eager(model_and_data(k, spec)[0], spec, batches, steps, change_at))
        opt = OPTIMIZERS[spec["optimizer"]](model.parameters(), spec["hyper"])
        jobs.append(ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=batches,
                           step_schedulers=warmups(opt, spec), **job_settings(spec)))
    trainer = ww.ConcurrentTrainer(jobs, schedule=schedule)
    trainer.run(change_at)
    if change_at < steps:
        for job, spec in zip(jobs, specs):
            change_lr(job.optimizer, spec)
        trainer.run(steps - change_at)
    for job, (losses, eager_opt), spec in zip(jobs, expected, specs):
        assert job.error is None, (spec, job.error)
        assert_trains_as_eager(job, losses, eager_opt, job.losses)
