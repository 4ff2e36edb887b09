"""What a captured step took as fixed, checked before every step.

A capture traces the model as it was: in train or eval mode (dropout and
batch norm trace differently), with its parameters and hooks then, outside
or inside ``torch.autocast`` (and with gradients on, as training needs). A
step run after any of these changed would
silently train another model than eager PyTorch would. ``StepGuard`` notes
them at capture and raises ``StaleCaptureError`` at the next step when one
changed, naming it and the fix; it never guesses.

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations

from dataclasses import dataclass


class StaleCaptureError(ValueError):
    """The model or the context changed since the step was captured."""


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
         "_state_dict_hooks")


def _autocast(device: str) -> tuple:
    import torch

    if not torch.is_autocast_enabled(device):
        return (False,)
    return (True, str(torch.get_autocast_dtype(device)))


@dataclass(frozen=True)
class StepGuard:
    training: tuple[tuple[str, bool], ...]  # (module name, training) for every module
    parameters: tuple[int, ...]             # ids of the model's parameters, in order
    hooks: tuple[tuple[str, int], ...]      # (module name, hooks registered) where any are
    global_hooks: int
    autocast: tuple                         # on the step's device, at capture
    device: str

    @classmethod
    def of(cls, model, device: str) -> StepGuard:
        return cls(*cls._read(model, device), device)

    @staticmethod
    def _read(model, device: str) -> tuple:
        import torch.nn.modules.module as nn_module

        training, hooks = [], []
        for name, m in model.named_modules():
            training.append((name, m.training))
            n = sum(len(getattr(m, h, ())) for h in HOOKS)
            if n:
                hooks.append((name, n))
        global_hooks = (len(nn_module._global_forward_hooks)
                        + len(nn_module._global_forward_pre_hooks)
                        + len(nn_module._global_backward_hooks))
        return (tuple(training), tuple(id(p) for p in model.parameters()), tuple(hooks),
                global_hooks,
                _autocast("cuda" if device == "cuda" else "cpu"))

    def check(self, model) -> None:
        """Raise ``StaleCaptureError`` if what the capture took as fixed changed,
        or if gradients are off where the step is asked for."""
        import torch

        if not torch.is_grad_enabled():
            raise StaleCaptureError(
                "gradients are off here (inside torch.no_grad() or torch.inference_mode()): "
                "an eager step could not backpropagate, and a captured one would train anyway: "
                "call train() or step() outside them")
        training, ids, hooks, global_hooks, autocast = self._read(model, self.device)
        remake = "make a new Job (or waterwave.optimize) for the model as it is now"
        if training != self.training:
            then = dict(self.training)
            name, mode = next((n, t) for n, t in training if then.get(n) != t)
            was = "train" if then.get(name) else "eval"
            now = "train" if mode else "eval"
            raise StaleCaptureError(
                f"module {name or 'the model'} is in {now} mode; the step was captured in {was} "
                f"mode, which fixes what dropout and batch norm do: call model.{was}() before "
                f"training, or {remake}")
        if ids != self.parameters:
            raise StaleCaptureError("the model's parameters are not those the step was captured "
                                    f"with (one was replaced, added or removed): {remake}")
        if hooks != self.hooks or global_hooks != self.global_hooks:
            raise StaleCaptureError("module hooks changed since the step was captured (a captured "
                                    f"step runs the hooks it traced, no others): {remake}")
        if autocast != self.autocast:
            raise StaleCaptureError(
                f"torch.autocast is {'on' if autocast[0] else 'off'} here and was "
                f"{'on' if self.autocast[0] else 'off'} when the step was captured; a captured "
                "step runs in the precision it traced: train outside autocast and give the Job "
                "autocast_dtype= (its forward pass then runs inside autocast, as eager code's)")
