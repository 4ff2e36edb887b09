"""The package's layers import one way, as each package's docstring says:
alloc sees only _C; the planner never sees the executors, simulation or
tools; no module imports another module's private names; and no import
circle exists anywhere, between modules or packages."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "waterwave"
# What each layer may import of waterwave (besides itself).
# Bottom to top. ``cuda`` and ``cupy`` (modules at the top) are the
# allocator's CUDA face, over alloc; ``trace`` is the face of sim.trace. The
# simulator sees the pipeline, never the executors: both run its schedules.
ALLOWED = {
    "graph": {"_C"},
    "capturing": {"graph"},
    "alloc": {"_C"},
    "cuda": {"_C", "alloc"},
    "cupy": {"_C", "alloc", "cuda"},
    "planner": {"_C", "alloc", "graph"},
    "pipeline": {"graph"},
    "exec": {"_C", "alloc", "cuda", "graph", "capturing", "planner", "pipeline"},
    "sim": {"_C", "alloc", "graph", "capturing", "pipeline"},
    "trace": {"sim"},
    "tools": {"_C", "alloc", "cuda", "cupy", "graph", "capturing", "planner", "pipeline", "exec",
              "sim", "trace"},
}


def imports(path: Path):
    """(imported waterwave layer, names imported) of each import in a module."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = (*base, *(node.module.split(".") if node.module else ()))
            else:
                target = tuple((node.module or "").split("."))
            names = [a.name for a in node.names]
            if target[:1] == ("waterwave",) and len(target) == 1:
                for name in names:  # from .. import _C / from . import cuda
                    yield ("waterwave", name), []
            else:
                yield target, names
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield tuple(a.name.split(".")), []


MODULES = sorted(p for p in PACKAGE.rglob("*.py")
                 if len(p.relative_to(PACKAGE).parts) > 1 or p.stem in ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_import_one_way(path):
    layer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    for target, _ in imports(path):
        if target[:1] != ("waterwave",) or len(target) < 2 or target[1] == layer:
            continue
        assert target[1] in ALLOWED[layer], (
            f"{path.relative_to(PACKAGE)} imports waterwave.{target[1]}: layer {layer} may import "
            f"only {sorted(ALLOWED[layer])}")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_private_names(path):
    for target, names in imports(path):
        if target[:1] == ("waterwave",):
            private = [n for n in names if n.startswith("_") and n != "_C"]
            assert not private, f"{path.relative_to(PACKAGE)} imports private {private} of {'.'.join(target)}"


def test_at_most_six_modules_at_the_top():
    top = [p.name for p in PACKAGE.glob("*.py")] + [p.name for p in PACKAGE.glob("_C*.so")]
    assert len(top) <= 6, top


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path) -> set[str]:
    """The waterwave modules ``path`` imports, at its top or inside a
    function (an import put off into a function hides a circle; it does
    not remove one)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    known = {module_name(p) for p in PACKAGE.rglob("*.py")} | {"waterwave._C"}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # a submodule by name, else the module that holds the name
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    # Importing a.b.c imports a and a.b first; those edges are the packages'.
    return {m for m in out if m in known and m != name}


def test_no_import_circle_anywhere():
    # A package's __init__ imports its modules; a module that imports its
    # package's face (not the module it needs) closes a circle, and counts.
    graph = {module_name(p): module_imports(p) for p in PACKAGE.rglob("*.py")}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                circle = path[path.index(n):] + [n]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def readme_tree() -> set[str]:
    """The paths the README's Layout block names, from their indentation."""
    text = (PACKAGE.parent / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.strip("\n").splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        names = line.strip().split("  ")[0].split(", ")
        del stack[depth:]
        for name in names:
            paths.add("/".join([*stack, name.strip()]).rstrip("/"))
        if names[-1].endswith("/"):
            stack.append(names[-1].rstrip("/"))
    return paths


def test_the_readme_tree_is_the_repository():
    root = PACKAGE.parent
    named = readme_tree()
    missing = sorted(p for p in named if not (root / p).exists())
    assert not missing, f"the README's Layout names what is not here: {missing}"
    packages = {f"waterwave/{p.name}" for p in PACKAGE.iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    folders = {f"csrc/{p.name}" for p in (root / "csrc").iterdir() if p.is_dir()}
    top = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
           and p.name not in ("build", "out") and not p.name.endswith(".egg-info")}
    unlisted = sorted((packages | folders | top) - named)
    assert not unlisted, f"the README's Layout leaves out: {unlisted}"


def test_the_architecture_page_shows_this_layer_table():
    """The layer map is kept once, here; the architecture notes render it."""
    order = ["_C", *ALLOWED]
    rows = ["| layer | may import (of waterwave) |", "|---|---|"]
    for name, allowed in ALLOWED.items():
        names = ", ".join(f"`{a}`" for a in order if a in allowed) or "nothing"
        rows.append(f"| `{name}` | {names} |")
    page = (PACKAGE.parent / "docs" / "design" / "architecture.md").read_text()
    assert "\n".join(rows) in page, "render ALLOWED into docs/design/architecture.md's table"


def test_the_graph_and_the_allocator_load_without_the_executors():
    """The executors (and what they import) load at first use of ww.Job,
    ww.sharing and their kin, not with ``import waterwave.graph``."""
    import subprocess
    import sys

    probe = ("import sys, waterwave.graph, waterwave.cuda\n"
             "assert not [m for m in sys.modules if m.startswith('waterwave.exec')]\n"
             "import waterwave as ww\n"
             "assert ww.Job.__module__ == 'waterwave.exec.job' and ww.sharing\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
