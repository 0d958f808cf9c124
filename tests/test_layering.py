"""Imports go one way at the edge (ARCHITECTURE.md): the batch runner, the Python API, the
offline loop and the HTTP middleware import the shared request path (``app.api.request_path``,
``app.api.answers``...), never a route module (a module that makes an ``APIRouter``); and no
file of app/ grows past 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the modules that must not reach a route, however indirectly
ROUTE_FREE = (
    "app.llm",
    "app.offline",
    "app.batch.command",
    "app.batch.runner",
    "app.batch.endpoints",
    "app.api.admission_gate",
    "app.api.request_id",
    "app.api.request_path",
    "app.api.answers",
)
MAX_LINES = 400


def route_modules() -> set[str]:
    """Every module of app/ that makes an ``APIRouter``."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "app").rglob("*.py")
        if "APIRouter(" in path.read_text()
    }


def test_route_modules_are_found():
    assert {"app.api.generate", "app.api.openai.routes", "app.api.anthropic.routes"} <= (
        route_modules()
    )


def module_path(module: str) -> Path | None:
    """The file of an ``app`` module (a package's ``__init__.py``), or None for any other."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if module.startswith("app") and path.is_file():
            return path
    return None


def imported_modules(module: str) -> set[str]:
    """The ``app`` modules ``module`` imports anywhere in its file (functions too), with the
    packages above each (importing a module runs its packages' ``__init__``)."""
    path = module_path(module)
    assert path is not None, module
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(
            prefix
            for prefix in (".".join(parts[:end]) for end in range(1, len(parts) + 1))
            if module_path(prefix) is not None
        )
    return found


def reachable(module: str) -> set[str]:
    """Every ``app`` module importing ``module`` imports, however indirectly."""
    seen, pending = set(), [module]
    while pending:
        current = pending.pop()
        if current not in seen:
            seen.add(current)
            pending.extend(imported_modules(current))
    return seen


def test_no_route_module_is_imported_by_the_shared_side():
    routes = route_modules()
    assert reachable("app.api.server") >= routes  # the graph does see the routes
    for module in ROUTE_FREE:
        assert reachable(module).isdisjoint(routes), (module, reachable(module) & routes)


def test_no_file_in_app_is_over_400_lines():
    """Found: the load plan (423 lines) and the GGUF reader (435) had grown past it while only
    the edge's files were checked."""
    files = (ROOT / "app").rglob("*.py")
    long = {
        str(path.relative_to(ROOT)): lines
        for path in files
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
