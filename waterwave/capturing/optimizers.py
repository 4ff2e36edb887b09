"""The optimizers a captured step updates with, as ``torch.optim``'s
single-tensor implementations do, bit for bit, honouring
``optimizer.param_groups`` and ``optimizer.state`` at every step as eager
``optimizer.step()`` does.

- **Hyperparameters** (lr, momentum, dampening, weight decay, betas, eps,
  alpha) are the graph's constants, in the very operator forms eager
  PyTorch uses (``p.add_(g, alpha=-lr)``: one fused multiply-add). The
  capture traces the update with a unique sentinel for each constant and
  notes where each landed (``ConstantSites``); before a step whose groups
  hold other values, those nodes get the new ones. So schedulers, warm-up
  and population-based training work, exactly. (Why not 0-d tensor inputs:
  a tensor in place of ``alpha`` costs the fused multiply-add, one rounding
  more, and a resnet18 step at batch 2, whose batch norms divide by nearly
  nothing, turned that rounding into momentum buffers 11.5 apart within two
  steps.) Adam's bias corrections, which change every step, are 0-d tensor
  inputs, as they always were.
- **State** lives in ``optimizer.state``: the momentum buffers and moments
  there are the tensors the step updates in place, read anew each step (so a
  ``load_state_dict`` in between is followed), and ``step`` is counted there,
  each parameter's own count as eager's (``step_cohorts``: parameters thawed
  late start theirs at 1); ``state_dict()``, checkpoints and resuming go on
  exactly where training was.

What decides the update's shape (momentum, weight decay or dampening zero
or not, nesterov, centered) is read at capture (decoupled weight decay, a
multiplication by exactly 1.0 at zero, is always in the update). After a
change of it ``Job.train`` captures the step again; ``optimize`` and
``ConcurrentTrainer`` refuse it at the next step with an error that names
the fix, never ignore it. Everywhere refused: what the update cannot do
(SGD's first step with dampening, amsgrad set after the first step, step
hooks) and settings that select another implementation of the update
(fused, capturable, differentiable, tensor hyperparameters).

Optimizers: SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam and RAdam,
each checked against torch's own ``step`` in the tests. What changes every
step (Adam's bias corrections, Adamax's and Adagrad's decayed rates, NAdam's momentum
schedule, RAdam's rectification) is computed on the host as torch computes
it and given to the step as 0-d tensor inputs (``SCALARS``). RAdam's two
updates (rectified once the variance estimate is long enough, plain in its
first steps) are one graph: a 0-d ``rectify`` input selects, with
``torch.where``, the adaptive factor or exactly 1, so each step multiplies
as eager's branch does.

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam")
ADAM = ("Adam", "AdamW")
# The 0-d tensor inputs each group's update takes every step, by optimizer.
# With a GradScaler, which may skip a step, these count their steps (and
# compute what depends on them) on the device, so a skipped step does not
# count; SGD keeps no count.
DEVICE_STEPS = ("Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam")
# They are float64 0-d tensors on the CPU, as torch's host code computes
# them: a kernel reads a CPU scalar in its own precision (double for float64
# parameters, float for the rest), as it reads eager's Python floats.
SCALARS = {"Adam": ("neg_step_size", "bc2_sqrt"), "AdamW": ("neg_step_size", "bc2_sqrt"),
           "Adamax": ("neg_clr",), "Adagrad": ("neg_clr",),
           "NAdam": ("bc2", "grad_coef", "avg_coef"),
           "RAdam": ("bc1", "bc2_sqrt", "rect", "rectify")}


class OptimizerError(ValueError):
    """An optimizer or a setting the captured step cannot follow; the message
    names the fix."""


def kind(optimizer) -> str:
    name = type(optimizer).__name__
    if name not in SUPPORTED:
        raise OptimizerError(f"capture supports the optimizers {', '.join(SUPPORTED)}; got {name}")
    return name


def _decoupled(name: str, group: dict) -> bool:
    return name == "AdamW" or bool(group.get("decoupled_weight_decay"))


def structure(optimizer) -> list[tuple]:
    """What each group's update graph is shaped by: read at capture, checked
    at every step (``begin_step``). Also refuses what the update cannot do."""
    name = kind(optimizer)
    out = []
    for group in optimizer.param_groups:
        _refuse_other_implementations(name, group)
        # Decoupled weight decay multiplies the parameters by 1 - lr * wd,
        # exactly 1.0 at weight_decay=0 (x * 1.0 is x, bit for bit): always
        # in the graph, so a schedule may move weight_decay to and from 0.
        decoupled = _decoupled(name, group)
        wd = ("weight_decay != 0", bool(group["weight_decay"]) or decoupled)
        maximize = ("maximize", bool(group.get("maximize")))
        if name == "SGD":
            out.append((("momentum != 0", bool(group["momentum"])), wd,
                        ("nesterov", bool(group["nesterov"])), maximize))
        elif name == "RMSprop":
            out.append((("momentum > 0", group["momentum"] > 0), wd,
                        ("centered", bool(group["centered"])), maximize))
        elif name == "Adagrad":  # a decaying rate is a 0-d input, as Adam's corrections
            out.append((wd, maximize, ("lr_decay != 0", bool(group["lr_decay"]))))
        elif name == "Adamax":
            out.append((wd, maximize))
        elif name in ADAM:
            out.append((wd, ("decoupled weight decay", decoupled), maximize,
                        ("amsgrad", bool(group["amsgrad"]))))
        else:
            out.append((wd, ("decoupled weight decay", decoupled), maximize))
    return out


# Settings that select another implementation of the update than the
# single-tensor one the captured step reproduces (foreach rounds alike on the
# CPU, but for NAdam and RAdam, refused below).
OTHER_IMPLEMENTATIONS = {
    "fused": "its fused kernel rounds differently from the single-tensor and foreach updates "
             "the captured step reproduces: leave fused unset (or False)",
    "capturable": "it keeps the step count on the device and computes the bias corrections "
                  "there, rounding differently: leave capturable False",
    "differentiable": "it backpropagates through the update, which a captured step does not: "
                      "leave differentiable False",
}
# Hyperparameters the update takes as Python numbers: a tensor selects other
# code in torch, and numpy's float32 rounds its arithmetic in float32.
NUMBERS = ("lr", "momentum", "dampening", "weight_decay", "eps", "alpha", "momentum_decay",
           "initial_accumulator_value")


def _refuse_other_implementations(name: str, group: dict) -> None:
    """An update the captured step would compute otherwise than eager
    ``optimizer.step()``: refused with the fix, never trained silently."""
    for setting, why in OTHER_IMPLEMENTATIONS.items():
        if group.get(setting):
            raise OptimizerError(f"capture does not support {name}({setting}=True): {why}")
    # NAdam's and RAdam's multi-tensor updates order their arithmetic otherwise
    # (1 ulp from the first step, measured); on the CPU the default is the
    # single-tensor one, bit for bit. (On CUDA the default is multi-tensor for
    # every optimizer: the same training, not bit for bit; docs/guide.)
    on_cpu = all(p.device.type == "cpu" for p in group["params"])
    if group.get("foreach") and name in ("NAdam", "RAdam") and on_cpu:
        raise OptimizerError(f"capture does not support {name}(foreach=True) on the CPU: its "
                             "multi-tensor update rounds otherwise than the single-tensor one "
                             "the captured step reproduces, the CPU's default: leave foreach "
                             "unset")
    values = [(k, group[k]) for k in NUMBERS if k in group]
    values += [(f"betas[{i}]", b) for i, b in enumerate(group.get("betas", ()))]
    for key, value in values:
        if not isinstance(value, (int, float)):  # numpy's float64 is a float
            fix = "betas=(float(...), float(...))" if key.startswith("betas") else f"{key}=float(...)"
            raise OptimizerError(
                f"{name}'s {key} is a {type(value).__name__}; the captured update takes its "
                f"hyperparameters as Python numbers, as torch's default update does: pass {fix}")


def constants(optimizer) -> list[dict[str, float]]:
    """Each group's constants, as the update uses them (derived ones
    included, computed as torch's implementation computes them)."""
    name = kind(optimizer)
    out = []
    for g in optimizer.param_groups:
        lr, wd = float(g["lr"]), g["weight_decay"]
        if name == "SGD":
            out.append({"weight_decay": wd, "momentum": g["momentum"],
                        "grad_share": 1 - g["dampening"], "neg_lr": -lr})
        elif name == "RMSprop":
            out.append({"weight_decay": wd, "alpha": g["alpha"], "one_minus_alpha": 1 - g["alpha"],
                        "eps": g["eps"], "momentum": g["momentum"], "neg_lr": -lr})
        elif name == "Adagrad":
            out.append({"weight_decay": wd, "eps": g["eps"], "neg_lr": -lr, "lr": lr,
                        "lr_decay": g["lr_decay"]})
        elif name == "Adamax":
            b1, b2 = g["betas"]
            out.append({"weight_decay": wd, "one_minus_b1": 1 - b1, "b2": b2, "eps": g["eps"],
                        "b1": b1, "lr": lr})
        else:
            b1, b2 = g["betas"]
            out.append({"one_minus_b1": 1 - b1, "b2": b2, "one_minus_b2": 1 - b2, "eps": g["eps"],
                        "weight_decay": wd, "decay": 1 - lr * wd, "b1": b1, "lr": lr})
            if name == "NAdam":
                out[-1]["momentum_decay"] = g["momentum_decay"]
    # As Python floats: a numpy float64 would be written into the graph's
    # code as np.float64(...), which its namespace cannot evaluate.
    return [{k: float(v) for k, v in c.items()} for c in out]


SENTINEL = -987654.25  # and below it, one for each constant: no graph holds these


def sentinels(real: list[dict[str, float]]) -> list[dict[str, float]]:
    """A value for each constant that nothing else in a graph holds, to
    trace the update with and find each constant's place after."""
    out, n = [], 0
    for consts in real:
        out.append({})
        for key in consts:
            out[-1][key] = SENTINEL - n
            n += 1
    return out


class ConstantSites:
    """Where each group's constants sit in a traced graph: (node name, arg
    index or kwarg name) for each (group, constant)."""

    def __init__(self, graph, traced_with: list[dict[str, float]]):
        lookup = {v: (k, key) for k, consts in enumerate(traced_with) for key, v in consts.items()}
        self.sites: list[tuple[str, int | str, int, str]] = []
        for node in graph.nodes:
            places = [*enumerate(node.args), *node.kwargs.items()]
            for where, a in places:
                if not isinstance(a, float):
                    continue
                if a in lookup:
                    self.sites.append((node.name, where, *lookup[a]))
                elif abs(a - SENTINEL) < 100_000:
                    # A value torch derived from a sentinel inside an operator's
                    # Python: it could not be patched, so the step would run with it.
                    raise OptimizerError(f"the optimizer's update traced a constant derived "
                                         f"from a hyperparameter ({node.name}: {a}); this "
                                         "optimizer cannot be captured")

    def patch(self, graph, values: list[dict[str, float]]) -> None:
        """Put ``values`` in their places in ``graph`` (the traced graph, or
        one with its node names, as ``CapturedStep.reorder`` makes)."""
        nodes = {n.name: n for n in graph.nodes}
        for name, where, k, key in self.sites:
            node = nodes.get(name)
            if node is None:
                continue
            if isinstance(where, int):
                args = list(node.args)
                args[where] = values[k][key]
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, where: values[k][key]}


def check_structure(optimizer, captured: list[tuple]) -> None:
    """The groups are still shaped as the step was captured."""
    now = structure(optimizer)
    if len(now) != len(captured):
        raise OptimizerError(f"the optimizer has {len(now)} parameter groups; the step was "
                             f"captured with {len(captured)}: make a new Job (or "
                             "waterwave.optimize) after add_param_group (Job.train "
                             "captures the step again by itself)")
    for k, (then, is_) in enumerate(zip(captured, now)):
        for (what, was), (_, value) in zip(then, is_):
            if was != value:
                raise OptimizerError(
                    f"parameter group {k}: {what} is {value} now; the step was captured with "
                    f"{what} {was}, which shapes its update: set it before making the Job (or "
                    "waterwave.optimize), or make a new one (values may change every step; "
                    "Job.train captures the step again by itself)")


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


def begin_step(optimizer, captured: list[tuple]) -> None:
    """What an eager ``optimizer.step()`` call would see and leave, checked
    and left before a captured step: the groups are shaped as captured
    (``check_structure``); no step hooks wait to run (the captured update
    runs none: refused; a hook marked ``waterwave_not_in_captured_steps``,
    waterwave.sharing's, acts only in eager members' threads); and a
    learning-rate scheduler sees that the optimizer stepped (its flag, as
    its wrapper of ``step`` sets it), so it neither warns nor skips its
    first value."""
    from torch.optim import optimizer as torch_optimizer

    check_structure(optimizer, captured)
    hooks = [*optimizer._optimizer_step_pre_hooks.values(),
             *optimizer._optimizer_step_post_hooks.values(),
             *torch_optimizer._global_optimizer_pre_hooks.values(),
             *torch_optimizer._global_optimizer_post_hooks.values()]
    hooks = sum(not getattr(h, "waterwave_not_in_captured_steps", False) for h in hooks)
    if hooks:
        raise OptimizerError(f"the optimizer has {hooks} step hook(s), which a captured step "
                             "does not run: remove them (or run their work between steps)")
    optimizer._opt_called = True


def state_names(optimizer, group: int, device_steps: bool = False) -> list[str]:
    """The state tensors the optimizer keeps per parameter of ``group`` that
    the step updates; ``device_steps``: Adam's ``step`` too (counted on the
    device, where a GradScaler's skipped step must not count it)."""
    name, g = kind(optimizer), optimizer.param_groups[group]
    if device_steps and name in DEVICE_STEPS:
        return [*state_names(optimizer, group), "step", *(["mu_product"] if name == "NAdam" else [])]
    if name == "SGD":
        return ["momentum_buffer"] if g["momentum"] else []
    if name == "RMSprop":
        return (["square_avg"] + (["momentum_buffer"] if g["momentum"] > 0 else [])
                + (["grad_avg"] if g["centered"] else []))
    if name == "Adagrad":
        return ["sum"]
    if name == "Adamax":
        return ["exp_avg", "exp_inf"]
    if name in ADAM and g["amsgrad"]:
        return ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    return ["exp_avg", "exp_avg_sq"]  # Adam, AdamW, NAdam (whose mu_product the host keeps), RAdam


def step_tensors(optimizer, params: list, groups: list[int], device_steps: bool = False) -> list:
    """The state tensors of the next step, each parameter's in
    ``state_names`` order, as they are in ``optimizer.state`` now; missing
    ones are made (zeros, as PyTorch starts Adam's moments) and put there.

    SGD with momentum starts its buffer as the first gradient, undamped; the
    update from a zero buffer gives the same only without dampening, so a
    first step with dampening is refused."""
    import torch

    out = []
    for p, k in zip(params, groups):
        names = state_names(optimizer, k, device_steps)
        if not names:  # no entry at all, as eager leaves SGD without momentum
            continue
        st = optimizer.state[p]
        if "max_exp_avg_sq" in names and "exp_avg" in st and "max_exp_avg_sq" not in st:
            raise OptimizerError(
                f"parameter group {k}: amsgrad was set after the first step, and these "
                "parameters' state has no max_exp_avg_sq, which torch's Adam then fails to "
                "find: set amsgrad before the first step")
        for n in names:
            if n in ("step", "mu_product"):  # kept where the step runs, as eager's floats
                start = 0.0 if n == "step" else 1.0
                if not isinstance(st.get(n), torch.Tensor) or st[n].device != p.device:
                    st[n] = torch.tensor(float(st.get(n, start)), device=p.device)
                out.append(st[n])
                continue
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


def step_count(state: dict) -> float:
    """The steps a parameter's state has counted (0 with none), as a float."""
    step = state.get("step", 0)
    return float(step.item() if hasattr(step, "item") else step)


def step_cohorts(optimizer, params: list, groups: list[int]) -> tuple[list[int], list[int]]:
    """Each parameter's step cohort, and each cohort's group: the parameters
    of a group at one step count in ``optimizer.state`` (0 with no state).
    A group trained from its start is one cohort; parameters unfrozen later,
    or given a state that counted apart, start or go on at their own count,
    as eager Adam counts each parameter's steps. The bias corrections are
    inputs per cohort; a captured step moves every cohort on together."""
    index: dict[tuple[int, float], int] = {}
    cohorts = [index.setdefault((k, step_count(optimizer.state.get(p, {}))), len(index))
               for p, k in zip(params, groups)]
    return cohorts, [k for k, _ in index]


def count_step(optimizer, params: list, groups: list[int], cohorts: list[int],
               n_cohorts: int) -> list[float]:
    """Each cohort's next step number (``step_cohorts``; for Adam's bias
    corrections), counted in ``optimizer.state[p]["step"]`` as PyTorch
    counts it, and moved on there. Empty for SGD, which counts none."""
    import torch

    if kind(optimizer) == "SGD":
        return []
    steps: dict[int, float] = {}
    for p, k, c in zip(params, groups, cohorts):
        st = optimizer.state[p]
        step = st.get("step", 0)
        t = step_count(st) + 1
        if steps.setdefault(c, t) != t:
            raise OptimizerError(
                f"parameters of group {k} that were at one step count when the step was "
                f"captured are at steps {steps[c] - 1:g} and {t - 1:g} now (a state_dict loaded "
                "since?): make a new Job (or waterwave.optimize) for the optimizer as it is now")
        if isinstance(step, torch.Tensor):
            step.fill_(t)
        else:
            st["step"] = torch.tensor(t)
        if kind(optimizer) == "NAdam":  # its momentum schedule's product, kept as eager keeps it
            g = optimizer.param_groups[k]
            if "mu_product" not in st:
                st["mu_product"] = torch.tensor(1.0)
            st["mu_product"] *= g["betas"][0] * (1.0 - 0.5 * (0.96 ** (t * g["momentum_decay"])))
    return [steps.get(c, 1.0) for c in range(n_cohorts)]


def scalar_inputs(optimizer, steps: list[float], cohort_groups: list[int],
                  params: list | None = None, cohorts: list[int] | None = None) -> list[float]:
    """Each cohort's 0-d inputs at its step ``steps[c]`` (``step_cohorts``:
    ``cohort_groups[c]`` is its group), in ``SCALARS`` order, computed as
    torch's single-tensor implementations compute them: Adam's
    -lr / (1 - b1^t) and (1 - b2^t) ** 0.5; Adamax's -lr / (1 - b1^t);
    NAdam's 1 - b2^t and its two update coefficients, from the mu_product
    ``count_step`` left in the state of the cohort's first parameter (at
    capture, with none, step 1's). Empty for the others."""
    name = kind(optimizer)
    if name not in SCALARS:
        return []
    first = {}
    for p, c in zip(params or [], cohorts or []):
        first.setdefault(c, p)
    out = []
    for c, (k, t) in enumerate(zip(cohort_groups, steps)):
        group = optimizer.param_groups[k]
        lr = float(group["lr"])
        if name == "Adagrad":
            out += [-(lr / (1 + (t - 1) * group["lr_decay"]))]
            continue
        b1, b2 = group["betas"]
        if name in ADAM:
            out += [-(lr / (1 - b1 ** t)), (1 - b2 ** t) ** 0.5]
        elif name == "RAdam":
            out += list(_radam_factors(t, b1, b2))
        elif name == "Adamax":
            out += [-(lr / (1 - b1 ** t))]
        else:
            decay = group["momentum_decay"]
            mu = b1 * (1.0 - 0.5 * (0.96 ** (t * decay)))
            mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * decay)))
            state = optimizer.state.get(first.get(c), {})
            product = float(state["mu_product"].item()) if "mu_product" in state else mu
            out += [1 - b2 ** t, -lr * (1.0 - mu) / (1.0 - product),
                    (-lr * mu_next) / (1.0 - product * mu_next)]
    return out


def update(optimizer, params, grads, states, groups, shapes: list[tuple],
           consts: list[dict[str, float]]) -> None:
    """Apply the optimizer's update in place, as torch.optim's single-tensor
    implementations do: ``shapes[k]`` (``structure``) picks the operators of
    group k, ``consts[k]`` (``constants``, or ``sentinels`` while tracing)
    are their constants. ``states[i]`` is a dict of this parameter's state
    (with its group's 0-d inputs, ``SCALARS``), ``groups[i]`` its
    group."""
    import torch

    name = kind(optimizer)
    with torch.no_grad():
        for p, g, st, k in zip(params, grads, states, groups):
            c, on = consts[k], dict(shapes[k])
            # As torch's: a complex parameter, its gradient and state updated
            # as real pairs (squares and roots per component), viewed so where
            # torch views them: NAdam and RAdam before coupled weight decay, the
            # rest after it (a complex add with alpha rounds otherwise).
            as_pairs = p.is_complex() and name != "SGD"
            if as_pairs and name in ("NAdam", "RAdam"):
                p, g, st = _as_real_pairs(p, g, st)
                as_pairs = False
            if on["maximize"]:  # as torch's: the negated gradient, before weight decay
                g = -g
            if on["weight_decay != 0"] and not on.get("decoupled weight decay"):
                g = g.add(p, alpha=c["weight_decay"])
            if as_pairs:
                p, g, st = _as_real_pairs(p, g, st)
            if name == "SGD":
                if on["momentum != 0"]:
                    buf = st["momentum_buffer"]
                    buf.mul_(c["momentum"]).add_(g, alpha=c["grad_share"])
                    g = g.add(buf, alpha=c["momentum"]) if on["nesterov"] else buf
                p.add_(g, alpha=c["neg_lr"])
            elif name == "RMSprop":
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
            elif name == "Adagrad":
                if "step" in st:  # counted on the device (a GradScaler may skip the step)
                    st["step"].add_(1)
                    if on["lr_decay != 0"]:
                        st["neg_clr"] = _adagrad_rate(st["step"], c, _kernel_scalar(p))
                st["sum"].addcmul_(g, g, value=1)
                std = st["sum"].sqrt().add_(c["eps"])
                if on["lr_decay != 0"]:  # torch: p.addcdiv_(g, std, value=-clr)
                    _addcdiv(p, g, std, st["neg_clr"])
                else:  # the rate is lr every step: eager's own form, a constant
                    p.addcdiv_(g, std, value=c["neg_lr"])
            elif name == "Adamax":
                st["exp_avg"].lerp_(g, c["one_minus_b1"])
                st["exp_inf"].copy_(torch.maximum(st["exp_inf"].mul_(c["b2"]),
                                                  g.abs().add_(c["eps"])))
                if "step" in st:  # counted on the device: the correction computed there
                    st["neg_clr"], _ = _adam_corrections(st["step"], c, _kernel_scalar(p))
                _addcdiv(p, st["exp_avg"], st["exp_inf"], st["neg_clr"])
            elif name == "RAdam":
                if on["weight_decay != 0"] and on["decoupled weight decay"]:
                    p.mul_(c["decay"])
                if "step" in st:  # counted on the device: the factors computed there
                    st["bc1"], st["bc2_sqrt"], st["rect"], st["rectify"] = _radam_on_device(
                        st["step"], c, _kernel_scalar(p))
                st["exp_avg"].lerp_(g, c["one_minus_b1"])
                st["exp_avg_sq"].mul_(c["b2"]).addcmul_(g, g, value=c["one_minus_b2"])
                # torch: exp_avg / bc1 * lr, times (bc2 ** 0.5 / (sqrt(v) + eps)) * rect once
                # rectified; ``bc2_sqrt / s`` is ``s.reciprocal() * bc2_sqrt`` (Tensor.__rdiv__).
                # Unrectified, both factors are exactly 1: the same products as eager's branch.
                rectified = st["rectify"] > 0
                adaptive = st["exp_avg_sq"].sqrt().add_(c["eps"]).reciprocal() * st["bc2_sqrt"]
                change = (st["exp_avg"] / st["bc1"] * c["lr"]
                          * torch.where(rectified, adaptive, 1.0) * torch.where(rectified, st["rect"], 1.0))
                p.add_(change, alpha=-1.0)
            elif name == "NAdam":
                if on["weight_decay != 0"] and on["decoupled weight decay"]:
                    p.mul_(c["decay"])
                if "step" in st:  # counted on the device: the schedule computed there
                    st["bc2"], st["grad_coef"], st["avg_coef"] = _nadam_coefficients(
                        st, c, _kernel_scalar(p))
                st["exp_avg"].lerp_(g, c["one_minus_b1"])
                st["exp_avg_sq"].mul_(c["b2"]).addcmul_(g, g, value=c["one_minus_b2"])
                denom = st["exp_avg_sq"].div(st["bc2"]).sqrt().add_(c["eps"])
                _addcdiv(p, g, denom, st["grad_coef"])
                _addcdiv(p, st["exp_avg"], denom, st["avg_coef"])
            else:
                if on["weight_decay != 0"] and on["decoupled weight decay"]:
                    p.mul_(c["decay"])
                st["exp_avg"].lerp_(g, c["one_minus_b1"])
                st["exp_avg_sq"].mul_(c["b2"]).addcmul_(g, g, value=c["one_minus_b2"])
                if "step" in st:  # counted on the device: the corrections computed there
                    st["neg_step_size"], st["bc2_sqrt"] = _adam_corrections(st["step"], c,
                                                                            _kernel_scalar(p))
                # Bias corrections change every step: 0-d tensor inputs
                # (-lr / (1 - b1^t) and (1 - b2^t) ** 0.5), not constants.
                second = st["exp_avg_sq"]
                if on["amsgrad"]:  # torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
                    second = st["max_exp_avg_sq"].copy_(torch.maximum(st["max_exp_avg_sq"],
                                                                      second))
                denom = (second.sqrt() / st["bc2_sqrt"]).add_(c["eps"])
                _addcdiv(p, st["exp_avg"], denom, st["neg_step_size"])


def _as_real_pairs(p, g, st: dict) -> tuple:
    """A complex parameter, its gradient and its complex state tensors as
    real views (``torch.view_as_real``); in-place updates write through."""
    import torch

    return (torch.view_as_real(p), torch.view_as_real(g),
            {n: torch.view_as_real(t) if t.is_complex() else t for n, t in st.items()})


def _addcdiv(p, a, b, value) -> None:
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


def _kernel_scalar(p):
    """The type a kernel reads a Python scale in for parameter ``p``: float64
    for float64, float32 for the rest (half types compute in float32)."""
    import torch

    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _adam_corrections(step, c: dict[str, float], dtype) -> tuple:
    """Adam's -lr / (1 - b1^t) and (1 - b2^t) ** 0.5 from its step tensor, on
    the device, moving the step on (t = step + 1), in float64 as torch's
    host code computes them (a tensor exponent: ``** 0.5`` is libm's pow,
    not a square root), then in ``dtype`` as the kernels take them
    (``_kernel_scalar``)."""
    import torch

    t = step + 1
    step.copy_(t)
    td = t.double()
    full = _float64_on(step.device)
    bc1 = 1 - torch.pow(full(c["b1"]), td)
    bc2 = 1 - torch.pow(full(c["b2"]), td)
    neg_step_size = -(full(c["lr"]) / bc1)
    return neg_step_size.to(dtype), torch.pow(bc2, full(0.5)).to(dtype)


def _adagrad_rate(step, c: dict[str, float], dtype):
    """Adagrad's -lr / (1 + (t - 1) * lr_decay) from its step tensor (already
    moved on), on the device, in float64 as torch's host code computes it,
    then in ``dtype`` as the kernels take it."""
    full = _float64_on(step.device)
    return (-(full(c["lr"]) / (1 + (step.double() - 1) * full(c["lr_decay"])))).to(dtype)


def _radam_factors(t: float, b1: float, b2: float) -> tuple[float, float, float, float]:
    """RAdam's 1 - b1^t, (1 - b2^t) ** 0.5, its rectification and whether it
    applies (rho_t > 5), at step ``t``, as torch's single-tensor RAdam
    computes them on the host (the rectification is 1 when it does not apply,
    where torch's expression has no real value)."""
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * (b2 ** t) / bc2
    if rho_t <= 5.0:
        return bc1, bc2 ** 0.5, 1.0, 0.0
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
    return bc1, bc2 ** 0.5, rect, 1.0


def _radam_on_device(step, c: dict[str, float], dtype) -> tuple:
    """``_radam_factors`` from RAdam's step tensor, on the device, moving the
    step on, in float64 as the host computes them, then in ``dtype`` as the
    kernels take them."""
    import torch

    t = step + 1
    step.copy_(t)
    td = t.double()
    full = _float64_on(step.device)
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


def _nadam_coefficients(st: dict, c: dict[str, float], dtype) -> tuple:
    """NAdam's 1 - b2^t and its two update coefficients from its step and
    mu_product tensors, on the device, moving both on, in float64 as
    torch's host code computes them (mu_product itself float32, as eager
    keeps it), then in ``dtype`` as the kernels take them."""
    import torch

    step, product = st["step"], st["mu_product"]
    t = step + 1
    step.copy_(t)
    td = t.double()
    full = _float64_on(step.device)
    decay, b1 = full(c["momentum_decay"]), full(c["b1"])
    mu = b1 * (1.0 - 0.5 * torch.pow(full(0.96), td * decay))
    mu_next = b1 * (1.0 - 0.5 * torch.pow(full(0.96), (td + 1) * decay))
    product.mul_(mu.float())
    p = product.double()
    neg_lr = -full(c["lr"])
    bc2 = 1 - torch.pow(full(c["b2"]), td)
    return (bc2.to(dtype), (neg_lr * (1.0 - mu) / (1.0 - p)).to(dtype),
            ((neg_lr * mu_next) / (1.0 - p * mu_next)).to(dtype))


def _float64_on(device):
    """A maker of 0-d float64 tensors on ``device``: the host's arithmetic of
    the step-dependent factors, done where the step count lives."""
    import torch

    def full(v: float):
        return torch.full((), v, dtype=torch.float64, device=device)

    return full
