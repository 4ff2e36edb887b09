"""Named GPUs for the simulator: memory, a roofline, and what PyTorch's CUDA
libraries keep on each.

Figures are the vendors' datasheet peaks (SXM parts): fp32 and TF32
tensor-core FLOP/s, HBM bandwidth, and the memory a CUDA context leaves to
PyTorch. Convolutions run in TF32 (PyTorch's default for cuDNN), matrix
products in fp32 (``torch.backends.cuda.matmul.allow_tf32`` is off by
default). A kernel reaches ``efficiency`` of a peak: the simulator's times
are estimates for comparing schedules, not predictions of a GPU.

cuBLAS and cuBLASLt each keep a workspace per stream, allocated through
PyTorch's allocator at a stream's first matrix product: 32 MiB each on
Hopper (sm90), 8 MiB + 128 KiB elsewhere (PyTorch's
``getChosenWorkspaceSize``); the H100 snapshots show the two 32 MiB blocks.

May import: nothing of waterwave.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int               # bytes PyTorch can reserve
    fp32_flops: float         # FLOP/s
    tf32_flops: float         # FLOP/s, tensor cores
    bandwidth: float          # bytes/s
    blas_workspace: int       # bytes, per library and stream
    efficiency: float = 0.6   # fraction of a peak a kernel reaches
    kernel_floor_us: float = 3.0  # the shortest kernel

    def kernel_us(self, flops: float, nbytes: float, tensor_cores: bool) -> float:
        """A kernel's time on the roofline: the slower of compute and memory."""
        peak = self.tf32_flops if tensor_cores else self.fp32_flops
        t = max(flops / (peak * self.efficiency), nbytes / (self.bandwidth * self.efficiency))
        return max(self.kernel_floor_us, t * 1e6)


GPUS = {g.name: g for g in (
    GPU("V100-32GB", 32 * GiB - 512 * MiB, 15.7e12, 15.7e12, 900e9, 8 * MiB + 128 * 1024),
    GPU("A100-80GB", 80 * GiB - 768 * MiB, 19.5e12, 156e12, 2039e9, 8 * MiB + 128 * 1024),
    GPU("H100-80GB", 80 * GiB - 1 * GiB, 67e12, 494.7e12, 3350e9, 32 * MiB),
)}


def gpu(name: str) -> GPU:
    """The named GPU; a ValueError lists the names known."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}") from None
