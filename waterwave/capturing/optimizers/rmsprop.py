"""RMSprop (momentum, centered, weight decay, maximize), as
``torch.optim.RMSprop``'s single-tensor update.

May import: this package; torch lazily.
"""
from __future__ import annotations

from .rule import OptimizerRule, register


@register("RMSprop")
class RMSprop(OptimizerRule):
    def structure(self, group, wd, maximize):
        return (("momentum > 0", group["momentum"] > 0), wd,
                ("centered", bool(group["centered"])), maximize)

    def constants(self, group):
        return {"weight_decay": group["weight_decay"], "alpha": group["alpha"],
                "one_minus_alpha": 1 - group["alpha"], "eps": group["eps"],
                "momentum": group["momentum"], "neg_lr": -float(group["lr"])}

    def state_names(self, group):
        return (["square_avg"] + (["momentum_buffer"] if group["momentum"] > 0 else [])
                + (["grad_avg"] if group["centered"] else []))

    def update(self, p, g, st, c, on):
        if "step" in st:  # counted on the device (a GradScaler may skip the step)
            st["step"].add_(1)
        square_avg = st["square_avg"]
        square_avg.mul_(c["alpha"]).addcmul_(g, g, value=c["one_minus_alpha"])
        if on["centered"]:
            st["grad_avg"].lerp_(g, c["one_minus_alpha"])
            avg = square_avg.addcmul(st["grad_avg"], st["grad_avg"], value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        avg = avg.add_(c["eps"])
        if on["momentum > 0"]:
            buf = st["momentum_buffer"]
            buf.mul_(c["momentum"]).addcdiv_(g, avg)
            p.add_(buf, alpha=c["neg_lr"])
        else:
            p.addcdiv_(g, avg, value=c["neg_lr"])
