"""simpar's modules import downward only, and never inside a function body.

The layers, bottom first (docs/design.md#modules-import-downward-only): configuration and
leaf helpers; the MPI package; meshes, layouts, parameters and the schedule guard;
redistribution; operators; the traced graph; planners; lowering and execution; the op-level
API; cells (and ``simpar.auto_parallel``, which names ``simpar.nn``'s AutoParallel); the check
and the data; the main job. A module may import its own layer or any layer below it.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "simpar"

LAYERS: list[tuple[str, ...]] = [
    ("simpar._env", "simpar._enums", "simpar._checks", "simpar._keyspec", "simpar.comm_fusion",
     "simpar.context",
     "simpar.cost_model_context", "simpar.seed", "simpar.counter_rng", "simpar.compare",
     "simpar.collective_kinds"),
    ("simpar.comm",),
    ("simpar.mesh", "simpar.layout", "simpar.parameter", "simpar.schedule"),
    ("simpar.redistribution", "simpar.cotangent", "simpar.optimizer_parallel", "simpar.cake"),
    ("simpar.ops",),
    ("simpar.graph",),
    ("simpar.search", "simpar.cost", "simpar.strategy_file", "simpar.strategy_import"),
    ("simpar.runtime", "simpar.pipeline"),
    ("simpar.parallel",),
    ("simpar.nn", "simpar.auto_parallel"),
    ("simpar.check", "simpar.dataset", "simpar.pipeline.search", "simpar.checkpoint",
     "simpar.viz", "simpar.trace_events", "simpar.report",
     "simpar.checkpoint.manifest", "simpar.checkpoint.save", "simpar.checkpoint.load",
     "simpar.checkpoint.training", "simpar.checkpoint.export", "simpar.checkpoint.cli"),
    ("simpar.train", "simpar.launch", "simpar.launch.rank_table", "simpar.launch.mpi",
     "simpar.launch.rank_wrapper", "simpar.launch.supervisor", "simpar.launch.cli",
     "simpar.calibrate", "simpar", "simpar.mindspore"),
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


#: The longest a module may be (issue 29): past it, a module holds more than one concept.
MAX_LINES = 800


def test_no_module_is_over_800_lines() -> None:
    long = {_module(p): n for p in FILES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split by concept: {long}"


def test_the_checker_sees_an_upward_and_a_hidden_import() -> None:
    """The test above can fail: an upward import and a function-level one are both found."""
    tree = ast.parse("from simpar import nn\n\ndef f():\n    from simpar.ops import Add\n")
    found = _imports(tree)
    assert found == [("simpar.nn", 1, False), ("simpar.ops", 4, True)]
    assert _layer("simpar.nn.cell") > _layer("simpar.ops._base")


def _every_import(path: pathlib.Path) -> set[str]:
    """Every simpar module ``path`` imports, ``if TYPE_CHECKING:`` blocks included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "simpar":
                out.update(f"simpar.{a.name}" for a in node.names)
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "simpar" or m.startswith("simpar.")}


def _under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


@pytest.mark.parametrize("path", sorted((ROOT / "ops").rglob("*.py")),
                         ids=lambda p: _module(p))
def test_ops_run_no_collective_themselves(path: pathlib.Path) -> None:
    """An op describes its collectives (CommSpec) and its kernels call those the runtime
    hands them (Collectives): simpar.ops imports neither simpar.comm nor the schedule
    guard."""
    found = sorted(m for m in _every_import(path) if _under(m, ("simpar.comm",
                                                                "simpar.schedule")))
    assert not found, f"{_module(path)} imports {found}"


def test_the_executor_is_given_what_it_runs() -> None:
    """The executor compiles a lowered graph (simpar.runtime.lowered) and never needs the
    program module, not even for types: no program <-> executor loop."""
    for name in ("executor.py", "op_runner.py", "program_schedule.py", "runner.py"):
        found = _every_import(ROOT / "runtime" / name)
        assert "simpar.runtime.program" not in found, name
        assert "simpar.runtime.lowering" not in found, name


# ----------------------------------------------------------------------------------------------
# Planning reads its request, not the world.

#: The context layer: process-wide settings, read into a plan request at the entry points.
CONTEXT = ("simpar.context", "simpar.cost_model_context")
#: The planning layers, which must not read the context layer's state while planning.
PLANNING = ("simpar.search", "simpar.cost", "simpar.ops")
#: The only functions there that may call a function of the context layer, and why.
BOUNDARY: dict[tuple[str, str], str] = {
    ("simpar.search.request", "request_from_context"):
        "the boundary: every entry point builds its plan request here",
    ("simpar.search.planner", "register_search"):
        "a search registered at run time becomes a search_mode the context accepts",
    ("simpar.search.pricing", "algo_or_context"):
        "a Pricer or cost graph built by hand (tests, benchmarks) without algo parameters; "
        "every planner passes its request's",
    **{("simpar.cost.mindspore", f): "a MindSpore pricing function called by hand without a "
       "CostModelContext prices under the process's; a request's model carries its own"
       for f in ("MindSporeCost.value", "refine_communication", "strategy_cost", "fits",
                 "edge_cost")},
    ("simpar.cost.interface", "MindSporeCostModel._context"):
        "MindSporeCostModel() used by hand; a plan request fixes its context when built",
    ("simpar.ops._base", "Primitive.candidate_strategies"):
        "the op's defaults for a call by hand (fully_use_devices, slice alignment); planners "
        "pass their request's",
    ("simpar.ops.matmul", "_MatMulBase._check_settings"):
        "MatMul refuses a misaligned strategy given by hand, under the algo parameters (on "
        "every call: the op's memo of shardings is keyed by the op, shapes and strategy)",
}


def _context_calls(tree: ast.Module) -> list[tuple[str, str, int]]:
    """(function qualname, context-layer function, line) for every use of a function of the
    context layer in ``tree``: its classes and constants (values, exceptions) are free."""
    names: dict[str, tuple[str, str]] = {}    # local name -> (module, attribute)
    modules: dict[str, str] = {}              # local name -> context module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                if node.module in CONTEXT:
                    names[a.asname or a.name] = (node.module, a.name)
                elif node.module == "simpar" and f"simpar.{a.name}" in CONTEXT:
                    modules[a.asname or a.name] = f"simpar.{a.name}"
    found: list[tuple[str, str, int]] = []

    def is_function(module: str, attr: str) -> bool:
        obj = getattr(importlib.import_module(module), attr, None)
        return callable(obj) and not isinstance(obj, type)

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = f"{where}.{node.name}" if where else node.name
        used = None
        if isinstance(node, ast.Name) and node.id in names:
            used = names[node.id]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in modules):
            used = (modules[node.value.id], node.attr)
        if used is not None and is_function(*used):
            found.append((where, f"{used[0]}.{used[1]}", node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "")
    return found


PLANNING_FILES = [p for p in FILES if any(_module(p) == name or _module(p).startswith(name + ".")
                                          for name in PLANNING)]


@pytest.mark.parametrize("path", PLANNING_FILES, ids=lambda p: _module(p))
def test_planning_reads_no_context(path: pathlib.Path) -> None:
    """Nothing under simpar/search, simpar/cost or simpar/ops reads the context layer, but
    for the boundary and the defaults of calls by hand listed in BOUNDARY: a plan is a
    function of its request."""
    me = _module(path)
    bad = [f"line {line}: {where or '<module>'} uses {used}"
           for where, used, line in _context_calls(ast.parse(path.read_text()))
           if (me, where) not in BOUNDARY]
    assert not bad, f"{me}: " + "; ".join(bad)


def test_the_context_checker_sees_a_getter_but_not_a_value() -> None:
    tree = ast.parse("from simpar import context\nfrom simpar.context import ContextError, "
                     "algo_parameters\n\ndef f():\n    context.get_algo_parameters('x')\n"
                     "    raise ContextError(algo_parameters())\n")
    assert _context_calls(tree) == [("f", "simpar.context.get_algo_parameters", 5),
                                    ("f", "simpar.context.algo_parameters", 6)]
