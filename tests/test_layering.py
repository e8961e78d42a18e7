"""simpar's modules import downward only, and never inside a function body.

The layers, bottom first (see README, "Layers"): configuration and leaf helpers; the MPI
package; meshes, layouts, parameters and the schedule guard; redistribution; operators; the
traced graph; planners; lowering and execution; the op-level API; cells (and
``simpar.auto_parallel``, which names ``simpar.nn``'s AutoParallel); the check and the data; the
main job. A module may import its own layer or any layer below it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "simpar"

LAYERS: list[tuple[str, ...]] = [
    ("simpar._env", "simpar.context", "simpar.cost_model_context", "simpar.seed",
     "simpar.counter_rng", "simpar.compare", "simpar.cost.collective"),
    ("simpar.comm",),
    ("simpar.mesh", "simpar.layout", "simpar.parameter", "simpar.schedule"),
    ("simpar.redistribution", "simpar.cotangent"),
    ("simpar.ops",),
    ("simpar.graph",),
    ("simpar.search", "simpar.cost", "simpar.strategy_file"),
    ("simpar.runtime",),
    ("simpar.parallel",),
    ("simpar.nn", "simpar.auto_parallel"),
    ("simpar.check", "simpar.dataset", "simpar.checkpoint"),
    ("simpar.train", "simpar.launch", "simpar.calibrate", "simpar"),
]


def _module(path: pathlib.Path) -> str:
    parts = ("simpar",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    """The layer of ``module``: its longest listed prefix."""
    best, found = -1, -1
    for k, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), k
    assert found >= 0, f"{module} is in no layer: add it to LAYERS"
    return found


def _imports(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(imported simpar module, line, inside a function) for every import in ``tree``,
    leaving out ``if TYPE_CHECKING:`` blocks (annotations only)."""
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "simpar":
                out.extend((f"simpar.{a.name}", node.lineno, in_function) for a in node.names)
            elif node.module.startswith("simpar."):
                out.append((node.module, node.lineno, in_function))
        elif isinstance(node, ast.Import):
            out.extend((a.name, node.lineno, in_function) for a in node.names
                       if a.name == "simpar" or a.name.startswith("simpar."))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return out


FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: _module(p))
def test_imports_go_down_and_stay_at_module_level(path: pathlib.Path) -> None:
    me = _module(path)
    problems = []
    for target, line, in_function in _imports(ast.parse(path.read_text())):
        if in_function:
            problems.append(f"line {line}: imports {target} inside a function")
        if _layer(target) > _layer(me):
            problems.append(f"line {line}: imports {target} (layer {_layer(target)}) from "
                            f"layer {_layer(me)}")
    assert not problems, f"{me}: " + "; ".join(problems)


def test_the_checker_sees_an_upward_and_a_hidden_import() -> None:
    """The test above can fail: an upward import and a function-level one are both found."""
    tree = ast.parse("from simpar import nn\n\ndef f():\n    from simpar.ops import Add\n")
    found = _imports(tree)
    assert found == [("simpar.nn", 1, False), ("simpar.ops", 4, True)]
    assert _layer("simpar.nn.cell") > _layer("simpar.ops._base")
