"""GBNF grammars that force tool calls in each family's wire format.

A forced call (``tool_choice="required"`` or a name) is generated under a grammar in the
syntax the family's record (:mod:`.registry`) names, so the model writes what it was
trained on and the format's own parser reads it back; with ``tool_choice="auto"`` the
grammar is lazy and starts at the family's trigger markers (as llama.cpp's
``common/chat`` builders do). Two kinds:

- :class:`~.registry.JsonCalls`: calls as JSON documents after an opening marker, from
  llama-cpp-python's schema converter (:mod:`~langchain_llamacpp_local.llama.sampling`);
- :class:`~.registry.Markup`: the model's own markup around each argument, or a name
  marker before a JSON object (Qwen3-Coder, Seed-OSS, GLM 4.5+, MiniMax M2, DeepSeek
  V3.1 and DSML, Kimi K2, Gemma 4, Ministral 3, Solar Open, Hunyuan Hy3, MiniCPM5).
  Argument values follow the parser's schema-aware typing
  (:func:`~.base.typed_value`): a parameter whose schema allows only strings is raw
  text up to the closing tag (``enum``/``const`` as literals, ``minLength``/
  ``maxLength`` enforced, ``pattern`` not), every other one is JSON from the same
  bounded schema conversion as the JSON formats.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from langchain_llamacpp_local.formats.base import schema_types
from langchain_llamacpp_local.formats.grammar_shapes import (
    Calls,
    JsonCalls,
    Markup,
    gbnf_literal,
    more_calls,
)
from langchain_llamacpp_local.formats.registry import FAMILIES
from langchain_llamacpp_local.llama.json_grammar import (
    SchemaConverter as _Converter,
)
from langchain_llamacpp_local.llama.json_grammar import (
    check_grammar,
    converting,
)
from langchain_llamacpp_local.llama.json_grammar import (
    convert_schema as _convert,
)
from langchain_llamacpp_local.llama.json_grammar import (
    relocate_schema as _relocate,
)

__all__ = [
    "NotTagShaped",
    "either_grammar",
    "markup_tool_call_grammar",
    "prefix_rules",
    "tool_call_grammar",
]

_lit = gbnf_literal


def _cls_char(c: str) -> str:
    return c if c.isalnum() else f"\\x{ord(c):02X}" if ord(c) < 0x80 else f"\\u{ord(c):04X}"


def _until_rules(closer: str) -> list[str]:
    """Rules ``raw-0``... for any text that does not contain ``closer``: one state per
    matched prefix of it (a string may hold ``<``, ``<<`` or a partial closer).

    Every closer here holds its first character once (``<``), so a mismatch goes back
    to state 0, or to 1 on that character. The text may end in any state: the closer
    that follows is then still its first occurrence.
    """
    assert len(closer) > 1 and closer[0] not in closer[1:], closer
    first = _cls_char(closer[0])
    rules = [f"raw-0 ::= ([^{first}] raw-0 | {_lit(closer[0])} raw-1)?"]
    for k in range(1, len(closer)):
        nxt = _cls_char(closer[k])
        alts = [f"{_lit(closer[0])} raw-1", f"[^{nxt}{first}] raw-0"]
        if k + 1 < len(closer):  # the last character would complete the closer
            alts.insert(0, f"{_lit(closer[k])} raw-{k + 1}")
        rules.append(f"raw-{k} ::= ({' | '.join(alts)})?")
    return rules


def _tool_function(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValueError(f"a tool must be a dict, got {type(tool).__name__}")
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"not an OpenAI function tool: {tool!r}")
    return fn


def _tool_parameters(fn: dict[str, Any]) -> Any:
    params = fn.get("parameters")
    if params is None or params == {}:
        return {"type": "object", "properties": {}}
    if (
        isinstance(params, dict)
        and "properties" not in params
        and not params.get("additionalProperties")
        and params.get("type", "object") == "object"
        and not any(k in params for k in ("anyOf", "oneOf", "allOf", "$ref"))
    ):
        # {"type": "object"} alone: the tool takes no arguments.
        return {**params, "properties": {}}
    return params


def tool_call_grammar(
    tools: Sequence[dict[str, Any]],
    fmt: str,
    *,
    parallel: Calls = True,
    name: str | None = None,
    prefill: str = "",
) -> tuple[str, str]:
    """GBNF forcing a valid call (or several: ``parallel`` True for any number, an int
    ``n`` for at most ``n``) of one of ``tools``
    (OpenAI tool dicts), restricted to ``name`` if given, in wire format ``fmt``.

    Returns ``(grammar, fmt_used)``; a format whose record has no grammar falls back to
    ``"generic"``, which the caller must then parse. ``prefill`` (the end of the prompt)
    lets a :class:`~.registry.Markup` grammar close a think block the prompt left open.
    """
    family = FAMILIES.get(fmt)
    shape = family.grammar if family is not None else None
    if isinstance(shape, Markup):
        try:
            grammar = markup_tool_call_grammar(
                tools, fmt, parallel=parallel, name=name, prefill=prefill
            )
            return grammar, fmt
        except NotTagShaped:  # e.g. free-form ``additionalProperties`` arguments
            shape = None
    if shape is None:
        fmt, shape = "generic", FAMILIES["generic"].grammar
    assert isinstance(shape, JsonCalls)
    return _json_calls_grammar(tools, shape, parallel=parallel, name=name), fmt


def _chosen_functions(tools: Sequence[dict[str, Any]], name: str | None) -> list[dict[str, Any]]:
    """The tools' function dicts, only ``name`` if given (ValueError when none is left)."""
    fns = [_tool_function(t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names tool {name!r}, which is not among the tools")
    if not fns:
        raise ValueError("tool_call_grammar needs at least one tool")
    return fns


def _json_calls_grammar(
    tools: Sequence[dict[str, Any]], shape: JsonCalls, *, parallel: Calls, name: str | None
) -> str:
    fns = _chosen_functions(tools, name)
    defs: dict[str, Any] = {}
    alternatives = []
    seen: set[str] = set()
    for i, fn in enumerate(fns):
        if fn["name"] in seen:
            continue
        seen.add(fn["name"])
        try:
            params = _relocate(_tool_parameters(fn), f"t{i}-", defs)
        except ValueError as exc:
            raise ValueError(f"tool {fn['name']!r}: {exc}") from exc
        if shape.call == "name_key":  # {"NAME": {arguments}}
            alternatives.append(
                {"type": "object", "properties": {fn["name"]: params}, "required": [fn["name"]]}
            )
        elif shape.call == "cohere":
            alternatives.append(
                {
                    "type": "object",
                    "properties": {
                        "tool_call_id": {"enum": [str(i) for i in range(10)]},
                        "tool_name": {"const": fn["name"]},
                        "parameters": params,
                    },
                    "required": ["tool_call_id", "tool_name", "parameters"],
                }
            )
        else:
            key = shape.args_key
            alternatives.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, key: params},
                    "required": ["name", key],
                }
            )
    call: dict[str, Any] = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}

    lit = json.dumps  # a GBNF string literal is a JSON string literal
    at_most = None if parallel is True else 1 if parallel is False else max(int(parallel), 1)
    if shape.shape == "document":
        key = "tool_calls" if at_most != 1 else "tool_call"
        value: dict[str, Any] = call
        if at_most != 1:
            value = {"type": "array", "items": call, "minItems": 1}
            if at_most is not None:
                value["maxItems"] = at_most
        doc = {"type": "object", "properties": {key: value}, "required": [key]}
        return _convert(doc, defs)
    if shape.shape == "each":  # every call wrapped in the opening and closing markers
        parts = [lit(shape.opening)] if shape.opening else []
        parts += ["call", lit(shape.closing)] if shape.closing else ["call"]
        one = " ".join(parts)
        root = f"root ::= {one}{more_calls(f'{lit(shape.sep)} {one}', parallel)}"
        return f"{root}\n{_convert(call, defs, 'call')}"
    if shape.shape == "list":
        doc = {"type": "array", "items": call, "minItems": 1}
        if at_most is not None:
            doc["maxItems"] = at_most
        rules = _convert(doc, defs, "calls")
        body = "calls"
    else:
        rules = _convert(call, defs, "call")
        sep = '"\\n"' if shape.shape == "lines" else lit(shape.opening)
        body = f"call{more_calls(f'{sep} call', parallel)}"
    closing_rule = f" {lit(shape.closing)}" if shape.closing else ""
    return f"root ::= {lit(shape.opening)} {body}{closing_rule}\n{rules}"


class NotTagShaped(ValueError):
    """A tool whose arguments cannot be written one tag each (no ``properties``)."""


def _raw_string(schema: dict[str, Any], syn: Markup) -> str:
    """A string-only value as the raw text the template writes."""
    values = schema.get("enum")
    if "const" in schema:
        values = [schema["const"]]
    q = f"{_lit(syn.quote)} " if syn.quote else ""
    end = f" {_lit(syn.quote)}" if syn.quote else ""
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return f"{q}({' | '.join(_lit(v) for v in values)}){end}"
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        lo = lo if isinstance(lo, int) and lo > 0 else 0
        bound = f"{{{lo},{hi}}}" if isinstance(hi, int) else f"{{{lo},}}"
        return f"{q}[^{_cls_char(syn.closer[0])}]{bound}{end}"
    return f"{q}raw-0{end}"


def _deref(schema: Any, root: Any) -> Any:
    """``schema`` with a local ``#/$defs/X`` (or ``definitions``) reference followed."""
    for _ in range(8):
        if isinstance(schema, dict) and isinstance(schema.get("allOf"), list):
            if len(schema["allOf"]) == 1:
                schema = schema["allOf"][0]
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        schema = node
    return schema


def _string_enum(schema: Any) -> list[str] | None:
    """The words of a string-only ``enum``/``const`` none of which reads as JSON: raw text
    the parser keeps as the string whether or not it sees the schema (a ``$ref``)."""
    if not isinstance(schema, dict):
        return None
    words = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(words, list) or not words or not all(isinstance(w, str) for w in words):
        return None
    for w in words:
        try:
            json.loads(w)
        except ValueError:
            continue
        return None
    return words


def _args_expr(items: list[str], required: list[bool], sep: str) -> str:
    """The arguments in order, optional ones skippable, ``sep`` between those written."""
    if not items:
        return ""
    if not sep:
        return " ".join(it if req else f"({it})?" for it, req in zip(items, required, strict=True))
    # with a separator: the first argument written has none before it
    glue = f"{_lit(sep)} "
    rest = [
        f"{glue}{it}" if req else f"({glue}{it})?" for it, req in zip(items, required, strict=True)
    ]
    alts = []
    for j, (it, req) in enumerate(zip(items, required, strict=True)):
        alts.append(" ".join([it, *rest[j + 1 :]]))
        if req:
            break
    else:
        alts.append("")
    body = " | ".join(f"({a})" if a else "" for a in alts)
    return f"({body})"


def markup_tool_call_grammar(
    tools: Sequence[dict[str, Any]],
    fmt: str,
    *,
    parallel: Calls = True,
    name: str | None = None,
    prefill: str = "",
) -> str:
    """GBNF (root ``root``) forcing a call of one of ``tools`` (only ``name`` if given;
    several if ``parallel``) in ``fmt``'s own markup (a family with a :class:`~.registry.Markup` grammar).

    ``prefill`` is the end of the prompt: when the template's generation prompt leaves
    the family's think block open (MiniMax M2 always opens ``<think>``), the grammar
    closes it first, as a call inside the reasoning would be read as reasoning.
    """
    syn = FAMILIES[fmt].grammar
    assert isinstance(syn, Markup), fmt
    fns = _chosen_functions(tools, name)

    defs: dict[str, Any] = {}
    values: dict[str, Any] = {}  # converter rule name -> schema of a JSON value
    calls: list[str] = []
    seen: set[str] = set()
    for i, fn in enumerate(fns):
        if fn["name"] in seen:
            continue
        seen.add(fn["name"])
        raw_params = _tool_parameters(fn)
        try:
            params = _relocate(raw_params, f"t{i}-", defs)
        except ValueError as exc:
            raise ValueError(f"tool {fn['name']!r}: {exc}") from exc
        if syn.arg is None:  # one JSON object of arguments
            values[f"v{i}"] = params
            calls.append(syn.call(_lit(fn["name"]), f"v{i}"))
            continue
        props = params.get("properties")
        if not isinstance(props, dict) or any(
            k in params for k in ("anyOf", "oneOf", "allOf", "$ref")
        ):
            raise NotTagShaped(
                f"tool {fn['name']!r}: its parameters are not an object with 'properties', "
                f"which {fmt} writes one tag per argument"
            )
        raw_props = raw_params.get("properties") or {}
        required = set(params.get("required") or ())
        keys = sorted(props) if syn.sorted_keys else list(props)
        items, req = [], []
        for j, key in enumerate(keys):
            types = schema_types(raw_props.get(key))  # what the parser types it as
            raw = types is not None and types <= {"string"}
            words = _string_enum(_deref(raw_props.get(key), raw_params))
            if raw or words is not None:
                value = _raw_string(props[key] if raw else {"enum": words}, syn)
                raw = True
            elif types is not None and "string" in types and syn.raw_unions:
                value = _raw_string({}, syn)
            else:
                value = f"v{i}-{j}"
                values[value] = props[key]
            items.append(syn.arg(key, value, raw))
            req.append(key in required)
        args = _args_expr(items, req, syn.sep)
        calls.append(syn.call(_lit(fn["name"]), args or '""'))

    rules = _convert_values(values, defs)
    lines = [f"root ::= {_close_think(fmt, prefill)}{syn.block('call', parallel)}"]
    lines.append("call ::= " + " | ".join(f"({c})" for c in calls))
    if any("raw-0" in c for c in calls):
        lines.extend(_until_rules(syn.closer))
    grammar = "\n".join(lines) + ("\n" + rules if rules else "")
    check_grammar(grammar)
    return grammar


def _close_think(fmt: str, prefill: str) -> str:
    """The GBNF that first closes a think block the prompt left open, else nothing."""
    spec = FAMILIES[fmt].spec
    markers = spec.think if spec is not None else None
    if not markers or not markers[0] or not prefill.rstrip().endswith(markers[0].rstrip()):
        return ""
    return f'{_lit(markers[1])} "\\n"? "\\n"? '


def _convert_values(values: dict[str, Any], defs: dict[str, Any]) -> str:
    """GBNF rules for JSON values, one rule per key of ``values`` (named by that key),
    from one converter run so shared rules are written once."""
    if not values:
        return ""
    with converting():
        doc: dict[str, Any] = {"properties": copy.deepcopy(values)}
        if defs:
            doc["$defs"] = copy.deepcopy(defs)
        conv = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        doc = conv.resolve_refs(doc, "")
        aliases = []
        for key in values:
            got = conv.visit(doc["properties"][key], key)
            if got != key:
                aliases.append(f"{key} ::= {got}")
        grammar = "\n".join([conv.format_grammar(), *aliases])
    return grammar


def _gbnf_tokens(grammar: str) -> Iterator[tuple[str, str]]:
    """``grammar`` as (kind, text) pieces: ``word`` (a rule name where one may stand) and
    ``other`` (literals, character classes, counts, comments, operators, space)."""
    i, n = 0, len(grammar)
    while i < n:
        ch = grammar[i]
        j = i + 1
        if ch in '"[':
            end = '"' if ch == '"' else "]"
            while j < n and grammar[j] != end:
                j += 2 if grammar[j] == "\\" else 1
            j += 1
        elif ch == "#":
            while j < n and grammar[j] != "\n":
                j += 1
        elif ch == "{":
            j = grammar.find("}", i) + 1 or n
        elif ch.isalnum() or ch == "-":
            while j < n and (grammar[j].isalnum() or grammar[j] == "-"):
                j += 1
            yield "word", grammar[i:j]
            i = j
            continue
        yield "other", grammar[i:j]
        i = j


def prefix_rules(grammar: str, prefix: str) -> str:
    """``grammar`` with every rule it defines renamed ``prefix + name`` (its root too),
    so two grammars can be joined into one without their helper rules colliding."""
    defined = set(re.findall(r"^\s*([A-Za-z0-9-]+)\s*::=", grammar, re.M))
    return "".join(
        prefix + text if kind == "word" and text in defined else text
        for kind, text in _gbnf_tokens(grammar)
    )


def either_grammar(calls: str, answer: str) -> str:
    """GBNF (root ``root``) for tool calls (``calls``'s language) or an answer
    (``answer``'s): the two grammars' rules kept apart by prefixes."""
    return "\n".join(
        [
            "root ::= calls-root | answer-root",
            prefix_rules(calls, "calls-"),
            prefix_rules(answer, "answer-"),
        ]
    )
