"""Adamax (weight decay, maximize), as ``torch.optim.Adamax``'s
single-tensor update.

May import: this package; torch lazily.
"""
from __future__ import annotations

from .device_math import adam_corrections, addcdiv, kernel_scalar
from .rule import OptimizerRule, register


@register("Adamax")
class Adamax(OptimizerRule):
    scalars = ("neg_clr",)

    def structure(self, group, wd, maximize):
        return (wd, maximize)

    def constants(self, group):
        b1, b2 = group["betas"]
        return {"weight_decay": group["weight_decay"], "one_minus_b1": 1 - b1, "b2": b2,
                "eps": group["eps"], "b1": b1, "lr": float(group["lr"])}

    def state_names(self, group):
        return ["exp_avg", "exp_inf"]

    def scalar_inputs(self, group, t, state):
        return [-(float(group["lr"]) / (1 - group["betas"][0] ** t))]

    def update(self, p, g, st, c, on):
        import torch

        st["exp_avg"].lerp_(g, c["one_minus_b1"])
        st["exp_inf"].copy_(torch.maximum(st["exp_inf"].mul_(c["b2"]), g.abs().add_(c["eps"])))
        if "step" in st:  # counted on the device: the correction computed there
            st["neg_clr"], _ = adam_corrections(st["step"], c, kernel_scalar(p))
        addcdiv(p, st["exp_avg"], st["exp_inf"], st["neg_clr"])
