"""The graph of one training step: operators in program order, tensors as
storages, sizes as the caching allocator rounds them, and its JSON format
(``graph.py``); those sizes by the allocator's own rules (``sizes.py``);
tensor lifetimes under an operator order and the peaks and
bounds they imply (``lifetimes.py``); the limits on files read from
elsewhere (``input_limits.py``).
Capture makes it; the planner, the executors and the simulator read it.

May import: waterwave._C (the allocator's size rules).
"""
from .graph import (  # noqa: F401
    FORMAT,
    KINDS,
    VERSION,
    Graph,
    GraphError,
    Node,
    Tensor,
    check_header,
    read_json,
    write_json,
)
from .input_limits import InputLimits, input_limits, read_bytes, set_input_limits  # noqa: F401
from .sizes import footprint, round_size  # noqa: F401
