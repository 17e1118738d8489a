"""The package's shape: no import cycles, mechanisms that know nothing of the labs, and text
reports that do not pull in matplotlib."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lab"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, those under ``if TYPE_CHECKING:`` included: a type a module
    names is one a reader must look up, so two modules that name each other's types are one
    knot to untie (issue 27: `sharding/state.py` and `sharding/unit.py` were)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        found += _imports(node)
    return found


def import_graph() -> dict[str, set[str]]:
    """fsdp_lab module -> the fsdp_lab modules it imports, anywhere in its body (a lazy import
    inside a function is still a dependency)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    package = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}".rstrip(".")
                # `from pkg import sub` imports the submodule when there is one
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names
                ]
            else:
                continue
            edges |= {t for t in targets if t in paths and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    # The control: a graph with a cycle is reported.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


TOPICS = ("collectives", "sharding", "checkpointing", "tying", "meta_init", "pipeline", "hsdp")
CORE = ["fsdp_lab.comm", "fsdp_lab.reference", "fsdp_lab.theory", "fsdp_lab.trace"]


def _is_lab_or_course(module: str) -> bool:
    parts = module.split(".") + [""]
    return "lab" in parts or "exercises" in parts or parts[1] in ("labs", "course")


def test_mechanisms_do_not_import_their_labs_or_the_course():
    # A topic's mechanism (everything in fsdp_lab/<topic>/ but lab/ and exercises/) and the
    # core layers know nothing of how a lab shows them or how the course grades them.
    graph = import_graph()
    mechanisms = [
        m for m in graph if (m.split(".") + [""])[1] in TOPICS and not _is_lab_or_course(m)
    ]
    assert len(mechanisms) > 25  # the walk found them
    for name in mechanisms + [m for m in graph if m.startswith(tuple(CORE))]:
        assert not any(_is_lab_or_course(t) for t in graph[name]), (name, graph[name])


def test_every_topic_is_one_folder_with_its_lab_and_exercises():
    # Issue 27: a lab lived in five places. Each topic's lab and exercises sit in its folder;
    # nothing of a topic is left loose at the package's top.
    for topic in TOPICS:
        assert (PACKAGE / topic / "lab" / "config.py").is_file(), topic
        assert (PACKAGE / topic / "exercises" / "__init__.py").is_file(), topic
    loose = {"checkpointing.py", "schedules.py", "tying.py", "wrap.py", "meta_init.py",
             "meta_device.py", "widgets.py"}  # fmt: skip
    assert not loose & {p.name for p in PACKAGE.glob("*.py")}
    assert not (PACKAGE / "exercises").exists()


def test_text_reports_do_not_import_matplotlib():
    code = (
        "import sys; from fsdp_lab.labs.registry import LABS\n"
        "for lab in LABS.values():\n"
        "    lab.config_class\n"
        "import fsdp_lab.sizes, fsdp_lab.theory\n"
        "print('matplotlib' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_shard_reads_as_its_lifecycle():
    # Issue 27: shard() was a 154-line hub with two interleaved init paths and closures; its
    # body (docstring aside) now names five steps in order, in about 40 lines.
    fn = _function(PACKAGE / "sharding" / "apply.py", "shard")
    body = fn.body[1:]  # the docstring first
    lines = body[-1].end_lineno - body[0].lineno + 1
    assert lines <= 55, f"shard() body is {lines} lines"
    nested = [n.name for n in ast.walk(fn) if isinstance(n, ast.FunctionDef) and n is not fn]
    assert nested == [], f"closures in shard(): {nested}"
    calls = [ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)]
    for step in ("strategy_named", "meshes.resolve", "build_plan", "build_storage", "ShardedUnit"):
        assert calls.count(step) == 1, (step, calls)


def test_no_course_module_writes_a_mechanism_attribute():
    # Issue 27: exercises put the learner's function in with `state.reduce_grad_shard = ...`
    # after wrap. The steps now go in by keyword (`shard(..., steps=ShardingSteps(...))`), so an
    # assignment to an attribute of something the mechanism made is refused here.
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "exercises" not in path.parts and "course" not in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                named = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                if named and t.value.id in ("state", "unit", "units", "sharding_state"):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize(
    "package", ["fsdp_lab", "fsdp_lab.sharding", "fsdp_lab.pipeline", "fsdp_lab.planning"]
)
def test_a_lazy_public_name_is_never_shadowed_by_a_submodule(package):
    # Importing `fsdp_lab.sharding.shard` (a module) binds `shard` on the package: had the
    # entry point's module been named like the function, `from fsdp_lab.sharding import shard`
    # would give a module once anything had imported it (it did, until apply.py).
    module = importlib.import_module(package)
    folder = Path(module.__file__).parent
    submodules = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir()}
    for name, where in module._PUBLIC.items():
        assert name not in submodules or where == f"{package}.{name}", (package, name)


def test_every_lab_has_one_report_shape():
    # Issue 27: the labs' output had grown by output type (tables, pictures, charts, words,
    # claims, textbook). Now prose and tables are `report.py`, pictures `figures.py`.
    for topic in TOPICS:
        lab = {p.stem for p in (PACKAGE / topic / "lab").glob("*.py")}
        assert {"config", "measure", "analysis", "report", "figures"} <= lab, topic
        by_output = {"tables", "pictures", "charts", "words", "claims", "textbook"}
        assert not lab & by_output, (topic, lab & by_output)


def test_a_file_over_450_lines_says_why_it_is_one_file():
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 450:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "lines on purpose" in doc, path.relative_to(PACKAGE)


def test_a_topic_has_one_spelling_in_its_folder_and_its_notebooks():
    # Issue 27: lab 01 was spelled `sharding`, `shard` and `01_shard`. The package folder, the
    # lab notebook and the learner notebook now share one name (the CLI keeps the lab's name,
    # `fsdp-lab shard`, the public contract).
    from fsdp_lab.labs.registry import LABS

    root = PACKAGE.parent / "notebooks"
    for number, lab in enumerate(LABS.values()):
        topic = lab.package.split(".")[1]
        assert (PACKAGE / topic / "lab").is_dir(), lab.name
        assert (root / f"{number:02d}_{topic}.ipynb").is_file(), lab.name
        assert (root / "exercises" / f"{number:02d}_{topic}.ipynb").is_file(), lab.name


def test_the_course_engine_uses_the_topics_and_no_topic_uses_the_engine():
    # The topics' exercises build on `fsdp_lab.exercise` (what an exercise is, what a judge and a
    # rank use); the engine (`fsdp_lab.course`: catalog, checker, grading) reads the topics.
    graph = import_graph()
    topic_modules = [m for m in graph if (m.split(".") + [""])[1] in TOPICS]
    for name in topic_modules:
        assert not any(t.startswith("fsdp_lab.course") for t in graph[name]), (name, graph[name])
    assert any(
        t.startswith("fsdp_lab.sharding.exercises") for t in graph["fsdp_lab.course.catalog"]
    )


# The layers every topic shares: collectives, traces, ranks, choices. The rest of what `shard()`
# imports is the mechanism a reader walks.
SHARED_LAYERS = ("comm", "trace", "cluster", "choices", "lazy", "host", "cores")


def test_shard_reads_in_one_folder_in_at_most_eleven_files():
    """Issue 38: reading `shard()` opened 15 package files, one in another topic's folder
    (`tying/ties.py`); FSDP2's own core reads in 6-8."""
    code = "import sys, fsdp_lab.sharding.apply; print(*sorted(sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    ours = [m for m in loaded if m == "fsdp_lab" or m.startswith("fsdp_lab.")]
    walked = [m for m in ours[1:] if m.split(".")[1] not in SHARED_LAYERS]
    assert all(m.startswith("fsdp_lab.sharding") for m in walked), walked
    assert len(walked) <= 11, walked
