"""SGD (momentum, dampening, nesterov, weight decay, maximize), as
``torch.optim.SGD``'s single-tensor update. It counts no steps.

May import: this package; torch lazily.
"""
from __future__ import annotations

from .rule import OptimizerRule, register


@register("SGD")
class SGD(OptimizerRule):
    counts_steps = False
    device_state = ()
    complex_as_pairs = False  # its arithmetic is the same on complex numbers

    def structure(self, group, wd, maximize):
        return (("momentum != 0", bool(group["momentum"])), wd,
                ("nesterov", bool(group["nesterov"])), maximize)

    def constants(self, group):
        return {"weight_decay": group["weight_decay"], "momentum": group["momentum"],
                "grad_share": 1 - group["dampening"], "neg_lr": -float(group["lr"])}

    def state_names(self, group):
        return ["momentum_buffer"] if group["momentum"] else []

    def update(self, p, g, st, c, on):
        if on["momentum != 0"]:
            buf = st["momentum_buffer"]
            buf.mul_(c["momentum"]).add_(g, alpha=c["grad_share"])
            g = g.add(buf, alpha=c["momentum"]) if on["nesterov"] else buf
        p.add_(g, alpha=c["neg_lr"])
