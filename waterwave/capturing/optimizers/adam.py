"""Adam and AdamW (amsgrad, coupled or decoupled weight decay, maximize), as
``torch.optim.Adam``'s and ``AdamW``'s single-tensor update; their bias
corrections change every step, so they are 0-d inputs, not constants.
``adam_constants`` and ``adam_state`` serve NAdam and RAdam too.

May import: this package; torch lazily.
"""
from __future__ import annotations

from .device_math import adam_corrections, addcdiv, kernel_scalar
from .rule import OptimizerRule, register


def adam_constants(group: dict) -> dict[str, float]:
    """The constants of the Adam family's updates."""
    b1, b2 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    return {"one_minus_b1": 1 - b1, "b2": b2, "one_minus_b2": 1 - b2, "eps": group["eps"],
            "weight_decay": wd, "decay": 1 - lr * wd, "b1": b1, "lr": lr}


def decay_decoupled(p, c: dict, on: dict) -> None:
    """Decoupled weight decay: the parameter times 1 - lr * weight_decay."""
    if on["weight_decay != 0"] and on["decoupled weight decay"]:
        p.mul_(c["decay"])


def moments(g, st: dict, c: dict) -> None:
    """The first and second moments, as the Adam family moves them."""
    st["exp_avg"].lerp_(g, c["one_minus_b1"])
    st["exp_avg_sq"].mul_(c["b2"]).addcmul_(g, g, value=c["one_minus_b2"])


@register("Adam")
class Adam(OptimizerRule):
    scalars = ("neg_step_size", "bc2_sqrt")

    def structure(self, group, wd, maximize):
        return (wd, ("decoupled weight decay", self.decoupled(group)), maximize,
                ("amsgrad", bool(group["amsgrad"])))

    def constants(self, group):
        return adam_constants(group)

    def state_names(self, group):
        return (["exp_avg", "exp_avg_sq", "max_exp_avg_sq"] if group["amsgrad"]
                else ["exp_avg", "exp_avg_sq"])

    def scalar_inputs(self, group, t, state):
        b1, b2 = group["betas"]
        return [-(float(group["lr"]) / (1 - b1 ** t)), (1 - b2 ** t) ** 0.5]

    def update(self, p, g, st, c, on):
        import torch

        decay_decoupled(p, c, on)
        moments(g, st, c)
        if "step" in st:  # counted on the device: the corrections computed there
            st["neg_step_size"], st["bc2_sqrt"] = adam_corrections(st["step"], c,
                                                                    kernel_scalar(p))
        second = st["exp_avg_sq"]
        if on["amsgrad"]:  # torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            second = st["max_exp_avg_sq"].copy_(torch.maximum(st["max_exp_avg_sq"], second))
        denom = (second.sqrt() / st["bc2_sqrt"]).add_(c["eps"])
        addcdiv(p, st["exp_avg"], denom, st["neg_step_size"])


@register("AdamW")
class AdamW(Adam):
    always_decoupled = True  # multiplying by exactly 1.0 at weight_decay=0
