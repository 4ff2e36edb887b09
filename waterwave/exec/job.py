"""``waterwave.Job``: one training job (a model, its loss, its optimizer and
its data), its step captured once; ``Job.train(steps)`` trains it in the
device's training session beside every other job training there
(``session.py``); ``ConcurrentTrainer`` trains a fixed set together.

May import: waterwave.capturing, waterwave.pipeline, this package; torch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..capturing import fake_step
from ..capturing.fake_step import CaptureError, default_loss
from ..capturing.keywords import Keywords, call_model, input_names
from ..capturing.optimizers import GradClip
from .batches import BatchFeed
from .between_calls import BetweenCalls
from .pipeline_settings import whole_steps
from .session import TrainingSession, training_session
from .sharing import NO_KEYWORDS, base_bytes, job_sharing, sharing
from .step import CapturedStep, batches_per_step


class Job:
    """One training job: a model, its loss and its optimizer, and what it
    trains on: ``data``, any re-iterable of ``(inputs..., targets...)``
    batches (a ``DataLoader``, a list), drawn a batch a step and iterated
    again each epoch, the first ``n_inputs`` items of a batch being the
    model's inputs; or of dicts, whose items go to the model by name
    (``model(**batch)``) but for ``target_keys``, which go to the loss in
    that order; or, without data, ``example_inputs`` (a tuple, or a dict of
    keyword inputs) and ``targets``, the batch every step trains on. The
    loss is ``loss_fn(model(*inputs), *targets)``; without ``loss_fn``, the
    loss the model computed (``output.loss``, as a Hugging Face model given
    ``labels`` returns it), else the sum of its output. The step is captured on
    ``example_inputs``, else on the data's first batch (which is then trained
    on first), when a plan first needs it: as the Job is made where its
    device's session captures (``training_session(capture=True)``), else
    when a ``ConcurrentTrainer`` or a capturing session first trains it
    (``captured``). A session that captures nothing (the default) trains its
    steps eagerly, each as its own loop would: with a budget (a GPU, or a
    ``memory_limit``) as a ``waterwave.sharing`` member.
    ``clip_grad_norm`` and ``clip_grad_value`` clip the gradients before each update, as
    ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over the
    model's parameters would (``clip_grad_norm_type``: the norm's order,
    ``clip_grad_norm_``'s ``norm_type``, 2.0 unless given).
    ``accumulate_grad_batches`` k: each step trains on the data's next k
    batches, each batch's loss / k backpropagated and the gradients summed
    before one update (clipping included), as the usual eager loop does; a
    step's loss is their mean. The data's batches an epoch must be a
    multiple of k. ``autocast_dtype`` (``torch.bfloat16``
    or ``torch.float16``): mixed precision, the forward pass and the loss
    inside ``torch.autocast`` on the model's device, as eager code runs them.
    ``grad_scaler``: a ``torch.amp.GradScaler``, used as
    eager code uses it (scale, unscale_ before clipping, step, update), on
    the device with no host sync: a step with an inf or NaN gradient is
    undone, and the scaler's scale and growth tracker move as its own
    ``update`` moves them. ``evaluation_memory``: bytes the calling thread
    allocates between ``train()`` calls (evaluation), which a capturing
    session keeps free for it; default: measured on a GPU under Waterwave's
    allocator, and until then the training step's own peak
    (``between_calls.py``). Eager members (the default) keep no such room,
    as ``waterwave.sharing`` keeps none: on a GPU without a ``memory_limit``
    their budget is measured again as each pass starts, after what was
    allocated between their blocks. ``step_schedulers``: learning-rate schedulers
    of the optimizer stepped after every step, as an eager loop steps a
    per-batch scheduler (warm-up, ``OneCycleLR``) after
    ``optimizer.step()``; step per-epoch ones yourself between calls.

    ``train(steps)`` trains it, from any thread, beside the other jobs
    training on its device at the time; ``ConcurrentTrainer`` trains a
    fixed set of jobs together."""

    def __init__(self, model, example_inputs: Sequence[Any] | None = None,
                 loss_fn: Callable | None = None, optimizer=None, targets=None,
                 name: str | None = None, data=None, n_inputs: int = 1,
                 clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
                 accumulate_grad_batches: int = 1, autocast_dtype=None, grad_scaler=None,
                 evaluation_memory: int | None = None, step_schedulers: Sequence = (),
                 clip_grad_norm_type: float = 2.0, target_keys: Sequence[str] = ()):
        if optimizer is None:
            raise ValueError("a Job needs the optimizer that trains the model")
        self.step_schedulers = _checked_schedulers(step_schedulers, optimizer)
        between = BetweenCalls(evaluation_memory)  # its setting checked before the capture
        k = batches_per_step(accumulate_grad_batches)
        if k > 1:
            if data is None:
                raise ValueError("accumulate_grad_batches needs data: each step trains on the "
                                 f"data's next {k} batches")
            n = len(data) if hasattr(data, "__len__") else None
            if n is not None and n % k:
                raise ValueError(
                    f"the data has {n} batches an epoch, not a multiple of "
                    f"accumulate_grad_batches={k}: a step's batches would span two epochs, "
                    "which eager loops do not do alike; drop or add batches (drop_last=True, "
                    "another batch size)")
        device = next((p.device for p in model.parameters()), None)
        if target_keys and data is None:
            raise ValueError("target_keys name items of the data's dict batches, and the job "
                             "has no data: give data=, or pass targets= with example_inputs")
        self.batches = None if data is None else BatchFeed(data, n_inputs, device, per_step=k,
                                                           target_keys=target_keys)
        if example_inputs is None:
            if self.batches is None:
                raise ValueError("a Job needs data (batches to train on) or example_inputs")
            example_inputs, targets = self.batches.peek()
            targets = targets or None
        self.name = name or type(model).__name__
        clip = GradClip(clip_grad_norm, clip_grad_norm_type, clip_grad_value)
        self._capture = (loss_fn, clip, k, autocast_dtype, grad_scaler)
        self._example = (example_inputs, targets)
        self._model, self._optimizer, self._device = model, optimizer, device
        self._step_fn: CapturedStep | None = None  # captured when a plan first needs it
        # The example batch's key, which capture_for matches (every capture has that batch)
        self._example_key = None
        if device is not None and device.type == "cuda":
            # Its model and batches there are taken while it is captured and
            # until it first trains (awaiting_jobs): a running feed's budget
            # would count them as free.
            training_session(device).job_made(self, self.bytes_on_device())
        if device is None or training_session(device).captures:
            self._capture_first()
        # Batches of other shapes (a short last batch) or non-tensor values:
        # _batch_key -> their capture (None: they train eagerly)
        self._other_shapes: dict = {}
        self._by_variant: dict = {}
        self.losses: list[float] = []
        self.error: BaseException | None = None
        # The error came while fetching a batch, before its step began: the
        # model, optimizer and data are whole, and the next train() goes on.
        self.error_between_steps = False
        self.between = between  # what it holds between train() calls
        # Steps run eagerly: in a session that captures nothing, or on batches no
        # capture of it could train
        self.eager_steps = 0
        # True from the end of a step's backward to the end of its update:
        # an error before it leaves what the job keeps as it was, but for
        # batch norm's statistics (rollback.StepStart).
        self.updating = False
        self._stream = None

    def bytes_on_device(self) -> int:
        """What its model (parameters and buffers, each storage once:
        ``sharing.base_bytes``) and its data's batches
        (``BatchFeed.resident_bytes``) hold on its device."""
        data = self.batches.resident_bytes() if self.batches is not None else 0
        return base_bytes(self._model, str(self._device)) + data

    def train(self, steps: int, session=None) -> list[float]:
        """Train ``steps`` steps on the job's next batches, beside every other
        job training in the same session (by default its device's,
        ``waterwave.training_session``) at the time, and return their
        losses. Blocks the calling thread, which runs the job's own groups
        (its steps, eagerly, where the session captures nothing); the
        model, its optimizer and its data are the caller's again when
        it returns (evaluate, step a scheduler, change hyperparameters).
        The job's error, if it failed, is raised here."""
        steps = whole_steps(steps)
        if self.error is not None:
            if not self.error_between_steps:
                raise RuntimeError(f"job {self.name!r} failed earlier ({self.error!r}); its model "
                                   "may hold half a step: make a new Job from a checkpoint"
                                   ) from self.error
            self.error, self.error_between_steps = None, False  # raised once, by its own call
        session = session if session is not None else training_session(self.device)
        if session.captures:
            self._follow_model()
        before = len(self.losses)
        session.train(self, steps)
        return self.losses[before:]

    @property
    def step_fn(self) -> CapturedStep:
        """The job's step as captured, for the model's variant when it was
        captured (``_follow_model``); captured now if it was not yet."""
        if self._step_fn is None:
            self._capture_first()
        return self._step_fn

    @property
    def graph(self):
        """The captured step's graph (``waterwave.graph.Graph``), what
        sessions and trainers cut into node groups and plan."""
        return self.step_fn.graph

    @property
    def captured(self) -> bool:
        """Whether its step is captured yet. A job whose device's session
        captures nothing (its default) trains eagerly and is captured when a
        plan first needs it: a capturing session, a ``ConcurrentTrainer``,
        its ``graph``."""
        return self._step_fn is not None

    def _capture_first(self) -> None:
        """The job's first capture, on its example batch, and that batch's key."""
        step = self._new_capture(*self._example)
        self._example_key = (step.input_names, _batch_key(step.example))
        self._step_fn = step

    def forget_skipped_state(self) -> None:
        """After a call's steps: optimizer state made for steps a GradScaler
        skipped goes again, as eager makes none (``CapturedStep.forget_skipped_state``)."""
        if self._step_fn is None:
            return
        self._step_fn.forget_skipped_state()
        for capture in self._other_shapes.values():
            if capture is not None:
                capture.forget_skipped_state()

    def captures(self) -> list[CapturedStep]:
        """Every capture of its step made so far: its own, those for batches
        of other shapes, and those for the model's other variants."""
        if self._step_fn is None:
            return []
        out = [self._step_fn, *(c for c in self._other_shapes.values() if c is not None)]
        for step_fn, others in self._by_variant.values():
            out += [step_fn, *(c for c in others.values() if c is not None)]
        return out

    @property
    def grad_scaler(self):
        """The GradScaler its steps use, or None."""
        return self._capture[4]

    def after_step(self) -> None:
        """After each step's update, on the job's thread: its per-step
        schedulers step, as ``scheduler.step()`` follows
        ``optimizer.step()`` in an eager loop (the next step reads the
        learning rate they set)."""
        for scheduler in self.step_schedulers:
            scheduler.step()

    def _follow_model(self) -> None:
        """The step for the model and optimizer as they are now, as eager
        training simply runs in whatever setting it finds: captured once per
        variant (``CapturedStep.variant_now``: train/eval modes, frozen
        parameters, parameter groups, the update's shape, step cohorts), the
        job then cut into the session's node groups again."""

        variant = self.step_fn.variant_now()
        if variant == self.step_fn.variant:
            return
        self._by_variant[self.step_fn.variant] = (self.step_fn, self._other_shapes)
        found = self._by_variant.pop(variant, None)
        if found is None:
            found = (self._new_capture(*self._example), {})
        self._step_fn, self._other_shapes = found  # sessions and trainers cut it again

    def check_context(self) -> None:
        """Before a call's steps, on the caller's thread: the model is as its
        step was captured (``CapturedStep.check_context``); the captures at
        other shapes take the model's buffers as they are now too."""
        if self._step_fn is None:  # nothing captured: nothing to hold the model to
            return
        self.step_fn.check_context()
        for capture in self._other_shapes.values():
            if capture is not None:  # None: batches of that key train eagerly
                capture.buffers = self.step_fn.buffers

    @property
    def device(self):
        """The device the model trains on (a ``torch.device``)."""
        return self._device

    @property
    def model(self):
        return self._model

    @property
    def optimizer(self):
        """The optimizer that trains it (the one it was made with)."""
        return self._optimizer

    @property
    def failed(self) -> bool:
        return self.error is not None

    def stream(self):
        """The job's own CUDA stream (created once), or None on the CPU."""
        if self._device.type != "cuda":
            return None
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=self._device)
        return self._stream

    def next_batch(self) -> tuple[tuple, Any]:
        """The inputs and targets of the job's next step: its data's next
        batch, or nothing (the example batch) without data."""
        if self.batches is None:
            return (), None
        inputs, targets = self.batches.next()
        return inputs, targets or None

    def capture_for(self, inputs: tuple, targets) -> CapturedStep | None:
        """The capture that trains a batch: the job's own, or, for a batch of
        other shapes (a DataLoader's short last batch) or other non-tensor
        values, a capture of the step for it, made once (and cut into the
        same node groups by whichever run trains it). It must run the same
        operators, each tensor no larger than at the job's shapes (so the
        memory planned for a step bounds it). None where no capture can
        train the batch (a larger batch, one that runs other operators or
        cannot be captured, shapes past ``MAX_OTHER_CAPTURES``): the step
        then runs eagerly (``eager_step``), as the same loop would run it."""

        try:
            key = (input_names(inputs), _batch_key((*inputs, *(targets or ()))))
        except ValueError:
            return None
        if not inputs or key == self._example_key:
            return self.step_fn
        if key not in self._other_shapes:
            if len(self._other_shapes) >= MAX_OTHER_CAPTURES:
                return None
            try:
                capture = self._capture_at(inputs, targets)
            except ValueError:
                capture = None
            self._other_shapes[key] = capture
        return self._other_shapes[key]

    def sharing_block(self, session: TrainingSession, told: bool = False) -> sharing:
        """Its model as a ``waterwave.sharing`` member of ``session``;
        ``told``: the caller's steps tell the member of each call of the
        model and each optimizer step (``plain_step``'s, given the member),
        so neither the model nor any optimizer is hooked (``job_sharing``)."""
        block = job_sharing if told else sharing
        return block(self.model, session, name=self.name)

    def eager_step(self, inputs: tuple, targets, session: TrainingSession | None = None,
                   keep_grads: bool = False, grads_none: bool = False):
        """One step run eagerly as the same loop would run it (its settings:
        accumulation, autocast, the GradScaler, clipping): a batch no capture
        can train, or any step where nothing is planned. The gradients are
        left None, as a captured step leaves them, unless ``keep_grads``
        (where nothing counts what a job holds between steps, as an eager
        loop leaves them). ``grads_none``: the caller knows they are None
        already (its previous step left them so, and nothing ran since), so
        the step does not zero them first. Inside a training ``session``, as
        a ``waterwave.sharing`` member, so its memory is counted and gated
        with the others'. Returns the step's loss (the batches' mean with
        accumulation), not detached with one batch a step."""
        block = self.sharing_block(session) if session is not None else None
        if block is None:
            return self._eager_step(inputs, targets, keep_grads, grads_none)
        with block:
            return self._eager_step(inputs, targets, keep_grads, grads_none)

    @property
    def steps_plain(self) -> bool:
        """Whether its step is the usual one, which ``plain_step`` runs: one
        batch a step, no autocast, GradScaler or clipping, positional
        inputs."""
        _, clip, k, autocast_dtype, scaler = self._capture
        return (k == 1 and autocast_dtype is None and not clip.active
                and (scaler is None or not scaler.is_enabled())
                and not isinstance(self._example[0], Keywords))

    def plain_step(self, keep_grads: bool, member=None):
        """``_eager_step`` as one closure for the usual step
        (``steps_plain``; a batch of other inputs goes to ``_eager_step``),
        the same operators in the same order. A digits-sized step takes a
        few hundred µs on the CPU, and ``_eager_step``'s settings, read at
        every step, several of them. ``member``: the job's sharing member,
        told of each optimizer step where the step is a point of its pass
        (``job_sharing``). None where the step is not plain:
        ``(inputs, targets, grads_none) -> loss`` otherwise."""
        if not self.steps_plain:
            return None
        loss_fn = self._capture[0] or default_loss
        model, opt = self._model, self._optimizer
        clear_grads = grads_clearer(opt)
        # job_sharing's member: its pass boundary, called here before each
        # call of the model, in place of a hook on the model.
        boundary = member.boundary if member is not None else None

        def step(inputs: tuple, targets, grads_none: bool):
            if type(inputs) is not tuple or not inputs:  # keyword inputs, or none
                return self._eager_step(inputs, targets, keep_grads, grads_none, boundary)
            if not grads_none:
                clear_grads()
            if boundary is not None:
                boundary(model, inputs, NO_KEYWORDS)
            loss = loss_fn(model(*inputs), *(targets or ()))
            loss.backward()
            self.updating = True
            if member is not None and member.step_point:
                member.optimizer_step()
            opt.step()
            self.updating = False
            if not keep_grads:
                clear_grads()
            self.eager_steps += 1
            return loss
        return step

    def _eager_step(self, inputs: tuple, targets, keep_grads: bool, grads_none: bool = False,
                    boundary=None):
        """``eager_step``'s work; ``boundary``: a ``job_sharing`` member's,
        called before each call of the model (``plain_step``)."""
        import torch

        loss_fn, clip, k, autocast_dtype, scaler = self._capture
        loss_fn = loss_fn or default_loss
        scaler = scaler if scaler is not None and scaler.is_enabled() else None
        model, opt = self.model, self._optimizer
        if not inputs:  # no data: the example batch, every step
            inputs, targets = map(fake_step.as_tuple, self._example)
        targets = tuple(targets or ())
        names = input_names(inputs)
        n_in, n_t = len(inputs) // k, len(targets) // k
        clear_grads = grads_clearer(opt)
        if not grads_none:  # a short step feels zero_grad's own cost (a few µs)
            clear_grads()
        losses = []
        for i in range(k):
            batch, batch_targets = (inputs, targets) if k == 1 else (
                inputs[i * n_in:(i + 1) * n_in], targets[i * n_t:(i + 1) * n_t])
            if boundary is not None:  # what a hook on the model would be called with
                boundary(model, () if names else tuple(batch),
                         dict(zip(names, batch)) if names else NO_KEYWORDS)
            if autocast_dtype is None:
                loss = loss_fn(call_model(model, batch, names), *batch_targets)
            else:
                with torch.autocast(self.device.type, dtype=autocast_dtype):
                    loss = loss_fn(call_model(model, batch, names), *batch_targets)
            losses.append(loss)
            scaled = loss / k if k > 1 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        self.updating = True
        if clip.active:
            if scaler is not None:
                scaler.unscale_(opt)
            if clip.max_value is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip.max_value)
            if clip.max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip.max_norm, clip.norm_type)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        self.updating = False
        if not keep_grads:
            clear_grads()
        self.eager_steps += 1
        if k == 1:
            return losses[0]  # its graph freed by backward; the caller reads or detaches it
        losses = [x.detach() for x in losses]
        return sum(losses[1:], losses[0]) / k

    def stats(self) -> dict:
        """Steps trained, those run eagerly (where nothing was planned, or on
        batches no capture could train), and captures made (shapes, and
        variants the model went through; 0 while nothing needed a plan)."""
        return {"steps": len(self.losses), "eager_steps": self.eager_steps,
                "captures": int(self.captured) + len(self._by_variant)
                + sum(capture is not None for capture in self._other_shapes.values())}

    def _new_capture(self, inputs, targets) -> CapturedStep:
        """The job's step captured anew on ``inputs`` and ``targets``, with
        its settings, for the model and optimizer as they are now (with
        gradients on, whatever the caller's mode: a capture needs them)."""
        import torch

        loss_fn, clip, k, autocast_dtype, grad_scaler = self._capture
        with torch.enable_grad():
            return CapturedStep(self.model, inputs, loss_fn, self._optimizer, targets,
                                self.name, clip, k, autocast_dtype, grad_scaler)

    def _capture_at(self, inputs: tuple, targets) -> CapturedStep:
        main = self.step_fn
        if len(inputs) + len(targets or ()) != len(main.example):
            main._check_batch((*inputs, *(targets or ())))  # its error names the difference
        shapes = "/".join(str(tuple(x.shape)) for x in inputs if hasattr(x, "shape"))
        first = "/".join(str(tuple(x.shape)) for x in main.example[:len(inputs)]
                         if hasattr(x, "shape"))
        try:
            step = self._new_capture(inputs, targets or None)
        except CaptureError as e:
            raise ValueError(f"a batch of shapes {shapes} (the first batch's: {first}) cannot "
                             f"train this model: {e}") from None
        ours, theirs = main.graph, step.graph
        if [n.op for n in ours.nodes] != [n.op for n in theirs.nodes]:
            raise ValueError(f"a batch of shapes {shapes} runs other operators than the job's "
                             "first batch (the model branches on its batch's shape): drop "
                             "that batch (DataLoader(drop_last=True)), or make a Job for it")
        if any(b.size > a.size for a, b in zip(ours.tensors, theirs.tensors)):
            raise ValueError(f"a batch of shapes {shapes} is larger than the job's first batch, "
                             "whose step the memory plan is made for: make the first batch the "
                             "largest (drop_last=True drops a short last one)")
        return step

    def persistent_bytes(self) -> int:
        return sum(t.size for t in self.graph.tensors if t.persistent or t.kind == "input")

    def __repr__(self) -> str:
        state = f"failed: {self.error!r}" if self.failed else f"{len(self.losses)} steps"
        return f"Job({self.name!r}, {state})"


def grads_clearer(optimizer) -> Callable[[], None]:
    """``optimizer.zero_grad(set_to_none=True)`` as a function of no
    arguments. For an optimizer whose ``zero_grad`` is torch's own, with
    the profiler off, it does what that method does, setting each of its
    parameters' gradients to None, without the method's wrapping (a
    profiler label, dynamo's guard): 10 µs of a digits MLP's 500 µs step
    on the CPU, for the loop's 0.5. Any other ``zero_grad`` (a subclass's,
    one set on the optimizer) is called as it is, and so is torch's while
    the profiler runs, so that its trace names the call."""
    import torch

    zero_grad = optimizer.zero_grad
    # Whether the profiler runs (a private call: a torch without it gets
    # the method every step).
    profiling = getattr(torch._C._autograd, "_profiler_enabled", None)
    if (type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad
            or "zero_grad" in vars(optimizer) or profiling is None):
        return lambda: zero_grad(set_to_none=True)

    def clear() -> None:
        if profiling():
            zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None
    return clear


def _checked_schedulers(schedulers, optimizer) -> tuple:
    """A Job's ``step_schedulers``: schedulers of its optimizer that step
    without an argument."""
    import torch

    if not isinstance(schedulers, (list, tuple)):
        raise ValueError("step_schedulers must be a list of learning-rate schedulers, got a "
                         f"{type(schedulers).__name__}")
    for s in schedulers:
        if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("ReduceLROnPlateau steps on a metric: call its step(metric) "
                             "between train() calls, not as a step scheduler")
        if not callable(getattr(s, "step", None)):
            raise ValueError(f"step_schedulers holds a {type(s).__name__}, which has no step(): "
                             "give torch.optim.lr_scheduler schedulers")
        if getattr(s, "optimizer", optimizer) is not optimizer:
            raise ValueError(f"a step scheduler ({type(s).__name__}) schedules another "
                             "optimizer than the Job's: make it on the Job's optimizer")
    return tuple(schedulers)


# Captures a job may make for batches unlike its first (other shapes, other
# non-tensor values); more means the batches vary without end, and each
# capture holds a graph.
MAX_OTHER_CAPTURES = 64


def _batch_key(data: tuple) -> tuple:
    """What a batch's capture depends on: each tensor's shape and dtype, and
    each other item's value (a captured step holds it as a constant: a loss
    weight given as a Python number, say). Items that cannot be told apart
    by value (lists, dicts) are refused."""
    import torch

    key = []
    for i, x in enumerate(data):
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype))
            continue
        try:
            hash(x)
        except TypeError:
            raise ValueError(
                f"batch item {i} is a {type(x).__name__}; a captured step takes tensors, and "
                "holds any other value as the constant it was at capture: make it a tensor, "
                "or leave it out of the batch (a collate_fn)") from None
        key.append((type(x), x))
    return tuple(key)

