"""Requests are held to the documented interface (the app's own OpenAPI schema).

- An unknown query parameter is a 422, not silently ignored: `?delay=60` for `?delay_seconds=60` would
  otherwise run a job at once that was meant to wait.
- A 405's `Allow` header lists every documented method of the path (Starlette names only the first route).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, HTTPException, Request

_PARAM = re.compile(r"\{([^}/]+)\}")


Operations = dict[str, set[str]]  # METHOD → names of its query parameters


def _paths(app: FastAPI) -> list[tuple[re.Pattern[str], bool, Operations]]:
    """(path regex, is templated, operations) for every documented path; built once per app."""
    cached: list[tuple[re.Pattern[str], bool, Operations]] | None = getattr(app.state, "documented_paths", None)
    if cached is None:
        cached = []
        for template, ops in app.openapi().get("paths", {}).items():
            parts = _PARAM.split(template)  # literal, parameter name, literal, ...
            regex = "".join("[^/]+" if i % 2 else re.escape(part) for i, part in enumerate(parts))
            operations = {
                method.upper(): {p["name"] for p in op.get("parameters", []) if p.get("in") == "query"}
                for method, op in ops.items()
                if isinstance(op, dict)
            }
            cached.append((re.compile(f"^{regex}$"), len(parts) > 1, operations))
        app.state.documented_paths = cached
    return cached


def operations_for(app: FastAPI, path: str) -> Operations:
    """The documented operations of `path`; a concrete path wins over templated ones (as in OpenAPI)."""
    matches = [(templated, ops) for pattern, templated, ops in _paths(app) if pattern.match(path)]
    concrete = [ops for templated, ops in matches if not templated]
    found: Operations = {}
    for ops in concrete or [ops for _, ops in matches]:
        for method, names in ops.items():
            found[method] = found.get(method, set()) | names
    return found


def documented_methods(app: FastAPI, path: str) -> set[str]:
    return set(operations_for(app, path))


def reject_unknown_query(request: Request) -> None:
    """Route dependency: 422 naming each query parameter the operation does not document."""
    if not request.query_params:
        return
    known = operations_for(request.app, request.url.path).get(request.method, set())
    unknown = sorted(set(request.query_params.keys()) - known)
    if unknown:
        detail: list[dict[str, Any]] = [
            {"loc": ["query", name], "msg": "unknown query parameter", "type": "extra_forbidden"} for name in unknown
        ]
        raise HTTPException(422, detail=detail)
