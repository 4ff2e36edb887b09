"""An ordinary Optuna study over Job.train (issue 24, item 4): trials side
by side through ``study.optimize(n_jobs=4)`` with a pruner, each trial
trained exactly as eager PyTorch trains it; a failing trial that leaves
the others training; two worker processes sharing one study, over
SQLite and over Optuna's journal file."""
import json
import re
import subprocess
import sys
import textwrap
import threading

import pytest

torch = pytest.importorskip("torch")
optuna = pytest.importorskip("optuna")

import torch.nn.functional as F  # noqa: E402

import waterwave as ww  # noqa: E402
from conftest import PLANNING_LIMIT  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")

optuna.logging.set_verbosity(optuna.logging.WARNING)


def dataset(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


TRAIN, VAL = dataset(96, 0), dataset(48, 1)


def build(width, seed):
    """The trial's model, initialised from its own generator: trials build
    models on several threads at once, and torch's global one is shared."""
    model = torch.nn.Sequential(torch.nn.Linear(10, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def loader(seed):
    return torch.utils.data.DataLoader(TRAIN, batch_size=16, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


def evaluate(model):
    x, y = VAL.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def make_objective(session, epochs=3, start_together=None, fail_trial=None):
    def objective(trial):
        lr = trial.suggest_float("lr", 1e-2, 0.5, log=True)
        width = trial.suggest_categorical("width", [16, 32])
        model = build(width, trial.number)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        data = loader(trial.number)
        if trial.number == fail_trial:
            data = [(torch.randn(16, 10), torch.randint(0, 3, (16,))),
                    (torch.randn(16, 7), torch.randint(0, 3, (16,)))]  # a batch of the wrong width
        job = ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=data)
        if start_together is not None and trial.number < start_together.parties:
            start_together.wait()
        losses = []
        for epoch in range(epochs):
            model.train()
            losses += job.train(steps=len(data), session=session)
            sched.step()
            acc = evaluate(model)
            trial.report(acc, epoch)
            trial.set_user_attr("losses", losses)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return acc
    return objective


def eager_losses(params, number, epochs):
    """The same trial in a plain eager loop."""
    model = build(params["width"], number)
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data, losses = loader(number), []
    for _ in range(epochs):
        model.train()
        for x, y in data:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        sched.step()
    return losses, evaluate(model)


def test_study_with_four_jobs_and_a_pruner_trains_each_trial_as_eager():
    session = ww.TrainingSession("cpu", memory_limit=1 << 20)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    study.optimize(make_objective(session, start_together=threading.Barrier(4, timeout=60)),
                   n_trials=10, n_jobs=4)
    states = [t.state for t in study.trials]
    assert len(states) == 10 and set(states) <= {optuna.trial.TrialState.COMPLETE,
                                                  optuna.trial.TrialState.PRUNED}
    assert states.count(optuna.trial.TrialState.COMPLETE) >= 2
    assert session.most_training >= 2  # trials really trained side by side
    assert session.training == []
    for t in study.trials:
        epochs = 3 if t.state == optuna.trial.TrialState.COMPLETE else len(t.intermediate_values)
        losses, acc = eager_losses(t.params, t.number, epochs)
        torch.testing.assert_close(t.user_attrs["losses"], losses, rtol=1e-5, atol=1e-6)
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert t.value == pytest.approx(acc, abs=1e-6)


def test_a_failing_trial_fails_alone_and_the_study_goes_on():
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=2))
    # The batch of the wrong width runs eagerly (no capture can train it) and
    # fails as the eager loop fails: PyTorch's RuntimeError, caught by Optuna.
    study.optimize(make_objective(session, epochs=2, fail_trial=1), n_trials=5, n_jobs=3,
                   catch=(RuntimeError,))
    states = {t.number: t.state for t in study.trials}
    assert states[1] == optuna.trial.TrialState.FAIL
    assert all(s == optuna.trial.TrialState.COMPLETE for n, s in states.items() if n != 1)
    assert session.training == []


WORKER = textwrap.dedent("""
    import sys, optuna, torch
    sys.path.insert(0, {tests!r})
    import waterwave as ww
    from test_optuna import make_objective
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="shared", storage={storage})
    study.optimize(make_objective(ww.training_session("cpu"), epochs=2), n_trials=3, n_jobs=2)
""")


def journal(path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(path)))


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_worker_processes_share_one_study(tmp_path, kind):
    """Over one SQLite file, and over one Optuna journal file (a shared file
    system without a database)."""
    url, log = f"sqlite:///{tmp_path / 'study.db'}", str(tmp_path / "study.log")

    def storage():
        return url if kind == "sqlite" else journal(log)
    in_worker = repr(url) if kind == "sqlite" else (
        f"optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend({log!r}))")
    optuna.create_study(study_name="shared", storage=storage(), direction="maximize")
    script = WORKER.format(tests=str(__import__("pathlib").Path(__file__).parent),
                           storage=in_worker)
    workers = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for w in workers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name="shared", storage=storage())
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = [t for t in study.trials if t.state in finished]  # the default pruner may prune
    assert len(done) == 6, [(t.number, t.state) for t in study.trials]
    assert len({t.number for t in done}) == 6
    assert json.dumps(study.best_params)  # a best trial, readable by any worker


def test_the_example_search_runs_and_reports_its_trials_and_the_simulated_gpu(tmp_path):
    """examples/optuna_search.py, as make demo runs it but shorter, its study
    kept in an Optuna journal file."""
    root = __import__("pathlib").Path(__file__).parent.parent
    log = tmp_path / "digits.log"
    r = subprocess.run([sys.executable, str(root / "examples" / "optuna_search.py"), "--trials", "4",
                        "--jobs", "2", "--epochs", "2", "--simulate", "--storage", f"journal:{log}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(optuna.load_study(study_name="digits", storage=journal(log)).trials) == 4
    assert r.stdout.count("held-out accuracy") == 5  # four trials and the best
    assert "at most 2 training at once" in r.stdout or "at most 1 training at once" in r.stdout
    assert "2 of these trials on a simulated H100-80GB" in r.stdout
    assert "each trial its own eager loop, sharing (job.train's default):" in r.stdout
    assert "a session choosing its way (capture=True):" in r.stdout
    assert "(all simulated, not measured on a GPU;" in r.stdout


def test_trials_on_a_simulated_gpu_train_in_a_session_where_side_by_side_runs_out():
    from waterwave.tools.demo import trials_on_gpu

    graphs = []
    for k, width in enumerate((256, 128)):
        model = build(width, k)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        graphs.append(ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt,
                             data=[TRAIN.tensors]).graph)
    r = trials_on_gpu(graphs)
    assert r["simulated"] and r["memory_limit"] < r["lockstep"]["peak_reserved"]
    assert not r["lockstep_under_the_limit"]["ok"]
    session, one_by_one = r["session"], r["sequential"]
    assert session["ok"] and session["hazards"] == 0 and session["peak_reserved"] <= r["memory_limit"]
    assert session["ran"] in ("free", "turns", "sequential", "memory")
    if one_by_one["ok"]:  # the session is the best way that fits, one after another among them
        assert session["throughput"] >= 0.97 * one_by_one["throughput"]
    members = r["sharing"]  # job.train's default: runs, sound, under the cap
    assert members["ok"] and members["hazards"] == 0
    assert members["peak_reserved"] <= r["memory_limit"]
    assert 0 < r["blas_workspaces"] < r["lockstep"]["peak_reserved"]
    with pytest.raises(ValueError, match="needs the graphs"):
        trials_on_gpu([])


def test_a_text_search_with_dynamic_padding_shares_memory_under_a_limit():
    """examples/text_search.py (issue 39's measure of done): 24 trials of
    LSTM and BERT text classifiers, batches dynamically padded and shuffled,
    their loops under ``with ww.sharing(model):``, four at a time on the CPU
    under a memory_limit below what four of the trials need side by side:
    every trial ends (complete or pruned) and the counted peak stays under
    the limit."""
    root = __import__("pathlib").Path(__file__).parent.parent
    r = subprocess.run([sys.executable, str(root / "examples" / "text_search.py"), "--trials", "24",
                        "--jobs", "4", "--epochs", "2", "--sentences", "160",
                        "--memory-limit", "40"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    first = r.stdout.splitlines()[0]
    done = re.match(r"24 trials in [\d.]+ s on cpu, 4 at a time: (\d+) complete(?:, (\d+) pruned)?$",
                    first)
    assert done, r.stdout  # no trial failed
    side_by_side = float(re.search(r"the 4 largest side by side ([\d.]+) MiB", r.stdout)[1])
    peak = float(re.search(r"held at most ([\d.]+) MiB at once", r.stdout)[1])
    assert side_by_side > 40 >= peak, r.stdout
    assert "out of memory 0" in r.stdout
