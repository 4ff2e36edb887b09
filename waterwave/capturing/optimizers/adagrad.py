"""Adagrad (learning-rate decay, weight decay, maximize), as
``torch.optim.Adagrad``'s single-tensor update; a decaying rate is a 0-d
input every step, as Adam's bias corrections are.

May import: this package; torch lazily.
"""
from __future__ import annotations

from .device_math import addcdiv, float64_on, kernel_scalar
from .rule import OptimizerRule, register


@register("Adagrad")
class Adagrad(OptimizerRule):
    scalars = ("neg_clr",)

    def structure(self, group, wd, maximize):
        return (wd, maximize, ("lr_decay != 0", bool(group["lr_decay"])))

    def constants(self, group):
        lr = float(group["lr"])
        return {"weight_decay": group["weight_decay"], "eps": group["eps"], "neg_lr": -lr,
                "lr": lr, "lr_decay": group["lr_decay"]}

    def state_names(self, group):
        return ["sum"]

    def scalar_inputs(self, group, t, state):
        return [-(float(group["lr"]) / (1 + (t - 1) * group["lr_decay"]))]

    def update(self, p, g, st, c, on):
        if "step" in st:  # counted on the device (a GradScaler may skip the step)
            st["step"].add_(1)
            if on["lr_decay != 0"]:
                st["neg_clr"] = _rate_on_device(st["step"], c, kernel_scalar(p))
        st["sum"].addcmul_(g, g, value=1)
        std = st["sum"].sqrt().add_(c["eps"])
        if on["lr_decay != 0"]:  # torch: p.addcdiv_(g, std, value=-clr)
            addcdiv(p, g, std, st["neg_clr"])
        else:  # the rate is lr every step: eager's own form, a constant
            p.addcdiv_(g, std, value=c["neg_lr"])


def _rate_on_device(step, c: dict[str, float], dtype):
    """-lr / (1 + (t - 1) * lr_decay) from the step tensor (already moved
    on), on the device, in float64 as torch's host code computes it, then in
    ``dtype`` as the kernels take it."""
    full = float64_on(step.device)
    return (-(full(c["lr"]) / (1 + (step.double() - 1) * full(c["lr_decay"])))).to(dtype)
