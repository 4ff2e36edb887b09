"""A model's training step, captured once and run with the model's real
tensors: what every executor runs.

``CapturedStep`` traces forward, backward and the optimizer's in-place
update as one FX graph (``waterwave.capturing``), keeps the graph the
planners see, and assembles each step's inputs: the parameters and buffers
(updated in place by the graph), the optimizer state (continuing from the
optimizer's, if it has any), Adam's bias corrections for the step, and the
batch. ``reorder`` gives a copy of the FX graph whose operators run in
another order.

May import: waterwave.planner; torch.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..capturing import fake_step, guards, optimizers
from ..capturing.keywords import input_names
from ..capturing.trace_cache import TRACES
from ..planner.plan import PlanError

# Captures run one at a time: tracing swaps torch's dispatch modes and
# patches the optimizer while it runs, and trials of a search (Optuna's
# n_jobs) build their jobs on several threads at once.
_CAPTURE_LOCK = threading.Lock()


def grad_mode():
    """The grad mode a captured step runs in: the one it was traced in, on.
    Its tensors require no gradient, so autograd records nothing; but some
    kernels read the mode (mkldnn's RNN layers on the CPU leave out the
    workspace their backward needs when gradients are off)."""
    import torch

    return torch.enable_grad()


def batches_per_step(accumulate_grad_batches) -> int:
    """A Job's or optimize's ``accumulate_grad_batches``, checked: a whole
    number, at least 1."""
    k = accumulate_grad_batches
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"accumulate_grad_batches must be a whole number, at least 1; got {k!r}")
    return k


class CapturedStep:
    def __init__(self, model, example_inputs: Sequence[Any], loss_fn: Callable | None, optimizer,
                 example_targets=None, name: str | None = None,
                 clip: optimizers.GradClip | None = None, micro_batches: int = 1,
                 autocast_dtype=None, grad_scaler=None):
        import torch

        example_inputs = fake_step.as_tuple(example_inputs)
        example_targets = fake_step.as_tuple(example_targets)
        self.model, self.optimizer = model, optimizer
        self.takes_targets = bool(example_targets)
        self.input_names = input_names(example_inputs)  # () where the model takes them in order
        self.example = (*example_inputs, *example_targets)
        # The step runs what it traced, so it records its own device's kernels.
        with _CAPTURE_LOCK:  # a model like one traced before takes its trace
            (traced, reads), self.reused = TRACES.trace(
                model, example_inputs, loss_fn, optimizer, example_targets, clip, micro_batches,
                autocast_dtype, grad_scaler)
        self.gm, roles, names, grads, self.sites = traced
        if reads.tensor_state:
            where, attr = reads.tensor_state[0]
            raise fake_step.CaptureError(
                f"{'module ' + where if where else 'the model'}'s attribute {attr!r} is read "
                "and then set to a tensor by the step (a running value kept as a plain "
                "attribute), which a captured step cannot carry from step to step: register it "
                f"as a buffer (self.register_buffer({attr!r}, ...)) and update it in place")
        self.device = fake_step.model_device(model, example_inputs)
        self.micro_batches = micro_batches
        # The user's GradScaler: its scale and growth tracker are the step's
        # inputs, updated in place, so get_scale() and state_dict() follow.
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() \
            else None
        meta = {"optimizer": type(optimizer).__name__, "kernels": self.device,
                "micro_batches": micro_batches,
                "autocast_dtype": None if autocast_dtype is None else str(autocast_dtype),
                "input_shapes": [list(x.shape) for x in example_inputs
                                 if isinstance(x, torch.Tensor)]}
        self.graph = fake_step.graph_from_trace(self.gm, roles, names, grads,
                                                name or type(model).__name__, meta)
        traced = {n for n, role in zip(names, roles) if role == "param"}
        trained = [t for t in fake_step.trained_parameters(model, optimizer) if t[0] in traced]
        self.params = [p for _, p, _ in trained]
        self.groups = [k for _, _, k in trained]  # each parameter's group
        # Each parameter's step cohort (its group's parameters at one step
        # count, as the trace laid out their bias corrections) and each
        # cohort's group.
        self.cohorts, self.cohort_groups = optimizers.step_cohorts(optimizer, self.params,
                                                                   self.groups)
        self.buffers = [b for _, b in model.named_buffers()]
        self.shapes = optimizers.structure(optimizer)  # what the update is shaped by
        self.constants = optimizers.constants(optimizer)  # the values in the graphs now
        # The groups' settings as the last step's checks found them, and
        # each group's state names then: None until a step checks.
        self.settings_checked: optimizers.GroupSettings | None = None
        self.state_names: list[list[str]] = []
        # Every module whose graph holds the update's constants, and whether it
        # runs as compiled code (then a change recompiles it: 54 ms for
        # resnet50's step) or node by node (then the patched nodes suffice).
        self.modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary({self.gm: False})
        self.guard = guards.StepGuard(model, self.device, reads.read, loss_fn)
        self.attribute_outputs = reads.outputs  # what clear_step_outputs marks
        self.steps = 0  # steps run through this capture
        # Parameters whose optimizer state a step under a GradScaler made
        # (forget_skipped_state): gone again if every step skipped them.
        self.fresh_state: list = []
        self.variant = self.variant_now()  # what a Job follows by capturing again

    @property
    def device_steps(self) -> bool:
        """The optimizer's steps are counted on the device (with a
        GradScaler, whose skipped steps must not count)."""
        return (self.grad_scaler is not None
                and type(self.optimizer).__name__ in optimizers.DEVICE_STEPS)

    @property
    def host_counts_steps(self) -> bool:
        """Each step counts the optimizer's steps on the host, a cohort at a
        time (``optimizers.count_step``)."""
        return optimizers.rule_for(self.optimizer)[1].counts_steps and not self.device_steps

    def variant_now(self) -> tuple:
        """What the capture depends on that a user changes between epochs,
        as the model and its optimizer are now: each module's train/eval
        mode, which parameters require grad (a backbone unfrozen), each
        parameter's optimizer group (``add_param_group``), what shapes the
        update (``optimizers.structure``: momentum set from 0, say) and,
        where the host computes bias corrections, which parameters share a
        step count (``optimizers.step_cohorts``). ``Job.train`` captures the
        step again when it differs from ``variant``, as eager training simply
        runs in the new setting; ``ConcurrentTrainer`` and ``optimize``
        refuse the change (``check_context``, ``flat_inputs``)."""
        opt = self.optimizer
        modes = tuple((name, m.training) for name, m in self.model.named_modules())
        params = list(self.model.parameters())
        frozen = tuple(not p.requires_grad for p in params)
        group_of = {id(p): k for k, g in enumerate(opt.param_groups) for p in g["params"]}
        groups = tuple(group_of.get(id(p), -1) for p in params)
        cohorts: tuple = ()
        if self.host_counts_steps:
            trained = fake_step.trained_parameters(self.model, opt)
            cohorts = tuple(optimizers.step_cohorts(opt, [p for _, p, _ in trained],
                                                    [k for _, _, k in trained])[0])
        return modes, frozen, groups, tuple(optimizers.structure(opt)), cohorts

    def check_context(self) -> None:
        """On the caller's thread, before its steps: the model and the context
        (train/eval mode, parameters, hooks, autocast) are still as captured;
        ``guards.StaleCaptureError`` naming the change otherwise. Buffers
        replaced by others alike (``model.to()`` there and back, a running
        mean reset by assignment) are followed, as eager code follows them."""
        self.buffers = self.guard.check(self.model)

    def clear_step_outputs(self) -> None:
        """Before a call's steps, what an eager step would leave behind and
        the captured steps keep inside: every trained parameter's ``.grad``
        to None, as ``optimizer.zero_grad()`` leaves it, and each module
        attribute the step's code sets (an auxiliary loss kept as
        ``self.aux``) to a ``guards.SetInsideCapturedStep``. A value left
        from before (an eager step's gradients, an evaluation's ``aux``)
        would be stale after training, silently; these say plainly that
        there is none."""
        for p in self.params:
            p.grad = None
        guards.mark_outputs(self.attribute_outputs)

    def flat_inputs(self, inputs: Sequence[Any] = (), targets=None) -> list:
        """The next step's inputs, in the captured graph's order (the example
        batch when none is given), with the optimizer's state as it is in
        ``optimizer.state`` now and Adam's step counted there, and the
        groups' hyperparameters put in the graphs, as eager
        ``optimizer.step()`` reads them (``capturing/optimizers/``). A
        change of what shapes the update is an ``OptimizerError`` naming the
        fix."""
        import torch

        targets = fake_step.as_tuple(targets)
        if targets and not self.takes_targets or inputs and self.takes_targets and not targets:
            raise ValueError("this step was captured " + ("with" if self.takes_targets else
                                                          "without")
                             + " example targets: pass targets exactly when it was")
        data = (*inputs, *targets) if inputs else self.example
        if inputs:
            if input_names(inputs) != self.input_names:
                raise ValueError(f"a batch whose inputs are named {input_names(inputs)}; the "
                                 f"step was captured with {self.input_names}: give every batch "
                                 "the same keys, or make a Job for each")
            self._check_batch(data)
        opt = self.optimizer
        if self.settings_checked is not None and self.settings_checked.unchanged(opt):
            optimizers.ready_to_step(opt)  # what the checks below would find, they found
        else:
            optimizers.begin_step(opt, self.shapes)
            self._follow_hyperparameters()
            self.settings_checked = optimizers.GroupSettings(opt)
            self.state_names = [optimizers.state_names(opt, k, self.device_steps)
                                for k in range(len(opt.param_groups))]
        had = None if self.grad_scaler is None else [p in opt.state for p in self.params]
        state = optimizers.step_tensors(opt, self.params, self.groups, self.device_steps,
                                        self.state_names)
        if had is not None and not all(had):
            self.fresh_state += [p for p, h in zip(self.params, had) if not h and p in opt.state]
        scalars = []
        if not self.device_steps:  # else the step counts and corrects on the device
            steps = optimizers.count_step(opt, self.params, self.groups, self.cohorts,
                                          len(self.cohort_groups))
            scalars = [torch.tensor(v, dtype=torch.float64) for v in optimizers.scalar_inputs(
                opt, steps, self.cohort_groups, self.params, self.cohorts)]
        self.steps += 1
        scaler = []
        if self.grad_scaler is not None:
            gs = self.grad_scaler
            if gs._scale is None:  # as GradScaler.scale makes them, at its first use
                gs._lazy_init_scale_growth_tracker(self.params[0].device)
            scaler = [gs._scale, gs._growth_tracker]
        return ([p.detach() for p in self.params] + [b.detach() for b in self.buffers]
                + state + scalars + scaler + list(data))

    def forget_skipped_state(self) -> None:
        """After a call's steps: the optimizer state its steps made for
        parameters that no step since has updated goes again. Under a
        GradScaler, eager code never calls ``optimizer.step()`` for a step
        the scaler skips (an inf in the gradients, common while a float16
        run's scale settles), so the optimizer makes no state before its
        first good step; a captured step takes its state as inputs and makes
        it first. Adam and the others count their steps on the device: a
        count of 0 says no step updated the parameter. SGD's momentum buffer
        is the first good step's gradient: some parameter's is nonzero
        unless every step was skipped."""
        import torch

        fresh, self.fresh_state = self.fresh_state, []
        opt = self.optimizer
        fresh = [p for p in fresh if p in opt.state]
        if not fresh:
            return
        if self.device_steps:
            skipped = [c == 0 for c in _read_at_once([opt.state[p]["step"].double()
                                                      for p in fresh])]
        else:
            stepped = any(_read_at_once([t.ne(0).any() for p in fresh
                                         for t in opt.state[p].values()
                                         if isinstance(t, torch.Tensor)]))
            skipped = [not stepped] * len(fresh)
        for p, gone in zip(fresh, skipped):
            if gone:
                del opt.state[p]

    def _follow_hyperparameters(self) -> None:
        """Values the groups hold now, put where the update's constants sit in
        every module run from this capture (a scheduler changed lr, say)."""
        now = optimizers.constants(self.optimizer)
        if now != self.constants:
            for module, compiled in list(self.modules.items()):
                self.sites.patch(module.graph, now)
                if compiled:
                    module.recompile()
            self.constants = now

    def _check_batch(self, data: tuple) -> None:
        """A batch has the shapes and dtypes the step was captured with: the
        captured operators are shaped for them."""
        import torch

        if len(data) != len(self.example):
            raise ValueError(f"a batch of {len(data)} inputs and targets; the step was captured "
                             f"with {len(self.example)}")
        for i, (x, ex) in enumerate(zip(data, self.example)):
            if not isinstance(ex, torch.Tensor) and not _same_value(x, ex):
                raise ValueError(
                    f"batch item {i} is {x!r}; the step was captured with {ex!r}, and a "
                    "captured step holds a non-tensor item as the constant it was at capture: "
                    "pass it as a tensor (torch.tensor(value)), or capture once per value")
            if isinstance(ex, torch.Tensor) and (not isinstance(x, torch.Tensor)
                                                 or x.shape != ex.shape or x.dtype != ex.dtype):
                got = (f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor)
                       else type(x).__name__)
                raise ValueError(
                    f"batch item {i} is {got}; the step was captured with {tuple(ex.shape)} "
                    f"{ex.dtype}, and a captured step runs the shapes it was captured with: drop "
                    "a short last batch (DataLoader(drop_last=True)), or make a Job for each "
                    "shape")

    def reorder(self, order_names: list[str], in_place: frozenset[str] = frozenset(),
                compiled: bool = True):
        """A copy of the FX graph whose call nodes run in ``order_names``
        order; nodes the planner's graph dropped (views, metadata) go right
        before their first need. Nodes named in ``in_place`` run their
        operator's in-place overload, writing into their first argument (a
        plan's in-place pairs: that argument dies there). ``compiled``: the
        module will be called (its code is recompiled when a hyperparameter
        changes); else a ``NodeByNode``, run node by node."""
        from torch import fx

        old = self.gm.graph
        by_name = {n.name: n for n in old.nodes}
        new = fx.Graph()
        env: dict = {}
        for n in old.nodes:
            if n.op == "placeholder":
                env[n] = new.node_copy(n, lambda x: env[x])

        def emit(n):
            if n in env:
                return
            for a in n.all_input_nodes:
                emit(a)
            env[n] = new.node_copy(n, lambda x: env[x])
            if n.name in in_place:
                overload = fake_step.inplace_variant(n.target)
                if overload is None:
                    raise PlanError(f"the plan runs {n.name} ({n.target}) in place, but it has "
                                    "no in-place overload: re-plan from a fresh capture")
                env[n].target = overload

        # In-place writes must keep their place relative to readers: the
        # order respects those edges, and dropped nodes only read.
        for name in order_names:
            emit(by_name[name])
        for n in old.nodes:
            if n.op not in ("placeholder", "output"):
                emit(n)
            elif n.op == "output":
                new.output(fx.map_arg(n.args[0], lambda x: env[x]))
        new.lint()
        # Run node by node, the graph needs no module: making one generates
        # and compiles Python code that never runs (about 5 ms of the 30 a
        # digits MLP's trial spent setting up on the CPU).
        module = fx.GraphModule(self.gm, new) if compiled else NodeByNode(new, self.gm)
        self.modules[module] = compiled  # its constants follow the optimizer's too
        return module


class NodeByNode:
    """A reordered copy of a capture's graph that is run node by node
    (``GroupRunner``), never called as a module: the graph, and the module
    its ``get_attr`` and ``call_module`` nodes read (``root``)."""

    def __init__(self, graph, root):
        self.graph, self.root = graph, root


def _same_value(a, b) -> bool:
    """Two non-tensor batch items are the same constant to a captured step."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 (an object whose == is not a truth value)
        return False


def _read_at_once(values: list) -> list:
    """The 0-d tensors' values, read with one wait per device, not one each."""
    import torch

    by_device: dict = {}
    for i, v in enumerate(values):
        by_device.setdefault(v.device, []).append(i)
    out = [None] * len(values)
    for indices in by_device.values():
        for i, v in zip(indices, torch.stack([values[i] for i in indices]).tolist()):
            out[i] = v
    return out
