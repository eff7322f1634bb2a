"""The package's shape, read from the source (ast, nothing imported): its folders are its layers.

Layers, lowest first; a module imports only its own layer and those below it:

    steerspec.errors, steerspec.v1 (the generated protos)
    < steerspec.data < steerspec.models < steerspec.policies < steerspec.decoding < steerspec.steering
    < steerspec.sprinter < steerspec.observability < steerspec.serving < steerspec.blocks < steerspec.train
    < drafter_service | verifier_service (neither imports the other)
    < coordinator (of which only the deployment modules start the services)
    < steerspec.cli < steerspec.bench < steerspec.__main__

The one exception is the package itself: `steerspec.Client` and the SDK errors are the coordinator's,
imported lazily by `steerspec/__init__.py`. Besides the order:

- no import cycles between modules;
- no private name (`_x`) used outside its module, and no private module;
- no two modules with the same file name, but the three services' `server.py` and `cli.py`;
- an import inside a function says why it is there (a comment on its line or right above its block);
- no module changes `os.environ` when it is imported.

Every import counts: at the top, inside functions, and `importlib.import_module("...")` / `find_spec("...")`
with a literal name; only an `if TYPE_CHECKING:` block (which never runs) does not.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("steerspec", "drafter_service", "verifier_service", "coordinator")
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("steerspec.errors", "steerspec.v1"),
    ("steerspec.data",),
    ("steerspec.models",),
    ("steerspec.policies",),
    ("steerspec.decoding",),
    ("steerspec.steering",),
    ("steerspec.sprinter",),
    ("steerspec.observability",),
    ("steerspec.serving",),
    ("steerspec.blocks",),
    ("steerspec.train",),
    ("drafter_service", "verifier_service"),
    ("coordinator",),
    ("steerspec.cli",),
    ("steerspec.bench",),
    ("steerspec.__main__",),
)
SIBLINGS = ("drafter_service", "verifier_service")
SERVICES = ("drafter_service", "verifier_service")
DEPLOYMENT = ("coordinator.launch", "coordinator.local", "coordinator.ray_app")  # they start the services
EXCEPTIONS = {"steerspec": ("coordinator.client", "coordinator.exceptions")}  # the lazy steerspec.Client
SERVICE_FILE_NAMES = ("server.py", "cli.py")  # one of each per service, by convention
DYNAMIC_IMPORTS = ("import_module", "find_spec", "__import__")
ENV_MUTATORS = ("setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> Dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


SOURCES = _sources()
MODULES = {name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
           for name, path in SOURCES.items() if not name.startswith("steerspec.v1.")}  # v1: generated


def _is_under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _is_package(module: str) -> bool:
    return (ROOT / Path(*module.split(".")) / "__init__.py").is_file()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if _is_package(module) else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_blocks(tree: ast.Module) -> Set[ast.AST]:
    """Every node under an `if TYPE_CHECKING:` (imports for annotations only; they never run)."""
    out: Set[ast.AST] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
                                         or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")):
            for child in node.body:
                out.update(ast.walk(child))
    return out


def imports_of(module: str, tree: ast.Module) -> Iterator[Tuple[str, int]]:
    """(imported module or name, line) for every import that can run and every literal dynamic import.

    `from a.b import c` yields `a.b.c` (a module or a name in a.b; `owner` tells which)."""
    skip = _type_checking_blocks(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                yield (f"{base}.{alias.name}" if base and alias.name != "*" else base), node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in DYNAMIC_IMPORTS and isinstance(node.args[0].value, str):
                yield node.args[0].value, node.lineno


def owner(name: str, modules) -> Optional[str]:
    """The module of ours that `name` (a module, or a name inside one) lives in; None if not ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def layer_of(module: str) -> int:
    for index, layer in enumerate(LAYERS):
        if _is_under(module, layer):
            return index
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")


def allowed(importer: str, imported: str) -> bool:
    """Whether `importer` may import `imported` (both modules of ours)."""
    if importer in EXCEPTIONS and _is_under(imported, EXCEPTIONS[importer]):
        return True
    if importer == "steerspec":
        return layer_of(imported) == 0
    if imported == "steerspec":  # the package's own __init__: nothing to import from it but the lazy SDK
        return False
    mine, theirs = layer_of(importer), layer_of(imported)
    if theirs > mine:
        return False
    if theirs == mine and _is_under(importer, SIBLINGS):
        return _is_under(imported, (importer.split(".")[0],))
    if _is_under(importer, ("coordinator",)) and _is_under(imported, SERVICES):
        return _is_under(importer, DEPLOYMENT)
    return True


def upward_imports(modules: Dict[str, ast.Module], known=None) -> List[str]:
    known = set(known if known is not None else SOURCES) | set(modules)
    found = []
    for module, tree in modules.items():
        for name, line in imports_of(module, tree):
            target = owner(name, known)
            if target is None or target == module:
                continue
            if not allowed(module, target):
                found.append(f"{module}:{line} imports {target}")
    return found


def import_graph(modules: Dict[str, ast.Module]) -> Dict[str, Set[str]]:
    known = set(SOURCES) | set(modules)
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    for module, tree in modules.items():
        for name, _ in imports_of(module, tree):
            target = owner(name, known)
            if target is not None and target != module and target in modules:
                graph[module].add(target)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def private_uses(modules: Dict[str, ast.Module]) -> List[str]:
    """`from m import _x`, `m._x` on an imported module of ours, and imports of a private module."""
    known = set(SOURCES) | set(modules)
    found = []
    for module, tree in modules.items():
        aliases: Dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if owner(base, known) is None:
                        continue
                    if full in known:
                        aliases[alias.asname or alias.name] = full
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{module}:{node.lineno} imports {full}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known:
                        aliases[alias.asname or alias.name] = alias.name
                        if any(p.startswith("_") and not p.startswith("__") for p in alias.name.split(".")):
                            found.append(f"{module}:{node.lineno} imports {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def repeated_file_names(paths) -> List[str]:
    by_name = collections.defaultdict(list)
    for path in paths:
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py" or rel.parts[:2] == ("steerspec", "v1"):
            continue
        if rel.name in SERVICE_FILE_NAMES and len(rel.parts) == 2 and rel.parts[0] in ("coordinator", *SERVICES):
            continue
        by_name[rel.name].append(str(rel))
    return [f"{name}: {', '.join(sorted(where))}" for name, where in sorted(by_name.items()) if len(where) > 1]


def unexplained_lazy_imports(sources: Dict[str, str]) -> List[str]:
    """Imports inside functions with no comment on their line or on a comment line right above their block."""
    found = []
    for module, text in sources.items():
        lines = text.splitlines()
        tree = ast.parse(text)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if "#" in lines[node.lineno - 1]:
                    continue
                above = node.lineno - 2  # walk up over the imports of the same block
                while above >= 0 and (lines[above].lstrip().startswith(("from ", "import ", ")"))
                                      or lines[above].rstrip().endswith(",")):
                    above -= 1
                if above < 0 or not lines[above].lstrip().startswith("#"):
                    found.append(f"{module}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return sorted(set(found))


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
    assert {"steerspec.decoding.engine", "steerspec.serving.store", "steerspec.serving.registration",
            "drafter_service.server", "verifier_service.server", "coordinator.loop", "steerspec.cli.run"} <= set(MODULES)


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "steerspec" and not any(_is_under(m, layer) for layer in LAYERS)] == []


def test_no_upward_imports():
    assert upward_imports(MODULES) == []


def test_no_import_cycles():
    assert cycles(import_graph(MODULES)) == []


def test_no_private_names_outside_their_module():
    assert private_uses(MODULES) == []


def test_every_file_name_is_used_once():
    assert repeated_file_names(SOURCES.values()) == []


def test_imports_inside_functions_say_why():
    sources = {m: SOURCES[m].read_text(encoding="utf-8") for m in MODULES}
    assert unexplained_lazy_imports(sources) == []


def test_no_environment_changes_at_import():
    assert environment_writes(MODULES) == []


@pytest.mark.parametrize("source, module, expected", [
    ("from coordinator.cli import parse_targets", "steerspec.serving.registration", "coordinator.cli"),
    ("def f():\n    import verifier_service.verify_sessions", "drafter_service.draft_sessions",
     "verifier_service.verify_sessions"),
    ("import importlib\nimportlib.import_module('coordinator.local')", "steerspec.decoding.engine", "coordinator.local"),
    ("from drafter_service import server", "coordinator.loop", "drafter_service.server"),
    ("from steerspec.serving.wire import WireBlock", "steerspec.decoding.engine", "steerspec.serving.wire"),
    ("from steerspec.bench.remote import run", "steerspec.cli.run", "steerspec.bench.remote"),
    ("from .server import serve", "verifier_service.cli", None),  # relative, same package: allowed
    ("from steerspec.serving.store import Store", "verifier_service.cli", None),
    ("from drafter_service.server import serve", "coordinator.local", None),  # a deployment module
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from coordinator.loop import SessionLoop",
     "steerspec.serving.wire", None),  # annotations only: never runs
])
def test_the_layer_check_catches_what_it_should(source, module, expected):
    found = upward_imports({module: ast.parse(source)})
    line = source.count(chr(10)) + 1
    assert found == ([] if expected is None else [f"{module}:{line} imports {expected}"])


def test_the_cycle_check_catches_a_cycle_through_a_function():
    modules = {"steerspec.models.a": ast.parse("from steerspec.models import b"),
               "steerspec.models.b": ast.parse("def f():\n    import steerspec.models.c  # lazy: x"),
               "steerspec.models.c": ast.parse("from steerspec.models.a import thing"),
               "steerspec.models.d": ast.parse("from steerspec.models.a import thing")}
    assert cycles(import_graph(modules)) == [["steerspec.models.a", "steerspec.models.b", "steerspec.models.c"]]


@pytest.mark.parametrize("source, bad", [
    ("from steerspec.models.kv import _rms", True),
    ("from steerspec.models import kv\nkv._rms(1)", True),
    ("import steerspec.models.kv as kv\nkv._rms(1)", True),
    ("from steerspec.models.kv import rms_normalize\nself = 1\nself._x = 2", False),
    ("from torch.nn.modules import module as m\nm._global_forward_hooks", False),  # not ours
])
def test_the_private_check_catches_what_it_should(source, bad):
    assert bool(private_uses({"steerspec.decoding.x": ast.parse(source)})) is bad


def test_the_name_check_allows_only_the_services_conventions():
    paths = [ROOT / p for p in ("coordinator/server.py", "drafter_service/server.py", "verifier_service/cli.py",
                                "steerspec/cli/__init__.py", "steerspec/policies/__init__.py")]
    assert repeated_file_names(paths) == []
    assert repeated_file_names([ROOT / "steerspec/bench/engine.py", ROOT / "steerspec/decoding/engine.py"]) == \
        ["engine.py: steerspec/bench/engine.py, steerspec/decoding/engine.py"]


@pytest.mark.parametrize("source, bad", [
    ("def f():\n    import torch\n", True),
    ("def f():\n    import torch  # lazy: only here\n", False),
    ("def f():\n    # lazy: transformers takes seconds\n    from transformers import A\n    from transformers import (\n"
     "        B,\n    )\n    import json\n", False),
    ("def f():\n    x = 1\n    # lazy: x\n    x = 2\n    import json\n", True),
    ("import json\n", False),
])
def test_the_lazy_import_check_catches_what_it_should(source, bad):
    assert bool(unexplained_lazy_imports({"steerspec.x": source})) is bad


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
