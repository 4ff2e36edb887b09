"""Run training steps in a planned order: ``waterwave.optimize``.

The captured step (an FX graph of forward, backward and the optimizer's
in-place update) is reordered into the plan's operator order and run with
the model's real tensors: parameters and buffers are updated in place, and
the optimizer state lives in the trainer. On a GPU with the Waterwave
allocator installed, the step's allocations follow the plan's offsets (the
plan allocator of csrc/core, over the CUDA backend); on the CPU the order is
applied and results are bit-for-bit those of the same math in program order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..planner import Plan, PlanError, check_plan, plan_from_trace
from ..planner import plan as make_plan
from ..planner.capture import (
    adam_scalars,
    as_tuple,
    graph_from_trace,
    inplace_variant,
    model_device,
    state_names,
    trace_step,
    trained_parameters,
)


def _reorder(gm, order_names: list[str], in_place: frozenset[str] = frozenset()):
    """A copy of ``gm`` whose call nodes run in ``order_names`` order; nodes
    the graph dropped (views, metadata) go right before their first need.
    Nodes named in ``in_place`` run their operator's in-place overload,
    writing into their first argument (the plan's in-place pairs: that
    argument dies there)."""
    from torch import fx

    old = gm.graph
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
            overload = inplace_variant(n.target)
            if overload is None:
                raise PlanError(f"the plan runs {n.name} ({n.target}) in place, but it has no "
                                "in-place overload: re-plan from a fresh capture")
            env[n].target = overload

    # In-place writes must keep their place relative to readers: the plan's
    # order respects those edges, and dropped nodes only read.
    for name in order_names:
        emit(by_name[name])
    for n in old.nodes:
        if n.op not in ("placeholder", "output"):
            emit(n)
        elif n.op == "output":
            new.output(fx.map_arg(n.args[0], lambda x: env[x]))
    new.lint()
    return fx.GraphModule(gm, new)


def _cuda_index(tensors) -> int | None:
    """The CUDA device the tensors live on, or None when they are not on one."""
    for t in tensors:
        if t.device.type == "cuda":
            import torch

            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return None


class Trainer:
    """Runs training steps of ``model`` in the plan's operator order.

    With the model on a GPU and the Waterwave allocator installed
    (``waterwave.install_allocator()``), allocations follow a plan too. The
    first step runs in the plan's order on the online allocator (libraries
    set up their handles and caches); the second is recorded, and its
    blocks' lifetimes are packed exactly (``waterwave.pack``) into one
    arena; from the third step on, the k-th allocation of a step gets its
    offset there. Recording rather than taking the graph's offsets
    puts into the plan what the captured graph cannot show: cuDNN and cuBLAS
    workspaces, and outputs a CUDA kernel shapes otherwise than its fake
    tensor did. ``plan_stats()`` says how many allocations the plan served.
    ``use_plan=False`` keeps the order but leaves allocation to the online
    allocator."""

    def __init__(self, model, example_inputs: Sequence[Any], loss_fn: Callable | None, optimizer,
                 strategy: str = "greedy", time_limit: float = 10.0, example_targets=None,
                 use_plan: bool = True):
        import torch

        example_inputs = as_tuple(example_inputs)
        self.model = model
        self.optimizer = optimizer
        example_targets = as_tuple(example_targets)
        self._takes_targets = bool(example_targets)
        # The step runs what it traced, so it records its own device's kernels.
        gm, roles, names, grads = trace_step(model, example_inputs, loss_fn, optimizer,
                                             example_targets)
        kernels = model_device(model, example_inputs)
        self.graph = graph_from_trace(gm, roles, names, grads, type(model).__name__,
                                      {"optimizer": type(optimizer).__name__, "kernels": kernels})
        self.plan: Plan = make_plan(self.graph, strategy, time_limit=time_limit)
        check_plan(self.graph, self.plan)
        order_names = [self.graph.nodes[v].name for v in self.plan.order]
        in_place = frozenset(self.graph.nodes[self.graph.producer(out)].name
                             for out, _ in self.plan.inplace)
        self.module = _reorder(gm, order_names, in_place)
        trained = trained_parameters(model, optimizer)
        self._params = [p for _, p, _ in trained]
        self._buffers = [b for _, b in model.named_buffers()]
        # Optimizer state continues from the optimizer's, if it has any.
        self._state = []
        for _, p, group in trained:
            st = optimizer.state.get(p, {})
            for name in state_names(optimizer, group):
                self._state.append(st[name].detach() if name in st else torch.zeros_like(p))
        first = optimizer.state.get(self._params[0], {}).get("step", 0) if self._params else 0
        self._step = int(first)
        self._adam = type(optimizer).__name__ in ("Adam", "AdamW")
        self._plan_device = None
        if use_plan:
            from ..alloc import cuda

            device = _cuda_index(self._params)
            if device is not None and cuda.is_installed():
                self._plan_device = device
        self._loss_to_cpu = self._plan_device is not None  # see step()
        self._planned_steps = 0  # steps run since the trainer was made, on a GPU plan
        self._recorded = False
        self.trace_plan: dict = {}  # the packing of the recorded step

    def _install_recorded_plan(self) -> None:
        import warnings

        from .. import _C
        from ..alloc import cuda

        trace = cuda.stop_recording(self._plan_device)
        slots, arena, info = plan_from_trace(trace)
        self.trace_plan = {"allocations": len(slots), "arena_bytes": arena, **info}
        try:
            cuda.set_plan(slots, arena, device=self._plan_device)
        except _C.OutOfMemoryError as e:
            # The step's result is not lost over it: train on without a plan.
            warnings.warn(f"waterwave: training on without the plan: {e}", stacklevel=3)
            self._plan_device = None
            return
        self._recorded = True

    @property
    def planned_device(self) -> int | None:
        """The CUDA device whose allocations follow the plan, or None."""
        return self._plan_device

    def plan_stats(self) -> dict:
        """Planned and fallback allocations and deviations (planned GPU runs only)."""
        from ..alloc import cuda

        if self._plan_device is None:
            raise PlanError("this trainer's allocations do not follow its plan: that needs the "
                            "model on a GPU and waterwave.install_allocator() at process start")
        if not self._recorded:
            raise PlanError("the plan is installed after the second step, which it records: "
                            "run two steps first")
        return cuda.plan_stats(self._plan_device)

    def step(self, *inputs, targets=None):
        """One training step on ``inputs`` (and ``targets``, if the step was
        captured with them); returns the loss. On a planned GPU run the loss
        comes back on the CPU: a GPU copy kept by the caller would occupy
        planned memory during the next step."""
        import torch

        targets = as_tuple(targets)
        if bool(targets) != self._takes_targets:
            raise ValueError("this trainer was built " + ("with" if self._takes_targets else "without")
                             + " example targets: pass targets= to step() exactly when it was")
        inputs = (*inputs, *targets)
        self._step += 1
        scalars = [torch.tensor(v) for v in adam_scalars(self.optimizer, self._step)] if self._adam else []
        flat = ([p.detach() for p in self._params] + [b.detach() for b in self._buffers]
                + self._state + scalars + list(inputs))
        if self._plan_device is None:
            with torch.no_grad():
                loss = self.module(*flat)
            return loss.to("cpu") if self._loss_to_cpu else loss
        from ..alloc import cuda

        self._planned_steps += 1
        recording = not self._recorded and self._planned_steps >= 2  # the first one warms up
        if self._recorded:
            cuda.begin_step(self._plan_device)
        elif recording:
            cuda.start_recording(self._plan_device)
        try:
            with torch.no_grad():
                loss = self.module(*flat).to("cpu")
        except BaseException:
            if recording:
                cuda.stop_recording(self._plan_device)
            raise
        if recording:
            self._install_recorded_plan()
        return loss

    @property
    def order(self) -> list[str]:
        return [self.graph.nodes[v].name for v in self.plan.order]


def optimize(model, example_inputs: Sequence[Any], loss_fn: Callable | None = None, optimizer=None,
             strategy: str = "greedy", time_limit: float = 10.0, example_targets=None,
             use_plan: bool = True) -> Trainer:
    """Capture ``model``'s training step, plan it, and return a Trainer that
    runs each step in the planned order. With ``example_targets`` (e.g.
    class labels) the loss is ``loss_fn(model(*inputs), *targets)`` and each
    step takes ``targets=``. On a GPU with ``waterwave.install_allocator()``
    the step's allocations follow the plan (see ``Trainer``)."""
    import torch

    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, example_inputs, loss_fn, optimizer, strategy, time_limit, example_targets,
                   use_plan)
