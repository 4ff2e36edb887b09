"""Settings, parsed once at the edge: the policy's name and an
``AllocatorConfig`` (typed values, bound from C++) from the arguments, a
``PYTORCH_CUDA_ALLOC_CONF``-style string, keyword settings, or the
``WATERWAVE_ALLOC_CONF`` environment variable (which may also name the
policy: ``policy:pytorch,max_split_size_mb:200``).

May import: waterwave._C.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from .. import _C
from .._C import AllocatorConfig

ENV_VAR = "WATERWAVE_ALLOC_CONF"
# The one list of policies is the C++ core's (csrc/alloc/policies.cpp).
POLICIES = tuple(name for name, _ in _C.policies())


def fraction_allowing(limit: int, total: int) -> float:
    """The ``per_process_memory_fraction`` under which an allocator of a
    device of ``total`` bytes allows exactly ``limit`` bytes. The allocator
    allows ``int(fraction * total)``, as PyTorch's does, and ``limit /
    total`` can round to a byte less (646 MiB of 79 GiB does): a cap set so
    would refuse a schedule whose peaks add up to the limit exactly."""
    if not 0 < limit <= total:
        raise ValueError(f"a limit of {limit} bytes is not within the device's {total} bytes")
    fraction = limit / total
    while int(fraction * total) < limit:
        fraction = math.nextafter(fraction, math.inf)
    return fraction


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return str(value)
    try:
        parts = [f"{k}:{v}" for k, v in items]
    except (TypeError, ValueError):
        raise _C.ConfigError(
            f"allocator config: {key} takes an int or a mapping of interval (MiB) to "
            f"divisions, e.g. {{256: 1, '>': 4}}; got {value!r}"
        ) from None
    return "[" + ",".join(parts) + "]"


def config_string(config: str | None = None, **kwargs: Any) -> str:
    """Join a PYTORCH_CUDA_ALLOC_CONF-style string and keyword settings into
    one string, for an environment variable or a command line:
    ``config_string("max_split_size_mb:200", roundup_power2_divisions={256: 1, ">": 4})``
    gives ``"max_split_size_mb:200,roundup_power2_divisions:[256:1,>:4]"``.
    (Waterwave's own calls take ``AllocatorConfig`` values instead.)"""
    parts = [config] if config else []
    parts += [f"{k}:{_format_value(k, v)}" for k, v in kwargs.items()]
    return ",".join(parts)


def parse_config(config: str) -> str:
    """Validate a config string; returns its canonical form or raises ConfigError."""
    return str(AllocatorConfig(config))


def resolve_settings(policy: str | None, config: str | AllocatorConfig | None,
                     role: str = "allocator policy", **kwargs: Any) -> tuple[str, AllocatorConfig]:
    """The policy and the typed configuration to use. The config is the
    argument (a string or an ``AllocatorConfig``), else ``WATERWAVE_ALLOC_CONF``;
    a string's ``policy:`` entry picks the policy unless the argument does;
    the default is ``waterwave``. Keyword settings apply on top."""
    named = None
    if policy is not None and not isinstance(policy, str):
        raise TypeError(f"the {role} must be a name ({', '.join(POLICIES)}), got {policy!r}")
    if isinstance(config, AllocatorConfig):
        parsed = config
    elif config is not None and not isinstance(config, str):
        raise TypeError("config must be a PYTORCH_CUDA_ALLOC_CONF-style string (e.g. "
                        "'max_split_size_mb:128') or a waterwave.AllocatorConfig, got "
                        f"{config!r}")
    else:
        named, parsed = _C.parse_settings(os.environ.get(ENV_VAR, "") if config is None else config)
    policy = policy or named or POLICIES[0]
    if policy not in POLICIES:
        raise _C.ConfigError(f"unknown {role} {policy!r}: choose one of {', '.join(POLICIES)} "
                             f"(in {ENV_VAR} write e.g. policy:{POLICIES[0]})")
    return policy, parsed.replace(**kwargs) if kwargs else parsed
