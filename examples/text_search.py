"""An Optuna search of text classifiers whose trials share one device.

Each trial is an ordinary eager training loop over a Hugging Face-style
model: batches are dicts (``input_ids``, ``attention_mask``, ``labels``),
padded to each batch's longest sentence by the loader's ``collate_fn`` and
shuffled, so every batch has a shape of its own; the model returns an object
carrying ``.loss``. The architecture is a trial's choice: an LSTM over
``pack_padded_sequence``, or a small BERT from Hugging Face transformers.
``with ww.sharing(model):`` around each epoch's loop makes the trial a member
of its device's training session: the loop stays the user's own, and its
memory flows with the other trials' under the session's ``memory_limit``.

    python examples/text_search.py                         # 24 trials, 4 at a time
    python examples/text_search.py --memory-limit 96       # MiB for all trials at once

At the end it prints what each trial needed alone at most, what four of
the largest would need side by side, and the most the session's members
held at once, as the allocator counted them.

Needs: pip install 'waterwave[planner,optuna]' (torch, transformers, Optuna).
"""
import argparse
import time
from types import SimpleNamespace

import optuna
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

import waterwave as ww

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cuda":
    ww.install_allocator()  # one cache for every trial: memory flows between them
VOCAB, CLASSES, LONGEST = 200, 3, 64
MiB = 1 << 20


def corpus(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Sentences of 4 to 64 tokens; the label is which of three keyword sets
    appears most (ties to the first)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, LONGEST + 1, (1,), generator=g))
        tokens = torch.randint(1, VOCAB, (length,), generator=g)
        counts = [int(((tokens % CLASSES == c) & (tokens < 90)).sum()) for c in range(CLASSES)]
        out.append((tokens.tolist(), counts.index(max(counts))))
    return out


def pad(batch: list[tuple[list[int], int]]) -> dict:
    """A batch padded to its longest sentence (dynamic padding)."""
    width = max(len(tokens) for tokens, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for i, (tokens, _) in enumerate(batch):
        ids[i, :len(tokens)] = torch.tensor(tokens)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "labels": torch.tensor([label for _, label in batch])}


HELD_OUT = corpus(160, 1)


class LSTMClassifier(nn.Module):
    """Hugging Face-style: keyword inputs, an output with ``.loss``."""

    def __init__(self, dim: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, input_ids, attention_mask, labels=None):
        lengths = attention_mask.sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(input_ids), lengths,
                                                   batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        logits = self.head(h[-1])
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


def build(trial: optuna.Trial) -> nn.Module:
    dim = trial.suggest_categorical("dim", [32, 64])
    if trial.suggest_categorical("arch", ["lstm", "transformer"]) == "lstm":
        return LSTMClassifier(dim)
    config = BertConfig(vocab_size=VOCAB, hidden_size=dim, num_attention_heads=2,
                        num_hidden_layers=trial.suggest_int("layers", 1, 2),
                        intermediate_size=2 * dim, max_position_embeddings=LONGEST,
                        num_labels=CLASSES)
    return BertForSequenceClassification(config)


def to_device(batch: dict) -> dict:
    return {k: v.to(DEVICE, non_blocking=True) for k, v in batch.items()}


def evaluate(model: nn.Module) -> float:
    model.eval()
    right = 0
    with torch.no_grad():
        for batch in DataLoader(HELD_OUT, batch_size=64, collate_fn=pad):
            batch = to_device(batch)
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
            right += int((logits.argmax(1) == batch["labels"]).sum())
    return right / len(HELD_OUT)


def objective(trial: optuna.Trial, train: list, epochs: int) -> float:
    model = build(trial).to(DEVICE)
    loader = DataLoader(train, batch_size=trial.suggest_categorical("batch", [16, 32]),
                        shuffle=True, collate_fn=pad)
    opt = torch.optim.AdamW(model.parameters(),
                            lr=trial.suggest_float("lr", 1e-4, 1e-2, log=True))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"],
                                                total_steps=epochs * len(loader))
    accuracy = 0.0
    for epoch in range(epochs):
        model.train()
        with ww.sharing(model) as member:  # this trial's memory flows with the others'
            for batch in loader:           # the loop is the user's own
                opt.zero_grad()
                model(**to_device(batch)).loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
        trial.set_user_attr("peak_bytes", member.stats()["peak_bytes"])
        accuracy = evaluate(model)
        trial.report(accuracy, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=4, help="trials at once (n_jobs)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=480, help="to train on")
    parser.add_argument("--memory-limit", type=float, default=40,
                        help="MiB the trials may hold together (default: 40)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    limit = int(args.memory_limit * MiB)
    session = ww.training_session(DEVICE, memory_limit=limit)
    if DEVICE == "cpu":  # k trials' threads share the cores (see the guide)
        torch.set_num_threads(max(1, torch.get_num_threads() // args.jobs))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=args.seed),
                                pruner=optuna.pruners.MedianPruner(n_warmup_steps=1))
    start = time.perf_counter()
    train = corpus(args.sentences, 0)
    study.optimize(lambda t: objective(t, train, args.epochs), n_trials=args.trials,
                   n_jobs=args.jobs)
    took = time.perf_counter() - start
    trials = study.get_trials(deepcopy=False)
    states = {s.name: sum(t.state == s for t in trials) for s in optuna.trial.TrialState}
    peaks = sorted((t.user_attrs.get("peak_bytes", 0) for t in trials), reverse=True)
    stats = session.stats()
    print(f"{len(trials)} trials in {took:.1f} s on {DEVICE}, {args.jobs} at a time: "
          + ", ".join(f"{n} {name.lower()}" for name, n in states.items() if n))
    print(f"best: {study.best_value:.3f} held-out accuracy with {study.best_params}")
    print(f"each trial alone needed at most {peaks[0] / MiB:.1f} MiB; the {args.jobs} largest "
          f"side by side {sum(peaks[:args.jobs]) / MiB:.1f} MiB")
    print(f"memory_limit {limit / MiB:.1f} MiB; the trials held at most "
          f"{stats['peak_bytes'] / MiB:.1f} MiB at once (counted by Waterwave's allocator); "
          f"gate waits {stats['waits']['gate_waits']}, allocation waits "
          f"{stats['waits']['allocation_waits']}, out of memory {stats['waits']['failed']}")


if __name__ == "__main__":
    main()
