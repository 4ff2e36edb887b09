"""Sharing members beside captured jobs and one another: a ``Job`` and eager
members in one session under one budget, a job's batches it has not
captured run as a member, and random mixes of members under random budgets
(hypothesis): the counted peak never passes the budget, every run ends,
every member that does not fail equals its eager loop."""
import copy
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_sharing import (  # noqa: E402,F401  (session and the collection: fixtures)
    _collect_other_files_trials,
    assert_same_training,
    mlp,
    mlp_batches,
    mlp_loop,
    session,
    wide_member,
)

import waterwave as ww  # noqa: E402


def test_a_captured_job_and_sharing_members_train_in_one_session(session):
    # A Job (planned, job.train) and eager members share one budget: the job
    # keeps room for its step, the members share the rest; both exact.
    torch.manual_seed(0)
    net = mlp(7)
    x, y = torch.randn(32, 32), torch.randint(0, 4, (32,))
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref_losses = []
    for _ in range(6):
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    session.configure(memory_limit=64 << 20, capture=True)
    job = ww.Job(net, (x,), F.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.05),
                 targets=(y,))
    model, data = wide_member(1, batch=128)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-3)
    eager_losses = mlp_loop(eager_model, eager_opt, data)
    out = {}

    def member():
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with ww.sharing(model):
            out["member"] = (model, opt, mlp_loop(model, opt, data))

    t = threading.Thread(target=member)
    t.start()
    out["job"] = job.train(6)
    t.join(60)
    assert out["job"] == ref_losses
    assert_same_training(eager_model, eager_opt, eager_losses, *out["member"])
    assert session.stats()["most_training"] >= 2


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(16, 256),      # batch
                          st.booleans(),             # shapes change every batch
                          st.integers(1, 3),         # blocks (epochs), joining and leaving
                          st.integers(0, 6)),        # the step it fails at (0: never)
                min_size=1, max_size=4),
       st.floats(0.6, 1.5))
def test_random_members_under_random_budgets(session, specs, tightness):
    # Any mix: the counted peak never passes the budget, every run ends in
    # time, every member that does not fail equals its eager loop.
    runs = []
    for k, (batch, vary, blocks, fail_at) in enumerate(specs):
        torch.manual_seed(k)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
        runs.append((model, mlp_batches(k, n=4, batch=batch, vary=vary), blocks, fail_at))
    eager = []
    for model, data, blocks, fail_at in runs:
        m = copy.deepcopy(model)
        o = torch.optim.Adam(m.parameters(), lr=1e-3)
        eager.append((m, o, [loss for _ in range(blocks) for loss in mlp_loop(m, o, data)]))
    # The session is configured afresh for each example (the fixture's
    # settings are only its start). Room for each member's parameters and
    # state, and some of its passes.
    params = sum(4 * sum(p.numel() for p in m.parameters()) for m, *_ in runs) * 4
    biggest_pass = max(b for b, *_ in specs) * (128 + 32 + 4) * 4 * 8
    limit = int(params + tightness * biggest_pass * len(specs) / 2)
    session.configure(memory_limit=limit)
    session.reset_peak()
    baseline = session.stats()["members_bytes"]
    out = [None] * len(runs)

    def member(k):
        model, data, blocks, fail_at = runs[k]
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        try:
            for _ in range(blocks):
                with ww.sharing(model):
                    losses += mlp_loop(model, opt, data)
                    if fail_at and fail_at <= len(losses):
                        raise ValueError("the trial's own error")
                time.sleep(0.001 * k)  # evaluate, report: the others go on
            out[k] = ("done", model, opt, losses)
        except ValueError as e:
            out[k] = ("failed", e)
        except torch.OutOfMemoryError as e:
            out[k] = ("oom", e)

    threads = [threading.Thread(target=member, args=(k,)) for k in range(len(runs))]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, 90 - (time.monotonic() - start)))
    assert not any(t.is_alive() for t in threads), "a member hung"
    assert session.stats()["peak_bytes"] - baseline <= limit
    for (model, data, blocks, fail_at), e, o in zip(runs, eager, out):
        if o[0] == "done":
            assert_same_training(*e, *o[1:])
        elif o[0] == "oom":
            assert "memory_limit" in str(o[1])


def test_a_job_meeting_batches_it_has_not_captured_runs_them_eagerly_as_a_member(session):
    # Issue 39, item 4: dynamic padding (batches longer than the captured
    # one) used to stop a Job partway; those steps now run eagerly, as
    # sharing members of the session, with the Job's settings, and the
    # whole run is the eager loop's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    sizes = [8, 8, 12, 12, 8, 8, 16, 16, 6, 6, 8, 8]  # in pairs: accumulated steps
    data = [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
            for n in sizes]
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    expected = []
    for i in range(0, len(data), 2):
        ref_opt.zero_grad()
        losses = []
        for x, y in data[i:i + 2]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(reference(x), y)
            (loss / 2).backward()
            losses.append(loss.detach())
        nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        expected.append(((losses[0] + losses[1]) / 2).item())
    session.configure(memory_limit=64 << 20, capture=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    job = ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=data,
                 accumulate_grad_batches=2, clip_grad_norm=0.5, autocast_dtype=torch.bfloat16)
    got = job.train(6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert b.grad is None
    assert job.stats()["eager_steps"] == 2  # the pairs of 12 and of 16
    assert session.stats()["peak_bytes"] > 0
