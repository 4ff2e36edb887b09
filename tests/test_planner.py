"""Planners, the independent plan checker, packing, and file formats."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_graphs import random_graphs

from waterwave.graph import Graph, GraphError
from waterwave.planner import (
    STRATEGIES,
    Plan,
    PlanError,
    check_plan,
    order_peak,
    plan,
)
from waterwave.planner.baseline import replay

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chain(sizes=(1024, 4096, 2048, 8192, 512)):
    g = Graph("chain")
    prev = g.add_tensor("x", 1024, "input")
    w = g.add_tensor("w", 2048, "param", True)
    acts = []
    for i, s in enumerate(sizes):
        t = g.add_tensor(f"a{i}", s)
        g.add_node(f"f{i}", "aten.mm", [prev, w], [t])
        acts.append(t)
        prev = t
    for i in reversed(range(len(sizes))):
        t = g.add_tensor(f"d{i}", sizes[i])
        g.add_node(f"b{i}", "aten.mm", [prev, acts[i], w], [t])
        prev = t
    g.meta["outputs"] = [prev]
    return g


@given(random_graphs())
@FAST
def test_every_planner_passes_the_checker_on_random_graphs(g):
    for strategy in STRATEGIES:
        p = plan(g, strategy, time_limit=2.0)
        check_plan(g, p)
        assert p.arena_size >= p.lower_bound or strategy in ("mxnet", "paddle")
        assert p.arena_size >= g.persistent_bytes()


@given(random_graphs())
@FAST
def test_model_is_never_worse_than_greedy_and_bounds_hold(g):
    greedy = plan(g, "greedy")
    model = plan(g, "model", time_limit=2.0)
    assert model.arena_size <= greedy.arena_size
    for s in ("mxnet", "paddle"):  # never worse than a baseline either
        assert model.arena_size <= plan(g, s).arena_size
    # No plan of any strategy, in-place sharing included, beats the bound
    # with sharing; a plan that shares is held to it.
    for s in STRATEGIES:
        assert plan(g, s).arena_size >= model.stats["inplace_bound"]
    if model.inplace:
        assert model.stats["proven_lower_bound"] == model.stats["inplace_bound"]
        assert 0 <= model.stats["gap"] < 1
        return  # the bound without sharing does not hold for it
    lb = model.stats["proven_lower_bound"]
    assert lb <= model.arena_size
    # No plan without in-place sharing beats the proven bound.
    for s in ("pytorch", "greedy"):
        assert plan(g, s).arena_size >= lb


def test_model_finds_the_optimum_on_a_small_graph():
    g = chain()
    p = plan(g, "model", time_limit=10)
    check_plan(g, p)
    assert p.status == "optimal" and p.stats["gap"] == 0.0
    assert p.arena_size == p.stats["proven_lower_bound"]


@given(random_graphs(), st.randoms(use_true_random=False))
@FAST
def test_must_live_bound_holds_for_every_order(g, rng):
    """No topological order goes below the must-live bound, and the exact
    model's optimum (gap limit 0) is never below it either."""
    from waterwave.graph.lifetimes import must_live_bound, node_lower_bound

    bound = must_live_bound(g)
    assert bound >= node_lower_bound(g)
    for _ in range(5):  # random topological orders
        indeg = [len(g.preds(v)) for v in range(len(g.nodes))]
        ready = [v for v, d in enumerate(indeg) if d == 0]
        order = []
        while ready:
            v = ready.pop(rng.randrange(len(ready)))
            order.append(v)
            for s in g.succs(v):
                indeg[s] -= 1
                if indeg[s] == 0:
                    ready.append(s)
        assert order_peak(g, order) >= bound
    exact = plan(g, "model", time_limit=5, gap_limit=0.0)
    if not exact.inplace:
        assert exact.arena_size >= bound


def test_must_live_bound_proves_a_training_step_optimal_without_search():
    # Forward activations are all saved for backward: at the turn they are
    # live in every order, so the bound equals program order's peak, and
    # `model` stops at once with a zero gap.
    from waterwave.graph.lifetimes import must_live_bound

    g = chain()
    assert must_live_bound(g) == order_peak(g, list(range(len(g.nodes))))
    p = plan(g, "model", time_limit=30)
    assert p.status == "optimal" and p.stats["gap"] == 0.0
    assert p.solve_seconds < 5


def all_topological_orders(g, limit=5000):
    orders, order, indeg = [], [], [len(g.preds(v)) for v in range(len(g.nodes))]

    def extend():
        if len(orders) >= limit:
            return
        if len(order) == len(g.nodes):
            orders.append(list(order))
            return
        for v in range(len(g.nodes)):
            if indeg[v] == 0 and v not in order:
                order.append(v)
                for s in g.succs(v):
                    indeg[s] -= 1
                extend()
                for s in g.succs(v):
                    indeg[s] += 1
                order.pop()

    extend()
    return orders


@given(random_graphs(max_nodes=7))
@FAST
def test_least_live_is_exact_for_every_node(g):
    """The cut gives, for each node, exactly the fewest bytes any order has
    live while it runs (every topological order enumerated), and the cut
    bound lies between the must-live bound and the best order's peak."""
    from waterwave.planner.cut_bound import cut_bound, least_live
    from waterwave.graph.lifetimes import live_profile, must_live_bound

    orders = all_topological_orders(g)
    assert len(orders) < 5000
    fewest = [None] * len(g.nodes)
    for order in orders:
        for step, live in enumerate(live_profile(g, order)):
            v = order[step]
            fewest[v] = live if fewest[v] is None else min(fewest[v], live)
    assert [least_live(g, v) for v in range(len(g.nodes))] == fewest
    bound = cut_bound(g)
    assert bound == max(must_live_bound(g), max(fewest))
    assert bound <= min(order_peak(g, o) for o in orders)


@given(random_graphs(max_nodes=7))
@FAST
def test_cut_bound_with_sharing_holds_for_every_order_and_sharing(g):
    """Every topological order, with in-place sharing along it (the rule of
    greedy and model) or as MXNet and Paddle share, stays at or above the
    bound with sharing, which never exceeds the bound without."""
    from waterwave.planner.classic import mxnet_plan, paddle_plan
    from waterwave.planner.cut_bound import cut_bound
    from waterwave.planner.inplace import inplace_pairs

    bound = cut_bound(g, inplace=True)
    assert bound <= cut_bound(g)
    for order in all_topological_orders(g):
        assert order_peak(g, order, inplace_pairs(g, order)) >= bound
    for classic in (mxnet_plan, paddle_plan):
        order, _, arena, pairs = classic(g)
        assert order_peak(g, order, pairs) >= bound and arena >= bound


def test_cut_bound_with_sharing_proves_an_in_place_plan_optimal():
    """A chain of pointwise operators, each allowed to overwrite its input:
    sharing keeps one buffer per step where two would be live, and the bound
    with sharing proves that plan optimal."""
    g = Graph("pointwise")
    x = g.add_tensor("x", 512, "input")
    prev = g.add_tensor("a0", 4096)
    g.add_node("expand", "aten.expand", [x], [prev])
    for i in range(1, 5):
        t = g.add_tensor(f"a{i}", 4096)
        g.add_node(f"relu{i}", "aten.relu", [prev], [t], inplace_ok=[prev])
        prev = t
    g.meta["outputs"] = [prev]
    p = plan(g, "model", time_limit=10)
    assert p.inplace
    assert p.arena_size < p.stats["bound_without_inplace"]
    assert p.arena_size == p.stats["inplace_bound"] == p.stats["proven_lower_bound"] == 4096 + 512
    assert p.status == "optimal" and p.stats["gap"] == 0.0


def test_cut_bound_counts_a_tensor_or_what_replaces_it():
    """GPT-2's GELU backward takes x ** 2 of the layer's input: it may run
    before the loss, freeing x, but then its output is live instead. The
    must-live bound counts neither; the cut bound proves program order
    optimal."""
    from waterwave.planner.cut_bound import cut_bound
    from waterwave.graph.lifetimes import must_live_bound

    g = Graph("gelu")
    x = g.add_tensor("x", 4096, "input")
    h = g.add_tensor("h", 4096)
    g.add_node("linear", "aten.mm", [x], [h])
    loss = g.add_tensor("loss", 512)
    g.add_node("loss", "aten.sum", [h], [loss])
    grad = g.add_tensor("grad", 8192)
    g.add_node("loss_backward", "aten.expand", [loss], [grad])
    reduced = g.add_tensor("reduced", 1024)
    g.add_node("reduce", "aten.sum", [grad], [reduced])
    sq = g.add_tensor("sq", 4096)
    g.add_node("pow", "aten.pow", [h], [sq])  # needs h only, not the gradient
    dx = g.add_tensor("dx", 512)
    g.add_node("gelu_backward", "aten.mul", [reduced, sq], [dx])
    g.meta["outputs"] = [loss, dx]
    best = min(order_peak(g, o) for o in all_topological_orders(g))
    assert must_live_bound(g) < best
    assert cut_bound(g) == best == order_peak(g, list(range(len(g.nodes))))
    p = plan(g, "model", time_limit=10)
    assert p.status == "optimal" and p.stats["gap"] == 0.0
    assert p.stats["cut_bound"] == best > p.stats["must_live_bound"]


def test_greedy_beats_program_order_when_order_matters():
    # Two independent branches: running each to completion keeps memory low.
    g = Graph("branches")
    x = g.add_tensor("x", 512, "input")
    ends = []
    for b in range(2):
        big = g.add_tensor(f"big{b}", 64 * 512)
        g.add_node(f"make{b}", "aten.op", [x], [big])
        small = g.add_tensor(f"small{b}", 512)
        ends.append((big, small))
    for b, (big, small) in enumerate(ends):
        g.add_node(f"use{b}", "aten.op", [big], [small])
    out = g.add_tensor("out", 512)
    g.add_node("join", "aten.op", [ends[0][1], ends[1][1]], [out])
    g.meta["outputs"] = [out]
    assert plan(g, "greedy").arena_size < plan(g, "pytorch").arena_size


def corrupt(p: Plan, **changes) -> Plan:
    d = p.to_dict()
    d.update(changes)
    return Plan.from_dict(d)


def test_checker_rejects_bad_plans():
    g = chain()
    p = plan(g, "greedy")
    check_plan(g, p)
    with pytest.raises(PlanError, match="predecessor"):
        check_plan(g, corrupt(p, order=list(reversed(p.order))))
    with pytest.raises(PlanError, match="permutation"):
        check_plan(g, corrupt(p, order=p.order[:-1]))
    with pytest.raises(PlanError, match="not exact"):
        check_plan(g, corrupt(p, arena_size=p.arena_size + 512))
    offs = dict(p.offsets)
    a0, a1 = g.tensors[2].id, g.tensors[3].id  # x and a0 are live together
    offs[a1] = offs[a0]
    bad = corrupt(p, offsets={str(k): v for k, v in offs.items()},
                  arena_size=max(offs[t] + p.sizes[t] for t in offs))
    with pytest.raises(PlanError, match="overlap"):
        check_plan(g, bad)
    with pytest.raises(PlanError, match="size"):
        check_plan(g, corrupt(p, sizes={str(k): v + 512 for k, v in p.sizes.items()}))
    with pytest.raises(PlanError, match="in-place pair"):
        check_plan(g, corrupt(p, inplace=[[4, 2]]))


def test_plan_and_graph_files_round_trip(tmp_path):
    g = chain()
    g.save(tmp_path / "g.json")
    g2 = Graph.load(tmp_path / "g.json")
    assert g2.to_dict() == g.to_dict()
    p = plan(g2, "greedy")
    p.save(tmp_path / "p.json")
    p2 = Plan.load(tmp_path / "p.json")
    assert p2.to_dict() == p.to_dict()
    check_plan(g2, p2)


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"format": "other"}', "not a waterwave"),
    ('{"format": "waterwave-graph", "version": 99}', "version 99"),
    ('{"format": "waterwave-graph", "version": 1, "tensors": [{"id": 0}], "nodes": []}', "corrupt"),
])
def test_corrupt_graph_files_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(GraphError, match=message):
        Graph.load(path)


def test_corrupt_plan_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "waterwave-plan", "version": 1, "graph": "x"}))
    with pytest.raises(PlanError, match="corrupt"):
        Plan.load(path)


def test_graph_validation_names_the_problem():
    g = Graph("bad")
    a = g.add_tensor("a", 512)
    b = g.add_tensor("b", 512)
    g.add_node("n0", "op", [b], [a])
    g.add_node("n1", "op", [a], [b])
    with pytest.raises(GraphError, match="cycle"):
        g.validate()
    g2 = Graph("orphan")
    g2.add_tensor("lost", 512)
    with pytest.raises(GraphError, match="neither produced"):
        g2.validate()


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy"):
        plan(chain(), "tetris")
    with pytest.raises(ValueError, match="gap_limit must be a fraction"):
        plan(chain(), "model", gap_limit=-0.1)


def test_baseline_replay_counts_fragmentation():
    g = chain()
    r = replay(g)
    assert r.ideal_peak == order_peak(g, list(range(len(g.nodes))))
    assert r.peak_allocated >= r.ideal_peak  # rounding can only add
    assert r.peak_reserved >= r.peak_allocated
    assert r.peak_reserved % (2 * 1024 * 1024) == 0  # whole segments
    assert 0 <= r.fragmentation < 1


@given(random_graphs())
@FAST
def test_a_trace_of_a_graph_replays_as_the_graph_does(g):
    """replay_trace, given the blocks a graph's program order allocates (as
    a GPU recording lists them), reserves what replay(g) reserves."""
    from waterwave.planner.baseline import replay_trace
    from waterwave.graph.lifetimes import allocation_events

    clock, blocks, index = 0, [], {}
    for t in g.tensors:
        if (t.persistent or t.kind == "input") and t.size:
            blocks.append([t.size, clock, -1])
            clock += 1
    for kind, t in allocation_events(g, list(range(len(g.nodes)))):
        if kind == "alloc":
            index[t] = len(blocks)
            blocks.append([g.tensors[t].size, clock, -1])
        else:
            blocks[index.pop(t)][2] = clock
        clock += 1
    expected, got = replay(g), replay_trace([tuple(b) for b in blocks])
    assert (got.peak_reserved, got.peak_allocated) == (expected.peak_reserved, expected.peak_allocated)


def test_replay_trace_rejects_what_is_not_a_block():
    from waterwave.planner.baseline import replay_trace

    for bad in ((0, 0, 1), (512, 3, 3), (512, -1, 2)):
        with pytest.raises(ValueError, match="trace entry 1"):
            replay_trace([(512, 0, 5), bad])


@st.composite
def plain_graphs(draw):
    """Small graphs the paper's ILP can express: every node makes a tensor."""
    g = Graph("plain")
    live = [g.add_tensor("x", 512 * draw(st.integers(1, 4)), "input")]
    for i in range(draw(st.integers(2, 6))):
        ins = draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True))
        outs = [g.add_tensor(f"t{i}_{j}", 512 * draw(st.integers(1, 6)))
                for j in range(draw(st.integers(1, 2)))]
        g.add_node(f"n{i}", "op", ins, outs)
        live.extend(outs)
    g.meta["outputs"] = [live[-1]]
    return g


@given(plain_graphs())
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_paper_ilp_agrees_with_cp_sat(g):
    from waterwave.planner.ilp import solve_paper_ilp

    result = solve_paper_ilp(g, time_limit=120)
    assert result is not None
    order, offsets, arena, status = result
    assert status == "optimal"
    cp = plan(g, "model", time_limit=10, gap_limit=0.0)
    assert cp.status == "optimal"
    assert arena == cp.arena_size - g.persistent_bytes()
    # The ILP's decoded plan is itself valid.
    from waterwave.planner import Plan
    full = {t.id: o for t, o in ((g.tensors[e], o) for e, o in offsets.items())}
    p = Plan(g.name, "ilp", order, full, {e: g.tensors[e].size for e in offsets}, arena,
             order_peak(g, order), 0.0, status)
    check_plan(g, p)


def shrinking_after_relu():
    """x -> a (1 MiB) -relu-> b -> c (16 KiB) -> e (64 KiB). Only running the
    relu in place avoids 2 MiB live at once; mxnet, which does, then puts its
    storages back to back (1 MiB + 16 + 64 + 1 KiB), though c and e never
    outlive the 1 MiB one by more than one step."""
    g = Graph("shrinking")
    x = g.add_tensor("x", 1024, "input")
    a = g.add_tensor("a", 1 << 20)
    b = g.add_tensor("b", 1 << 20)
    c = g.add_tensor("c", 16 << 10)
    e = g.add_tensor("e", 64 << 10)
    g.add_node("expand", "aten.op", [x], [a])
    g.add_node("relu", "aten.relu", [a], [b], inplace_ok=[a])
    g.add_node("reduce", "aten.op", [b], [c])
    g.add_node("expand2", "aten.op", [c], [e])
    g.meta["outputs"] = [e]
    return g


@pytest.mark.parametrize("strategy", ["greedy", "model"])
def test_in_place_plans_are_laid_out_exactly(strategy):
    """When a classic planner's in-place sharing wins, greedy and model keep
    its sharing but pack the shared storages exactly: the arena meets the
    order's own bound instead of stacking storages back to back."""
    g = shrinking_after_relu()
    mxnet = plan(g, "mxnet")
    assert mxnet.arena_size == (1 << 20) + 1024 + (16 << 10) + (64 << 10)
    p = plan(g, strategy, time_limit=5)
    check_plan(g, p)
    assert p.inplace == mxnet.inplace
    assert p.arena_size == p.lower_bound == (1 << 20) + (16 << 10)  # b and c, at "reduce"
    assert "exact pack" in p.stats["layout"]


def test_cpsat_workers_come_from_the_environment(monkeypatch):
    from waterwave.planner import default_workers

    monkeypatch.setenv("WATERWAVE_CPSAT_WORKERS", "3")
    assert default_workers() == 3
    monkeypatch.delenv("WATERWAVE_CPSAT_WORKERS")
    assert default_workers() == 2
    monkeypatch.setenv("WATERWAVE_CPSAT_WORKERS", "two")
    with pytest.raises(ValueError, match="positive whole number, got 'two'"):
        plan(chain(), "model")
