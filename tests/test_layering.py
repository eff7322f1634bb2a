"""Layering, read from the source (ast, nothing imported): no module imports a layer above its own.

    steerspec (core)  <  drafter_service, verifier_service  <  coordinator  <  entry points

- core (every steerspec module but the entry points) imports nothing from the services or coordinator/;
- each service imports only the core: not coordinator/, not the other service;
- in coordinator/ only the deployment modules (which start the services) import them;
- entry points (`steerspec` CLI, benchmarks, the package's lazy `steerspec.Client`) may import anything.

Imports inside functions and `importlib.import_module("...")` / `find_spec("...")` with a literal
name count as imports. No module of these packages changes `os.environ` when it is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("steerspec", "drafter_service", "verifier_service", "coordinator")
SERVICES = ("drafter_service", "verifier_service")
ENTRY_POINTS = ("steerspec.__main__", "steerspec.cli", "steerspec.bench")  # and the package itself (lazy Client)
DEPLOYMENT = ("coordinator.launch", "coordinator.local", "coordinator.ray_app")
DYNAMIC_IMPORTS = ("import_module", "find_spec", "__import__")
ENV_MUTATORS = ("setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "v1" in path.relative_to(ROOT).parts:  # generated stubs
                continue
            out[_module_name(path)] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return out


MODULES = _modules()


def _is_under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_package = (ROOT / Path(*base) / "__init__.py").is_file()
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, tree: ast.Module) -> Iterator[Tuple[str, int]]:
    """(imported module, line) for every import statement and literal dynamic import in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield _resolve(module, node), node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in DYNAMIC_IMPORTS and isinstance(node.args[0].value, str):
                yield node.args[0].value, node.lineno


def forbidden_for(module: str) -> Tuple[str, ...]:
    """The top-level packages `module` must not import."""
    if module == "steerspec" or _is_under(module, ENTRY_POINTS):
        return ()
    if _is_under(module, ("steerspec",)):
        return ("coordinator", *SERVICES)
    if _is_under(module, SERVICES):
        return tuple(p for p in ("coordinator", *SERVICES) if not _is_under(module, (p,)))
    if _is_under(module, ("coordinator",)):
        return () if _is_under(module, DEPLOYMENT) else SERVICES
    raise AssertionError(f"no layer for {module}")


def upward_imports(modules: Dict[str, ast.Module]) -> List[str]:
    found = []
    for module, tree in modules.items():
        forbidden = forbidden_for(module)
        for imported, line in imports_of(module, tree):
            if _is_under(imported, forbidden):
                found.append(f"{module}:{line} imports {imported}")
    return found


def _runs_at_import(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node executed when the module is imported (function bodies excluded, class bodies not)."""
    stack: List[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(node.decorator_list if not isinstance(node, ast.Lambda) else ())
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def environment_writes(modules: Dict[str, ast.Module]) -> List[str]:
    found = []
    for module, tree in modules.items():
        for node in _runs_at_import(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            hit = any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                hit = hit or (node.func.attr in ENV_MUTATORS and _is_environ(node.func.value))
                hit = hit or node.func.attr in ("putenv", "unsetenv")
            if hit:
                found.append(f"{module}:{node.lineno}")
    return found


def test_every_package_is_read():
    assert {"steerspec.engine", "steerspec.store", "steerspec.registration", "drafter_service.server",
            "verifier_service.server", "coordinator.loop", "steerspec.cli.run"} <= set(MODULES)


def test_no_upward_imports():
    assert upward_imports(MODULES) == []


def test_no_environment_changes_at_import():
    assert environment_writes(MODULES) == []


@pytest.mark.parametrize("source, module, expected", [
    ("from coordinator.cli import parse_targets", "steerspec.registration", "coordinator.cli"),
    ("def f():\n    import verifier_service.sessions", "drafter_service.sessions", "verifier_service.sessions"),
    ("import importlib\nimportlib.import_module('coordinator.local')", "steerspec.engine", "coordinator.local"),
    ("from drafter_service import cli", "coordinator.loop", "drafter_service"),
    ("from .server import serve", "verifier_service.cli", None),  # relative, same package: allowed
    ("from steerspec.store import Store", "verifier_service.cli", None),
])
def test_the_checks_catch_what_they_should(source, module, expected):
    found = upward_imports({module: ast.parse(source)})
    assert found == ([] if expected is None else [f"{module}:{source.count(chr(10)) + 1} imports {expected}"])


@pytest.mark.parametrize("source, bad", [
    ("import os\nos.environ.setdefault('X', '0')", True),
    ("import os\nos.environ['X'] = '0'", True),
    ("import os\nif True:\n    os.environ.update(X='0')", True),
    ("import os\nclass A:\n    os.putenv('X', '0')", True),
    ("import os\ndef f():\n    os.environ['X'] = '0'", False),  # at call time: fine
    ("import os\nX = os.environ.get('X')", False),
])
def test_the_environment_check_catches_what_it_should(source, bad):
    assert bool(environment_writes({"steerspec.x": ast.parse(source)})) is bad
