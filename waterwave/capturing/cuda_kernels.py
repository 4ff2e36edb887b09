"""The operators PyTorch runs on a CUDA device, recorded by a capture made
on the CPU.

A few composite operators take another path on a CUDA device than on the
CPU, and the paths keep different tensors alive:

- ``dropout``: CUDA runs one fused ``native_dropout`` that keeps a bool
  mask; the CPU draws a float mask with ``bernoulli_`` and scales it.
- ``scaled_dot_product_attention``: CUDA runs the flash or the
  memory-efficient kernel, which keep the output and a log-sum-exp per row;
  the CPU runs ``_scaled_dot_product_flash_attention_for_cpu`` or the math
  path, which keeps the whole attention matrix (GPT-2 at batch 32: 1.1 GB
  more at the peak).

While ``cuda_kernels()`` is active, those two operators follow PyTorch's
CUDA dispatch (``aten/src/ATen/native/transformers/attention.cpp`` and
``Dropout.cpp``) on fake tensors. Batch norm differs too (cuDNN's
``cudnn_batch_norm``), with the same bytes, so it is left alone.

Which attention kernel CUDA picks depends on the GPU. This follows
PyTorch's order on compute capability 8.0 and later (flash, then
memory-efficient, then math, among the backends ``sdpa_kernel`` leaves
enabled): float32 always gets the memory-efficient
kernel, which an H100 run confirmed (bench/results/gpu.json); half
precision without a mask gets flash, which no run here has checked.
"""
from __future__ import annotations

import contextlib
import threading

# One override at a time, process-wide; a nested capture in the same thread
# finds it in place.
_lock = threading.Lock()
_here = threading.local()


def emulating() -> bool:
    """Whether this thread is inside ``cuda_kernels()``."""
    return getattr(_here, "depth", 0) > 0


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _dropout(x, p: float, train: bool):
    """aten::dropout as on CUDA: the fused kernel whenever it applies."""
    import torch

    if not train or p == 0:
        return x
    if 0 < p < 1 and x.numel() > 0:
        return torch.ops.aten.native_dropout(x, p, train)[0]
    # p == 1, or an empty tensor: the unfused path, as on every device
    return x * torch.zeros((), dtype=x.dtype, device=x.device) if p == 1 else x


def _attention_kernel(q, k, v, mask, enable_gqa: bool) -> str:
    """PyTorch's choice on an sm80+ GPU: "flash", "efficient" or "math",
    among the backends left enabled (``torch.nn.attention.sdpa_kernel``)."""
    import torch

    cuda = torch.backends.cuda
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "math"
    head_dim = q.shape[-1]
    same_heads = q.shape[1] == k.shape[1] == v.shape[1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    if (cuda.flash_sdp_enabled() and half and mask is None and head_dim <= 256
            and (same_heads or enable_gqa)):
        return "flash"
    efficient_dtype = half or q.dtype == torch.float32
    if (cuda.mem_efficient_sdp_enabled() and efficient_dtype and same_heads
            and head_dim % (8 if half else 4) == 0):
        return "efficient"
    return "math"


def _additive_mask(mask, dtype):
    """A bool mask (True: attend) as the additive mask the kernels take."""
    import torch

    if mask is None or mask.dtype != torch.bool:
        return mask
    neg_inf = torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, 0.0, neg_inf)


def _aligned_bias(mask, q, k):
    """The memory-efficient kernel's bias: rows padded to 8 elements when
    they are not aligned (a copy), broadcast to (batch, heads, L, S)."""
    import torch.nn.functional as F

    strides_ok = all(s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not strides_ok:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """aten::scaled_dot_product_attention as on CUDA."""
    import math

    import torch
    import torch.nn.functional as F

    aten = torch.ops.aten
    # Real CPU tensors that meet the override (another thread's work) cannot
    # run the CUDA kernels: the math path gives them the same result.
    on_cuda = _is_fake(q) or q.is_cuda
    kernel = _attention_kernel(q, k, v, attn_mask, enable_gqa) if on_cuda else "math"
    if kernel == "flash":
        head_dim = q.shape[-1]
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        if head_dim % 8:  # flash needs a multiple of 8: pad, then slice the output
            q, k, v = (F.pad(t, (0, 8 - head_dim % 8)) for t in (q, k, v))
        out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                       scale=scale)[0]
        return out[..., :head_dim] if out.shape[-1] != head_dim else out
    mask = _additive_mask(attn_mask, q.dtype)
    if kernel == "efficient":
        if mask is not None:
            mask = _aligned_bias(mask, q, k)
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout_p,
                                                            is_causal, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, is_causal,
                                                   None, scale=scale, enable_gqa=enable_gqa)[0]


@contextlib.contextmanager
def cuda_kernels():
    """Route dropout and attention to the kernels a CUDA device runs, for
    as long as the context lasts. The override is process-wide (PyTorch
    keeps one kernel table): real tensors that meet it meanwhile in other
    threads get the same results, CPU tensors by other kernels (fused
    dropout, math attention), CUDA tensors by the sm80+ choice above."""
    import torch

    if emulating():
        _here.depth += 1
        try:
            yield
        finally:
            _here.depth -= 1
        return
    with _lock, torch.library._scoped_library("aten", "IMPL") as lib:
        lib.impl("dropout", _dropout, "CompositeImplicitAutograd")
        lib.impl("scaled_dot_product_attention", _attention, "CompositeImplicitAutograd")
        _here.depth = 1
        try:
            yield
        finally:
            _here.depth = 0


@contextlib.contextmanager
def own_kernels():
    """PyTorch's own kernels for as long as the context lasts: waits while
    another thread emulates CUDA's. Inside ``cuda_kernels()`` in this thread
    the override cannot be lifted: an error."""
    if emulating():
        raise RuntimeError("PyTorch's own kernels were asked for inside cuda_kernels(): "
                           "leave that block first")
    with _lock:
        yield
