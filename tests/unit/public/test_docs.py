"""The docs' snippets can be pasted and run: every class they use is imported, and the
image forms docs/multimodal.md lists are the ones a message can carry."""

from __future__ import annotations

import ast
import builtins
import functools
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _snippets() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(DOCS.glob("*.md")):
        for k, m in enumerate(_BLOCK.finditer(path.read_text())):
            out.append((path.name, k, m.group(1)))
    return out


def _defined(tree: ast.AST) -> set[str]:
    names = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


@functools.cache
def _library_names() -> set[str]:
    """The public names of this package and of the LangChain modules snippets use."""
    import importlib

    names: set[str] = set()
    for module in (
        "langchain_llamacpp_local",
        "langchain_core.messages",
        "langchain_core.runnables",
        "langchain_core.tools",
        "langchain_core.documents",
        "langchain_core.prompts",
    ):
        mod = importlib.import_module(module)
        names.update(getattr(mod, "__all__", None) or dir(mod))
    return {n for n in names if n[:1].isupper()}


@pytest.mark.parametrize(("doc", "index", "code"), _snippets(), ids=lambda v: str(v)[:20])
def test_every_library_class_a_snippet_uses_is_imported(doc: str, index: int, code: str) -> None:
    """A snippet may leave a value to the reader (``docs``, ``Person``), but a class of
    this package or of LangChain it uses must be imported in it."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        pytest.skip("not a complete program")
    known = _defined(tree)
    used = {
        n.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id[:1].isupper()
    }
    missing = (used & _library_names()) - known
    assert not missing, f"{doc} snippet {index} uses {sorted(missing)} without importing it"


def test_multimodal_doc_lists_only_message_forms() -> None:
    """Bytes and PIL images cannot be put in a message; the doc must not offer them."""
    text = (DOCS / "multimodal.md").read_text()
    accepted = text[text.index("Accepted") :].split("\n- ", 1)[0]
    assert not re.search(r"raw bytes|bytes and PIL images", accepted), accepted
    assert "base64-encode" in accepted  # and says how to send them


REPO = DOCS.parent
PKG_DIR = REPO / "langchain_llamacpp_local"
#: Files named in the docs that belong to other projects (llama.cpp's scripts).
_FOREIGN_FILES = {"convert_lora_to_gguf.py"}


def _texts() -> list[tuple[str, str]]:
    paths = [*DOCS.glob("*.md"), REPO / "README.md", *PKG_DIR.rglob("*.py")]
    return [(str(p.relative_to(REPO)), p.read_text()) for p in sorted(paths)]


def test_every_file_the_docs_and_docstrings_name_exists() -> None:
    """``weights.py``, ``llama/draft.py``: a module renamed or split leaves no stale name."""
    existing = {p.name for p in REPO.rglob("*.py") if ".venv" not in p.parts}
    stale = sorted(
        f"{where}: {m.group(0)}"
        for where, text in _texts()
        for m in re.finditer(r"\b(\w+\.py)\b", text)
        if m.group(1) not in existing and m.group(1) not in _FOREIGN_FILES
    )
    assert stale == []


def test_every_module_a_docstring_cross_references_exists() -> None:
    """``:mod:`.sandbox```, ``:class:`~.host_ram.CachedPrompt```: the module part of a
    Sphinx cross-reference names a module of the package."""
    modules = {p.stem for p in PKG_DIR.rglob("*.py")} | {
        p.name for p in PKG_DIR.rglob("*") if p.is_dir()
    }
    stale = []
    for where, text in _texts():
        for m in re.finditer(r":mod:`~?\.([\w.]+)`", text):
            if m.group(1).split(".")[-1] not in modules:
                stale.append(f"{where}: {m.group(0)}")
        for m in re.finditer(r":(?:class|func|data|meth):`~?\.(\w+)\.[\w.]+`", text):
            if m.group(1) not in modules:
                stale.append(f"{where}: {m.group(0)}")
    assert stale == []


_SIZE = {"GiB": 1024**3, "MiB": 1024**2, "s": 1}


def _doc_default(text: str) -> object:
    """The value a configuration table's default column starts with, or ``...`` when it
    describes one in words (``trained context``, ``GGUF template``)."""
    m = re.match(r"(-?[\d.]+)(?: (GiB|MiB|s)\b)?|(None|True|False)\b", text.strip())
    if m is None:
        return ...
    if m.group(3):
        return {"None": None, "True": True, "False": False}[m.group(3)]
    number = float(m.group(1)) * _SIZE.get(m.group(2) or "s", 1)
    return int(number) if number.is_integer() else number


def test_the_configuration_table_gives_the_fields_defaults() -> None:
    """docs/configuration.md is a third place a default is written: it must say what the
    field (which takes it from the settings dataclasses) says."""
    from langchain_llamacpp_local import ChatLlamaCpp

    fields = ChatLlamaCpp.model_fields
    checked, wrong = 0, []
    for line in (DOCS / "configuration.md").read_text().splitlines():
        m = re.match(r"\| (`\w+`(?: / `\w+`)*) \| ([^|]+) \|", line)
        if m is None:
            continue
        names = re.findall(r"`(\w+)`", m.group(1))
        values = m.group(2).split(" / ") if len(names) > 1 else [m.group(2)]
        if len(values) == 1:  # one default for every field of the row
            values *= len(names)
        for name, text in zip(names, values, strict=True):
            expected = _doc_default(text)
            if expected is ... or name not in fields or name == "verbose":
                continue
            checked += 1
            if fields[name].default != expected:
                wrong.append(f"{name}: doc {text.strip()!r}, field {fields[name].default!r}")
    assert wrong == []
    assert checked >= 25
