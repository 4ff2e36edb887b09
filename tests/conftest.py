import os

import pytest

import waterwave as ww

# One CP-SAT worker in the suite: deterministic searches, and none of OR-Tools
# 9.15's parallel-search aborts (one killed a fresh-clone run of this suite).
os.environ.setdefault("WATERWAVE_CPSAT_WORKERS", "1")

MiB = 1024**2
KiB = 1024


@pytest.fixture(params=["waterwave", "pytorch"])
def policy(request):
    return request.param


def make(policy="waterwave", capacity=1024 * MiB, overhead=1.0, **cfg):
    return ww.Allocator(policy, ww.SimDevice(capacity, overhead), **cfg)
