"""A hyperparameter search whose trials train side by side on one device.

Each trial is an ordinary PyTorch training loop: it builds a model and an
optimizer from the trial's suggestions, trains an epoch at a time with
``job.train`` (which runs beside every other trial training at that moment),
steps its scheduler, evaluates in plain PyTorch, reports to Optuna and lets
the pruner stop it. ``study.optimize(objective, n_jobs=4)`` runs four trials
at once; on a GPU each trial's steps share its memory as a ``ww.sharing``
member, counted and gated under the session's budget.

The data is scikit-learn's handwritten digits (8x8 images, 10 classes).

    python examples/optuna_search.py                      # 16 trials, 4 at a time
    python examples/optuna_search.py --storage sqlite:///digits.db   # run it in
        several processes (one per GPU, on one machine or many) to share the study;
        --storage journal:digits.log shares it through Optuna's journal file (a
        shared file system, no database), a database URL across machines

Needs: pip install 'waterwave[optuna,demo]' (Optuna and scikit-learn).
"""
import argparse
import time

import optuna
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import waterwave as ww

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cuda":
    ww.install_allocator()  # one cache for every trial: memory flows between them


def digits(device: str) -> tuple[TensorDataset, TensorDataset]:
    """80% of the digits to train on, 20% held out, on ``device``."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32, device=device)
    y = torch.tensor(y, device=device)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).to(device)
    cut = int(0.8 * len(x))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


TRAIN, HELD_OUT = digits(DEVICE)
GRAPHS = {}  # trial number -> its captured step, kept with --simulate only
train_loader = DataLoader(TRAIN, batch_size=64, shuffle=True, drop_last=True)


def build(trial: optuna.Trial) -> torch.nn.Module:
    width = trial.suggest_categorical("width", [64, 128, 256])
    layers, features = [], 64
    for _ in range(trial.suggest_int("layers", 1, 3)):
        layers += [torch.nn.Linear(features, width), torch.nn.ReLU()]
        features = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(features, 10))


def evaluate(model: torch.nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def objective(trial: optuna.Trial, epochs: int = 10, keep_graph: bool = False) -> float:
    model = build(trial).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=trial.suggest_float("lr", 1e-3, 1, log=True),
                          momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    job = ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=train_loader,
                 clip_grad_norm=1.0)
    if keep_graph:  # reading it captures the step, which a CPU session without a budget skips
        GRAPHS[trial.number] = job.graph
    for epoch in range(epochs):
        model.train()
        job.train(steps=len(train_loader))  # runs beside every other job training now
        sched.step()
        acc = evaluate(model, HELD_OUT)  # plain PyTorch between train() calls
        trial.report(acc, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return acc


def open_storage(spec: str | None):
    """The Optuna storage ``--storage`` names: None keeps the study in memory;
    ``journal:PATH`` is Optuna's journal file (processes append to one file,
    over a shared file system where SQLite's locks fail, as on NFS); anything
    else is a database URL (``sqlite:///digits.db``, ``postgresql://...``)."""
    if spec is not None and spec.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = spec[len("journal:"):]
        if not path:
            raise SystemExit("--storage journal:PATH needs the journal file's path")
        return JournalStorage(JournalFileBackend(path))
    return spec


def main(argv=None) -> optuna.Study:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=4, help="trials side by side (Optuna's n_jobs)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--storage", help="an Optuna storage shared by several processes: "
                                      "sqlite:///file.db, journal:FILE (Optuna's journal file) "
                                      "or a database URL; default: in memory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", metavar="GPU", nargs="?", const="H100-80GB",
                    help="then show what the largest trials, --jobs of them side by side, would "
                         "use on a simulated GPU (default H100-80GB) with and without the pipeline")
    args = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.manual_seed(args.seed)
    study = optuna.create_study(
        study_name="digits", storage=open_storage(args.storage), load_if_exists=True,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=args.seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=2))

    def report(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        acc = trial.value if trial.value is not None else max(trial.intermediate_values.values(),
                                                                default=float("nan"))
        what = {"COMPLETE": "finished", "PRUNED": f"pruned after {len(trial.intermediate_values)} "
                "epochs"}.get(trial.state.name, trial.state.name.lower())
        print(f"trial {trial.number:>3}  {what:<24} held-out accuracy {acc:6.2%}  {trial.params}",
              flush=True)

    start = time.monotonic()
    study.optimize(lambda t: objective(t, args.epochs, bool(args.simulate)),
                   n_trials=args.trials, n_jobs=args.jobs,
                   callbacks=[report])
    session = ww.training_session(DEVICE).stats()
    print(f"\nbest held-out accuracy {study.best_value:.2%} with {study.best_params}")
    print(f"{len(study.trials)} trials in {time.monotonic() - start:.1f} s on {DEVICE}, "
          f"at most {session['most_training']} training at once, "
          f"{session['steps_run']:,} steps through Waterwave")
    if args.simulate:
        from waterwave.tools.demo import format_trials, trials_on_gpu

        largest = sorted(GRAPHS.values(), key=lambda g: -sum(t.size for t in g.tensors))
        print()
        print(format_trials(trials_on_gpu(largest[:args.jobs], args.simulate)))
    return study


if __name__ == "__main__":
    main()
