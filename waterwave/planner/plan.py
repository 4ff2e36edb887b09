"""A memory plan: operator order plus the byte offset of every tensor.

JSON format (``format: "waterwave-plan"``, ``version: 1``)::

    {"format": "waterwave-plan", "version": 1, "graph": "resnet18", "strategy": "model",
     "order": [node ids], "offsets": {tensor id: offset}, "sizes": {tensor id: bytes},
     "arena_size": bytes, "lower_bound": bytes, "solve_seconds": s, "status": "optimal",
     "inplace": [[output tensor, input tensor], ...], "stats": {...}}

``lower_bound`` is the peak of the plan's order with no fragmentation;
``stats`` may carry the solver's proven bound over all orders and its gap.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..graph import check_header, read_json, write_json
from .plan_error import PlanError
from .slots import plan_slots

FORMAT = "waterwave-plan"
VERSION = 1


@dataclass
class Plan:
    graph: str
    strategy: str
    order: list[int]
    offsets: dict[int, int]
    sizes: dict[int, int]
    arena_size: int
    lower_bound: int
    solve_seconds: float = 0.0
    status: str = "heuristic"
    inplace: list[tuple[int, int]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return self.arena_size

    @property
    def fragmentation(self) -> float:
        """Bytes the layout wastes against its order's bound, as a fraction of the arena."""
        return 0.0 if self.arena_size == 0 else 1 - self.lower_bound / self.arena_size

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "graph": self.graph,
                "strategy": self.strategy, "order": self.order,
                "offsets": {str(k): v for k, v in self.offsets.items()},
                "sizes": {str(k): v for k, v in self.sizes.items()},
                "arena_size": self.arena_size, "lower_bound": self.lower_bound,
                "solve_seconds": self.solve_seconds, "status": self.status,
                "inplace": [list(p) for p in self.inplace], "stats": self.stats}

    def save(self, path: str) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        check_header(d, FORMAT, VERSION, PlanError, "plan the graph again")
        try:
            return cls(str(d["graph"]), str(d["strategy"]), [int(v) for v in d["order"]],
                       {int(k): int(v) for k, v in d["offsets"].items()},
                       {int(k): int(v) for k, v in d["sizes"].items()},
                       int(d["arena_size"]), int(d["lower_bound"]),
                       float(d.get("solve_seconds", 0.0)), str(d.get("status", "heuristic")),
                       [(int(a), int(b)) for a, b in d.get("inplace", [])], dict(d.get("stats", {})))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise PlanError(f"plan file is corrupt: {type(e).__name__}: {e}") from None

    def allocation_slots(self, graph) -> tuple[list[tuple[int, int]], int]:
        """The allocation sequence a step makes under this plan, as (size,
        offset) slots and the arena (``slots.plan_slots``)."""
        return plan_slots(graph, self)

    @classmethod
    def load(cls, path: str) -> "Plan":
        return cls.from_dict(read_json(path, PlanError))
