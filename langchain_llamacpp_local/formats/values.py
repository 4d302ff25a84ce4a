"""Values written in a family's own notation, read as Python data.

Python literals (pythonic calls), MiniMax M3's nested tags and Gemma 4's ``<|"|>``
strings: the body readers read whole values with these, and the argument streams
(:mod:`.arg_stream`) read a closed value with the same code, so both agree.
"""

from __future__ import annotations

import ast
import json
import re

from langchain_llamacpp_local.formats.base import json_safe, typed_value


def py_literal(node: ast.AST) -> object:
    """``ast.literal_eval`` that also reads JSON's ``true``/``false``/``null``."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [py_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return [py_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking")
        return {py_literal(k): py_literal(v) for k, v in zip(node.keys, node.values, strict=False)}  # type: ignore[arg-type]
    return json_safe(ast.literal_eval(node))


#: MiniMax M3 writes this before each of its tags
MM_MARKER = "]<]minimax[>["
_MMQ = re.escape(MM_MARKER)
MM_PARAM = re.compile(rf"(?:{_MMQ})?<(?P<k>[\w.\-]+)>(?P<v>.*?)(?:{_MMQ})?</(?P=k)>", re.S)


def mm_value(text: str, types: set[str] | None) -> object:
    """A MiniMax M3 value: text, or nested ``<k>v</k>`` tags (``<item>`` ones make a list)."""
    if types is not None and "string" in types:
        return text  # a string-typed value stays text even when it looks structured
    children = list(MM_PARAM.finditer(text)) if "<" in text else []  # (a tag needs "<")
    if not children:
        return typed_value(text.strip(), types)
    if all(c.group("k") == "item" for c in children):
        return [mm_value(c.group("v"), None) for c in children]
    return {c.group("k"): mm_value(c.group("v"), None) for c in children}


#: Gemma 4's string quote (both ends)
GEMMA_QUOTE = '<|"|>'
#: a bare key of Gemma 4's argument notation
GEMMA_KEY = re.compile(r"([A-Za-z_][\w.\-]*)\s*:")


def gemma_value(text: str) -> object:
    """Gemma 4's argument notation: ``{key:<|"|>str<|"|>, n:1, l:[...]}`` -> Python data."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith(GEMMA_QUOTE, i):
            j = text.find(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
            if j < 0:
                raise ValueError("unterminated string")
            out.append(json.dumps(text[i + len(GEMMA_QUOTE) : j], ensure_ascii=False))
            i = j + len(GEMMA_QUOTE)
            continue
        m = GEMMA_KEY.match(text[i:])
        if m and (not out or out[-1].rstrip().endswith(("{", ","))):
            out.append(json.dumps(m.group(1)) + ":")
            i += m.end()
            continue
        out.append(text[i])
        i += 1
    return json.loads("".join(out))
