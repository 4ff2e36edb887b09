import pytest

import waterwave as ww

MiB = 1024**2
KiB = 1024


@pytest.fixture(params=["waterwave", "pytorch"])
def policy(request):
    return request.param


def make(policy="waterwave", capacity=1024 * MiB, overhead=1.0, **cfg):
    return ww.Allocator(policy, ww.SimDevice(capacity, overhead), **cfg)
