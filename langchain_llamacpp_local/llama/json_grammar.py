"""JSON schema -> GBNF grammars for structured output, and the bounds every grammar is
checked against before llama.cpp parses it.

:func:`json_schema_to_grammar` and :data:`JSON_OBJECT_GRAMMAR` build on llama-cpp-python's
JSON-schema converter (the tool-call grammars of
:mod:`~langchain_llamacpp_local.formats.grammars` use it too).
"""

from __future__ import annotations

import contextlib
import copy
import re
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

from llama_cpp import llama_grammar as G

from langchain_llamacpp_local.errors import GrammarTooLargeError

# --------------------------------------------------------------------------- grammars

#: Any JSON object (json_mode).
JSON_OBJECT_GRAMMAR: str = G.JSON_GBNF

# JSON strings may not hold raw control characters; the bundled converter's rule
# allows them (newer llama.cpp excludes them, as here).
_CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
# A number's exponent has at most two digits: the bundled rule allows up to 16, and
# 1e999 is JSON no parser reads back as a finite number.
_NUMBER_RULE = '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? [0-9] [0-9]?)? space'
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "$id",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",
    }
)
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "not",
    "contains",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_LOCAL_DEF_REF = re.compile(r"^#/(\$defs|definitions)/([^/]+)(.*)$")


#: Largest count llama.cpp's GBNF parser takes in ``x{m,n}`` (its MAX_REPETITION_THRESHOLD
#: is 2000; above it a max silently becomes "unbounded"). Bigger counts are written as
#: chunks of this size.
_REP_CHUNK = 1000
#: Largest count a schema may ask for (``maxLength``, ``maxItems``, ``{m,n}``): two
#: levels of chunks.
MAX_GRAMMAR_REPETITION = _REP_CHUNK * _REP_CHUNK
#: Bounds checked on every grammar before llama.cpp parses it: its parser recurses once
#: per nested group (deep nesting overflows the C stack) and expands each ``{m,n}``
#: into up to ``n`` rules.
MAX_GRAMMAR_DEPTH = 200
MAX_GRAMMAR_RULES = 200_000
MAX_GRAMMAR_CHARS = 4_000_000


def _repeat(item: str, lo: int, hi: int | None, *, literal: bool = False) -> str:
    """GBNF for ``item`` repeated ``lo``..``hi`` times (``hi`` None: unbounded), flat.

    Written with ``{m,n}`` quantifiers as llama.cpp's own json-schema-to-grammar does,
    never as nested optional groups (20 000 of those overflow the parser's C stack).
    Counts above :data:`_REP_CHUNK` are split into exact chunks so every bound is
    enforced exactly.
    """
    for n in (lo, hi):
        if n is not None and n > MAX_GRAMMAR_REPETITION:
            raise GrammarTooLargeError(
                f"a repetition count of {n} is above the {MAX_GRAMMAR_REPETITION} a grammar "
                "can enforce"
            )
    if literal:
        item = f"({item})"
    c = _REP_CHUNK

    def exact(n: int) -> str:
        if n <= c:
            return f"{item}{{{n}}}" if n else ""
        q, r = divmod(n, c)
        return f"({item}{{{c}}}){{{q}}}" + (f" {item}{{{r}}}" if r else "")

    def at_most(m: int) -> str:
        if m <= c:
            return f"{item}{{0,{m}}}" if m else ""
        q, r = divmod(m, c)
        # m = q*c + r: fewer than q full chunks and a partial one, or q chunks and <= r.
        head = (
            f"({item}{{{c}}}){{0,{q - 1}}} {item}{{0,{c - 1}}}"
            if q > 1
            else (f"{item}{{0,{c - 1}}}")
        )
        tail = f" {item}{{0,{r}}}" if r else ""
        return f"(({head}) | ({item}{{{c}}}){{{q}}}{tail})"

    if hi is None:
        return f"{exact(lo)} {item}*".strip()
    if hi < lo:
        raise GrammarTooLargeError(f"a repetition of {lo}..{hi} items matches nothing")
    return f"{exact(lo)} {at_most(hi - lo)}".strip()


def _flat_repetition(
    item_rule: str,
    min_items: int,
    max_items: int | None,
    separator_rule: str | None = None,
    item_rule_is_literal: bool = False,
) -> str:
    """Drop-in for llama-cpp-python's ``_build_repetition`` that writes flat GBNF."""
    lo = int(min_items or 0)
    hi = None if max_items is None else int(max_items)
    if lo < 0 or (hi is not None and hi < 0):
        raise GrammarTooLargeError(f"negative repetition bounds {lo}..{hi}")
    if hi == 0:
        return ""
    if not separator_rule:
        return _repeat(item_rule, lo, hi, literal=item_rule_is_literal)
    rest = _repeat(
        f"({separator_rule} {item_rule})", max(lo - 1, 0), None if hi is None else hi - 1
    )
    seq = f"{item_rule} {rest}".strip()
    return seq if lo > 0 else f"({seq})?"


def _rebind(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a converter method) seeing :func:`_flat_repetition` as ``_build_repetition``,
    without patching llama-cpp-python's module for everyone else."""
    scope = dict(fn.__globals__)
    scope["_build_repetition"] = _flat_repetition
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    return out


def check_grammar(grammar: str) -> None:
    """Refuse a GBNF grammar that could crash or exhaust llama.cpp's grammar parser.

    Checks nesting depth (the parser recurses per group), total size and the rules
    ``{m,n}`` quantifiers expand to; raises :class:`GrammarTooLargeError`.
    """
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLargeError(
            f"grammar of {len(grammar)} characters is over the {MAX_GRAMMAR_CHARS} limit"
        )
    depth = max_depth = 0
    rules = 0
    i, n = 0, len(grammar)
    while i < n:
        ch = grammar[i]
        if ch == '"' or ch == "[":
            end = '"' if ch == '"' else "]"
            i += 1
            while i < n and grammar[i] != end:
                i += 2 if grammar[i] == "\\" else 1
        elif ch == "#":
            while i < n and grammar[i] != "\n":
                i += 1
        elif ch == "(":
            depth += 1
            max_depth = max(max_depth, depth)
        elif ch == ")":
            depth -= 1
        elif ch == "{":
            j = grammar.find("}", i)
            counts = [int(x) for x in re.findall(r"\d+", grammar[i:j])] if j > 0 else []
            rules += max(counts, default=0)
            i = max(j, i)
        i += 1
    if max_depth > MAX_GRAMMAR_DEPTH:
        raise GrammarTooLargeError(
            f"grammar nests {max_depth} groups deep, over the {MAX_GRAMMAR_DEPTH} limit "
            "(llama.cpp's parser would overflow its stack)"
        )
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarTooLargeError(
            f"grammar repetitions expand to about {rules} rules, over the {MAX_GRAMMAR_RULES} "
            "limit (lower maxLength/maxItems or {m,n} counts)"
        )


class SchemaConverter(G.SchemaConverter):
    """llama-cpp-python's converter with fixes that keep its output valid JSON:
    backslashes in literals are escaped (a const like ``"a\\\\b"``), strings and
    a pattern's ``.`` exclude raw quotes, backslashes and control characters, and a
    number's exponent keeps it finite.

    Repetitions (``maxLength``, ``maxItems``, regex ``{m,n}``) are written flat with
    ``{m,n}`` quantifiers (see :func:`_flat_repetition`), and a count too large to
    enforce is an error naming the rule it belongs to.
    """

    _visit = _rebind(G.SchemaConverter.visit)
    _visit_pattern = _rebind(G.SchemaConverter._visit_pattern)

    def visit(self, schema: Any, name: str) -> str:
        try:
            return self._visit(schema, name)
        except GrammarTooLargeError as exc:
            if getattr(exc, "where", None) is None:
                field = name.rsplit("-", 1)[-1] if name else "(root)"
                new = GrammarTooLargeError(f"field {field!r} (rule {name or 'root'!r}): {exc}")
                new.where = name  # type: ignore[attr-defined]
                raise new from None
            raise

    def _format_literal(self, literal: str) -> str:
        escaped = re.sub(
            r'[\r\n"\\]',
            lambda m: {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}[m.group(0)],
            literal,
        )
        return f'"{escaped}"'

    def _add_rule(self, name: str, rule: str) -> str:
        if name == "dot":  # a pattern's "." inside a JSON string: any JSON string char
            rule = _CHAR_RULE
        return super()._add_rule(name, rule)

    def _add_primitive(self, name: str, rule: Any) -> str:
        if name == "char" and rule is G.PRIMITIVE_RULES["char"]:
            rule = G.BuiltinRule(_CHAR_RULE, [])
        if name == "number" and rule is G.PRIMITIVE_RULES["number"]:
            rule = G.BuiltinRule(_NUMBER_RULE, ["integral-part", "decimal-part"])
        return super()._add_primitive(name, rule)


def _map_schema(node: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """Apply ``fn`` bottom-up to every subschema (schema-aware: property names and
    const/enum values are never mistaken for keywords)."""
    if node is True:
        node = {}
    if node is False:
        raise ValueError("a `false` schema (matches nothing) cannot be generated")
    if not isinstance(node, dict):
        raise ValueError(f"a schema must be an object, got {node!r}")
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _map_schema(v, fn) for k, v in out[key].items()}
    for key in _SCHEMA_VALUES:  # booleans here are left to the converter
        if isinstance(out.get(key), dict):
            out[key] = _map_schema(out[key], fn)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_map_schema(v, fn) for v in out[key]]
    return fn(out)


_ANY_VALUE = {"type": ["object", "array", "string", "number", "boolean", "null"]}
_CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r"}
# The pattern constrains the decoded string, but the grammar writes JSON text: a
# quote or backslash must come out escaped, and control characters never raw.
_JSON_UNSAFE = "\\x22\\x5C\\x00-\\x1F\\x7F"
_JSON_ESCAPED = {"\\": "([\\x5C][\\x5C])", '"': "([\\x5C][\\x22])"}


def _normalize_pattern(pattern: str) -> str:
    """Make a JSON-schema regex digestible for the converter and safe for JSON text.

    Anchors it (a full match also satisfies the unanchored search JSON schema
    means), expands ``\\d \\w \\s`` and escaped metacharacters (GBNF has no such
    escapes), writes literal quotes/backslashes as JSON escapes and keeps negated
    classes from producing raw quotes, backslashes or control characters.
    Positive classes that contain a quote or backslash are not rewritten.
    """
    if not (pattern.startswith("^") and pattern.endswith("$")):
        core = pattern[1:] if pattern.startswith("^") else pattern
        if core.endswith("$") and not core.endswith("\\$"):
            core = core[:-1]
        pattern = f"^({core})$"
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e in _CLASS_ESCAPES:
                out.append(_CLASS_ESCAPES[e] if in_class else f"[{_CLASS_ESCAPES[e]}]")
            elif e.lower() in _CLASS_ESCAPES and not in_class:
                out.append(f"[^{_CLASS_ESCAPES[e.lower()]}{_JSON_UNSAFE}]")
            elif e in _JSON_ESCAPED and not in_class:
                out.append(_JSON_ESCAPED[e])
            elif not (
                e.isascii() and e.isalnum()
            ):  # an escaped metachar: GBNF only knows it as a code
                code = f"\\x{ord(e):02X}" if ord(e) < 0x80 else f"\\u{ord(e):04X}"
                out.append(code if in_class else f"[{code}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            if pattern.startswith("[^", i):
                out.append("[^" + _JSON_UNSAFE)
                i += 2
                continue
        elif c == "]" and in_class:
            in_class = False
        elif c == '"' and not in_class:
            c = _JSON_ESCAPED['"']
        out.append(c)
        i += 1
    return "".join(out)


def _simplify(node: dict[str, Any]) -> dict[str, Any]:
    """Drop keywords that do not constrain output (so ``{"title": "X"}`` is any value),
    unwrap a single ``allOf`` (older pydantic wraps ``$ref`` in it) and normalize
    ``pattern``."""
    node = {k: v for k, v in node.items() if k not in _ANNOTATIONS}
    if not node:
        return dict(_ANY_VALUE)
    if isinstance(node.get("pattern"), str):
        node["pattern"] = _normalize_pattern(node["pattern"])
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and "properties" not in node:
        rest = {k: v for k, v in node.items() if k != "allOf"}
        node = {**rest, **all_of[0]}
    if "type" in node and not isinstance(node["type"], (str, list)):
        raise ValueError(f"'type' must be a string or a list, got {node['type']!r}")
    return node


def _unescape_pointer(token: str) -> str:
    return unquote(token).replace("~1", "/").replace("~0", "~")


#: Deepest nesting of objects/arrays a JSON schema may have (each schema level is
#: about two: ``properties`` and the property's schema). Deeper ones would exhaust
#: Python's recursion limit in the converter, or llama.cpp's parser stack.
MAX_SCHEMA_NESTING = 128


def nesting_depth(value: Any) -> int:
    """How many objects/arrays deep ``value`` nests (measured without recursion, so a
    value nested past Python's recursion limit is measured too)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def check_schema_nesting(schema: Any) -> None:
    """Refuse a schema nested deeper than :data:`MAX_SCHEMA_NESTING` (measured without
    recursion, so the check itself cannot overflow)."""
    if nesting_depth(schema) > MAX_SCHEMA_NESTING:
        raise GrammarTooLargeError(
            f"JSON schema nests more than {MAX_SCHEMA_NESTING} objects/arrays deep"
        )


def relocate_schema(schema: Any, prefix: str, defs_out: dict[str, Any]) -> dict[str, Any]:
    """Move ``schema``'s ``$defs``/``definitions`` into ``defs_out`` under unique,
    GBNF-safe names starting with ``prefix`` and rewrite its local ``$ref``s.

    The converter names a referenced rule after the last path segment, so
    def names must be unique across everything combined into one grammar and may
    only hold ``[a-zA-Z0-9-]``; refs to ``#`` itself are pointed at a copy of the
    schema stored as a def.
    """
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"a schema must be an object, got {schema!r}")
    check_schema_nesting(schema)
    renames: dict[tuple[str, str], str] = {}
    raw_defs: dict[str, Any] = {}
    for section in ("$defs", "definitions"):
        defs = schema.get(section) or {}
        if not isinstance(defs, dict):
            raise ValueError(f"'{section}' must be an object")
        for key, value in defs.items():
            base = prefix + (G.INVALID_RULE_CHARS_RE.sub("-", key).strip("-") or "def")
            new, i = base, 1
            while new in defs_out or new in raw_defs:
                new, i = f"{base}{i}", i + 1
            renames[(section, key)] = new
            raw_defs[new] = value
    self_name = prefix + "self"
    uses_self = False

    def rewrite(node: dict[str, Any]) -> dict[str, Any]:
        nonlocal uses_self
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return node
        if m := _LOCAL_DEF_REF.match(ref):
            new = renames.get((m.group(1), _unescape_pointer(m.group(2))))
            if new is None:
                raise ValueError(f"$ref {ref!r} points to a missing definition")
            return {**node, "$ref": f"#/$defs/{new}{m.group(3)}"}
        if ref == "#" or ref.startswith("#/"):
            uses_self = True
            return {**node, "$ref": f"#/$defs/{self_name}{ref[1:]}"}
        raise ValueError(f"unsupported $ref {ref!r}: only local refs ('#/...') are allowed")

    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    # Two passes: simplifying may hoist an already-visited $ref out of an allOf.
    body = _map_schema(_map_schema(body, _simplify), rewrite)
    for new, value in raw_defs.items():
        defs_out[new] = _map_schema(_map_schema(value, _simplify), rewrite)
    if uses_self:
        defs_out[self_name] = body
    return body


@contextlib.contextmanager
def converting() -> Iterator[None]:
    """Schema conversion failures as a ``ValueError`` naming the problem."""
    try:
        yield
    except GrammarTooLargeError as exc:
        raise GrammarTooLargeError(f"cannot convert JSON schema to a grammar: {exc}") from None
    except RecursionError:
        raise ValueError("cannot convert JSON schema to a grammar: it nests too deeply") from None
    except (AssertionError, KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ValueError(f"cannot convert JSON schema to a grammar: {exc}") from exc


def convert_schema(root: dict[str, Any], defs: dict[str, Any], root_name: str = "") -> str:
    """Run the converter on ``root`` (with ``defs`` as its ``$defs``)."""
    with converting():
        schema = copy.deepcopy(root)
        if defs:
            schema["$defs"] = copy.deepcopy(defs)
        conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        schema = conv.resolve_refs(schema, "")
        conv.visit(schema, root_name)
        grammar = conv.format_grammar()
    check_grammar(grammar)
    return grammar


def json_schema_to_grammar(schema: dict[str, Any]) -> str:
    """GBNF (root rule ``root``) for JSON documents matching ``schema``.

    ``$defs``/``definitions`` refs are resolved (pydantic schemas), ``enum``,
    ``const``, ``anyOf``, optional properties, arrays (``minItems``/``maxItems``),
    string lengths, ``pattern`` and common formats are enforced; numeric bounds are
    not. Raises ``ValueError`` naming the problem for schemas that cannot be
    converted (remote refs, ``false`` schemas, unknown types ...).
    """
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be a dict, got {type(schema).__name__}")
    defs: dict[str, Any] = {}
    body = relocate_schema(schema, "ref-", defs)
    return convert_schema(body, defs)
