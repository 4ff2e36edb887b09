"""A job's batches, drawn from its data as an eager training loop draws them:
any re-iterable of ``(inputs..., targets...)`` or of dicts (a ``DataLoader``,
a list), iterated again for each epoch; each batch moved to the model's
device as ``x.to(device)`` would. A dict batch's items go to the model by
name (``model(**batch)``, as Hugging Face models take theirs), except
those the job names as targets, which go to its loss.

Drawing a batch can draw random numbers: a shuffling ``DataLoader`` draws
its epoch's order from torch's generator when it is iterated. A Job looks
at its first batch when it is made, to capture its step, and so draws the
first epoch's order then, where an eager loop draws it as the loop starts;
with nothing drawn in between, the two draw alike. (Putting the global
generator back after the look was tried: with trials on several threads,
that rewinds what the others drew meanwhile.) Steps undone (a trainer's
probe of side by side whose step ran out of memory, or a sharing job's step
that ran out before its update: ``rollback.py``) give their batches back,
to be trained on next.

May import: waterwave.capturing; torch lazily.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..capturing.keywords import Keywords, input_names


def split(batch: Any, n_inputs: int, target_keys: Sequence[str] = ()) -> tuple[tuple, tuple]:
    """(inputs, targets) of one batch: a tensor is one input; a tuple or list
    holds ``n_inputs`` inputs, then the targets; a dict's items are keyword
    inputs (``Keywords``), but for ``target_keys``, the targets in that order."""
    import torch

    # Tuples first: the common case, and the Mapping check (an ABC) costs more.
    if isinstance(batch, (tuple, list)) and not target_keys:
        if len(batch) < n_inputs:
            raise ValueError(f"a batch of {len(batch)} items cannot hold the step's {n_inputs} "
                             "inputs: yield (inputs..., targets...)")
        return tuple(batch[:n_inputs]), tuple(batch[n_inputs:])
    if isinstance(batch, Mapping):
        missing = [k for k in target_keys if k not in batch]
        if missing:
            raise ValueError(f"a dict batch has no {', '.join(map(repr, missing))} (the job's "
                             f"target_keys); its keys: {', '.join(map(repr, batch))}")
        inputs = {k: v for k, v in batch.items() if k not in target_keys}
        return Keywords.of(inputs), tuple(batch[k] for k in target_keys)
    if target_keys:
        raise ValueError(f"target_keys name items of dict batches, and this batch is a "
                         f"{type(batch).__name__}: yield dicts, or leave target_keys out")
    if isinstance(batch, torch.Tensor):
        return (batch,), ()
    raise ValueError(f"a batch must be a tensor, a tuple (inputs..., targets...) or a dict of "
                     f"keyword inputs, got a {type(batch).__name__}: map the data to one of them")


class BatchFeed:
    """The next batch of ``data``, epoch after epoch; ``per_step`` batches a
    step (gradient accumulation), their inputs joined, then their targets."""

    def __init__(self, data: Iterable, n_inputs: int = 1, device=None, per_step: int = 1,
                 target_keys: Sequence[str] = ()):
        if not isinstance(data, Iterable):
            raise ValueError(f"data must be an iterable of batches (a DataLoader, a list), got a "
                             f"{type(data).__name__}")
        if isinstance(target_keys, str) or not all(isinstance(k, str) for k in target_keys):
            raise ValueError(f"target_keys must be a list of a dict batch's keys, got "
                             f"{target_keys!r}")
        self.data, self.n_inputs, self.device, self.per_step = data, n_inputs, device, per_step
        self.target_keys = tuple(target_keys)
        self.epoch = 0  # epochs begun
        self._batches: Iterator | None = None
        # Steps' batches drawn and not yet trained on, in order: one looked
        # at (peek), and those a rolled-back step gives back (rewind).
        self._ahead: deque[tuple] = deque()
        self._recorded: list[tuple] | None = None  # steps handed out since record()
        self._last: tuple | None = None  # the step handed out last, for again()

    def peek(self) -> tuple[tuple, tuple]:
        """The next step's batches, without using them up (the job captures
        its step on them)."""
        if not self._ahead:
            self._ahead.append(self._draw_step())
        return self._ahead[0]

    def next(self) -> tuple[tuple, tuple]:
        """(inputs, targets) of the next step's batches, on the model's device."""
        step = self._ahead.popleft() if self._ahead else self._draw_step()
        self._last = step
        if self._recorded is not None:
            self._recorded.append(step)
        inputs, targets = step
        return self._to_device(inputs), self._to_device(targets)

    def record(self) -> None:
        """Keep the steps' batches handed out from here on (as drawn, before
        they were moved to the device), for ``rewind``."""
        self._recorded = []

    def rewind(self) -> None:
        """The steps handed out since ``record()`` come again, in order,
        before any other: their steps were undone (``exec/rollback.py``)."""
        if self._recorded is None:
            raise RuntimeError("rewind() without record(): no batches were kept to give back")
        self._ahead.extendleft(reversed(self._recorded))
        self._recorded = None

    def again(self) -> None:
        """The step handed out last comes again, before any other: it was
        undone before its update (``rollback.StepStart``)."""
        if self._last is None:
            raise RuntimeError("again() before any step was handed out")
        self._ahead.appendleft(self._last)
        if self._recorded:
            self._recorded.pop()
        self._last = None

    def stop_recording(self) -> None:
        """Let go of the batches kept since ``record()``."""
        self._recorded = None

    def _draw_step(self) -> tuple[tuple, tuple]:
        if self.per_step == 1:
            return self._draw()
        batches = [self._draw() for _ in range(self.per_step)]
        if len({(len(i), len(t), input_names(i)) for i, t in batches}) > 1:
            raise ValueError("the batches of one accumulated step hold different numbers of "
                             "inputs and targets, or other keys: yield the same (inputs..., "
                             "targets...) or keys each time")
        inputs = tuple(x for i, _ in batches for x in i)
        first = batches[0][0]
        return (first.with_values(inputs) if isinstance(first, Keywords) else inputs,
                tuple(x for _, t in batches for x in t))

    def _draw(self) -> tuple[tuple, tuple]:
        if self._batches is not None:
            try:
                return split(next(self._batches), self.n_inputs, self.target_keys)
            except StopIteration:
                # Not iter(data) is data: a DataLoader's iter() draws from its
                # generator, and the next epoch's order would not be eager's.
                if isinstance(self.data, Iterator):
                    raise ValueError("the job's data ran out: it is an iterator, which yields "
                                     "one epoch only; pass a DataLoader or a list, which can be "
                                     "iterated again") from None
        self._batches = iter(self.data)
        self.epoch += 1
        try:
            return split(next(self._batches), self.n_inputs, self.target_keys)
        except StopIteration:
            raise ValueError("the job's data yields no batch") from None

    def resident_bytes(self) -> int:
        """Bytes of the data's tensors that are on the job's device already
        (batches put on the GPU beforehand), less the largest batch, which
        the captured step counts as its input: memory the job holds between
        steps that none of its steps allocates. 0 where the data is no list
        or tuple (a ``DataLoader`` makes each batch as it is drawn)."""
        import torch

        if self.device is None or not isinstance(self.data, (list, tuple)):
            return 0  # a Dataset or another Sequence may load each item it is asked for
        device = torch.device(self.device)
        seen: set[int] = set()
        total = largest = 0
        for batch in self.data:
            items = (batch.values() if isinstance(batch, Mapping)
                     else batch if isinstance(batch, (tuple, list)) else (batch,))
            here = 0  # the batch's own bytes
            for x in items:
                if (isinstance(x, torch.Tensor) and x.device.type == device.type
                        and device.index in (None, x.device.index)):
                    here += x.nbytes
                    storage = x.untyped_storage()
                    if storage.data_ptr() not in seen:  # views of one storage count once
                        seen.add(storage.data_ptr())
                        total += storage.nbytes()
            largest = max(largest, here)
        return max(0, total - largest)

    def _to_device(self, xs: tuple) -> tuple:
        if self.device is None:
            return xs
        if self.device.type == "cpu":
            # A CPU job's batch, on the CPU already (every step of a digits
            # trial): a plain loop, which costs a third of all()'s generator.
            for x in xs:
                if not getattr(x, "is_cpu", True):
                    break
            else:
                return xs
        import torch

        moved = tuple(x.to(self.device, non_blocking=True)
                      if isinstance(x, torch.Tensor) and x.device != self.device else x for x in xs)
        return xs.with_values(moved) if isinstance(xs, Keywords) else moved
