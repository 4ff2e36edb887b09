"""The optimizers a captured step updates with, as ``torch.optim``'s
single-tensor implementations do, bit for bit: the update's hyperparameters
are the constants of the captured graph, in the very operator forms eager
PyTorch uses (``p.add_(g, alpha=-lr)``: one fused multiply-add).

What the captured step honours at every step, as eager ``optimizer.step()``:

- **state** lives in ``optimizer.state``: the momentum buffers and Adam's
  moments there are the tensors the step updates in place, read anew each
  step (so a ``load_state_dict`` in between is followed), and Adam's
  ``step`` is counted there; ``state_dict()``, checkpoints and resuming, or
  a new job on the same optimizer, go on exactly where training was;
- **Adam's learning rate** and bias corrections, which reach the graph as
  0-d tensor inputs computed on the host each step.

Optimizers: SGD, Adam, AdamW, RMSprop and Adagrad (``lr_decay=0``), each
checked against torch's own ``step`` in the tests.

What it cannot follow is refused, never ignored: a hyperparameter the
graph holds as a constant that changed since the capture (a learning-rate
scheduler under SGD, say) raises ``OptimizerError`` at the next step,
naming the value and the fix. (Why not every hyperparameter as an input: a
0-d tensor in place of ``alpha`` costs the fused multiply-add, one rounding
more, and a resnet18 step at batch 2, whose batch norms divide by nearly
nothing, turned that rounding into momentum buffers 11.5 apart within two
steps.)

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")
ADAM = ("Adam", "AdamW")  # their lr and bias corrections are inputs
# What each kind's graph holds as constants, per parameter group.
BAKED = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "Adam": ("betas", "eps", "weight_decay", "maximize"),
    "RMSprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
    "Adagrad": ("lr", "lr_decay", "eps", "weight_decay", "maximize"),
}
BAKED["AdamW"] = BAKED["Adam"]


class OptimizerError(ValueError):
    """An optimizer or a setting the captured step cannot follow; the message
    names the fix."""


def kind(optimizer) -> str:
    name = type(optimizer).__name__
    if name not in SUPPORTED:
        raise OptimizerError(f"capture supports the optimizers {', '.join(SUPPORTED)}; got {name}")
    return name


def baked(optimizer) -> list[dict]:
    """Each group's constants, as the capture bakes them in; checked at every
    step (``check_unchanged``). Also refuses what the update cannot do."""
    name = kind(optimizer)
    out = []
    for k, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise OptimizerError("capture does not support Adam(amsgrad=True) yet: use "
                                 "amsgrad=False")
        if group.get("maximize"):
            raise OptimizerError("capture does not support maximize=True yet: minimize the "
                                 "negated loss")
        if group.get("lr_decay"):
            raise OptimizerError("capture does not support Adagrad's lr_decay yet (its rate "
                                 "changes every step): use lr_decay=0")
        if name == "AdamW" or group.get("decoupled_weight_decay"):
            keys = (*BAKED[name], "lr") if group["weight_decay"] else BAKED[name]
        else:
            keys = BAKED[name]
        out.append({key: group.get(key) for key in keys})
    return out


def check_unchanged(optimizer, captured: list[dict]) -> None:
    """The constants the step was captured with still hold."""
    groups = optimizer.param_groups
    if len(groups) != len(captured):
        raise OptimizerError(f"the optimizer has {len(groups)} parameter groups; the step was "
                             f"captured with {len(captured)}: make a new Job (or "
                             "waterwave.optimize) after add_param_group")
    for k, (group, then) in enumerate(zip(groups, captured)):
        for key, value in then.items():
            if group.get(key) != value:
                raise OptimizerError(
                    f"parameter group {k}'s {key} is {group.get(key)!r} now; the step was "
                    f"captured with {value!r}, which its update holds as a constant (a "
                    f"scheduler or a hand change?). Make a new Job (or waterwave.optimize) "
                    f"after changing it; with Adam or AdamW, lr may change every step")


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


def begin_step(optimizer, captured: list[dict]) -> None:
    """What an eager ``optimizer.step()`` call would see and leave, checked
    and left before a captured step: the constants still hold
    (``check_unchanged``); no step hooks wait to run (the captured update
    runs none: refused); and a learning-rate scheduler sees that the
    optimizer stepped (its flag, as its wrapper of ``step`` sets it), so it
    neither warns nor skips its first value."""
    from torch.optim import optimizer as torch_optimizer

    check_unchanged(optimizer, captured)
    hooks = (len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
             + len(torch_optimizer._global_optimizer_pre_hooks)
             + len(torch_optimizer._global_optimizer_post_hooks))
    if hooks:
        raise OptimizerError(f"the optimizer has {hooks} step hook(s), which a captured step "
                             "does not run: remove them (or run their work between steps)")
    optimizer._opt_called = True


def state_names(optimizer, group: int) -> list[str]:
    """The state tensors the optimizer keeps per parameter of ``group``."""
    name, g = kind(optimizer), optimizer.param_groups[group]
    if name == "SGD":
        return ["momentum_buffer"] if g["momentum"] else []
    if name == "RMSprop":
        return (["square_avg"] + (["momentum_buffer"] if g["momentum"] > 0 else [])
                + (["grad_avg"] if g["centered"] else []))
    if name == "Adagrad":
        return ["sum"]
    return ["exp_avg", "exp_avg_sq"]


def step_tensors(optimizer, params: list, groups: list[int]) -> list:
    """The state tensors of the next step, each parameter's in
    ``state_names`` order, as they are in ``optimizer.state`` now; missing
    ones are made (zeros, as PyTorch starts Adam's moments) and put there.

    SGD with momentum starts its buffer as the first gradient, undamped; the
    update from a zero buffer gives the same only without dampening, so a
    first step with dampening is refused."""
    import torch

    out = []
    for p, k in zip(params, groups):
        names = state_names(optimizer, k)
        if not names:  # no entry at all, as eager leaves SGD without momentum
            continue
        st = optimizer.state[p]
        for n in names:
            if n not in st:
                if n == "momentum_buffer" and optimizer.param_groups[k].get("dampening"):
                    raise OptimizerError(
                        f"parameter group {k}: SGD's first step with dampening="
                        f"{optimizer.param_groups[k]['dampening']} takes the gradient undamped, "
                        "which the captured update cannot; run one eager optimizer.step() "
                        "first, or use dampening=0")
                # Adagrad starts its sum at initial_accumulator_value; the rest at zero.
                group = optimizer.param_groups[k]
                start = group.get("initial_accumulator_value", 0) if n == "sum" else 0
                st[n] = torch.full_like(p, start, memory_format=torch.preserve_format)
            out.append(st[n])
    return out


def count_step(optimizer, params: list, groups: list[int]) -> list[float]:
    """Each group's next step number (for Adam's bias corrections), counted
    in ``optimizer.state[p]["step"]`` as PyTorch counts it, and moved on
    there. Empty for SGD, which counts none."""
    import torch

    if kind(optimizer) == "SGD":
        return []
    steps: dict[int, float] = {}
    for p, k in zip(params, groups):
        st = optimizer.state[p]
        step = st.get("step", 0)
        t = float(step.item() if isinstance(step, torch.Tensor) else step) + 1
        if steps.setdefault(k, t) != t:
            raise OptimizerError(f"the parameters of group {k} are at different steps; load a "
                                 "whole state_dict, or none")
        if isinstance(step, torch.Tensor):
            step.fill_(t)
        else:
            st["step"] = torch.tensor(t)
    return [steps.get(k, 1.0) for k in range(len(optimizer.param_groups))]


def adam_inputs(optimizer, steps: list[float]) -> list[float]:
    """Adam's host-side inputs for each group at its step ``steps[k]``:
    lr / (1 - b1^t) and sqrt(1 - b2^t). Empty for the others."""
    if kind(optimizer) not in ADAM:
        return []
    out = []
    for group, t in zip(optimizer.param_groups, steps):
        b1, b2 = group["betas"]
        out += [float(group["lr"]) / (1 - b1 ** t), math.sqrt(1 - b2 ** t)]
    return out


def update(optimizer, params, grads, states, groups) -> None:
    """Apply the optimizer's update in place, as torch.optim's single-tensor
    implementations do. ``states[i]`` is a dict of this parameter's state
    (with Adam's ``step_size`` and ``bc2_sqrt`` inputs), ``groups[i]`` the
    index of its parameter group (its hyperparameters)."""
    import torch

    name = kind(optimizer)
    with torch.no_grad():
        for p, g, st, k in zip(params, grads, states, groups):
            group = optimizer.param_groups[k]
            if name == "SGD":
                lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
                damp, nesterov = group["dampening"], group["nesterov"]
                if wd:
                    g = g.add(p, alpha=wd)
                if mom:
                    buf = st["momentum_buffer"]
                    buf.mul_(mom).add_(g, alpha=1 - damp)
                    g = g.add(buf, alpha=mom) if nesterov else buf
                p.add_(g, alpha=-lr)
            elif name == "RMSprop":
                lr, alpha, eps, wd = group["lr"], group["alpha"], group["eps"], group["weight_decay"]
                if wd:
                    g = g.add(p, alpha=wd)
                square_avg = st["square_avg"]
                square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
                if group["centered"]:
                    st["grad_avg"].lerp_(g, 1 - alpha)
                    avg = square_avg.addcmul(st["grad_avg"], st["grad_avg"], value=-1).sqrt_()
                else:
                    avg = square_avg.sqrt()
                avg = avg.add_(eps)
                if group["momentum"] > 0:
                    buf = st["momentum_buffer"]
                    buf.mul_(group["momentum"]).addcdiv_(g, avg)
                    p.add_(buf, alpha=-lr)
                else:
                    p.addcdiv_(g, avg, value=-lr)
            elif name == "Adagrad":
                lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
                if wd:
                    g = g.add(p, alpha=wd)
                st["sum"].addcmul_(g, g, value=1)
                std = st["sum"].sqrt().add_(eps)
                p.addcdiv_(g, std, value=-lr)  # lr_decay=0: the rate is lr every step
            else:
                lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
                if wd and (name == "AdamW" or group.get("decoupled_weight_decay")):
                    p.mul_(1 - lr * wd)
                elif wd:
                    g = g.add(p, alpha=wd)
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                # Bias corrections change every step: 0-d tensor inputs
                # (lr / (1 - b1^t) and sqrt(1 - b2^t)), not constants.
                denom = (st["exp_avg_sq"].sqrt() / st["bc2_sqrt"]).add_(eps)
                p.sub_(st["exp_avg"] / denom * st["step_size"])
