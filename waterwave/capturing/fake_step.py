"""Capture one full training step (forward, backward, optimizer update) of an
``nn.Module`` on the CPU with fake tensors: no GPU, no tensor memory.

The step is written as a pure function of (parameters, buffers, optimizer
state, inputs): ``torch.func.functional_call`` for the forward pass,
``torch.autograd.grad`` for the backward pass, and the optimizer's update
as in-place operations on the parameter and state tensors (the way
``torch.optim``'s single-tensor implementations write it). ``make_fx`` traces
it with ``tracing_mode="fake"``.

The FX graph becomes a ``waterwave.graph.Graph`` in ``trace_graph.py``.

May import: waterwave.graph; torch lazily.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..graph import Graph
from . import data_dependence, optimizers
from .cuda_kernels import cuda_kernels, emulating, own_kernels
from .keywords import Keywords, call_model, input_names
from .trace_graph import graph_from_trace, inplace_variant  # noqa: F401  (re-exported)

SUPPORTED_OPTIMIZERS = optimizers.SUPPORTED


class CaptureError(RuntimeError):
    pass


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - a dependency
        raise CaptureError("capture needs torch: pip install torch==2.14.1") from e
    return torch


def default_loss(output):
    """The loss of a step without a ``loss_fn``: the loss a model computed
    itself (a Hugging Face model given ``labels``: ``output.loss``), else
    the sum of its output (a benchmark's stand-in for a loss)."""
    torch = _torch()
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    own = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    if hasattr(output, "logits"):
        return output.logits.float().sum()
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state.float().sum()
    if isinstance(output, (tuple, list)):
        return default_loss(output[0])
    raise CaptureError(f"cannot derive a loss from a {type(output).__name__}; pass loss_fn")


def trained_parameters(model, optimizer, untrained: frozenset[str] = frozenset()
                       ) -> list[tuple[str, Any, int]]:
    """(name, parameter, parameter group) for each parameter the optimizer
    updates, in the model's order: the order of the traced step's first
    inputs. ``untrained``: names of parameters no gradient reaches, which
    eager ``optimizer.step()`` skips (their ``.grad`` stays None)."""
    group_of = {id(p): k for k, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return [(n, p, group_of[id(p)]) for n, p in model.named_parameters()
            if p.requires_grad and id(p) in group_of and n not in untrained]


@dataclass
class StepLayout:
    """How a traced step's flat inputs are laid out: parameters, buffers,
    optimizer state (per parameter, in ``optimizers.state_names`` order), each
    step cohort's 0-d inputs (``optimizers.SCALARS``; a cohort is a group's
    parameters at one step count, ``optimizers.step_cohorts``), the model's
    inputs, then the targets."""
    param_names: list[str]
    groups: list[int]             # each parameter's group
    param_states: list[list[str]]  # each parameter's state tensors
    buffer_names: list[str]
    n_scalar: int
    n_inputs: int
    n_targets: int
    optimizer: str = ""
    micro_batches: int = 1  # batches whose gradients one update sums (accumulation)
    scaler: bool = False    # a GradScaler's scale and growth tracker follow the scalars
    untrained: frozenset = frozenset()  # parameters no gradient reaches: not updated
    cohorts: list[int] = field(default_factory=list)  # each parameter's step cohort
    cohort_groups: list[int] = field(default_factory=list)  # each cohort's group
    input_names: tuple[str, ...] = ()  # keyword inputs' names (one batch's); () positional

    @property
    def scalar_names(self) -> tuple[str, ...]:
        """Each cohort's 0-d inputs (``optimizers.SCALARS``); none where the
        device counts the steps."""
        return optimizers.SCALARS.get(self.optimizer, ()) if self.n_scalar else ()

    @property
    def device_steps(self) -> bool:
        return any("step" in names for names in self.param_states)

    @classmethod
    def of(cls, model, optimizer, n_inputs: int, n_targets: int,
           micro_batches: int = 1, scaler: bool = False,
           untrained: frozenset[str] = frozenset(),
           input_names: tuple[str, ...] = ()) -> "StepLayout":
        named_params = trained_parameters(model, optimizer, untrained)
        if not named_params:
            raise CaptureError("the optimizer updates none of the model's parameters"
                               + (" that the loss's gradient reaches: check that the loss "
                                  "depends on the model's output" if untrained else ""))
        groups = [k for _, _, k in named_params]
        # With a GradScaler, Adam counts its steps on the device (a skipped
        # step must not count): its step tensors are inputs, no scalars.
        device_steps = scaler and type(optimizer).__name__ in optimizers.DEVICE_STEPS
        scalars = () if device_steps else optimizers.SCALARS.get(type(optimizer).__name__, ())
        cohorts, cohort_groups = optimizers.step_cohorts(
            optimizer, [p for _, p, _ in named_params], groups)
        return cls([n for n, _, _ in named_params], groups,
                   [optimizers.state_names(optimizer, k, device_steps) for k in groups],
                   [n for n, _ in model.named_buffers()],
                   len(scalars) * len(cohort_groups), n_inputs, n_targets,
                   type(optimizer).__name__, micro_batches, scaler, frozenset(untrained),
                   cohorts, cohort_groups, tuple(input_names))

    def split(self, flat):
        """(params, buffers, state, scalars, scaler, inputs, targets) of the flat inputs."""
        bounds = [len(self.param_names), len(self.buffer_names),
                  sum(len(s) for s in self.param_states), self.n_scalar, 2 * self.scaler,
                  self.n_inputs]
        parts, start = [], 0
        for n in bounds:
            parts.append(list(flat[start:start + n]))
            start += n
        return (*parts, list(flat[start:]))

    def roles(self) -> list[str]:
        n_state = sum(len(s) for s in self.param_states) + self.n_scalar + 2 * self.scaler
        return (["param"] * len(self.param_names) + ["buffer"] * len(self.buffer_names)
                + ["optimizer_state"] * n_state + ["input"] * (self.n_inputs + self.n_targets))

    def names(self) -> list[str]:
        names = self.param_names + self.buffer_names
        names += [f"{p}.{s}" for p, ss in zip(self.param_names, self.param_states) for s in ss]
        if self.n_scalar:  # a group's own name while it is one cohort
            parts = {k: self.cohort_groups.count(k) for k in self.cohort_groups}
            seen: dict[int, int] = {}
            for k in self.cohort_groups:
                j = seen[k] = seen.get(k, -1) + 1
                where = f"group{k}" + (f".cohort{j}" if parts[k] > 1 else "")
                names += [f"{self.optimizer.lower()}.{where}.{s}" for s in self.scalar_names]
        if self.scaler:
            names += ["grad_scaler.scale", "grad_scaler.growth_tracker"]
        names += [f"input{i}" for i in range(self.n_inputs)]
        return names + [f"target{i}" for i in range(self.n_targets)]


def _step_function(model, loss_fn, optimizer, layout: StepLayout, grads_seen: list,
                   clip: optimizers.GradClip, shapes: list[tuple], consts: list[dict],
                   autocast: tuple[str, Any] | None = None,
                   scaling: tuple[float, float, int] | None = None,
                   no_gradient: set | None = None):
    """The training step as a pure function of the flat inputs: forward,
    backward, and the optimizer's update in place; returns the loss. The
    names of parameters no batch's gradient reaches go into
    ``no_gradient``."""
    torch = _torch()
    from torch.func import functional_call

    per_cohort = layout.scalar_names
    # Parameters eager's step skips are the model's own, not inputs: what
    # the forward pass does with them (nothing, or without gradient) reads them.
    untrained = {n: p.detach() for n, p in model.named_parameters() if n in layout.untrained}
    # The model and its loss as one call, the model's tensors swapped for
    # the step's during both: a loss that reads the model's parameters (an
    # L2 penalty over model.parameters()) reads the traced ones and
    # backpropagates into them, as eager's does.
    model_and_loss = _model_and_loss(model, loss_fn, layout.input_names)

    def step(*flat):
        params, buffers, state_flat, scalars, scaler, inputs, targets = layout.split(flat)
        tensors = dict(zip(layout.param_names, params))
        tensors.update(untrained)
        tensors.update(zip(layout.buffer_names, buffers))
        tensors = {"model." + name: t for name, t in tensors.items()}
        # Gradient accumulation, as eager code does it: each batch's loss / k
        # backward in turn, the gradients summed in batch order (.grad += g).
        k = layout.micro_batches
        n_in, n_t = len(inputs) // k, len(targets) // k
        grads, losses = None, []
        reached = [False] * len(params)
        for i in range(k):
            # Mixed precision as eager code runs it: the forward pass and the
            # loss inside torch.autocast, backward and the update outside.
            with (torch.autocast(autocast[0], dtype=autocast[1]) if autocast
                  else contextlib.nullcontext()):
                loss = functional_call(model_and_loss, tensors,
                                       (tuple(inputs[i * n_in:(i + 1) * n_in]),
                                        tuple(targets[i * n_t:(i + 1) * n_t])))
            _check_loss(loss)
            losses.append(loss)
            scaled = loss / k if k > 1 else loss
            if scaling:  # GradScaler.scale(loss): backward from loss * scale
                scaled = scaled * scaler[0]
            part = torch.autograd.grad(scaled, params, allow_unused=True)
            reached = [r or g is not None for r, g in zip(reached, part)]
            # A parameter one batch reaches and another does not: eager's .grad
            # sums the batches that reach it, as adding zeros does.
            part = [g if g is not None else torch.zeros_like(p) for g, p in zip(part, params)]
            grads_seen.extend(part)
            grads = part if grads is None else [a + b for a, b in zip(grads, part)]
        if no_gradient is not None:
            no_gradient.update(n for n, r in zip(layout.param_names, reached) if not r)
        if k > 1:  # the step's loss: the batches' mean
            loss = sum(losses[1:], losses[0]).detach() / k
            grads_seen.extend(grads)
        if scaling:  # GradScaler.unscale_: the gradients / scale, and whether any is inf/NaN
            found_inf = torch.full((), 0.0, dtype=torch.float32, device=scaler[0].device)
            inv_scale = scaler[0].double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        grads = clip.apply(grads)
        states = []
        next_state = iter(state_flat)
        for names, c in zip(layout.param_states, layout.cohorts):
            st = {name: next(next_state) for name in names}
            m = len(per_cohort)
            st.update(zip(per_cohort, scalars[m * c:m * c + m]))
            states.append(st)
        written = [p.detach() for p in params] + list(state_flat)
        if scaling:  # what the update writes, to put back if the step is skipped
            before = [t.clone() for t in written]
        optimizers.update(optimizer, [p.detach() for p in params], grads, states, layout.groups,
                          shapes, consts)
        if scaling:
            # GradScaler.step skips optimizer.step() when a gradient was inf or
            # NaN; here, with no host sync, the update's writes are undone on
            # the device. Then GradScaler.update's scale and growth tracker.
            skip = found_inf > 0
            for t, old in zip(written, before):
                t.copy_(torch.where(skip, old, t))
            torch._amp_update_scale_(scaler[0], scaler[1], found_inf, *scaling)
        return loss

    return step


def _model_and_loss(model, loss_fn, names: tuple[str, ...] = ()):
    """A module whose call is ``loss_fn(model(*inputs), *targets)`` (the
    inputs by ``names`` where they are keyword inputs), holding the model as
    its child ``model`` (the model itself is unchanged)."""
    torch = _torch()

    class ModelAndLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.__dict__["loss_fn"] = loss_fn  # not a child: its parameters are not the step's

        def forward(self, inputs, targets):
            return self.loss_fn(call_model(self.model, inputs, names), *targets)

    return ModelAndLoss()


def _check_loss(loss) -> None:
    """The loss is what ``loss.backward()`` takes: a tensor of one number."""
    torch = _torch()
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(f"the loss function returned a {type(loss).__name__}; a step "
                           "backpropagates from one number, as loss.backward() does: return "
                           "the loss tensor alone")
    if loss.numel() != 1:
        raise CaptureError(f"the loss has shape {list(loss.shape)}; a step backpropagates from "
                           "one number, as loss.backward() does: reduce it (.mean(), or "
                           "reduction='mean')")


def _example_flat(model, optimizer, layout: StepLayout, example_inputs, example_targets) -> list:
    """Flat inputs to trace with: copies of the parameters (requiring grad),
    buffers, zero optimizer state, Adam's step-1 scalars, inputs, targets."""
    torch = _torch()
    with torch.no_grad():
        params = [p for _, p, _ in trained_parameters(model, optimizer, layout.untrained)]
        flat = [p.detach().clone() for p in params]
        flat += [b.detach().clone() for _, b in model.named_buffers()]
        for p, names in zip(params, layout.param_states):
            # step and mu_product: 0-d, in the default dtype, as step_tensors keeps them
            flat += [torch.zeros((), device=p.device) if n in ("step", "mu_product")
                     else torch.zeros_like(p) for n in names]
        if layout.n_scalar:
            steps = [1.0] * len(layout.cohort_groups)
            flat += [torch.tensor(v, dtype=torch.float64)  # see optimizers.SCALARS
                     for v in optimizers.scalar_inputs(optimizer, steps, layout.cohort_groups)]
        if layout.scaler:
            device = params[0].device
            flat += [torch.full((), 65536.0, dtype=torch.float32, device=device),
                     torch.zeros((), dtype=torch.int32, device=device)]
        flat += [x.detach().clone() if isinstance(x, torch.Tensor) else x
                 for x in (*example_inputs, *example_targets)]
    for x in flat[:len(params)]:
        x.requires_grad_(True)
    return flat


def _refuse_parameters_outside(model, optimizer, loss_fn) -> None:
    """The optimizer trains only the model's parameters: a step traces the
    model's as its inputs, and would hold any other (a loss module's
    temperature, a free tensor) fixed where eager training updates it."""
    torch = _torch()
    ours = {id(p) for p in model.parameters()}
    outside = [p for g in optimizer.param_groups for p in g["params"]
               if p.requires_grad and id(p) not in ours]
    if not outside:
        return
    named = {}
    if isinstance(loss_fn, torch.nn.Module):
        named = {id(p): "loss_fn." + n for n, p in loss_fn.named_parameters()}
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    shapes = {tuple(p.shape) for p in outside}
    replaced = [n for n, p in model.named_parameters()
                if id(p) not in trained and tuple(p.shape) in shapes]
    if replaced:  # a parameter assigned anew after the optimizer was made
        raise CaptureError(
            f"the model's parameter {replaced[0]!r} is not the tensor the optimizer trains, and "
            f"the optimizer trains {len(outside)} tensor(s) of its shape outside the model: a "
            "parameter replaced after the optimizer was made (module.weight = "
            "nn.Parameter(...)) leaves the optimizer training the old one, eagerly too. Copy "
            "the new values in place instead (with torch.no_grad(): "
            f"model.get_parameter({replaced[0]!r}).copy_(new)), or make a new optimizer and a "
            "new Job")
    shown = ", ".join(named.get(id(p), f"a tensor of shape {list(p.shape)}") for p in outside[:3])
    raise CaptureError(
        f"the optimizer trains {len(outside)} parameter(s) that are not the model's ({shown}); "
        "a captured step updates the model's parameters, and would hold these fixed where "
        "eager training updates them: make them part of the model (a module that holds the "
        "model and them), or leave them out of the optimizer")


def _refuse_untraceable(model) -> None:
    """Models a capture cannot trace, refused up front with the fix."""
    torch = _torch()
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise CaptureError("the model is wrapped by torch.compile, whose compiled code a capture "
                           "cannot trace: give the module itself (model._orig_mod); the "
                           "captured step replaces what compiling would do")
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            raise CaptureError(f"module {name or 'the model'} ({type(m).__name__}) makes sparse "
                               "gradients (sparse=True), "
                               "which a captured step does not hold: use sparse=False")
    for name, p in model.named_parameters():
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            raise CaptureError(
                f"parameter {name} has a gradient hook (register_hook or "
                "register_post_accumulate_grad_hook), which a captured step does not run (its "
                "gradients are its own, not the parameter's): remove it, and change the "
                "gradient in the loss or the model, or clip with clip_grad_norm= or "
                "clip_grad_value=")


def check_step(model, example_inputs: Sequence[Any], loss_fn: Callable | None, optimizer,
               example_targets: Sequence[Any] = (), clip: optimizers.GradClip | None = None,
               micro_batches: int = 1, autocast_dtype=None, grad_scaler=None):
    """Every refusal of ``trace_step`` that comes before tracing (a model,
    optimizer, clipping or precision a captured step cannot train as eager
    PyTorch does), raised as ``CaptureError`` with its fix. Returns what
    the trace is shaped by: (update structure, gradient scaling, step
    layout, clipping, autocast)."""
    _refuse_untraceable(model)
    try:
        shapes = optimizers.structure(optimizer)  # also refuses what the update cannot do
    except optimizers.OptimizerError as e:
        raise CaptureError(str(e)) from None
    if example_targets and loss_fn is None:
        raise CaptureError("targets need a loss_fn(output, *targets) to go into")
    if len(example_inputs) % micro_batches or len(example_targets) % micro_batches:
        raise CaptureError(f"{micro_batches} batches of accumulation need inputs and targets "
                           f"for each: got {len(example_inputs)} inputs, {len(example_targets)} "
                           "targets")
    scaling = None
    if grad_scaler is not None and grad_scaler.is_enabled():
        scaling = (grad_scaler.get_growth_factor(), grad_scaler.get_backoff_factor(),
                   grad_scaler.get_growth_interval())
    _refuse_parameters_outside(model, optimizer, loss_fn)
    if scaling is not None:
        half = next((n for n, p, _ in trained_parameters(model, optimizer)
                     if p.dtype == _torch().float16), None)
        if half is not None:  # GradScaler.unscale_ raises here eagerly
            raise CaptureError(
                f"parameter {half} is float16, and a GradScaler does not unscale float16 "
                "gradients (torch raises 'Attempting to unscale FP16 gradients'): keep the "
                "parameters in float32 and train in float16 with autocast_dtype=torch.float16")
    layout = StepLayout.of(model, optimizer, len(example_inputs), len(example_targets),
                           micro_batches, scaling is not None,
                           input_names=input_names(example_inputs))
    clip = clip or optimizers.GradClip()
    try:
        optimizers.check_clip_covers(model, [p for _, p, _ in trained_parameters(model, optimizer)],
                                     clip)
    except optimizers.OptimizerError as e:
        raise CaptureError(str(e)) from None
    autocast = None
    if autocast_dtype is not None:
        torch = _torch()
        if autocast_dtype not in (torch.bfloat16, torch.float16):
            raise CaptureError(f"autocast_dtype must be torch.bfloat16 or torch.float16, got "
                               f"{autocast_dtype!r}")
        autocast = (model_device(model, example_inputs), autocast_dtype)
    return shapes, scaling, layout, clip, autocast


def trace_step(model, example_inputs: Sequence[Any], loss_fn: Callable | None, optimizer,
               example_targets: Sequence[Any] = (), clip: optimizers.GradClip | None = None,
               micro_batches: int = 1, autocast_dtype=None, grad_scaler=None):
    """Trace one training step. Returns (fx GraphModule, placeholder roles,
    placeholder names, gradient tensors seen while tracing, the update's
    ``optimizers.ConstantSites``). The module's inputs are laid out as
    ``StepLayout`` says, its constants are the optimizer's now; the loss is
    ``loss_fn(model(*inputs), *targets)``. ``micro_batches`` k: the inputs
    and targets are k batches' (the first's inputs, the second's, ..., then
    their targets likewise), each batch's loss / k backpropagated in turn,
    their gradients summed, then one update; the step returns their mean
    loss. ``autocast_dtype`` (bfloat16 or float16): the forward pass and the
    loss run inside ``torch.autocast`` on the model's device, as eager mixed
    precision code runs them; backward and the update outside.
    ``grad_scaler`` (an enabled ``torch.amp.GradScaler``): the loss
    is scaled, the gradients unscaled and checked, a step with an inf or NaN
    gradient undone, and the scale updated, as ``scale``, ``unscale_``,
    ``step`` and ``update`` do, on the device, with no host sync."""
    from torch.fx.experimental.proxy_tensor import make_fx

    shapes, scaling, layout, clip, autocast = check_step(
        model, example_inputs, loss_fn, optimizer, example_targets, clip, micro_batches,
        autocast_dtype, grad_scaler)
    traced_with = optimizers.sentinels(optimizers.constants(optimizer))
    grads_seen: list = []
    # Eager optimizer.step() skips a parameter whose .grad is None (no
    # momentum, no weight decay, no state): when the first trace finds
    # parameters no gradient reaches, the step is traced again without them.
    no_gradient: set = set()
    try:
        while True:
            grads_seen.clear()
            step = _step_function(model, loss_fn or default_loss, optimizer, layout, grads_seen,
                                  clip, shapes, traced_with, autocast, scaling, no_gradient)
            flat = _example_flat(model, optimizer, layout, example_inputs, example_targets)
            with _quiet_fake_tensor_log():
                gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
            if not no_gradient - layout.untrained:
                break
            layout = StepLayout.of(model, optimizer, len(example_inputs), len(example_targets),
                                   micro_batches, scaling is not None,
                                   frozenset(no_gradient | layout.untrained), layout.input_names)
        sites = optimizers.ConstantSites(gm.graph, traced_with)
    except CaptureError:
        raise
    except optimizers.OptimizerError as e:
        raise CaptureError(str(e)) from None
    except Exception as e:
        explained = data_dependence.explain_trace_error(e)
        if explained is not None:
            raise CaptureError(explained) from None
        hint = ""
        if len(example_targets) > micro_batches:  # several targets a batch: say where they go
            hint = (f" (the loss is called as loss_fn(output, *targets), the targets being "
                    f"each batch's items after its inputs: {len(example_targets) // micro_batches}"
                    " here)")
        raise CaptureError(f"tracing the training step failed: {type(e).__name__}: {e}"
                           f"{hint}") from e
    value_sized = data_dependence.value_sized_node(gm)
    if value_sized is not None:
        raise CaptureError(data_dependence.value_sized_message(value_sized))
    sites.patch(gm.graph, optimizers.constants(optimizer))
    gm.recompile()
    return gm, layout.roles(), layout.names(), grads_seen, sites


def as_tuple(xs) -> tuple:
    """One tensor, or a sequence of them, as a tuple; a dict (or
    ``Keywords``) as keyword inputs."""
    torch = _torch()
    if xs is None:
        return ()
    if isinstance(xs, Keywords):
        return xs
    if isinstance(xs, dict):
        return Keywords.of(xs)
    return (xs,) if isinstance(xs, torch.Tensor) else tuple(xs)


KERNELS = ("cuda", "cpu")


def model_device(model, example_inputs) -> str:
    """The device type ("cpu", "cuda") of the model's tensors, else its inputs'."""
    torch = _torch()
    for t in (*model.parameters(), *model.buffers(), *example_inputs):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensor logs an operator that fails (a model whose example input
    has the wrong shape) with its whole traceback, before raising the error
    that the capture turns into one CaptureError line; the log says nothing
    more, so it is held back while tracing."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(before)


def capture(model, example_inputs: Sequence[Any], loss_fn: Callable | None = None,
            optimizer=None, name: str | None = None, targets=None,
            kernels: str = "cuda", clip_grad_norm: float | None = None,
            clip_grad_value: float | None = None, autocast_dtype=None,
            clip_grad_norm_type: float = 2.0) -> Graph:
    """Record one training step of ``model`` as a Graph, with fake tensors.
    The loss is ``loss_fn(model(*example_inputs), *targets)``; ``targets``
    (one tensor or several, e.g. class labels) are optional.

    ``kernels`` is the device whose operators the graph records: "cuda"
    (the default; for a model on the CPU, dropout and attention take the
    kernels a CUDA device runs, see ``waterwave.capturing.cuda_kernels``) or "cpu"
    (a model on the CPU, as the CPU runs it). ``clip_grad_norm``,
    ``clip_grad_value``: the gradients are clipped before the update, as
    ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` would
    (``clip_grad_norm_type``: ``clip_grad_norm_``'s ``norm_type``).
    ``autocast_dtype`` (bfloat16 or float16): the forward pass and the loss
    inside ``torch.autocast``, as mixed-precision training runs them (their
    activations then take half the bytes)."""
    torch = _torch()

    if kernels not in KERNELS:
        raise CaptureError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    example_inputs = as_tuple(example_inputs)
    device = model_device(model, example_inputs)
    if kernels == "cpu" and device != "cpu":
        raise CaptureError(f"kernels='cpu' records a model on the CPU, and this one is on "
                           f"{device}: move it with model.cpu(), or capture with kernels='{device}'")
    emulate = kernels == "cuda" and device == "cpu"
    if not emulate and emulating():
        raise CaptureError(f"kernels='{kernels}' asks for PyTorch's own kernels, and this "
                           "capture runs inside cuda_kernels(): leave that block first")
    with cuda_kernels() if emulate else own_kernels():
        gm, roles, names, grads_seen, _ = trace_step(
            model, example_inputs, loss_fn, optimizer, as_tuple(targets),
            optimizers.GradClip(clip_grad_norm, clip_grad_norm_type, clip_grad_value),
            autocast_dtype=autocast_dtype)
    meta = {"optimizer": type(optimizer).__name__, "kernels": kernels,
            "input_shapes": [list(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]}
    return graph_from_trace(gm, roles, names, grads_seen, name or type(model).__name__, meta)
