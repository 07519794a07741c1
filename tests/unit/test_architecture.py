"""The layout holds: imports go one way, no loops, small modules, and nothing happens at import.

Layers, bottom to top (a module may import its own layer and the ones below, never above):

1. core, directly in `pipeline/`: settings (`config/`), the app factory, errors, retry, the typed task contract,
   the Lua scripts (`lua/`) and the Celery-side replacements of library internals with the version guard (`compat/`)
2. `status`, `control/`, `browse`, `dlq/`, `scheduling/`, `observability/`, `storage/`, `flows/`
3. `delivery/`: the Redis delivery layer; `runtime/`: the worker's wiring
4. `api/`, `cli/`

`tasks/` builds on core and layer 2 (the housekeeping tasks use the dead-letter queue and storage).
`pipeline/__init__.py` and `__main__.py` are entry points (`celery -A pipeline`, `python -m pipeline`) and sit above
everything.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"pipeline", "pipeline.__main__"}
LAYER_2 = (
    "pipeline.status",
    "pipeline.control",
    "pipeline.browse",
    "pipeline.dlq",
    "pipeline.scheduling",
    "pipeline.observability",
    "pipeline.storage",
    "pipeline.flows",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("pipeline", "tasks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Project modules `name` imports anywhere in its body (function-level imports count too)."""
    targets: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from package import module` imports the module (parents load implicitly)
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {t for t in targets if t in MODULES and t != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int:
    if name in ENTRY_POINTS:
        return 9
    if name.startswith("tasks"):
        return 5  # nothing in pipeline may import tasks (they are named by string in TASK_MODULES)
    if name.startswith(("pipeline.api", "pipeline.cli")):
        return 4
    if name.startswith(("pipeline.runtime", "pipeline.delivery")):
        return 3
    if name.startswith(LAYER_2):
        return 2
    return 1


def test_imports_go_one_way() -> None:
    upward = [(a, b) for a, deps in GRAPH.items() for b in deps if layer(b) > layer(a) and not a.startswith("tasks")]
    assert upward == []


def test_tasks_build_on_core_and_layer_2_only() -> None:
    allowed = [
        (a, b)
        for a, deps in GRAPH.items()
        if a.startswith("tasks")
        for b in deps
        if b.startswith("pipeline") and layer(b) > 2
    ]
    assert allowed == []


def test_the_delivery_layer_does_not_import_the_workers_wiring() -> None:
    """`runtime/` wires the delivery layer into the worker, never the other way round."""
    upward = [
        (a, b)
        for a, deps in GRAPH.items()
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


def test_no_import_loops() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(GRAPH[node] - ENTRY_POINTS):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name)
    assert cycles == []


def test_modules_stay_small_and_the_top_level_short() -> None:
    too_long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 400}
    assert too_long == {}
    top_level = [p.name for p in (ROOT / "pipeline").glob("*.py")]
    assert len(top_level) <= 15, top_level


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "REDIS_", "PIPELINE_"))}
    return {**env, "ENV_FILE": "", "SECRETS_DIR": "/nonexistent", **extra}


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
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(REDIS_URL="http://not-redis:1"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("imported")


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_processes_refuse_invalid_settings_at_start_naming_the_variable(command: str) -> None:
    celery = Path(sys.executable).with_name("celery")
    done = subprocess.run(
        [str(celery), "-A", "pipeline", command],
        cwd=ROOT,
        env=_env(REDIS_URL="http://not-redis:1"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "REDIS_URL" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
