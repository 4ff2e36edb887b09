"""Named GPUs for the simulator: memory, a roofline, and what PyTorch's CUDA
libraries keep on each.

Figures are the vendors' datasheet peaks (SXM parts): fp32 and TF32
tensor-core FLOP/s, HBM bandwidth, and the memory a CUDA context leaves to
PyTorch. Convolutions run in TF32 (PyTorch's default for cuDNN), matrix
products in fp32 (``torch.backends.cuda.matmul.allow_tf32`` is off by
default). A kernel reaches ``efficiency`` of a peak: the simulator's times
are estimates for comparing schedules, not predictions of a GPU.

Concurrent kernels (``SimDevice.set_concurrent_kernels``): a kernel takes a
share of the SMs and of the memory bandwidth while it runs
(``kernel_shares``). The SM share is its threads, one per output element (as
elementwise and most library kernels launch them), over the threads the
GPU's SMs hold at once (``sms`` x 2048, the resident-thread limit of every
part here: CUDA's occupancy tables), at least one SM's worth; the bandwidth
share is its memory time on the roofline over its time alone. Both are a
model for comparing schedules, fitted to nothing yet (no GPU measurement of
kernels side by side).

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
    sms: int = 132            # streaming multiprocessors
    efficiency: float = 0.6   # fraction of a peak a kernel reaches
    kernel_floor_us: float = 3.0  # the shortest kernel
    threads_per_sm: int = 2048    # resident threads an SM holds

    def kernel_us(self, flops: float, nbytes: float, tensor_cores: bool) -> float:
        """A kernel's time on the roofline: the slower of compute and memory."""
        peak = self.tf32_flops if tensor_cores else self.fp32_flops
        t = max(flops / (peak * self.efficiency), nbytes / (self.bandwidth * self.efficiency))
        return max(self.kernel_floor_us, t * 1e6)

    def kernel_shares(self, nbytes: float, alone_us: float,
                      out_elements: float) -> tuple[float, float]:
        """(SM share, bandwidth share) of a kernel of ``alone_us`` (its
        ``kernel_us``) beside others: see the module's opening. Both in (0, 1]."""
        sm = min(1.0, max(out_elements / (self.sms * self.threads_per_sm), 1 / self.sms))
        memory_us = nbytes / (self.bandwidth * self.efficiency) * 1e6
        bw = min(1.0, max(memory_us / alone_us, 1e-3))
        return round(sm, 6), round(bw, 6)


GPUS = {g.name: g for g in (
    GPU("V100-32GB", 32 * GiB - 512 * MiB, 15.7e12, 15.7e12, 900e9, 8 * MiB + 128 * 1024, sms=80),
    GPU("A100-80GB", 80 * GiB - 768 * MiB, 19.5e12, 156e12, 2039e9, 8 * MiB + 128 * 1024, sms=108),
    GPU("H100-80GB", 80 * GiB - 1 * GiB, 67e12, 494.7e12, 3350e9, 32 * MiB, sms=132),
)}


def gpu(name: str) -> GPU:
    """The named GPU; a ValueError lists the names known."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}") from None
