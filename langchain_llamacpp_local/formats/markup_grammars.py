"""GBNF grammars for tool calls in a model's own markup (Qwen3-Coder, Seed-OSS, GLM 4.5+,
MiniMax M2, DeepSeek V3.1 and DSML, Kimi K2, Gemma 4, Ministral 3, Solar Open, Hunyuan Hy3,
MiniCPM5).

These families write a call as tags around each argument, or a name marker before a JSON
object, not as one JSON document. A forced call (``tool_choice="required"`` or a name)
is generated under a grammar in that same syntax, so the model writes what it was
trained on and the format's own parser reads it back; with ``tool_choice="auto"`` the
grammar is lazy and starts at the family's opening marker (as llama.cpp's ``common/chat``
builders do for these templates).

Argument values follow the parser's schema-aware typing
(:func:`~.tool_parsers.base.typed_value`): a parameter whose schema allows only strings
is raw text up to the closing tag (``enum``/``const`` as literals, ``minLength``/
``maxLength`` enforced, ``pattern`` not), every other one is JSON from llama-cpp-python's
schema converter (the same bounded conversion as the JSON formats).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.formats.base import _schema_types
from langchain_llamacpp_local.formats.families import SPECS
from langchain_llamacpp_local.llama.sampling import (
    MARKUP_CALL_FORMATS,
    GrammarTooLargeError,
    _Converter,
    _relocate,
    _tool_function,
    _tool_parameters,
    check_grammar,
)

__all__ = ["NotTagShaped", "markup_tool_call_grammar"]

_DSML = "｜DSML｜"


def _lit(text: str) -> str:
    """A GBNF string literal (UTF-8 kept raw: GBNF reads ``\\u`` escapes one code point
    at a time, so JSON's surrogate pairs would be wrong)."""
    return json.dumps(text, ensure_ascii=False)


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


@dataclass(frozen=True)
class _Syntax:
    """One family's call layout; ``arg`` gets (key, value rule, is raw string)."""

    #: whole output for the calls (rule of one call, parallel) -> GBNF expression
    block: Callable[[str, bool], str]
    #: (name literal, args expression) -> one call
    call: Callable[[str, str], str]
    arg: Callable[[str, str, bool], str] | None = None  # None: arguments are one JSON object
    closer: str = ""  # what ends a raw string value
    quote: str = ""  # around a raw string value (Gemma 4's <|"|>)
    sep: str = ""  # between arguments
    sorted_keys: bool = False  # the template writes arguments in key order
    #: a union with ``string`` is written as raw text (DSML marks JSON ones instead)
    raw_unions: bool = True


def _repeat(one: str, parallel: bool, sep: str = "") -> str:
    if not parallel:
        return one
    glue = f"{_lit(sep)} " if sep else ""
    return f"{one} ({glue}{one})*"


_SYNTAXES: dict[str, _Syntax] = {
    "qwen3_coder": _Syntax(
        block=lambda call, par: _repeat(f'"<tool_call>\\n" {call} "\\n</tool_call>"', par, "\n"),
        call=lambda name, args: f'"<function=" {name} ">\\n" {args} "</function>"',
        arg=lambda k, v, raw: f'"<parameter=" {_lit(k)} ">\\n" {v} "\\n</parameter>\\n"',
        closer="</parameter>",
    ),
    "seed_oss": _Syntax(
        block=lambda call, par: _repeat(
            f'"<seed:tool_call>\\n" {call} "\\n</seed:tool_call>"', par, "\n"
        ),
        call=lambda name, args: f'"<function=" {name} ">\\n" {args} "</function>"',
        arg=lambda k, v, raw: f'"<parameter=" {_lit(k)} ">" {v} "</parameter>\\n"',
        closer="</parameter>",
    ),
    "glm45": _Syntax(
        # GLM 4.5/4.6 put a newline before each tag, GLM 4.7 none: both are read
        block=lambda call, par: _repeat(f'"<tool_call>" {call} "</tool_call>"', par, "\n"),
        call=lambda name, args: f'{name} "\\n"? {args}',
        arg=lambda k, v, raw: (
            f'"<arg_key>" {_lit(k)} "</arg_key>" "\\n"? "<arg_value>" {v} "</arg_value>" "\\n"?'
        ),
        closer="</arg_value>",
    ),
    "minimax_m2": _Syntax(
        block=lambda call, par: (
            f'"<minimax:tool_call>\\n" {_repeat(call, par)} "</minimax:tool_call>"'
        ),
        call=lambda name, args: f'"<invoke name=\\"" {name} "\\">\\n" {args} "</invoke>\\n"',
        arg=lambda k, v, raw: f'"<parameter name=\\"" {_lit(k)} "\\">" {v} "</parameter>\\n"',
        closer="</parameter>",
    ),
    "deepseek_v3_2": _Syntax(
        # V3.2 writes function_calls, V4 tool_calls (same invoke syntax)
        block=lambda call, par: " | ".join(
            f"({_lit(f'<{_DSML}{tag}>' + chr(10))} {_repeat(call, par)} {_lit(f'</{_DSML}{tag}>')})"
            for tag in ("function_calls", "tool_calls")
        ),
        call=lambda name, args: (
            f"{_lit(f'<{_DSML}invoke name=' + chr(34))} {name} "
            f"{_lit(chr(34) + '>' + chr(10))} {args} {_lit(f'</{_DSML}invoke>' + chr(10))}"
        ),
        arg=lambda k, v, raw: (
            f"{_lit(f'<{_DSML}parameter name={json.dumps(k, ensure_ascii=False)} ')} "
            f'"string=\\"{"true" if raw else "false"}\\">" {v} '
            f"{_lit(f'</{_DSML}parameter>' + chr(10))}"
        ),
        closer=f"</{_DSML}parameter>",
        raw_unions=False,
    ),
    "kimi_k2": _Syntax(
        block=lambda call, par: (
            f'"<|tool_calls_section_begin|>" {_repeat(call, par)} "<|tool_calls_section_end|>"'
        ),
        call=lambda name, args: (
            f'"<|tool_call_begin|>functions." {name} ":" [0-9] [0-9]? '
            f'"<|tool_call_argument_begin|>" {args} "<|tool_call_end|>"'
        ),
    ),
    "gemma4": _Syntax(
        block=lambda call, par: _repeat(call, par),
        call=lambda name, args: f'"<|tool_call>call:" {name} "{{" {args} "}}<tool_call|>"',
        arg=lambda k, v, raw: f'{_lit(k)} ":" {v}',
        closer='<|"|>',
        quote='<|"|>',
        sep=",",
        sorted_keys=True,
    ),
    "ministral_3": _Syntax(
        block=lambda call, par: _repeat(call, par),
        call=lambda name, args: f'"[TOOL_CALLS]" {name} "[ARGS]" {args}',
    ),
    "deepseek_v3_1": _Syntax(
        block=lambda call, par: (
            f'"<｜tool▁calls▁begin｜>" {_repeat(call, par)} "<｜tool▁calls▁end｜>"'
        ),
        call=lambda name, args: (
            f'"<｜tool▁call▁begin｜>" {name} "<｜tool▁sep｜>" {args} "<｜tool▁call▁end｜>"'
        ),
    ),
    "solar_open": _Syntax(
        block=lambda call, par: _repeat(call, par),
        call=lambda name, args: (
            f'"<|tool_call:begin|>" [a-zA-Z0-9]{{1,12}} "<|tool_call:name|>" {name} '
            f'"<|tool_call:args|>" {args} "<|tool_call:end|>"'
        ),
    ),
    "hy3": _Syntax(
        block=lambda call, par: (
            f'"<tool_calls:opensource>\\n" {_repeat(call, par)} "</tool_calls:opensource>"'
        ),
        call=lambda name, args: (
            f'"<tool_call:opensource>" {name} "<tool_sep:opensource>\\n" {args} '
            '"</tool_call:opensource>\\n"'
        ),
        arg=lambda k, v, raw: (
            f'"<arg_key:opensource>" {_lit(k)} "</arg_key:opensource>\\n" '
            f'"<arg_value:opensource>" {v} "</arg_value:opensource>\\n"'
        ),
        closer="</arg_value:opensource>",
    ),
    "minicpm5": _Syntax(
        block=lambda call, par: _repeat(call, par, "\n"),
        call=lambda name, args: f'"<function name=\\"" {name} "\\">" {args} "</function>"',
        arg=lambda k, v, raw: f'"<param name=\\"" {_lit(k)} "\\">" {v} "</param>"',
        closer="</param>",
    ),
}

assert _SYNTAXES.keys() == MARKUP_CALL_FORMATS.keys()


class NotTagShaped(ValueError):
    """A tool whose arguments cannot be written one tag each (no ``properties``)."""


def _raw_string(schema: dict[str, Any], syn: _Syntax) -> str:
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
    parallel: bool = True,
    name: str | None = None,
    prefill: str = "",
) -> str:
    """GBNF (root ``root``) forcing a call of one of ``tools`` (only ``name`` if given;
    several if ``parallel``) in ``fmt``'s own markup (a key of :data:`MARKUP_CALL_FORMATS`).

    ``prefill`` is the end of the prompt: when the template's generation prompt leaves
    the family's think block open (MiniMax M2 always opens ``<think>``), the grammar
    closes it first, as a call inside the reasoning would be read as reasoning.
    """
    syn = _SYNTAXES[fmt]
    fns = [_tool_function(t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names tool {name!r}, which is not among the tools")
    if not fns:
        raise ValueError("tool_call_grammar needs at least one tool")

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
            types = _schema_types(raw_props.get(key))  # what the parser types it as
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
    spec = SPECS.get(fmt)
    markers = spec.think if spec is not None else None
    if not markers or not markers[0] or not prefill.rstrip().endswith(markers[0].rstrip()):
        return ""
    return f'{_lit(markers[1])} "\\n"? "\\n"? '


def _convert_values(values: dict[str, Any], defs: dict[str, Any]) -> str:
    """GBNF rules for JSON values, one rule per key of ``values`` (named by that key),
    from one converter run so shared rules are written once."""
    if not values:
        return ""
    try:
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
    except GrammarTooLargeError as exc:
        raise GrammarTooLargeError(f"cannot convert JSON schema to a grammar: {exc}") from None
    except RecursionError:
        raise ValueError("cannot convert JSON schema to a grammar: it nests too deeply") from None
    except (AssertionError, KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ValueError(f"cannot convert JSON schema to a grammar: {exc}") from exc
    return grammar
