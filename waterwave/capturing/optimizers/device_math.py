"""Arithmetic the updates share, as torch's kernels and host code do it:
``addcdiv`` with a 0-d scale, the type a kernel reads a scale in, float64
0-d tensors on a device, Adam's bias corrections from a step count on the
device, and complex parameters as real pairs.

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations


def as_real_pairs(p, g, st: dict) -> tuple:
    """A complex parameter, its gradient and its complex state tensors as
    real views (``torch.view_as_real``); in-place updates write through."""
    import torch

    return (torch.view_as_real(p), torch.view_as_real(g),
            {n: torch.view_as_real(t) if t.is_complex() else t for n, t in st.items()})


def addcdiv(p, a, b, value) -> None:
    """``p.addcdiv_(a, b, value=value)`` with ``value`` a 0-d tensor (a bias
    correction, which torch passes as a Python float): as torch's CPU kernel
    computes it, ``p + (value * a) / b`` in the opmath type (float32 for
    float16 and bfloat16 parameters, their own type otherwise), rounded to
    the parameter's type once."""
    import torch

    if p.dtype in (torch.float16, torch.bfloat16):
        p.copy_(p.float() + a.float() * value / b.float())
    else:
        p.add_(a * value / b)


def kernel_scalar(p):
    """The type a kernel reads a Python scale in for parameter ``p``: float64
    for float64, float32 for the rest (half types compute in float32)."""
    import torch

    return torch.float64 if p.dtype == torch.float64 else torch.float32


def float64_on(device):
    """A maker of 0-d float64 tensors on ``device``: the host's arithmetic of
    the step-dependent factors, done where the step count lives."""
    import torch

    def full(v: float):
        return torch.full((), v, dtype=torch.float64, device=device)

    return full


def adam_corrections(step, c: dict[str, float], dtype) -> tuple:
    """Adam's -lr / (1 - b1^t) and (1 - b2^t) ** 0.5 from its step tensor, on
    the device, moving the step on (t = step + 1), in float64 as torch's
    host code computes them (a tensor exponent: ``** 0.5`` is libm's pow,
    not a square root), then in ``dtype`` as the kernels take them
    (``kernel_scalar``)."""
    import torch

    t = step + 1
    step.copy_(t)
    td = t.double()
    full = float64_on(step.device)
    bc1 = 1 - torch.pow(full(c["b1"]), td)
    bc2 = 1 - torch.pow(full(c["b2"]), td)
    neg_step_size = -(full(c["lr"]) / bc1)
    return neg_step_size.to(dtype), torch.pow(bc2, full(0.5)).to(dtype)
