"""The settings grammar both allocator faces share: policy names, and
``PYTORCH_CUDA_ALLOC_CONF``-style config strings with keyword settings on
top, taken from the arguments or from ``WATERWAVE_ALLOC_CONF``.

May import: waterwave._C.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from .. import _C

ENV_VAR = "WATERWAVE_ALLOC_CONF"
# The one list of policies is the C++ core's (csrc/alloc/policies.cpp).
POLICIES = tuple(name for name, _ in _C.policies())


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
    """Join a PYTORCH_CUDA_ALLOC_CONF-style string and keyword settings.

    ``config_string("max_split_size_mb:200", roundup_power2_divisions={256: 1, ">": 4})``
    gives ``"max_split_size_mb:200,roundup_power2_divisions:[256:1,>:4]"``.
    Keywords override keys of the string (they come later).
    """
    parts = [config] if config else []
    parts += [f"{k}:{_format_value(k, v)}" for k, v in kwargs.items()]
    return ",".join(parts)


def parse_config(config: str) -> str:
    """Validate a config string; returns its canonical form or raises ConfigError."""
    return _C.parse_config(config)


def split_policy(config: str) -> tuple[str | None, str]:
    """Take the ``policy:NAME`` entry out of a config string:
    ``"policy:pytorch,max_split_size_mb:200"`` → ``("pytorch", "max_split_size_mb:200")``."""
    policy, rest = None, []
    for entry in re.split(r",(?![^\[]*\])", config):  # commas inside [...] belong to a value
        key, _, value = entry.partition(":")
        if key.strip() == "policy":
            policy = value.strip()
        elif entry.strip():
            rest.append(entry.strip())
    return policy, ",".join(rest)


def resolve_settings(policy: str | None, config: str | None,
                     role: str = "allocator policy") -> tuple[str, str]:
    """The policy and config string to use. The config is the argument, else
    ``WATERWAVE_ALLOC_CONF``; its ``policy:`` entry picks the policy unless
    the argument does; the default is ``waterwave``."""
    config_policy, config = split_policy(os.environ.get(ENV_VAR, "") if config is None else config)
    policy = policy or config_policy or POLICIES[0]
    if policy not in POLICIES:
        raise _C.ConfigError(f"unknown {role} {policy!r}: choose one of {', '.join(POLICIES)} "
                             f"(in {ENV_VAR} write e.g. policy:{POLICIES[0]})")
    return policy, config
