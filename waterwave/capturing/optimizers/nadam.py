"""NAdam (momentum decay, coupled or decoupled weight decay, maximize), as
``torch.optim.NAdam``'s single-tensor update. Its momentum schedule's
product is kept in the state (``mu_product``), as eager keeps it.

May import: this package; torch lazily.
"""
from __future__ import annotations

from .adam import adam_constants, decay_decoupled, moments
from .device_math import addcdiv, float64_on, kernel_scalar
from .rule import OptimizerRule, register


@register("NAdam")
class NAdam(OptimizerRule):
    scalars = ("bc2", "grad_coef", "avg_coef")
    device_state = ("step", "mu_product")
    foreach_differs_on_cpu = True  # its multi-tensor update orders the arithmetic otherwise
    pairs_before_decay = True

    def structure(self, group, wd, maximize):
        return (wd, ("decoupled weight decay", self.decoupled(group)), maximize)

    def constants(self, group):
        return {**adam_constants(group), "momentum_decay": group["momentum_decay"]}

    def state_names(self, group):
        return ["exp_avg", "exp_avg_sq"]  # mu_product: the host keeps it (after_count)

    def scalar_inputs(self, group, t, state):
        b1, b2 = group["betas"]
        lr, decay = float(group["lr"]), group["momentum_decay"]
        mu = b1 * (1.0 - 0.5 * (0.96 ** (t * decay)))
        mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * decay)))
        product = float(state["mu_product"].item()) if "mu_product" in state else mu
        return [1 - b2 ** t, -lr * (1.0 - mu) / (1.0 - product),
                (-lr * mu_next) / (1.0 - product * mu_next)]

    def after_count(self, group, state, t):
        import torch

        if "mu_product" not in state:
            state["mu_product"] = torch.tensor(1.0)
        state["mu_product"] *= group["betas"][0] * (1.0 - 0.5 * (0.96 ** (t * group["momentum_decay"])))

    def update(self, p, g, st, c, on):
        decay_decoupled(p, c, on)
        if "step" in st:  # counted on the device: the schedule computed there
            st["bc2"], st["grad_coef"], st["avg_coef"] = _coefficients_on_device(
                st, c, kernel_scalar(p))
        moments(g, st, c)
        denom = st["exp_avg_sq"].div(st["bc2"]).sqrt().add_(c["eps"])
        addcdiv(p, g, denom, st["grad_coef"])
        addcdiv(p, st["exp_avg"], denom, st["avg_coef"])


def _coefficients_on_device(st: dict, c: dict[str, float], dtype) -> tuple:
    """1 - b2^t and the two update coefficients from the step and mu_product
    tensors, on the device, moving both on, in float64 as torch's host code
    computes them (mu_product itself float32, as eager keeps it), then in
    ``dtype`` as the kernels take them."""
    import torch

    step, product = st["step"], st["mu_product"]
    t = step + 1
    step.copy_(t)
    td = t.double()
    full = float64_on(step.device)
    decay, b1 = full(c["momentum_decay"]), full(c["b1"])
    mu = b1 * (1.0 - 0.5 * torch.pow(full(0.96), td * decay))
    mu_next = b1 * (1.0 - 0.5 * torch.pow(full(0.96), (td + 1) * decay))
    product.mul_(mu.float())
    p = product.double()
    neg_lr = -full(c["lr"])
    bc2 = 1 - torch.pow(full(c["b2"]), td)
    return (bc2.to(dtype), (neg_lr * (1.0 - mu) / (1.0 - p)).to(dtype),
            ((neg_lr * mu_next) / (1.0 - p * mu_next)).to(dtype))
