"""The package's shape, read from its source (docs/DESIGN.md §2): dependencies point down, no cycles,
small files and functions."""

import ast
import builtins
from pathlib import Path

import edge0

ROOT = Path(edge0.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, at any depth of its code (lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def edge0_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports(m, p) if i in mods and i != m} for m, p in mods.items()}


def _in(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_nothing_imports_the_command_line_entry_points():
    offenders = {m: sorted(d for d in deps if _in(d, "edge0.cli", "edge0.run"))
                 for m, deps in edge0_graph().items() if not _in(m, "edge0.cli", "edge0.run")}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_io_imports_no_mlx_and_sched_no_mlx_arrays():
    mods = modules()
    for name, path in mods.items():
        if name.startswith(("edge0.io", "edge0.sched")):
            mlx = sorted(i for i in imports(name, path) if i == "mlx" or i.startswith("mlx.") or i.startswith("mlx_lm"))
            assert not mlx, f"{name} imports {mlx}"


# Each lower floor and what it may import besides itself: nothing above it (config.py, the engine, the commands).
BELOW = {"edge0.io": ("edge0.errors", "edge0.log", "edge0.compute.choices"),
         "edge0.sched": ("edge0.errors", "edge0.log", "edge0.compute.choices", "edge0.io"),
         "edge0.compute": ("edge0.errors", "edge0.log", "edge0.compute.choices", "edge0.io", "edge0.sched")}


def test_lower_floors_import_nothing_above_them():
    up = {m: sorted(d for d in deps if not _in(d, floor, *allowed))
          for floor, allowed in BELOW.items() for m, deps in edge0_graph().items() if _in(m, floor)}
    assert {m: d for m, d in up.items() if d} == {}


def test_no_import_cycles():
    graph = edge0_graph()
    parents = {m for m in graph if any(o.startswith(m + ".") for o in graph)}  # packages: their modules' imports
    graph = {m: {d for d in deps if d not in parents} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_files_and_functions_stay_small():
    big = []
    for name, path in modules().items():
        src = path.read_text()
        if src.count("\n") > MAX_FILE_LINES:
            big.append(f"{name}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{name}.{node.name}: {length} lines")
    assert big == []


def _base_names(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}


def test_exception_classes_live_in_errors():
    errors = ROOT / "errors.py"
    known = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    known |= {n.name for n in ast.walk(ast.parse(errors.read_text())) if isinstance(n, ast.ClassDef)}
    stray = []
    for name, path in modules().items():
        if path == errors:
            continue
        classes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
        mine = set(known)
        for _ in classes:  # a class built on a stray one is stray too, whatever its order in the file
            mine |= {c.name for c in classes if _base_names(c) & mine}
        stray += [f"{name}.{c.name}" for c in classes
                  if _base_names(c) & mine or any(b.endswith(("Error", "Exception")) for b in _base_names(c))]
    assert stray == []


# The commands (edge0/cli/) and the benchmarks (edge0/bench/) print their output; the library logs (edge0.log).
PRINTS_IN = ("edge0.cli", "edge0.bench")
# `python -m` entry points: the console script's, `python -m edge0.run` (the README's command), the mlx-lm arm's;
# bench/llama.py is a script that another interpreter (llama.cpp's venv, without edge0) runs.
MAIN_BLOCKS = {"edge0.cli.__main__", "edge0.run", "edge0.bench.__main__", "edge0.bench.llama"}


def _prints(tree: ast.AST) -> list[int]:
    """Lines of each use of `print`, a call or a value passed on (emit=print)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "print"]


def test_library_code_logs_and_only_commands_print():
    stray = [f"{name}:{line}" for name, path in modules().items() if not _in(name, *PRINTS_IN)
             for line in _prints(ast.parse(path.read_text()))]
    assert stray == []


def test_flags_are_defined_only_by_the_commands():
    stray = [name for name, path in modules().items() if not _in(name, "edge0.cli")
             and "argparse" in imports(name, path)]
    assert stray == []


def _main_block(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def test_main_blocks_only_in_the_entry_points():
    found = {m for m, p in modules().items() if any(_main_block(n) for n in ast.parse(p.read_text()).body)}
    assert found - MAIN_BLOCKS == set()


# Equal tuples that are two facts, not one list written twice.
SAME_BY_CHANCE = {
    ("gate_proj", "up_proj", "down_proj"): "export/ reads stores with numpy alone, without compute/'s MLX",
    (32, 64, 128): "the group sizes mx.quantize takes (model/convert) and those the edge0 kernel runs (compute/qmm)",
}


def test_each_choice_list_is_defined_once():
    where: dict[tuple, list[str]] = {}
    for name, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and len(node.value.elts) > 1
                    and all(isinstance(e, ast.Constant) for e in node.value.elts)):
                where.setdefault(ast.literal_eval(node.value), []).extend(
                    f"{name}.{t.id}" for t in node.targets if isinstance(t, ast.Name) and t.id.isupper())
    assert {v: m for v, m in where.items() if len(m) > 1 and v not in SAME_BY_CHANCE} == {}


DECODE_LOOPS = {"generate_steps", "prefill", "_prefill", "_overlapped", "_steps"}  # the token loop's functions


def test_one_decode_loop_and_one_serving_loop():
    """The token loop is written once, in edge0/decode: PREFILL_STEP is defined once, there; no module outside it
    defines a prefill or step loop or builds a step's head (step_log_softmax); serve/ has one serving loop (one
    `while True` coroutine)."""
    defined, loops, heads, serving = [], [], [], []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        inside = name.startswith("edge0.decode")
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            defined += [name for t in targets if isinstance(t, ast.Name) and t.id == "PREFILL_STEP"]
            if isinstance(node, ast.FunctionDef) and node.name in DECODE_LOOPS and not inside:
                loops.append(f"{name}.{node.name}")
        for node in ast.walk(tree):
            if (not inside and name != "edge0.compute.dense" and isinstance(node, ast.Call)
                    and getattr(node.func, "attr", getattr(node.func, "id", None)) == "step_log_softmax"):
                heads.append(name)
            if name.startswith("edge0.serve") and isinstance(node, ast.AsyncFunctionDef) and any(
                    isinstance(w, ast.While) and isinstance(w.test, ast.Constant) and w.test.value is True
                    for w in ast.walk(node)):
                serving.append(f"{name}.{node.name}")
    assert len(defined) == 1 and defined[0].startswith("edge0.decode."), defined
    assert loops == [] and heads == [], (loops, heads)
    assert len(serving) == 1, serving


def test_runtime_hooks_are_called_not_looked_up():
    """The runtime's hooks are compute/runtime.py's Hooks (no-op defaults): nothing finds one with getattr/hasattr."""
    hooks = next((n for n in ast.parse((ROOT / "compute" / "runtime.py").read_text()).body
                  if isinstance(n, ast.ClassDef) and n.name == "Hooks"), None)
    assert hooks is not None, "compute/runtime.py defines no Hooks class"
    names = {n.name for n in hooks.body if isinstance(n, ast.FunctionDef)}
    names |= {t.id for n in hooks.body if isinstance(n, ast.Assign) for t in n.targets}
    found = [f"{name}: {node.func.id}(..., {node.args[1].value!r})" for name, path in modules().items()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
             and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names]
    assert found == []


def test_package_root_holds_only_the_front_door():
    # the public API (edge0/__init__.py, engine.py's open_engine, the config package), errors, log, and the
    # README's `python -m edge0.run`; everything else lives in a package by role
    root = {p.stem for p in ROOT.glob("*.py")}
    assert root <= {"__init__", "engine", "errors", "log", "run"}, sorted(root)


def test_no_import_cycles_between_packages():
    # edge0.X -> edge0.Y for any module of X importing any module of Y (lazy imports count)
    graph: dict[str, set[str]] = {}
    for m, deps in edge0_graph().items():
        graph.setdefault(".".join(m.split(".")[:2]), set()).update(".".join(d.split(".")[:2]) for d in deps)
    for p in graph:
        graph[p].discard(p)

    def reaches(a, b, seen):
        return a == b or any(n not in seen and reaches(n, b, seen | {n}) for n in graph.get(a, ()))

    cycles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a, {b}))
    assert cycles == [], cycles
