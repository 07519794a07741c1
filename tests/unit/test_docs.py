"""The documentation holds: the README is a landing page, every page is in the site, the reference pages come from
the code (a new setting, command or route appears without editing a page), the guarantee matrix names tests that
exist, and `make docs-build` fails on any warning (a broken link in a copy of the site)."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
README_MAX_LINES = 250
#: What a reader sees before scrolling: the set-up commands must be there.
FIRST_SCREEN_LINES = 24


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as mkdocs loads a hook: its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


reference = _reference()


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_the_readme_is_a_landing_page_of_at_most_250_lines() -> None:
    assert len(README.splitlines()) <= README_MAX_LINES


def test_the_first_screen_has_exactly_the_two_set_up_commands() -> None:
    first = "\n".join(README.splitlines()[:FIRST_SCREEN_LINES])
    blocks = _code_blocks(first)
    assert len(blocks) == 1, "one block of set-up commands on the first screen"
    commands = [line.split("#")[0].strip() for line in blocks[0].splitlines() if line.strip()]
    assert commands == ["make run", "make test"]


def test_the_readme_holds_no_dated_log() -> None:
    dated = [line for line in README.splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert dated == [], "dated figures belong in docs/benchmarks.md"
    assert not re.search(r"\d\s*µs", README), "per-call CPU figures belong in docs/benchmarks.md"


def test_every_link_from_the_readme_into_docs_names_a_page() -> None:
    for target in re.findall(r"\]\((docs/[^)#\s]+)", README):
        assert (ROOT / target).is_file(), target


def _nav_pages(nav: list[object]) -> list[str]:
    found: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        found += _nav_pages(value) if isinstance(value, list) else [str(value)]
    return found


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "!python"))
    nav = _nav_pages(config["nav"])
    written = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert written - set(nav) == set(), "a page missing from mkdocs.yml's nav"
    assert set(nav) - written == set(reference.PAGES), "only the generated pages are not files"
    assert not any((DOCS / page).exists() for page in reference.PAGES), "generated pages are never committed"


def test_the_settings_reference_shows_every_field_with_its_default_and_meaning() -> None:
    from pipeline.config.settings import Settings

    page = reference.settings_page()
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    assert len(rows) == len(Settings.model_fields)
    for name in Settings.model_fields:
        row = rows[name.upper()]
        _, kind, default, meaning = (cell.strip() for cell in row.strip("|").split(" | ", 3))
        assert kind.startswith("`"), row
        assert default, row
        assert meaning, f"{name.upper()}: no comment in .env.example and no `#:` comment in the model"


def test_a_new_setting_appears_in_the_reference_without_editing_a_page(tmp_path: Path) -> None:
    source = (ROOT / "pipeline" / "config" / "settings.py").read_text()
    added = source.replace(
        "    # --- Tasks ---",
        "    #: A setting only this test declares.\n    brand_new_knob: int = 7\n\n    # --- Tasks ---",
        1,
    )
    assert added != source
    path = tmp_path / "settings.py"
    path.write_text(added)
    found = {doc.name: doc for doc in reference.settings_source(path)}
    assert found["brand_new_knob"].comment == "A setting only this test declares."
    assert found["brand_new_knob"].annotation == "int"
    assert found["task_time_limit"].section == "Tasks"


def test_the_cli_reference_shows_every_command() -> None:
    import typer.main

    from pipeline.cli.main import app

    page = reference.cli_page()
    headings = set(re.findall(r"^## `(.+)`$", page, flags=re.M))
    root = typer.main.get_command(app)
    expected = {" ".join(path) for path, _ in reference._commands(root, ["pipeline"])}
    assert headings == expected
    assert {"pipeline enqueue", "pipeline dlq replay", "pipeline queues pause", "pipeline flow start"} <= headings
    assert "`--idempotency-key`" in page


def test_the_http_api_reference_shows_every_route() -> None:
    schema = reference.openapi_schema()
    page = reference.http_api_page()
    for path, methods in schema["paths"].items():
        for method in methods:
            assert f"### `{method.upper()} {path}`" in page
    assert "### `POST /jobs/email`" in page


def _test_exists(path: str, name: str) -> bool:
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in ast.walk(tree))


def test_every_test_the_guarantee_matrix_names_exists() -> None:
    page = (DOCS / "guarantees.md").read_text()
    matrix = page[page.index("## Guarantees") :]
    named = 0
    for row in (line for line in matrix.splitlines() if line.startswith("|")):
        path = ""
        for found in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+)`", row):
            path = found.group(1) or path
            assert _test_exists(path, found.group(2)), f"{path}::{found.group(2)}"
            named += 1
    assert named >= 30


def _docs_build(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`make docs-build` (the target .ci/run calls) on the site copied into tmp_path, with this venv."""
    make = ["make", "--no-print-directory", "-o", "install", "docs-build"]
    make += [f"VENV={sys.prefix}", f"MKDOCS_CONFIG={tmp_path / 'mkdocs.yml'}", f"SITE_DIR={tmp_path / 'site'}"]
    return subprocess.run(make, cwd=ROOT, capture_output=True, text=True, check=False)


def _copy_site(tmp_path: Path) -> Path:
    """docs/ and mkdocs.yml copied into tmp_path; the hook stays the real one (it reads the code from the tree)."""
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("hooks"))
    hook = "docs/hooks/reference.py"
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text().replace(hook, str(ROOT / hook)))
    return tmp_path / "docs"


@pytest.mark.timeout(120)
def test_the_docs_build_passes_on_the_site_and_fails_on_one_broken_link(tmp_path: Path) -> None:
    docs = _copy_site(tmp_path)
    done = _docs_build(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "settings" / "index.html").is_file()

    page = docs / "operations.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](no-such-page.md).\n")
    broken = _docs_build(tmp_path)
    assert broken.returncode != 0, broken.stdout + broken.stderr
    output = broken.stdout + broken.stderr
    assert "no-such-page.md" in output
    assert "Aborted with 1 warnings in strict mode" in output


def test_the_deployment_guide_gives_one_set_of_worker_defaults_the_settings_have() -> None:
    """Each row of docs/deployment.md's "Defaults" table names its setting's default from the settings model, and
    every other mention of `WORKER_CONCURRENCY (N)` in the guide gives the same N."""
    from pipeline.config.settings import Settings

    text = (DOCS / "deployment.md").read_text()
    table = text[text.index("### Defaults") :].split("\n### ")[0]
    rows = re.findall(r"^\| `([A-Z_]+)`[^|]*\| ([^|]+) \|", table, flags=re.M)
    checked = 0
    for name, default in rows:
        field = Settings.model_fields.get(name.lower())
        if field is None or field.default is None:
            continue
        assert re.search(
            rf"\b{field.default:g}\b" if isinstance(field.default, float) else rf"\b{field.default}\b", default
        ), name
        checked += 1
    assert checked >= 4
    concurrency = Settings.model_fields["worker_concurrency"].default
    assert set(re.findall(r"WORKER_CONCURRENCY`? \((\d+)\)", text)) <= {str(concurrency)}
    assert "Why solo workers" not in text
