"""The generated reference pages of the documentation site, built from the code at `mkdocs build` time.

- `reference/settings.md`: every field of `pipeline.config.settings.Settings` (its environment variable, type,
  default and bounds from the model; its meaning from the variable's comment in `.env.example`, written for
  operators, else the field's `#:` comment), grouped by the `# --- Section ---` comments of the model;
- `reference/cli.md`: every `pipeline` command, walked from the typer app itself (usage, help, arguments, options);
- `reference/http-api.md`: every route of the producer API, from the FastAPI app's OpenAPI schema.

None of them is a file in the repository, so a new setting, command or route appears without editing a page. mkdocs
loads this module as a hook (`hooks:` in mkdocs.yml) and calls `on_files`; the tests call the `*_page()` functions.
Building the API reads no setting and connects to nothing (`Settings.model_construct()`: the defaults).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_SOURCE = ROOT / "pipeline" / "config" / "settings.py"
ENV_EXAMPLE = ROOT / ".env.example"
PAGES = ("reference/settings.md", "reference/cli.md", "reference/http-api.md")
_SECTION = re.compile(r"^\s*# -+ (.+?) -+\s*$")
_ENV_LINE = re.compile(r"^#? ?([A-Z][A-Z0-9_]*)=")
_SETTINGS_TABLE = ("| Variable | Type | Default | Meaning |", "|---|---|---|---|")
_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


# --- Settings ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SettingDoc:
    """One field of the settings model as its source declares it."""

    name: str
    annotation: str
    comment: str
    section: str


def settings_source(path: Path = SETTINGS_SOURCE) -> list[SettingDoc]:
    """The model's fields in source order, each with its annotation, its `#:` comment and its section."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    found, section = [], ""
    previous_end = model.lineno
    for node in model.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous_end = node.end_lineno or node.lineno
            continue
        comment: list[str] = []
        for line in lines[previous_end : node.lineno - 1]:
            if heading := _SECTION.match(line):
                section, comment = heading.group(1), []
            elif line.strip().startswith("#:"):
                comment.append(line.strip()[2:].strip())
        trailing = lines[(node.end_lineno or node.lineno) - 1].partition("#:")[2].strip()
        text = " ".join([*comment, trailing]).strip()
        found.append(SettingDoc(node.target.id, ast.unparse(node.annotation), text, section))
        previous_end = node.end_lineno or node.lineno
    return found


def env_example_comments(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """Each variable of `.env.example` with the comment written above it (variables on consecutive lines share it)."""
    comments: dict[str, str] = {}
    block: list[str] = []
    shared = ""
    for line in path.read_text().splitlines():
        if found := _ENV_LINE.match(line):
            shared = " ".join(block) if block else shared
            comments.setdefault(found.group(1), shared)
            block = []
            continue
        shared = ""
        if not line.strip() or _SECTION.match(line):
            block = []
        elif line.startswith("#"):
            block.append(line.lstrip("#").strip())
    return comments


def _env_names(name: str, field: Any) -> list[str]:
    alias = field.validation_alias
    choices = getattr(alias, "choices", None)
    if choices:
        return [str(choice) for choice in choices]
    return [str(alias) if alias else name.upper()]


def _default(field: Any) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _bounds(field: Any) -> str:
    parts = []
    for rule in field.metadata:
        for attribute, sign in _BOUNDS.items():
            if getattr(rule, attribute, None) is not None:
                parts.append(f"{sign} {getattr(rule, attribute)}")
        if getattr(rule, "pattern", None):
            parts.append(f"matches `{rule.pattern}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_page() -> str:
    """The settings reference, generated from the settings model."""
    from pipeline.config.settings import Settings

    env = env_example_comments()
    out = [
        "# Settings",
        "",
        "Every setting of the pipeline, generated from the settings model (`pipeline/config/settings.py`) when the",
        "site is built. Each is read from the environment variable of its name, from `.env`, or from a file of that",
        "name in `SECRETS_DIR` (default `/run/secrets`); an invalid value stops every process at start with a message",
        "naming the variable. `.env.example` is the same list as a file to copy; the",
        "[operations guide](../operations.md) says how the settings work together.",
    ]
    section = None
    for doc in settings_source():
        field = Settings.model_fields[doc.name]
        if doc.section != section:
            section = doc.section
            out += ["", f"## {section or 'General'}", "", *_SETTINGS_TABLE]
        names = " or ".join(f"`{n}`" for n in _env_names(doc.name, field))
        meaning = env.get(doc.name.upper()) or doc.comment
        bounds = _bounds(field)
        kind = f"`{_cell(doc.annotation)}`" + (f" ({_cell(bounds)})" if bounds else "")
        out.append(f"| {names} | {kind} | {_cell(_default(field))} | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


# --- CLI -----------------------------------------------------------------------------------------------------------


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    """The command and, depth first in name order, every visible command under it (typer's click objects)."""
    yield path, command
    subcommands = getattr(command, "commands", {})
    for name in sorted(subcommands):
        if not subcommands[name].hidden:
            yield from _commands(subcommands[name], [*path, name])


def _param_row(param: Any) -> str:
    """One argument or option as a table row: its names and help (an option's default, an argument's need)."""
    help_text = _cell(param.help or "")
    if param.param_type_name == "option":
        names = ", ".join(f"`{n}`" for n in [*param.opts, *param.secondary_opts])
        shown = not param.is_flag and param.default not in (None, (), [])
        default = f" (default `{param.default}`)" if shown else ""
        return f"| {names} | {help_text}{default} |"
    metavar = param.metavar or param.name.upper()
    return f"| `{metavar}` | {help_text}{'' if param.required else ' (optional)'} |"


def cli_page() -> str:
    """The `pipeline` command reference, walked from the typer app."""
    import typer
    import typer.main

    from pipeline.cli.main import app

    root = typer.main.get_command(app)
    out = [
        "# The `pipeline` command",
        "",
        "Every command and option, generated from the command itself when the site is built (`pipeline --help` and",
        "`pipeline COMMAND --help` print the same). Every command that prints takes `--json`.",
    ]
    for path, command in _commands(root, ["pipeline"]):
        name = " ".join(path)
        usage = " ".join(command.collect_usage_pieces(typer.Context(command, info_name=name)))
        out += ["", f"## `{name}`", "", "```", f"{name} {usage}".rstrip(), "```"]
        if command.help:
            out += ["", command.help.split("\b")[0].strip()]
        params = [p for p in command.params if p.name != "help"]
        if params:
            out += ["", "| Argument or option | Meaning |", "|---|---|"] + [_param_row(p) for p in params]
    return "\n".join(out) + "\n"


# --- HTTP API ------------------------------------------------------------------------------------------------------


def openapi_schema() -> dict[str, Any]:
    """The producer API's OpenAPI schema, from an app built on the default settings (no Redis, no environment)."""
    from pipeline.api.factory import create_app
    from pipeline.config.settings import Settings

    schema: dict[str, Any] = create_app(Settings.model_construct()).openapi()
    return schema


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    return f"`{schema.get('type', 'any')}`"


def _operation(method: str, path: str, operation: dict[str, Any]) -> list[str]:
    out = ["", f"### `{method.upper()} {path}`", ""]
    if operation.get("summary"):
        out += [f"**{operation['summary']}**", ""]
    if operation.get("description"):
        out += [operation["description"].strip(), ""]
    params = operation.get("parameters", [])
    if params:
        out += ["| Parameter | In | Type | Meaning |", "|---|---|---|---|"]
        for p in params:
            required = " (required)" if p.get("required") else ""
            kind = _schema_name(p.get("schema", {}))
            out.append(f"| `{p['name']}`{required} | {p['in']} | {kind} | {_cell(p.get('description', ''))} |")
        out.append("")
    body = operation.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        out += [f"Body ({media}): {_schema_name(content.get('schema', {}))}", ""]
    out += ["| Answer | Meaning |", "|---|---|"]
    for code, answer in operation.get("responses", {}).items():
        out.append(f"| `{code}` | {_cell(answer.get('description', ''))} |")
    return out


def _component(name: str, schema: dict[str, Any]) -> list[str]:
    out = ["", f"### {name}", ""]
    if schema.get("description"):
        out += [schema["description"].strip(), ""]
    properties = schema.get("properties", {})
    if properties:
        required = set(schema.get("required", []))
        out += ["| Field | Type | Meaning |", "|---|---|---|"]
        for field, spec in properties.items():
            mark = " (required)" if field in required else ""
            out.append(f"| `{field}`{mark} | {_schema_name(spec)} | {_cell(spec.get('description', ''))} |")
    elif "enum" in schema:
        out.append("One of " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".")
    return out


def http_api_page() -> str:
    """The HTTP API reference, from the OpenAPI schema."""
    schema = openapi_schema()
    out = [
        "# HTTP API",
        "",
        "Every route of the producer API, generated from its OpenAPI schema when the site is built. A running API",
        "serves the same schema at `/openapi.json` and Swagger UI at `/docs`; [the API guide](../api.md) describes",
        "the contract in prose (authentication, errors, idempotency, limits).",
        "",
        schema.get("info", {}).get("description", "").strip(),
        "",
        "## Routes",
    ]
    for path, methods in schema.get("paths", {}).items():
        for method, operation in methods.items():
            out += _operation(method, path, operation)
    components = schema.get("components", {}).get("schemas", {})
    if components:
        out += ["", "## Schemas"]
        for name in sorted(components):
            out += _component(name, components[name])
    return "\n".join(out) + "\n"


# --- The mkdocs hook -----------------------------------------------------------------------------------------------


def pages() -> dict[str, str]:
    """Each generated page's path in the site and its Markdown."""
    return dict(zip(PAGES, (settings_page(), cli_page(), http_api_page()), strict=True))


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated pages to the site's files (they exist only in the build)."""
    from mkdocs.structure.files import File

    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files
