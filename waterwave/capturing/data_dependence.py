"""What a captured step cannot hold: Python that reads a tensor's values.

A capture traces the step with fake tensors, which have shapes but no
values. Code that needs a value (``if loss > 0``, ``.item()``, ``float(t)``;
batch norm with ``momentum=None`` divides by its batch count that way) stops
the trace, and an operator whose output size depends on the values
(boolean-mask indexing, ``nonzero``, ``unique``) leaves a size no plan can
hold. torch reports both in the words of its symbolic-shape machinery; this
says what happened in the user's terms, where in their code, and the fix.

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations

import os
import traceback

TRAIN_EAGERLY = "or train this model eagerly"


def _data_dependent_errors() -> tuple[type, ...]:
    from torch._subclasses import fake_tensor
    from torch.fx.experimental import symbolic_shapes

    names = [(symbolic_shapes, "GuardOnDataDependentSymNode"),
             (fake_tensor, "DataDependentOutputException"),
             (fake_tensor, "DynamicOutputShapeException")]
    return tuple(getattr(m, n) for m, n in names if isinstance(getattr(m, n, None), type))


def _user_frame(tb) -> str | None:
    """The innermost frame of the model's or the loss's code: not torch's
    machinery (its ``nn`` modules are model code) and not Waterwave's."""
    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    nn_dir = os.path.join(torch_dir, "nn") + os.sep
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    found = None
    for frame in traceback.extract_tb(tb):
        path = os.path.abspath(frame.filename)
        if path.startswith(ours) or (path.startswith(torch_dir) and not path.startswith(nn_dir)):
            continue
        found = frame
    if found is None:
        return None
    code = f": {found.line.strip()}" if found.line else ""
    return f"{found.filename}:{found.lineno} in {found.name}{code}"


def explain_trace_error(error: BaseException) -> str | None:
    """The message for a trace stopped by a read of a tensor's value, or
    None when that is not what stopped it."""
    if not isinstance(error, _data_dependent_errors()):
        return None
    where = _user_frame(error.__traceback__)
    return ("the step reads a tensor's value in Python"
            + (f" at {where}" if where else "")
            + " (an `if` on a tensor, .item(), float() or int() of one; batch norm with "
            "momentum=None does it with its batch count), which a captured step cannot do: it "
            "runs the operators it traced, without their Python. Compute it with tensor "
            "operations (torch.where, torch.clamp), give batch norm a momentum, "
            + TRAIN_EAGERLY)


def value_sized_node(gm):
    """The first node of a traced graph whose output's size depends on the
    values of its inputs, or None."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if any(isinstance(v, torch.Tensor) and free_unbacked_symbols(v) for v in vals):
            return node
    return None


def value_sized_message(node) -> str:
    return (f"the operator {node.target} makes a tensor whose size depends on the values in "
            "the batch (boolean-mask indexing, nonzero, unique, masked_select do), which a "
            "captured step cannot plan memory for: keep its sizes fixed (torch.where in place "
            "of a mask, a padded size), " + TRAIN_EAGERLY)
