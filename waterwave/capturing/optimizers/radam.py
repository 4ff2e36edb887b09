"""RAdam (coupled or decoupled weight decay, maximize), as
``torch.optim.RAdam``'s single-tensor update. Its two updates (rectified
once the variance estimate is long enough, plain in its first steps) are one
graph: a 0-d ``rectify`` input selects, with ``torch.where``, the adaptive
factor or exactly 1, so each step multiplies as eager's branch does.

May import: this package; torch lazily.
"""
from __future__ import annotations

from .adam import adam_constants, decay_decoupled, moments
from .device_math import float64_on, kernel_scalar
from .rule import OptimizerRule, register


@register("RAdam")
class RAdam(OptimizerRule):
    scalars = ("bc1", "bc2_sqrt", "rect", "rectify")
    foreach_differs_on_cpu = True  # its multi-tensor update orders the arithmetic otherwise
    pairs_before_decay = True

    def structure(self, group, wd, maximize):
        return (wd, ("decoupled weight decay", self.decoupled(group)), maximize)

    def constants(self, group):
        return adam_constants(group)

    def state_names(self, group):
        return ["exp_avg", "exp_avg_sq"]

    def scalar_inputs(self, group, t, state):
        b1, b2 = group["betas"]
        return list(factors(t, b1, b2))

    def update(self, p, g, st, c, on):
        import torch

        decay_decoupled(p, c, on)
        if "step" in st:  # counted on the device: the factors computed there
            st["bc1"], st["bc2_sqrt"], st["rect"], st["rectify"] = _factors_on_device(
                st["step"], c, kernel_scalar(p))
        moments(g, st, c)
        # torch: exp_avg / bc1 * lr, times (bc2 ** 0.5 / (sqrt(v) + eps)) * rect once
        # rectified; ``bc2_sqrt / s`` is ``s.reciprocal() * bc2_sqrt`` (Tensor.__rdiv__).
        # Unrectified, both factors are exactly 1: the same products as eager's branch.
        rectified = st["rectify"] > 0
        adaptive = st["exp_avg_sq"].sqrt().add_(c["eps"]).reciprocal() * st["bc2_sqrt"]
        change = (st["exp_avg"] / st["bc1"] * c["lr"]
                  * torch.where(rectified, adaptive, 1.0) * torch.where(rectified, st["rect"], 1.0))
        p.add_(change, alpha=-1.0)


def factors(t: float, b1: float, b2: float) -> tuple[float, float, float, float]:
    """1 - b1^t, (1 - b2^t) ** 0.5, the rectification and whether it applies
    (rho_t > 5), at step ``t``, as torch's single-tensor RAdam computes them
    on the host (the rectification is 1 when it does not apply, where
    torch's expression has no real value)."""
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * (b2 ** t) / bc2
    if rho_t <= 5.0:
        return bc1, bc2 ** 0.5, 1.0, 0.0
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
    return bc1, bc2 ** 0.5, rect, 1.0


def _factors_on_device(step, c: dict[str, float], dtype) -> tuple:
    """``factors`` from the step tensor, on the device, moving the step on,
    in float64 as the host computes them, then in ``dtype`` as the kernels
    take them."""
    import torch

    t = step + 1
    step.copy_(t)
    td = t.double()
    full = float64_on(step.device)
    b1, b2 = full(c["b1"]), full(c["b2"])
    bc1 = 1 - torch.pow(b1, td)
    bc2 = 1 - torch.pow(b2, td)
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * td * torch.pow(b2, td) / bc2
    rectify = rho_t > 5.0
    ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
    rect = torch.where(rectify, torch.pow(ratio.clamp(min=0), full(0.5)), full(1.0))
    return (bc1.to(dtype), torch.pow(bc2, full(0.5)).to(dtype), rect.to(dtype),
            rectify.to(dtype))
