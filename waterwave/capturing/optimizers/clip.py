"""Gradient clipping before the update, as eager code clips between
``backward()`` and ``optimizer.step()``.

May import: this package; torch lazily.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .rule import OptimizerError


@dataclass(frozen=True)
class GradClip:
    """Gradient clipping before the update, as eager code calls
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)``
    or ``clip_grad_value_(model.parameters(), max_value)`` between
    ``backward()`` and ``optimizer.step()``; both may be given (value first)."""
    max_norm: float | None = None
    norm_type: float = 2.0
    max_value: float | None = None

    def __post_init__(self):
        for name in ("max_norm", "max_value"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                raise OptimizerError(f"clip {name} must be a positive number, got {v!r}")
        # torch.nn.utils.clip_grad_norm_ takes any float order, "inf" spelled
        # as a string included; NaN would make every step's norm NaN.
        norm_type = self.norm_type
        if isinstance(norm_type, str) and norm_type.strip().lower() in ("inf", "-inf"):
            norm_type = float(norm_type)
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) \
                or math.isnan(norm_type):
            raise OptimizerError(
                f"clip_grad_norm_type must be a number (2.0 for the Euclidean norm, "
                f"float('inf') for the largest magnitude), got {self.norm_type!r}")
        object.__setattr__(self, "norm_type", float(norm_type))

    @property
    def active(self) -> bool:
        return self.max_norm is not None or self.max_value is not None

    def apply(self, grads: list) -> list:
        """The clipped gradients, traced into the step: the operators
        ``torch.nn.utils`` runs, so the values are eager's."""
        import torch

        if self.max_value is not None:
            grads = [g.clamp(-self.max_value, self.max_value) for g in grads]
        if self.max_norm is not None and grads:
            total = torch.nn.utils.get_total_norm(grads, self.norm_type)
            coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        return grads


def check_clip_covers(model, params: list, clip: GradClip) -> None:
    """Eager code clips over ``model.parameters()``: every parameter that
    takes a gradient must be one the step trains, or the norms differ."""
    if not clip.active:
        return
    trained = {id(p) for p in params}
    extra = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in trained]
    if extra:
        raise OptimizerError(f"gradient clipping over the model's parameters includes "
                             f"{', '.join(extra[:3])}, which the optimizer does not train: give "
                             "them to the optimizer, or set requires_grad=False")
