"""Capturing: one training step of an ``nn.Module`` traced on the CPU with fake
tensors (``fake_step.py``) into a ``waterwave.graph.Graph``, recording the
operators a CUDA device would run (``cuda_kernels.py``).

May import: waterwave.graph; torch lazily.
"""
from .fake_step import (  # noqa: F401
    KERNELS,
    SUPPORTED_OPTIMIZERS,
    CaptureError,
    StepLayout,
    as_tuple,
    capture,
    graph_from_trace,
    inplace_variant,
    model_device,
    trace_step,
    trained_parameters,
)
from .keywords import Keywords, call_model, input_names  # noqa: F401
