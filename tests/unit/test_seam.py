"""The seam holds: private names of celery, kombu, billiard, celery-redbeat and redis-py are used in two places only.

`pipeline/delivery/` (the worker's Redis delivery layer) and `pipeline/compat/` (the Celery-side replacements) may
reach into those libraries' internals; each reach there is an entry of their `ENTRIES`, with a parity test. Every
other module of `pipeline/` and `tasks/` uses public names only, so an upgrade is checked in those two places.

What counts as a use of a private name (one with a single leading underscore, or a double one that is not a dunder):

(a) an import from a module path with a private segment (`celery._state`), or of a private name (`from celery
    import _state`), of one of the libraries;
(b) an attribute `x._name`, when `_name` is private upstream:
    - with `self` or `cls` as `x`: only inside a class that derives from a class of the libraries (its MRO, read
      from the imported class), and when one of those upstream classes defines `_name` (a method or class attribute,
      or an assignment `self._name = ...` in its source);
    - with any other `x`: when any module of the libraries defines `_name` (a function or method, a class or module
      attribute, or an attribute assignment), except names the project itself defines in classes that do not derive
      from the libraries (its own private state, e.g. `worker._stack`): the receiver's type is unknown to the scan,
      and a name both sides define is taken as the project's;
(c) `getattr`, `setattr`, `hasattr` or `delattr` with a literal private name, by the same rule as (b);
(d) in a class that derives from a class of the libraries, a method or class attribute `_name` that one of the
    upstream classes of its MRO defines: an override of an internal (also when a mixin of the project's, ahead of the
    upstream classes in the MRO, defines it);
(e) a call's keyword argument `_name=` that the libraries name, as a parameter or as a string (kombu's
    `_publish_batch`, popped from `**kwargs`).

The libraries' private names are read from their installed sources at test time (an AST walk), never listed here.
`test_the_scanner_flags_each_kind` plants one snippet per kind, so the scan is known to be able to fail.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from pipeline import compat
from pipeline.compat.versions import GUARDED, Entry

ROOT = Path(__file__).resolve().parents[2]
#: The libraries whose private names are the seam's business (top-level import names).
UPSTREAM = ("celery", "kombu", "billiard", "redbeat", "redis")
#: The only places a private name of theirs may be used.
SEAM = ("pipeline/delivery/", "pipeline/compat/")
_ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr"}

Resolve = Callable[[str], Any]  # a class's qualified name in the module → the class (None: unknown)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.name}"


# --- what the libraries define -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Definitions:
    """Private names defined in some source: anywhere, and per class (module, qualified name)."""

    names: frozenset[str]
    by_class: dict[tuple[str, str], frozenset[str]]
    #: Private parameter names, and private identifiers written as strings (`kwargs.pop('_publish_batch')`).
    keywords: frozenset[str]


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _assigned_names(node: ast.AST) -> Iterator[str]:
    """The plain names a statement assigns."""
    for target in _targets(node):
        for name in ast.walk(target):
            if isinstance(name, ast.Name):
                yield name.id


def _stored_attributes(node: ast.AST) -> Iterator[ast.Attribute]:
    """The attributes a statement assigns (`x._y = ...`)."""
    for target in _targets(node):
        for attr in ast.walk(target):
            if isinstance(attr, ast.Attribute) and isinstance(attr.ctx, ast.Store):
                yield attr


def _self_attributes(function: ast.AST) -> Iterator[str]:
    """The attributes a method assigns on `self` or `cls`."""
    for node in ast.walk(function):
        for attr in _stored_attributes(node):
            if isinstance(attr.value, ast.Name) and attr.value.id in ("self", "cls"):
                yield attr.attr


def classes(module: str, tree: ast.Module) -> dict[tuple[str, str], frozenset[str]]:
    """The private names each class of `tree` defines: its methods, class attributes and nested classes, and the
    attributes its methods assign on `self` or `cls`."""
    found: dict[tuple[str, str], frozenset[str]] = {}

    def visit(node: ast.ClassDef, qualname: str) -> None:
        names: set[str] = set()
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(item.name)
                names.update(_self_attributes(item))
            elif isinstance(item, ast.ClassDef):
                names.add(item.name)
                visit(item, f"{qualname}.{item.name}")
            else:
                names.update(_assigned_names(item))
        found[(module, qualname)] = frozenset(n for n in names if private(n))

    for item in tree.body:
        if isinstance(item, ast.ClassDef):
            visit(item, item.name)
    return found


def keywords(tree: ast.Module) -> set[str]:
    """The private parameter names of a module's functions, and the private identifiers it writes as strings."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return {n for n in names if private(n)}


def anywhere(tree: ast.Module) -> set[str]:
    """The private names a module defines or assigns anywhere: module-level names, functions, methods and classes at
    any depth, and attributes assigned on any object."""
    names = {name for item in tree.body for name in _assigned_names(item)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        names.update(attr.attr for attr in _stored_attributes(node))
    return {n for n in names if private(n)}


def _module_trees(package: str) -> Iterator[tuple[str, ast.Module]]:
    base = Path(str(importlib.import_module(package).__file__)).parent  # celery and kombu replace their module
    for path in sorted(base.rglob("*.py")):
        parts = [package, *path.relative_to(base).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        try:
            yield ".".join(parts), ast.parse(path.read_bytes(), str(path))
        except SyntaxError:  # a file for another Python (vendored backports): not importable here
            continue


@cache
def upstream() -> Definitions:
    """Every private name the installed libraries define, read from their sources now."""
    names: set[str] = set()
    words: set[str] = set()
    by_class: dict[tuple[str, str], frozenset[str]] = {}
    for package in UPSTREAM:
        for module, tree in _module_trees(package):
            names |= anywhere(tree)
            words |= keywords(tree)
            by_class.update(classes(module, tree))
    return Definitions(frozenset(names), by_class, frozenset(words))


def is_upstream(cls: type) -> bool:
    return cls.__module__.split(".")[0] in UPSTREAM


def upstream_bases(cls: Any) -> list[type]:
    """The classes of the libraries in `cls`'s MRO (none for a class of the project alone)."""
    return [k for k in getattr(cls, "__mro__", ())[1:] if is_upstream(k)]


def defined_by(bases: list[type]) -> set[str]:
    """The private names the upstream classes `bases` define: in their sources, or as attributes."""
    found: set[str] = set()
    for base in bases:
        found.update(upstream().by_class.get((base.__module__, base.__qualname__), ()))
        found.update(n for n in vars(base) if private(n))
    return found


# --- what a project module uses ------------------------------------------------------------------------------------


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str, resolve: Resolve, own: frozenset[str]) -> None:
        self.path, self.resolve, self.own = path, resolve, own
        self.hits: list[Hit] = []
        self.classes: list[tuple[str, set[str]]] = []  # (qualname, names its upstream bases define) from outermost

    def hit(self, node: ast.AST, kind: str, name: str) -> None:
        self.hits.append(Hit(self.path, getattr(node, "lineno", 0), kind, name))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._module_path(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] not in UPSTREAM:
            return
        self._module_path(node, module)
        for alias in node.names:
            if private(alias.name):
                self.hit(node, "import", f"{module}.{alias.name}")

    def _module_path(self, node: ast.AST, module: str) -> None:
        parts = module.split(".")
        if parts[0] in UPSTREAM and any(private(p) for p in parts):
            self.hit(node, "import", module)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        qualname = ".".join([*(name for name, _ in self.classes), node.name])
        cls = self.resolve(qualname)
        bases = upstream_bases(cls)
        defined = defined_by(bases) if bases else set()
        self.classes.append((qualname, defined))
        for mixin in [k for k in getattr(cls, "__mro__", ())[1:] if not is_upstream(k)] if bases else ():
            for name in sorted(n for n in vars(mixin) if private(n) and n in defined):  # a mixin's override
                self.hit(node, "override", f"{qualname}.{name} (from {mixin.__qualname__})")
        for item in node.body if bases else ():
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [item.name]
            else:
                names = list(_assigned_names(item))
            for name in names:
                if private(name) and name in defined:
                    self.hit(item, "override", f"{qualname}.{name}")
        self.generic_visit(node)
        self.classes.pop()

    def _used(self, node: ast.AST, receiver: ast.expr, name: str, kind: str) -> None:
        if not private(name):
            return
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            if self.classes and name in self.classes[-1][1]:
                self.hit(node, kind, name)
            return
        if name in upstream().names and name not in self.own:
            self.hit(node, kind, name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._used(node, node.value, node.attr, "attribute")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in _ATTRIBUTE_CALLS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._used(node, node.args[0], name.value, f"{func.id}()")
        for keyword in node.keywords:
            if keyword.arg and private(keyword.arg) and keyword.arg in upstream().keywords:
                self.hit(node, "keyword", keyword.arg)
        self.generic_visit(node)


def scan(path: str, tree: ast.Module, resolve: Resolve, own: frozenset[str]) -> list[Hit]:
    visitor = _Scan(path, resolve, own)
    visitor.visit(tree)
    return visitor.hits


def _resolver(namespace: Any) -> Resolve:
    def resolve(qualname: str) -> Any:
        found = namespace
        for part in qualname.split("."):
            found = getattr(found, part, None)
        return found if isinstance(found, type) else None

    return resolve


def project_modules() -> dict[str, Path]:
    """Every module of `pipeline/` and `tasks/` outside the seam, by name."""
    found = {}
    for package in ("pipeline", "tasks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative.startswith(SEAM):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def own_names(trees: dict[str, ast.Module], resolve: Callable[[str], Resolve]) -> frozenset[str]:
    """Private names the project defines in its classes that do not derive from the libraries."""
    return frozenset(
        name
        for module, tree in trees.items()
        for (_, qualname), names in classes(module, tree).items()
        if not upstream_bases(resolve(module)(qualname))
        for name in names
    )


def project_hits() -> list[Hit]:
    modules = project_modules()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    failed: list[Hit] = []

    @cache
    def imported(module: str) -> Resolve:
        try:
            return _resolver(importlib.import_module(module))
        except ImportError as exc:  # a module that does not import: reported, its classes unknown
            failed.append(Hit(module, 0, "unimportable", repr(exc)))
            return lambda _: None

    def resolve(module: str) -> Resolve:
        """Classes of `module`, which is imported when a class of it is first asked for (not `__main__`)."""
        return lambda qualname: imported(module)(qualname)

    own = own_names(trees, resolve)
    hits = []
    for name, tree in trees.items():
        hits += scan(modules[name].relative_to(ROOT).as_posix(), tree, resolve(name), own)
    return failed + hits


def test_no_private_upstream_name_outside_the_seam() -> None:
    hits = project_hits()
    assert not hits, "private names of celery/kombu/billiard/redbeat/redis outside pipeline/delivery/ and " + (
        "pipeline/compat/ (move the use there, with an entry in ENTRIES and a parity test):\n"
        + "\n".join(map(str, hits))
    )


# --- the scan can fail ---------------------------------------------------------------------------------------------

PLANTED = {
    "from celery._state import get_current_task\n": ("import", "celery._state"),
    "import celery._state\n": ("import", "celery._state"),
    "from celery import _state\n": ("import", "celery._state"),
    "def f(producer):\n    return producer._batch_local\n": ("attribute", "_batch_local"),
    "def f(pool):\n    return getattr(pool, '_does_debug', False)\n": ("getattr()", "_does_debug"),
    "def f(message):\n    setattr(message, '_raw', {})\n": ("setattr()", "_raw"),
    "from celery.worker.worker import WorkController\n\n"
    "class W(WorkController):\n    def f(self):\n        return self._process_task\n": ("attribute", "_process_task"),
    "from celery.app.task import Context\n\n"
    "class C(Context):\n    def _get_custom_headers(self, *args):\n        return None\n": (
        "override",
        "C._get_custom_headers",
    ),
    "from celery.concurrency.solo import TaskPool\n\nclass P(TaskPool):\n    _does_debug = True\n": (
        "override",
        "P._does_debug",
    ),
    "from celery.app.task import Context\n\n"
    "class Mixin:\n    def _get_custom_headers(self, *args):\n        return None\n\n"
    "class C(Mixin, Context):\n    pass\n": ("override", "C._get_custom_headers (from Mixin)"),
    "def f(channel, message):\n    channel.basic_publish(message, _publish_batch=None)\n": (
        "keyword",
        "_publish_batch",
    ),
}

NOT_FLAGGED = [
    # the project's own class, its own state (even under a name a library also uses)
    "class Mine:\n    def __init__(self):\n        self._batch_local = 1\n\n"
    "    def f(self):\n        return self._batch_local\n",
    # a private name of the project's own in a subclass of a library's class
    "from celery.app.task import Context\n\nclass C(Context):\n    def _mine(self):\n        return self._mine\n",
    # dunders, public names, another package's private names
    "def f(x):\n    return x.__class__, x.name, getattr(x, '__dict__')\n",
    "from json import _default_decoder\n",
]


def _planted(source: str) -> list[Hit]:
    namespace: dict[str, Any] = {"__name__": "planted"}
    exec(compile(source, "planted.py", "exec"), namespace)  # noqa: S102  # the test's own snippets
    tree = ast.parse(source)
    resolve = _resolver(type("Namespace", (), namespace))
    own = own_names({"planted": tree}, lambda _: resolve)
    return scan("planted.py", tree, resolve, own)


@pytest.mark.parametrize("source", list(PLANTED))
def test_the_scanner_flags_each_kind(source: str) -> None:
    assert [(h.kind, h.name) for h in _planted(source)] == [PLANTED[source]]


@pytest.mark.parametrize("source", NOT_FLAGGED)
def test_the_scanner_leaves_the_projects_own_names_alone(source: str) -> None:
    assert _planted(source) == []


def test_the_libraries_private_names_are_read_from_their_sources() -> None:
    names = upstream().names
    assert {"_batch_local", "_raw", "_process_task", "_get_custom_headers", "_maybe_due_kwargs"} <= names
    assert not any(n.startswith("__") and n.endswith("__") for n in names)


# --- the tables of the seam ----------------------------------------------------------------------------------------


def _entries() -> list[Entry]:
    """`pipeline.compat.ENTRIES`, and `pipeline.delivery.ENTRIES` once the delivery package exists (then required)."""
    entries = list(compat.ENTRIES)
    if importlib.util.find_spec("pipeline.delivery") is not None:
        delivery = importlib.import_module("pipeline.delivery")
        entries += list(delivery.ENTRIES)
    return entries


def _marked_parity(tree: ast.Module, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    def names_parity(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "parity" for n in ast.walk(node))

    module_mark = any(
        isinstance(item, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in item.targets)
        and names_parity(item.value)
        for item in tree.body
    )
    return module_mark or any(names_parity(d) for d in function.decorator_list)


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: f"{e.where}:{e.upstream[:40]}")
def test_every_entry_names_its_parity_test_and_verified_libraries(entry: Entry) -> None:
    assert entry.libraries and set(entry.libraries) <= set(GUARDED), entry.libraries
    for module in entry.where.split(","):
        assert importlib.util.find_spec(module.strip()) is not None, module
    path, _, name = entry.test.partition("::")
    name = name.partition("[")[0]
    assert (ROOT / path).is_file(), entry.test
    tree = ast.parse((ROOT / path).read_text())
    functions = {
        f.name: f for f in tree.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name == name
    }
    assert name in functions, f"{entry.test}: no such test function"
    assert _marked_parity(tree, functions[name]), f"{entry.test}: not marked parity"


def test_every_compat_module_has_an_entry() -> None:
    modules = {f"pipeline.compat.{p.stem}" for p in (ROOT / "pipeline" / "compat").glob("*.py") if p.stem != "__init__"}
    entered = {entry.where for entry in compat.ENTRIES}
    assert modules - {"pipeline.compat.versions"} <= entered
