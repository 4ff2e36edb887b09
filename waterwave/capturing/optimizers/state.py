"""A captured step's optimizer, step by step, over the rules (``rule.py``,
one file per optimizer): what shapes each group's update (``structure``,
checked before every step), its constants, the state tensors it reads from
and leaves in ``optimizer.state`` (made as eager makes them), the step
counts and the 0-d inputs computed from them on the host, and the update
itself, traced into the step.

May import: this package; torch lazily.
"""
from __future__ import annotations

import sys

from .device_math import as_real_pairs
from .rule import OptimizerError, refuse_other_implementations, rule_for


def structure(optimizer) -> list[tuple]:
    """What each group's update graph is shaped by: read at capture, checked
    at every step (``begin_step``). Also refuses what the update cannot do."""
    name, rule = rule_for(optimizer)
    out = []
    for group in optimizer.param_groups:
        refuse_other_implementations(name, rule, group)
        # Decoupled weight decay multiplies the parameters by 1 - lr * wd,
        # exactly 1.0 at weight_decay=0 (x * 1.0 is x, bit for bit): always
        # in the graph, so a schedule may move weight_decay to and from 0.
        wd = ("weight_decay != 0", bool(group["weight_decay"]) or rule.decoupled(group))
        maximize = ("maximize", bool(group.get("maximize")))
        out.append(rule.structure(group, wd, maximize))
    return out


def constants(optimizer) -> list[dict[str, float]]:
    """Each group's constants, as the update uses them (derived ones
    included, computed as torch's implementation computes them)."""
    _, rule = rule_for(optimizer)
    # As Python floats: a numpy float64 would be written into the graph's
    # code as np.float64(...), which its namespace cannot evaluate.
    return [{k: float(v) for k, v in rule.constants(g).items()} for g in optimizer.param_groups]


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


def begin_step(optimizer, captured: list[tuple]) -> None:
    """What an eager ``optimizer.step()`` call would see and leave, checked
    and left before a captured step: the groups are shaped as captured
    (``check_structure``), and ``ready_to_step``."""
    check_structure(optimizer, captured)
    ready_to_step(optimizer)


def ready_to_step(optimizer) -> None:
    """No step hooks wait to run (the captured update runs none: refused; a
    hook marked ``waterwave_not_in_captured_steps``, waterwave.sharing's,
    acts only in eager members' threads); and a learning-rate scheduler sees
    that the optimizer stepped (its flag, as its wrapper of ``step`` sets
    it), so it neither warns nor skips its first value."""
    # Imported already (the optimizer is one of its classes'); an import
    # statement here would cost every step a microsecond.
    torch_optimizer = sys.modules["torch.optim.optimizer"]
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks):
        hooks = [*optimizer._optimizer_step_pre_hooks.values(),
                 *optimizer._optimizer_step_post_hooks.values(),
                 *torch_optimizer._global_optimizer_pre_hooks.values(),
                 *torch_optimizer._global_optimizer_post_hooks.values()]
        hooks = sum(not getattr(h, "waterwave_not_in_captured_steps", False) for h in hooks)
        if hooks:
            raise OptimizerError(f"the optimizer has {hooks} step hook(s), which a captured "
                                 "step does not run: remove them (or run their work between "
                                 "steps)")
    optimizer._opt_called = True


class GroupSettings:
    """Every group's settings but its parameters (names, values and the
    values' types), as they were when a step's checks last ran: the
    structure, the refusals, the constants and the state's names are read
    from these alone, so while ``unchanged`` they would find what they found
    then. A step checks this instead (about a microsecond a group, where the
    checks take tens): a scheduler that moves lr, or a setting changed, sends
    the next step through them again."""

    __slots__ = ("keys", "values", "types")

    def __init__(self, optimizer) -> None:
        groups = optimizer.param_groups
        self.keys = [list(g) for g in groups]
        # Copies of lists and dicts (betas given as a list): one changed in
        # place must not compare equal to itself.
        self.values = [[list(v) if type(v) is list else dict(v) if type(v) is dict else v
                        for k, v in g.items() if k != "params"] for g in groups]
        # A value replaced by one of another type that compares equal (a
        # tensor lr for a float) selects other code in torch: not the same.
        self.types = [list(map(type, values)) for values in self.values]

    def unchanged(self, optimizer) -> bool:
        groups = optimizer.param_groups
        if len(groups) != len(self.keys):
            return False
        for g, keys, values, types in zip(groups, self.keys, self.values, self.types):
            now = [v for k, v in g.items() if k != "params"]
            if now != values or list(map(type, now)) != types or list(g) != keys:
                return False
        return True


def state_names(optimizer, group: int, device_steps: bool = False) -> list[str]:
    """The state tensors the optimizer keeps per parameter of ``group`` that
    the step updates; ``device_steps``: its step count too (counted on the
    device, where a GradScaler's skipped step must not count it)."""
    _, rule = rule_for(optimizer)
    names = rule.state_names(optimizer.param_groups[group])
    return [*names, *rule.device_state] if device_steps else names


def step_tensors(optimizer, params: list, groups: list[int], device_steps: bool = False,
                 names_by_group: list[list[str]] | None = None) -> list:
    """The state tensors of the next step, each parameter's in
    ``state_names`` order, as they are in ``optimizer.state`` now; missing
    ones are made (zeros, as PyTorch starts Adam's moments) and put there.
    ``names_by_group``: each group's ``state_names``, where the caller knows
    them still to hold (``GroupSettings``).

    SGD with momentum starts its buffer as the first gradient, undamped; the
    update from a zero buffer gives the same only without dampening, so a
    first step with dampening is refused."""
    import torch

    if names_by_group is None:
        names_by_group = [state_names(optimizer, k, device_steps)
                          for k in range(len(optimizer.param_groups))]
    out = []
    for p, k in zip(params, groups):
        names = names_by_group[k]
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
    counts it, and moved on there. Empty for an optimizer that counts none
    (SGD)."""
    import torch

    _, rule = rule_for(optimizer)
    if not rule.counts_steps:
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
        rule.after_count(optimizer.param_groups[k], st, t)
    return [steps.get(c, 1.0) for c in range(n_cohorts)]


def scalar_inputs(optimizer, steps: list[float], cohort_groups: list[int],
                  params: list | None = None, cohorts: list[int] | None = None) -> list[float]:
    """Each cohort's 0-d inputs at its step ``steps[c]`` (``step_cohorts``:
    ``cohort_groups[c]`` is its group), in the rule's ``scalars`` order,
    computed as torch's single-tensor implementations compute them (NAdam's
    from the mu_product ``count_step`` left in the state of the cohort's
    first parameter; at capture, with none, step 1's). Empty for an
    optimizer that takes none."""
    _, rule = rule_for(optimizer)
    if not rule.scalars:
        return []
    first = {}
    for p, c in zip(params or [], cohorts or []):
        first.setdefault(c, p)
    out = []
    for c, (k, t) in enumerate(zip(cohort_groups, steps)):
        out += rule.scalar_inputs(optimizer.param_groups[k], t,
                                  optimizer.state.get(first.get(c), {}))
    return out


def update(optimizer, params, grads, states, groups, shapes: list[tuple],
           consts: list[dict[str, float]]) -> None:
    """Apply the optimizer's update in place, as torch.optim's single-tensor
    implementations do: ``shapes[k]`` (``structure``) picks the operators of
    group k, ``consts[k]`` (``constants``, or ``sentinels`` while tracing)
    are their constants. ``states[i]`` is a dict of this parameter's state
    (with its group's 0-d inputs, the rule's ``scalars``), ``groups[i]`` its
    group."""
    import torch

    _, rule = rule_for(optimizer)
    with torch.no_grad():
        for p, g, st, k in zip(params, grads, states, groups):
            c, on = consts[k], dict(shapes[k])
            # As torch's: a complex parameter, its gradient and state updated
            # as real pairs (squares and roots per component), viewed so where
            # torch views them: some before coupled weight decay, the rest
            # after it (a complex add with alpha rounds otherwise).
            as_pairs = p.is_complex() and rule.complex_as_pairs
            if as_pairs and rule.pairs_before_decay:
                p, g, st = as_real_pairs(p, g, st)
                as_pairs = False
            if on["maximize"]:  # as torch's: the negated gradient, before weight decay
                g = -g
            if on["weight_decay != 0"] and not on.get("decoupled weight decay"):
                g = g.add(p, alpha=c["weight_decay"])
            if as_pairs:
                p, g, st = as_real_pairs(p, g, st)
            rule.update(p, g, st, c, on)
