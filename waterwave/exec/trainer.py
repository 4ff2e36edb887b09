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

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .. import cuda
from .._C import OutOfMemoryError
from ..capturing import as_tuple
from ..capturing.optimizers import GradClip
from ..planner import Plan, PlanError, check_plan, plan_from_trace
from ..planner import plan as make_plan
from .step import CapturedStep, batches_per_step, grad_mode


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
                 use_plan: bool = True, clip: GradClip | None = None, autocast_dtype=None,
                 accumulate_grad_batches: int = 1, grad_scaler=None):
        k = batches_per_step(accumulate_grad_batches)
        self.model = model
        self.optimizer = optimizer
        # Accumulating, a step takes k batches: captured on the example batch k times.
        inputs, targets = as_tuple(example_inputs), as_tuple(example_targets)
        self._captured = CapturedStep(model, inputs * k, loss_fn, optimizer, targets * k or None,
                                      clip=clip, micro_batches=k, autocast_dtype=autocast_dtype,
                                      grad_scaler=grad_scaler)
        self.graph = self._captured.graph
        self.plan: Plan = make_plan(self.graph, strategy, time_limit=time_limit)
        check_plan(self.graph, self.plan)
        order_names = [self.graph.nodes[v].name for v in self.plan.order]
        in_place = frozenset(self.graph.nodes[self.graph.producer(out)].name
                             for out, _ in self.plan.inplace)
        self.module = self._captured.reorder(order_names, in_place)
        self._params = self._captured.params
        self._plan_device = None
        if use_plan:
            device = _cuda_index(self._params)
            if device is not None and cuda.is_installed():
                self._plan_device = device
        self._loss_to_cpu = self._plan_device is not None  # see step()
        self._planned_steps = 0  # steps run since the trainer was made, on a GPU plan
        self._recorded = False
        self.trace_plan: dict = {}  # the packing of the recorded step

    def _install_recorded_plan(self) -> None:
        trace = cuda.stop_recording(self._plan_device)
        slots, arena, info = plan_from_trace(trace)
        self.trace_plan = {"allocations": len(slots), "arena_bytes": arena, **info}
        try:
            cuda.set_plan(slots, arena, device=self._plan_device, scope="device")
        except OutOfMemoryError as e:
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
        if self._plan_device is None:
            raise PlanError("this trainer's allocations do not follow its plan: that needs the "
                            "model on a GPU and waterwave.install_allocator() at process start")
        if not self._recorded:
            raise PlanError("the plan is installed after the second step, which it records: "
                            "run two steps first")
        return cuda.plan_stats(self._plan_device)

    def step(self, *inputs, targets=None):
        """One training step on ``inputs`` (and ``targets``, if the step was
        captured with them); returns the loss. Accumulating over k batches,
        ``inputs`` are the k batches' inputs one batch after another and
        ``targets`` theirs likewise (the loss returned is their mean). On a
        planned GPU run the loss comes back on the CPU: a GPU copy kept by
        the caller would occupy planned memory during the next step."""
        if bool(as_tuple(targets)) != self._captured.takes_targets:
            raise ValueError("this trainer was built "
                             + ("with" if self._captured.takes_targets else "without")
                             + " example targets: pass targets= to step() exactly when it was")
        self._captured.check_context()
        self._captured.clear_step_outputs()
        flat = self._captured.flat_inputs(inputs, targets)
        if self._plan_device is None:
            with grad_mode():
                loss = self.module(*flat)
            self._captured.forget_skipped_state()
            return loss.to("cpu") if self._loss_to_cpu else loss
        self._planned_steps += 1
        recording = not self._recorded and self._planned_steps >= 2  # the first one warms up
        if self._recorded:
            cuda.begin_step(self._plan_device)
        elif recording:
            cuda.start_recording(self._plan_device)
        try:
            with grad_mode():
                loss = self.module(*flat).to("cpu")
        except BaseException:
            if recording:
                cuda.stop_recording(self._plan_device)
            raise
        self._captured.forget_skipped_state()
        if recording:
            self._install_recorded_plan()
        return loss

    @property
    def order(self) -> list[str]:
        return [self.graph.nodes[v].name for v in self.plan.order]


def optimize(model, example_inputs: Sequence[Any], loss_fn: Callable | None = None, optimizer=None,
             strategy: str = "greedy", time_limit: float = 10.0, example_targets=None,
             use_plan: bool = True, clip_grad_norm: float | None = None,
             clip_grad_value: float | None = None, autocast_dtype=None,
             accumulate_grad_batches: int = 1, grad_scaler=None,
             clip_grad_norm_type: float = 2.0) -> Trainer:
    """Capture ``model``'s training step, plan it, and return a Trainer that
    runs each step in the planned order. With ``example_targets`` (e.g.
    class labels) the loss is ``loss_fn(model(*inputs), *targets)`` and each
    step takes ``targets=``. ``clip_grad_norm``, ``clip_grad_value``: the
    gradients are clipped before each update, as ``torch.nn.utils`` would
    (``clip_grad_norm_type``: ``clip_grad_norm_``'s ``norm_type``).
    ``autocast_dtype`` (bfloat16 or float16): the forward pass and the loss
    run inside ``torch.autocast``, as eager mixed-precision code runs them.
    ``accumulate_grad_batches`` k: each step takes k batches (``step(x1, x2,
    targets=(y1, y2))`` for k = 2), each batch's loss / k backpropagated and
    the gradients summed before one update, as the usual eager loop does.
    ``grad_scaler``: a ``torch.amp.GradScaler``, used as eager code uses it
    (scale, unscale_ before clipping, step, update), on the device with no
    host sync. These are ``Job``'s settings, with the same meaning. On a GPU
    with ``waterwave.install_allocator()`` the step's allocations follow the
    plan (see ``Trainer``)."""
    import torch

    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, example_inputs, loss_fn, optimizer, strategy, time_limit, example_targets,
                   use_plan, GradClip(clip_grad_norm, clip_grad_norm_type, clip_grad_value),
                   autocast_dtype, accumulate_grad_batches, grad_scaler)
