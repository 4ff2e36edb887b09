"""A job's training state at a point between steps, kept on the host, to
put back where the steps after it must be undone: a trainer's probe of side
by side (``concurrent.py``) whose step ran out of memory halfway, with some
parameters updated, batch norm's running statistics moved and the
optimizer's step counted.

``JobCheckpoint(job)`` copies what a step changes: the model's parameters
and buffers, the optimizer's state (its tensors, step counts and the state
made for parameters that had none), its groups' hyperparameters, the
per-step schedulers' states, a GradScaler's scale and growth tracker, each
capture's step count, and the losses; the job's data starts keeping the
batches it hands out. ``restore()`` writes them back in place (so every
reference the user or a capture holds sees them), drops the error the
undone step left, and gives its batches back to be trained on next: the
job then trains those steps as if the undone ones never ran. Random numbers
an undone step drew from torch's generators are not given back: other jobs
drew from the same generators meanwhile, and rewinding them would change
what those drew.

``StepStart(job)`` is the light form, for a step that failed before its
update (a sharing job's step that ran out of memory in its forward or
backward, ``job_loop.run_free``): until the optimizer's step (``Job.updating``)
an eager step changes only what it keeps in buffers (batch norm's running
statistics and counts) and the gradients, which a job's step starts from
None. So ``take()`` copies the buffers on the device at each step's start
(nothing for a model without buffers), and ``put_back()`` writes them back,
drops the gradients and gives the step's batch back.

May import: waterwave._C; torch.
"""
from __future__ import annotations

import copy

_NOT_GROUP_SETTINGS = frozenset({"params"})


def _host_copy(value):
    """A tensor's copy on the host; another value's deep copy."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def _put_back(current, kept):
    """``kept`` written into ``current`` where both are tensors of one shape
    and dtype (in place, as captures and the user hold ``current``); else
    ``kept`` itself (a copy, moved where ``current`` lives)."""
    import torch

    if isinstance(kept, torch.Tensor):
        if (isinstance(current, torch.Tensor) and current.shape == kept.shape
                and current.dtype == kept.dtype):
            with torch.no_grad():
                current.copy_(kept)
            return current
        device = current.device if isinstance(current, torch.Tensor) else kept.device
        return kept.to(device, copy=True)
    return copy.deepcopy(kept)


class JobCheckpoint:
    """``job``'s state now, on the host (see the module's opening). Take it
    between the job's steps, with its queued device work done."""

    def __init__(self, job):
        model, opt = job.model, job.optimizer
        self.job = job
        self.tensors = [(t, _host_copy(t)) for t in (*model.parameters(), *model.buffers())]
        self.optimizer_state = {p: {k: _host_copy(v) for k, v in state.items()}
                                for p, state in opt.state.items()}
        self.group_settings = [{k: copy.deepcopy(v) for k, v in g.items()
                                if k not in _NOT_GROUP_SETTINGS} for g in opt.param_groups]
        self.schedulers = [copy.deepcopy(s.state_dict()) for s in job.step_schedulers]
        scaler = job.grad_scaler
        self.scaler = None if scaler is None or scaler._scale is None else (
            scaler, _host_copy(scaler._scale), _host_copy(scaler._growth_tracker))
        self.captures = [(c, c.steps, len(c.fresh_state)) for c in job.captures()]
        self.losses, self.eager_steps = len(job.losses), job.eager_steps
        if job.batches is not None:
            job.batches.record()

    def restore(self) -> None:
        """The job as it was when the checkpoint was taken, its undone steps'
        batches next to train on, its error gone."""
        job, opt = self.job, self.job.optimizer
        stream = job.stream()
        if stream is not None:  # the undone step's kernels end before their tensors are written
            stream.synchronize()
        for t, kept in self.tensors:
            _put_back(t, kept)
        for p in list(opt.state):
            if p not in self.optimizer_state:  # made by an undone step
                del opt.state[p]
        for p, kept in self.optimizer_state.items():
            state = opt.state[p]
            for key in list(state):
                if key not in kept:
                    del state[key]
            for key, value in kept.items():
                state[key] = _put_back(state.get(key), value)
        for group, settings in zip(opt.param_groups, self.group_settings):
            group.update(copy.deepcopy(settings))
        for scheduler, state in zip(job.step_schedulers, self.schedulers):
            scheduler.load_state_dict(copy.deepcopy(state))
        if self.scaler is not None:
            scaler, scale, tracker = self.scaler
            _put_back(scaler._scale, scale)
            _put_back(scaler._growth_tracker, tracker)
        for capture, steps, fresh in self.captures:
            capture.steps = steps
            del capture.fresh_state[fresh:]
        for p in job.model.parameters():
            p.grad = None
        del job.losses[self.losses:]
        job.eager_steps = self.eager_steps
        if job.batches is not None:
            job.batches.rewind()
        job.error, job.error_between_steps = None, False

    def release(self) -> None:
        """Keep the steps since the checkpoint: its copies and the batches
        kept for it go."""
        if self.job.batches is not None:
            self.job.batches.stop_recording()
        self.tensors, self.optimizer_state = [], {}


class StepStart:
    """What ``job``'s step changes before its update, kept at its start
    (see the module's opening)."""

    def __init__(self, job):
        import torch

        self.job = job
        self.buffers = list(job.model.buffers())
        self.kept = [b.detach().clone() for b in self.buffers]
        self._copy = torch._foreach_copy_  # looked up once: take() runs every step

    def take(self) -> None:
        """The step starts: its buffers as they are now (into detached
        copies, so no autograd mode is needed)."""
        self._copy(self.kept, self.buffers)

    def put_back(self) -> None:
        """The step undone before its update: its buffers as it found them,
        no gradients, its batch next to train on."""
        import torch

        job = self.job
        if self.buffers:
            with torch.no_grad():  # a buffer may require gradients
                self._copy(self.buffers, self.kept)
        for p in job.model.parameters():
            p.grad = None
        job.updating = False
        if job.batches is not None:
            job.batches.again()


def ran_out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is an allocator's out-of-memory error: PyTorch's
    (``torch.OutOfMemoryError``, which Waterwave's allocator raises inside
    PyTorch too) or Waterwave's own."""
    if error is None:
        return False
    import torch

    from .._C import OutOfMemoryError

    return isinstance(error, (torch.OutOfMemoryError, OutOfMemoryError))
