"""What an optimizer is to a captured step, as one class per optimizer: its
structure (what shapes its update graph), its constants, its state tensors,
the 0-d inputs it takes every step and its update, as torch.optim's
single-tensor implementation computes them. ``register`` puts a rule in
``RULES`` by the names of the torch.optim classes it follows; an optimizer
without a rule is refused by name (``rule_for``), never given another's
update.

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations


class OptimizerError(ValueError):
    """An optimizer or a setting the captured step cannot follow; the message
    names the fix."""


class OptimizerRule:
    """One optimizer's update (see the module's opening). Subclasses set the
    class attributes and write the methods; a group is one of
    ``optimizer.param_groups``, ``on`` its ``structure`` as a dict, ``c``
    its ``constants``."""

    # 0-d inputs each step cohort takes every step (computed on the host as
    # torch computes them), in this order; with a GradScaler, which may skip
    # a step, the update computes them on the device from its step count.
    scalars: tuple[str, ...] = ()
    # It counts steps (``optimizer.state[p]["step"]``); SGD counts none.
    counts_steps: bool = True
    # The state tensors that count steps on the device under a GradScaler.
    device_state: tuple[str, ...] = ("step",)
    # Its multi-tensor (foreach) update rounds otherwise than the
    # single-tensor one on the CPU (measured: NAdam, RAdam).
    foreach_differs_on_cpu: bool = False
    # Weight decay is decoupled always (AdamW), else where the group says so.
    always_decoupled: bool = False
    # A complex parameter is viewed as real pairs before coupled weight
    # decay (NAdam, RAdam), else after it; SGD never views it so.
    pairs_before_decay: bool = False
    complex_as_pairs: bool = True

    def decoupled(self, group: dict) -> bool:
        return self.always_decoupled or bool(group.get("decoupled_weight_decay"))

    def structure(self, group: dict, wd: tuple, maximize: tuple) -> tuple:
        """What shapes the update of ``group``: (what, value) pairs; ``wd``
        and ``maximize`` are the pairs every optimizer has."""
        raise NotImplementedError

    def constants(self, group: dict) -> dict[str, float]:
        raise NotImplementedError

    def state_names(self, group: dict) -> list[str]:
        """The state tensors the update reads and writes per parameter."""
        raise NotImplementedError

    def scalar_inputs(self, group: dict, t: float, state: dict) -> list[float]:
        """The ``scalars`` at step ``t``; ``state`` the cohort's first
        parameter's (NAdam keeps its schedule's product there)."""
        return []

    def after_count(self, group: dict, state: dict, t: float) -> None:
        """What the host keeps beside the step count, moved on to step ``t``."""

    def update(self, p, g, st: dict, c: dict, on: dict) -> None:
        """The update of one parameter, in place, after maximize and coupled
        weight decay (``state.update`` applies them)."""
        raise NotImplementedError


RULES: dict[str, OptimizerRule] = {}


def register(*names: str):
    """Class decorator: the rule follows the torch.optim classes ``names``."""

    def add(cls):
        for name in names:
            RULES[name] = cls()
        return cls

    return add


def rule_for(optimizer) -> tuple[str, OptimizerRule]:
    """The optimizer's name and rule; an error naming those there are."""
    name = type(optimizer).__name__
    rule = RULES.get(name)
    if rule is None:
        raise OptimizerError(f"capture supports the optimizers {', '.join(RULES)}; got {name}")
    return name, rule


# Settings that select another implementation of the update than the
# single-tensor one the captured step reproduces (foreach rounds alike on the
# CPU, but where a rule says otherwise, refused below).
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


def refuse_other_implementations(name: str, rule: OptimizerRule, group: dict) -> None:
    """An update the captured step would compute otherwise than eager
    ``optimizer.step()``: refused with the fix, never trained silently."""
    for setting, why in OTHER_IMPLEMENTATIONS.items():
        if group.get(setting):
            raise OptimizerError(f"capture does not support {name}({setting}=True): {why}")
    # On the CPU the default is the single-tensor update, bit for bit. (On
    # CUDA the default is multi-tensor for every optimizer: the same
    # training, not bit for bit; docs/guide.)
    on_cpu = all(p.device.type == "cpu" for p in group["params"])
    if group.get("foreach") and rule.foreach_differs_on_cpu and on_cpu:
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
