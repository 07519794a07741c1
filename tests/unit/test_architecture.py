"""The layout holds: imports go one way, no loops, small modules, and nothing happens at import.

`LAYERS` states the layers, bottom to top, each a package or a few modules with one job. A module imports modules of
its own layer and of the layers below it, never of one above (function-level imports count too); every module is in
a layer. No import circle anywhere in the tree (bench/ and tests/ included), between modules or between packages.

`tasks/` sits on the pipeline's services and is named by string (`TASK_MODULES`), never imported by `pipeline/`.
`pipeline/__init__.py` and `__main__.py` are entry points (`celery -A pipeline`, `python -m pipeline`) and sit above
everything.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"pipeline", "pipeline.__main__"}
#: Bottom to top: each layer's name and the packages and modules in it, with why it sits there.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # wire names, what a failure means, settings: no Redis, no Celery app
    ("foundation", ("pipeline.constants", "pipeline.errors", "pipeline.text", "pipeline.retry", "pipeline.config")),
    ("lua", ("pipeline.lua",)),  # the server-side scripts, loaded one way
    ("pools", ("pipeline.pools",)),  # which pool runs the jobs, where an async task's coroutine runs
    ("queues", ("pipeline.queues",)),  # how a queue lies in Redis: a list per priority level, its wake-up marker
    ("app", ("pipeline.celery_app",)),  # the Celery app, built from the settings on first use
    ("broker", ("pipeline.broker", "pipeline.cluster", "pipeline.records")),  # clients, views, durable writes, records
    ("compat", ("pipeline.compat",)),  # every reach into a library's internals, and the version guard
    ("publish", ("pipeline.publish", "pipeline.producer")),  # the publish path: capture, park, write, idempotency
    ("task contract", ("pipeline.fairness", "pipeline.task", "pipeline.once")),  # typed tasks, groups, rates, once
    ("observability", ("pipeline.observability",)),  # metrics, logs, Sentry, health
    ("storage", ("pipeline.storage",)),  # where task outputs are kept
    ("scheduling", ("pipeline.scheduling",)),  # when jobs run: delayed jobs, paused queues, rate limits
    ("flows", ("pipeline.flows",)),  # multi-step jobs: declared, started, advanced step by step
    ("dlq", ("pipeline.dlq",)),  # the dead-letter queue: capture, store, replay (a dead step fails its flow)
    ("reading jobs", ("pipeline.status", "pipeline.browse")),  # a job's status, every queue's jobs by state
    ("control", ("pipeline.control",)),  # operators' actions on jobs and flows under way (reads their status)
    ("tasks", ("tasks",)),  # the job kinds, on the services below (named by string, never imported by pipeline)
    ("delivery", ("pipeline.delivery",)),  # the worker's Redis transport: fetch, leases, acknowledgements
    ("runtime", ("pipeline.runtime",)),  # the worker's wiring: bootsteps, signals, pools, Flower's auth
    ("interfaces", ("pipeline.api", "pipeline.cli")),  # the HTTP API and the `pipeline` command
    ("entry points", tuple(sorted(ENTRY_POINTS))),  # `celery -A pipeline`, `python -m pipeline`
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(*folders: str) -> dict[str, Path]:
    found = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules("pipeline", "tasks")
#: Every Python module of the tree: the package, the tasks, the benchmarks, the tests and the docs' build hook.
TREE = _modules("pipeline", "tasks", "bench", "tests", "docs/hooks")


def _imports(name: str, path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """Modules of `modules` that `name` imports anywhere in its body (function-level imports count too)."""
    targets: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from package import module` imports the module (parents load implicitly)
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != name}


@functools.cache
def _graph() -> dict[str, set[str]]:
    """What each module of `MODULES` imports of them: built by the tests that ask, not when the file is collected
    (every test process collects it; one runs them)."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


@functools.cache
def _tree_graph() -> dict[str, set[str]]:
    """What each module of `TREE` imports of it."""
    return {name: _imports(name, path, TREE) for name, path in TREE.items()}


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _package(name: str) -> str:
    """The package a module belongs to for the package graph: `pipeline.flows`, `pipeline.broker`, `tests.support`,
    `bench.compare` (a top-level module is a package of its own)."""
    return ".".join(name.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle a depth-first walk of `graph` meets, each as the path that closes it."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def layer(name: str) -> int:
    """The index of `name`'s layer in `LAYERS`: the entry naming the module or its closest package; -1 for none."""
    if name in ENTRY_POINTS:
        return len(LAYERS) - 1
    placed = [
        (len(prefix), index)
        for index, (_, members) in enumerate(LAYERS[:-1])
        for prefix in members
        if name == prefix or name.startswith(prefix + ".")
    ]
    return max(placed)[1] if placed else -1


def test_every_module_is_in_a_layer_and_every_layer_names_modules() -> None:
    assert [name for name in MODULES if layer(name) < 0] == []
    assert [prefix for _, members in LAYERS for prefix in members if prefix not in MODULES] == []


def test_imports_go_one_way() -> None:
    upward = [
        f"{a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})"
        for a, deps in sorted(_graph().items())
        for b in sorted(deps)
        if layer(b) > layer(a)
    ]
    assert upward == []


def test_task_modules_are_named_never_imported_by_the_package() -> None:
    imported = [
        (a, b) for a, deps in _graph().items() if a.startswith("pipeline") for b in deps if b.startswith("tasks")
    ]
    assert imported == []


def test_the_delivery_layer_does_not_import_the_workers_wiring() -> None:
    """`runtime/` wires the delivery layer into the worker, never the other way round."""
    upward = [
        (a, b)
        for a, deps in _graph().items()
        if a.startswith("pipeline.delivery")
        for b in deps
        if b.startswith("pipeline.runtime")
    ]
    assert upward == []

    assert not [
        name
        for name in MODULES
        if name.startswith("pipeline.runtime") and name.rpartition(".")[2] in {"housekeeping", "probe"}
    ]


def test_no_import_loops_between_modules_anywhere_in_the_tree() -> None:
    """bench/, tests/ and docs/hooks/ included; the entry points (`pipeline`, `pipeline.__main__`) sit above all."""
    graph = {name: deps - ENTRY_POINTS for name, deps in _tree_graph().items() if name not in ENTRY_POINTS}
    assert _cycles(graph) == []


def test_no_import_loops_between_packages() -> None:
    """A package is one layer: `dlq` -> `flows` -> `status` -> `dlq` would be a circle even with no module loop."""
    graph: dict[str, set[str]] = {}
    for name, deps in _tree_graph().items():
        if name in ENTRY_POINTS:
            continue
        edges = graph.setdefault(_package(name), set())
        edges.update(_package(dep) for dep in deps - ENTRY_POINTS if _package(dep) != _package(name))
    assert _cycles(graph) == []


def test_the_loop_check_sees_a_loop() -> None:
    assert _cycles({"a.x": {"b.y"}, "b.y": {"c.z"}, "c.z": {"a.x"}, "d": set()}) == [["a.x", "b.y", "c.z", "a.x"]]


def test_modules_stay_small_and_the_top_level_short() -> None:
    too_long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 400}
    assert too_long == {}
    top_level = [p.name for p in (ROOT / "pipeline").glob("*.py")]
    assert len(top_level) <= 15, top_level


def _with_invalid_settings(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`argv` run in the tree with no settings of the caller's and an unusable REDIS_URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "REDIS_", "PIPELINE_"))}
    env = {**env, "ENV_FILE": "", "SECRETS_DIR": "/nonexistent", "REDIS_URL": "http://not-redis:1"}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_every_module_imports_with_invalid_settings() -> None:
    """Importing reads no setting and connects nothing: an unusable REDIS_URL does not matter until start."""
    names = sorted(MODULES.keys() - {"pipeline.__main__"})
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "from pipeline.config import get_settings\n"
        "assert get_settings.cache_info().currsize == 0, 'settings were read at import'\n"
        "print('imported', len(sys.modules))\n"
    )
    done = _with_invalid_settings([sys.executable, "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("imported")


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_processes_refuse_invalid_settings_at_start_naming_the_variable(command: str) -> None:
    celery = Path(sys.executable).with_name("celery")
    done = _with_invalid_settings([str(celery), "-A", "pipeline", command], timeout=60)
    assert done.returncode != 0
    assert "REDIS_URL" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
