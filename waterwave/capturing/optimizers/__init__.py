"""The optimizers a captured step updates with, as ``torch.optim``'s
single-tensor implementations do, bit for bit, honouring
``optimizer.param_groups`` and ``optimizer.state`` at every step as eager
``optimizer.step()`` does. One class per optimizer (``sgd.py``, ``adam.py``
(Adam, AdamW), ``rmsprop.py``, ``adagrad.py``, ``adamax.py``, ``nadam.py``,
``radam.py``), each registered under the torch.optim names it follows
(``rule.py``); an optimizer without one is refused by name. Adding one:
CONTRIBUTING.md, "Adding an optimizer".

- **Hyperparameters** (lr, momentum, dampening, weight decay, betas, eps,
  alpha) are the graph's constants, in the very operator forms eager
  PyTorch uses (``p.add_(g, alpha=-lr)``: one fused multiply-add). The
  capture traces the update with a unique sentinel for each constant and
  notes where each landed (``constant_sites.py``); before a step whose
  groups hold other values, those nodes get the new ones. So schedulers,
  warm-up and population-based training work, exactly. (Why not 0-d tensor
  inputs: a tensor in place of ``alpha`` costs the fused multiply-add, one
  rounding more, and a resnet18 step at batch 2, whose batch norms divide by
  nearly nothing, turned that rounding into momentum buffers 11.5 apart
  within two steps.)
- **What changes every step** (Adam's bias corrections, Adamax's and
  Adagrad's decayed rates, NAdam's momentum schedule, RAdam's
  rectification) is computed on the host as torch computes it and given to
  the step as 0-d tensor inputs (each rule's ``scalars``); with a GradScaler,
  which may skip a step, on the device from the step count there.
- **State** lives in ``optimizer.state`` (``state.py``): the momentum
  buffers and moments there are the tensors the step updates in place, read
  anew each step (so a ``load_state_dict`` in between is followed), and
  ``step`` is counted there, each parameter's own count as eager's
  (``step_cohorts``: parameters thawed late start theirs at 1);
  ``state_dict()``, checkpoints and resuming go on exactly where training
  was.

What decides the update's shape (momentum, weight decay or dampening zero or
not, nesterov, centered) is read at capture (decoupled weight decay, a
multiplication by exactly 1.0 at zero, is always in the update). After a
change of it ``Job.train`` captures the step again; ``optimize`` and
``ConcurrentTrainer`` refuse it at the next step with an error that names
the fix, never ignore it. Everywhere refused: what the update cannot do
(SGD's first step with dampening, amsgrad set after the first step, step
hooks) and settings that select another implementation of the update
(fused, capturable, differentiable, tensor hyperparameters).

May import: nothing of waterwave; torch lazily.
"""
# The rules, registered in this order: the order errors list them in.
from . import sgd, adam, rmsprop, adagrad, adamax, nadam, radam  # noqa: F401,I001
from .clip import GradClip, check_clip_covers  # noqa: F401
from .constant_sites import SENTINEL, ConstantSites, sentinels  # noqa: F401
from .rule import RULES, OptimizerError, OptimizerRule, register, rule_for  # noqa: F401
from .state import (  # noqa: F401
    GroupSettings,
    begin_step,
    check_structure,
    constants,
    count_step,
    ready_to_step,
    scalar_inputs,
    state_names,
    step_cohorts,
    step_count,
    step_tensors,
    structure,
    update,
)

SUPPORTED = tuple(RULES)
# The 0-d inputs each cohort's update takes every step, by optimizer.
SCALARS = {name: rule.scalars for name, rule in RULES.items() if rule.scalars}
# Those that count their steps on the device under a GradScaler, which may
# skip a step (so a skipped step does not count).
DEVICE_STEPS = tuple(name for name, rule in RULES.items() if rule.device_state)
