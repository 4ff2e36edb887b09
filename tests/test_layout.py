"""The package's layers import one way, as each package's docstring says:
alloc sees only _C; the planner never sees the executors, simulation or
tools; and no module imports another module's private names."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "waterwave"
# What each layer may import of waterwave (besides itself).
ALLOWED = {
    "alloc": {"_C"},
    "planner": {"_C", "alloc"},
    "exec": {"_C", "alloc", "planner"},
    "sim": {"_C", "alloc", "planner", "exec"},
    "tools": {"_C", "alloc", "planner", "exec", "sim"},
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


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if len(p.relative_to(PACKAGE).parts) > 1)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_import_one_way(path):
    layer = path.relative_to(PACKAGE).parts[0]
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
