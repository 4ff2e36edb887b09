"""Keyword inputs: a batch whose inputs the model takes by name, as Hugging
Face models take ``model(**batch)``. ``Keywords`` is the tuple of the
values, so everything that moves a step's inputs as a tuple (the captured
graph's placeholders, the device copy, gradient accumulation's joined
batches) moves them unchanged; ``names`` says which argument each is, and
``call_model`` is the one place the model is called with them.

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class Keywords(tuple):
    """Input values that go to the model as keyword arguments: the first
    ``len(names)`` are one batch's ``names`` in order, and with gradient
    accumulation the next batch's follow in the same order."""

    names: tuple[str, ...]

    def __new__(cls, values: Sequence[Any], names: Sequence[str]):
        values = tuple(values)
        names = tuple(names)
        if not names or len(values) % len(names):
            raise ValueError(f"{len(values)} keyword input values for the names {names}")
        self = super().__new__(cls, values)
        self.names = names
        return self

    @classmethod
    def of(cls, batch: Mapping) -> Keywords:
        """A mapping's items as keyword inputs, in its order."""
        bad = next((k for k in batch if not isinstance(k, str) or not k.isidentifier()), None)
        if bad is not None:
            raise ValueError(f"a dict batch's keys name the model's keyword arguments; {bad!r} "
                             "cannot be one: use identifier strings")
        if not batch:
            raise ValueError("a dict batch holds no input: give the model's keyword arguments")
        return cls(tuple(batch.values()), tuple(batch))

    def with_values(self, values: Sequence[Any]) -> Keywords:
        """The same names over other values (moved to a device, joined)."""
        return Keywords(values, self.names)

    def __repr__(self) -> str:
        n = len(self.names)
        parts = [f"{name}={_shown(v)}" for name, v in zip(self.names * (len(self) // n), self)]
        return f"Keywords({', '.join(parts)})"


def input_names(inputs) -> tuple[str, ...]:
    """The names of keyword inputs; () for positional ones."""
    return inputs.names if isinstance(inputs, Keywords) else ()


def call_model(model, inputs: Sequence[Any], names: Sequence[str] = ()):
    """``model(*inputs)``, or ``model(**dict(zip(names, inputs)))`` when the
    inputs are named: one batch's inputs (a slice of an accumulated step's)."""
    if names:
        return model(**dict(zip(names, inputs)))
    return model(*inputs)


def _shown(value) -> str:
    shape = getattr(value, "shape", None)
    return f"<{tuple(shape)}>" if shape is not None else repr(value)
