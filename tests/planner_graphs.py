"""Random training-like graphs for planner tests (hypothesis strategies)."""
import hypothesis.strategies as st

from waterwave.graph import Graph


@st.composite
def random_graphs(draw, max_nodes=14):
    """A random DAG with persistent weights, an input, multi-output nodes,
    in-place writes with their ordering edges, and pointwise ops."""
    g = Graph("random")
    x = g.add_tensor("x", 512 * draw(st.integers(1, 8)), "input")
    ws = [g.add_tensor(f"w{i}", 512 * draw(st.integers(1, 8)), "param", True)
          for i in range(draw(st.integers(0, 2)))]
    live = [x]
    n = draw(st.integers(1, max_nodes))
    writers = {}
    for i in range(n):
        k = draw(st.integers(1, min(3, len(live))))
        ins = draw(st.lists(st.sampled_from(live), min_size=1, max_size=k, unique=True))
        if ws and draw(st.booleans()):
            ins.append(draw(st.sampled_from(ws)))
        if draw(st.integers(0, 5)) == 0 and len(live) > 1:
            target = draw(st.sampled_from([t for t in live if t != x]) if len(live) > 1 else st.just(None))
            if target is not None:
                if target not in ins:
                    ins.append(target)
                deps = [v for v in range(len(g.nodes)) if target in g.nodes[v].inputs]
                g.add_node(f"inplace{i}", "aten.add_.Tensor", ins, [], [target], deps)
                continue
        outs = [g.add_tensor(f"t{i}_{j}", 512 * draw(st.integers(1, 16)))
                for j in range(draw(st.integers(1, 2)))]
        pointwise = [t for t in ins if g.tensors[t].size == g.tensors[outs[0]].size
                     and not g.tensors[t].persistent] if len(outs) == 1 else []
        deps = [writers[t] for t in ins if t in writers]
        g.add_node(f"n{i}", "aten.op", ins, outs, deps=deps, inplace_ok=pointwise)
        live.extend(outs)
    g.meta["outputs"] = [live[-1]]
    g.validate()
    return g
