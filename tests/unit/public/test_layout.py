"""The package's layers, read from its source (docs/architecture.md).

Each subpackage may import only the layers below it, type-only imports (under
``if TYPE_CHECKING:``) included; ``llama/`` is the only code that imports ``llama_cpp``;
no two modules import each other, not even through an import inside a function; each
subpackage imports on its own in a fresh interpreter. The engine core (``runtime/``)
sits below the front end (``templates/``, ``formats/``, ``chat/``): the worker decodes
tokens and knows nothing of chat messages, templates or output formats.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import langchain_llamacpp_local

PKG = "langchain_llamacpp_local"
ROOT = Path(langchain_llamacpp_local.__file__).parent

# lowest first; a module may import its own layer and the ones before it
LAYERS = ("errors", "resolution", "llama", "cache", "runtime", "templates", "formats", "chat", "")
SUBPACKAGES = ("resolution", "llama", "cache", "runtime", "templates", "formats", "chat")
#: what the engine core's worker may never import (the front end's layers)
FRONT_END = ("chat", "templates", "formats")


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the checks of this module."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PKG, *parts])] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines under ``if TYPE_CHECKING:``: annotations only, never executed."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, *, type_only: bool = True) -> Iterator[tuple[str, int]]:
    """Every module ``name`` imports (function bodies included); with ``type_only``
    False, only those that run (not the ones under ``if TYPE_CHECKING:``)."""
    tree = _tree(path)
    skip = set() if type_only else _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, node.lineno
            for alias in node.names:  # `from pkg import module`
                yield f"{mod}.{alias.name}", node.lineno


@functools.cache
def _graph(*, type_only: bool = True) -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, _ in _imports(name, path, type_only=type_only):
            if target in mods and target != name:
                graph[name].add(target)
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return LAYERS.index(top) if top in LAYERS else LAYERS.index("")


@pytest.fixture(scope="module", autouse=True)
def alone_imports() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Every subpackage imported in its own fresh interpreter, all started at once with
    the module's first test (the source checks run meanwhile); each prints the package
    modules it ended up with."""
    procs = {}
    for sub in SUBPACKAGES:
        code = (
            f"import importlib, pkgutil, sys, {PKG}.{sub} as p\n"
            "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
            "    importlib.import_module(m.name)\n"
            f"print(*sorted(n for n in sys.modules if n.startswith('{PKG}.')))\n"
        )
        procs[sub] = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    yield procs
    for proc in procs.values():  # the tests that read them may have been deselected
        if proc.returncode is None:
            proc.kill()
            proc.communicate()


def test_only_llama_imports_llama_cpp() -> None:
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{line}"
        for name, path in _modules().items()
        if not name.startswith(f"{PKG}.llama.") and name != f"{PKG}.llama"
        for target, line in _imports(name, path)
        if target == "llama_cpp" or target.startswith("llama_cpp.")
    ]
    assert offenders == []


def test_layers_import_only_downwards() -> None:
    upward = [
        f"{src} -> {dst}"
        for src, targets in _graph().items()
        for dst in targets
        if _layer(dst) > _layer(src)
    ]
    assert upward == []


#: the engine core's modules that run the worker's steps; each is checked by name, so a
#: rename that drops one from the package fails here rather than going unchecked
ENGINE_CORE = (
    "worker",
    "loop",
    "active",
    "admission",
    "scheduler",
    "output",
    "verify",
    "speculative",
    "scoring",
    "stats",
    "step_cost",
    "requests",
    "channel",
    "registry",
)


def _runtime_modules() -> list[str]:
    return sorted(m for m in _modules() if m.startswith(f"{PKG}.runtime"))


def test_every_engine_core_module_is_in_the_runtime_layer() -> None:
    missing = [m for m in ENGINE_CORE if f"{PKG}.runtime.{m}" not in _modules()]
    assert missing == []
    assert all(_layer(m) == LAYERS.index("runtime") for m in _runtime_modules())


@pytest.mark.parametrize("name", _runtime_modules())
def test_the_worker_imports_nothing_of_the_front_end(name: str) -> None:
    """The engine core decodes token requests: no template, format or chat module, not
    even for a type, is imported by any module of ``runtime/`` (the worker, its step
    loop, admission, the scheduler, the output pipeline, verify, stats...)."""
    path = _modules()[name]
    front = [
        f"{target} (line {line})"
        for target, line in _imports(name, path)
        if any(target == f"{PKG}.{sub}" or target.startswith(f"{PKG}.{sub}.") for sub in FRONT_END)
    ]
    assert front == []


def test_no_import_circles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            # a package's __init__ re-exporting its own modules is not a circle
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_each_subpackage_imports_alone(
    sub: str, alone_imports: dict[str, subprocess.Popen[str]]
) -> None:
    """Imported first in a fresh interpreter, a subpackage and every module in it import
    without help, and bring in no module of a layer above (the package root imports its
    public names on first use, so importing one layer is not importing them all)."""
    stdout, stderr = alone_imports[sub].communicate(timeout=300)
    assert alone_imports[sub].returncode == 0, stderr
    loaded = stdout.split()
    assert f"{PKG}.{sub}" in loaded
    above = [m for m in loaded if _layer(m) > _layer(f"{PKG}.{sub}")]
    assert above == []


def _private_imports(path: Path, importer: str) -> Iterator[str]:
    """``module.name`` for each private name of the package that ``path`` imports."""
    tree = _tree(path)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module != PKG and not node.module.startswith(f"{PKG}."):
            continue
        for alias in node.names:
            private = alias.name.startswith("_") and not alias.name.startswith("__")
            if private:
                yield f"{importer}:{node.lineno} imports {node.module}.{alias.name}"


def test_no_private_name_is_imported_across_modules() -> None:
    """A name a module keeps to itself (``_x``) is no other module's to import, nor a
    test's: what another module or a test needs is public (the tests then test the
    package through names it owns up to)."""
    offenders = [hit for name, path in _modules().items() for hit in _private_imports(path, name)]
    tests_root = Path(__file__).resolve().parents[2]
    for path in sorted(tests_root.rglob("*.py")):
        offenders += _private_imports(path, str(path.relative_to(tests_root.parent)))
    assert offenders == []


def test_the_package_root_gives_every_public_name_and_module() -> None:
    """The root imports its public names on first use: each one is there, ``import *``
    gives them all, a module of the package is an attribute as a loaded one would be,
    and an unknown name is an ``AttributeError``."""
    names: dict[str, object] = {}
    exec(f"from {PKG} import *", names)
    assert set(langchain_llamacpp_local.__all__) <= set(names)
    assert set(langchain_llamacpp_local.__all__) <= set(dir(langchain_llamacpp_local))
    for name in langchain_llamacpp_local.__all__:
        assert getattr(langchain_llamacpp_local, name).__name__ == name
    assert langchain_llamacpp_local.chat_models.ChatLlamaCpp is names["ChatLlamaCpp"]
    assert langchain_llamacpp_local.rpc_server.__name__ == f"{PKG}.rpc_server"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = langchain_llamacpp_local.not_a_name  # type: ignore[attr-defined]


def test_validation_imports_nothing_of_chat() -> None:
    """The construction checks the three public classes share import no chat module,
    not even inside a function: a call option's check lives with the call options."""
    name = f"{PKG}.validation"
    chat = [
        f"{target} (line {line})"
        for target, line in _imports(name, _modules()[name])
        if target == f"{PKG}.chat" or target.startswith(f"{PKG}.chat.")
    ]
    assert chat == []


def test_the_embeddings_load_no_chat_code() -> None:
    """``LlamaCppEmbeddings`` needs no chat front end: the argument checks it shares with
    the chat model (``validation``) import nothing of ``chat/``."""
    code = (
        f"import sys, {PKG}.embeddings\n"
        f"print(*sorted(n for n in sys.modules if n.startswith('{PKG}.chat')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
