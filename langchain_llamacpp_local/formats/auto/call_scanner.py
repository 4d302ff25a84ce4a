"""Reading the calls of one learned tool region: the analysis' markers as patterns
(:func:`flex`) and :class:`CallScanner`, which walks a region's calls (tag + JSON
arguments or tag + tagged arguments) and says where the text ends inside one;
:func:`scan_tagged` reads a tool region with it."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from langchain_llamacpp_local.formats.auto.probes import TemplateAnalysis
from langchain_llamacpp_local.formats.base import (
    ParsedCall,
    json_arguments,
    schema_types,
    tool_schemas,
    typed_value,
)


def flex(marker: str) -> str:
    """Regex for a marker, tolerant of whitespace and of a changing number (``:0``, ``:1``)."""
    core = marker.strip()
    if not core:
        return ""
    parts = re.split(r'(\s+|\d+|="[^"<>]*")', core)
    out = []
    for p in parts:
        if not p:
            continue
        if p.isspace():
            out.append(r"\s*")
        elif p.isdigit():
            out.append(r"\d+")
        elif p.startswith('="'):
            out.append(r'="[^"<>]*"')  # an attribute value (DSML's string="true"/"false")
        else:
            out.append(re.escape(p))
    return "".join(out)


def tool_properties(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> {parameter -> JSON schema}."""
    out: dict[str, dict[str, Any]] = {}
    for name, params in tool_schemas(tools).items():
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[name] = dict(props) if isinstance(props, Mapping) else {}
    return out


def get_path(obj: Any, path: str) -> Any:
    for part in path.split(".") if path else ():
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


class _Incomplete(Exception):
    """The text ends inside a call (streaming): hold it back."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.name = name


class _Malformed(Exception):
    """The call does not follow the template's syntax."""


class CallScanner:
    """Reads the calls of one tool region with the analysis' markers."""

    def __init__(
        self, a: TemplateAnalysis, text: str, final: bool, tools: Sequence[Mapping[str, Any]] | None
    ):
        self.a = a
        self.text = text
        self.final = final
        self.schemas = tool_properties(tools)
        self.names = sorted(self.schemas, key=len, reverse=True)

    # ---- low-level matching
    def _ws(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos].isspace():
            pos += 1
        return pos

    def _at(self, pos: int, marker: str) -> int | None:
        """End of ``marker`` at ``pos`` (after whitespace); None if absent; raises
        _Incomplete when the text ends inside it (streaming)."""
        pat = flex(marker)
        if not pat:
            return pos
        p = self._ws(pos)
        m = re.compile(pat).match(self.text, p)
        if m:
            return m.end()
        rest = self.text[p:]
        if not self.final and (not rest or marker.strip().startswith(rest[: len(marker.strip())])):
            if len(rest) < len(marker.strip()):
                raise _Incomplete()
        return None

    def _need(self, pos: int, marker: str, what: str, name: str | None = None) -> int:
        try:
            end = self._at(pos, marker)
        except _Incomplete:
            raise _Incomplete(name) from None
        if end is None:
            if not self.final and self._ws(pos) >= len(self.text):
                raise _Incomplete(name)
            raise _Malformed(f"expected {marker.strip()!r} {what}")
        return end

    def _find(self, pos: int, marker: str) -> re.Match[str] | None:
        pat = flex(marker)
        return re.compile(pat).search(self.text, pos) if pat else None

    # ---- one call
    def _name_end(self) -> str:
        """Regex for what ends a function name: the name suffix, or a call id that
        the template writes between name and arguments (Mistral's ``[CALL_ID]``)."""
        a = self.a
        alts = [p for p in (flex(a.name_suffix),) if p]
        if a.call_id_position == "between_func_and_args" and a.call_id_prefix.strip():
            alts.append(flex(a.call_id_prefix))
        return "|".join(f"(?:{p})" for p in alts)

    def name(self, pos: int) -> tuple[str, int, str | None]:
        """(function name, position after it and its suffix, call id written next to it)."""
        a = self.a
        pos = self._need(pos, a.name_prefix, "before the function name")
        pos = self._ws(pos) if not a.name_prefix.strip() else pos
        ender = self._name_end()
        name: str | None = None
        for n in self.names:
            if self.text.startswith(n, pos):
                end = pos + len(n)
                if end >= len(self.text) and not self.final:
                    raise _Incomplete(None)  # a longer name may follow
                if end < len(self.text) and re.match(r"[\w.\-:/]", self.text[end]):
                    continue  # only the start of a longer name
                if not ender:
                    return n, end, None
                if re.compile(ender).match(self.text, self._ws(end)):
                    name, pos = n, self._ws(end)
                    break
                if not self.final and len(self.text) - end <= len(a.name_suffix.strip()):
                    raise _Incomplete(None)
        if name is None:
            if ender:
                m = re.compile(r"([^\s<>\[\]{}\"',()]+?)\s*(?=" + ender + ")").match(self.text, pos)
                if m:
                    name, pos = m.group(1), m.end()
                elif not self.final and re.fullmatch(
                    r"[^\s<>\[\]{}\"',()]*\s*\S{0,64}", self.text[pos:]
                ):
                    raise _Incomplete(None)
                else:
                    raise _Malformed("cannot read the function name")
            else:
                m = re.compile(r"[^\s<>\[\]{}\"',()]+").match(self.text, pos)
                if not m:
                    if not self.final and pos >= len(self.text):
                        raise _Incomplete(None)
                    raise _Malformed("cannot read the function name")
                if not self.final and m.end() >= len(self.text):
                    raise _Incomplete(None)
                return m.group(0), m.end(), None
        cid = None
        if a.call_id_position == "between_func_and_args" and a.call_id_prefix.strip():
            m = re.compile(flex(a.call_id_prefix)).match(self.text, pos)
            if m:
                stop = a.call_id_suffix if a.call_id_suffix.strip() else a.args_start
                e = self._find(m.end(), stop) if stop.strip() else None
                if e is None:
                    if not self.final:
                        raise _Incomplete(name)
                    raise _Malformed("unterminated call id")
                cid = self.text[m.end() : e.start()].strip()
                return name, (e.end() if a.call_id_suffix.strip() else e.start()), cid
        if a.name_suffix.strip():
            pos = self._need(pos, a.name_suffix, "after the function name", name)
        return name, pos, cid

    def json_args(self, pos: int, name: str) -> tuple[dict[str, Any], int]:
        a = self.a
        pos = self._need(pos, a.args_start, "before the arguments", name)
        p = self._ws(pos)
        try:
            val, end = json.JSONDecoder().raw_decode(self.text, p)
        except ValueError:
            if not self.final:
                raise _Incomplete(name) from None
            raise _Malformed("arguments are not valid JSON") from None
        args = json_arguments(val)
        if args is None:
            raise _Malformed("arguments are not a JSON object")
        end = self._need(end, a.args_end, "after the arguments", name)
        return args, end

    def tagged_args(self, pos: int, name: str) -> tuple[dict[str, Any], int]:
        a = self.a
        schema = self.schemas.get(name, {})
        has_schema = name in self.schemas
        args: dict[str, Any] = {}
        pos = self._need(pos, a.args_start, "before the arguments", name)
        key_pre, key_suf = flex(a.arg_name_prefix), flex(a.arg_name_suffix)
        val_pre, val_suf = flex(a.arg_value_prefix), flex(a.arg_value_suffix)
        if not key_suf and val_pre:  # the value's opening tag ends the name (``name="k">v``)
            key_suf, val_pre = val_pre, ""
        if not key_pre or not val_suf:
            raise _Malformed("the template's argument markers are unknown")
        while True:
            p = self._ws(pos)
            if a.arg_separator.strip():
                m = re.compile(flex(a.arg_separator)).match(self.text, p)
                if m:
                    p = self._ws(m.end())
            m = re.compile(key_pre).match(self.text, p)
            if not m:
                rest = self.text[p:]
                if not self.final and a.arg_name_prefix.strip().startswith(rest):
                    raise _Incomplete(name)
                return args, pos
            k_end = re.compile(key_suf).search(self.text, m.end()) if key_suf else None
            if k_end is None:
                if not self.final:
                    raise _Incomplete(name)
                raise _Malformed("unterminated argument name")
            key = self.text[m.end() : k_end.start()].strip()
            v = k_end.end()
            if val_pre:
                vm = re.compile(r"\s*" + val_pre).match(self.text, v)
                if not vm:
                    if not self.final and len(self.text) - v < len(a.arg_value_prefix.strip()) + 2:
                        raise _Incomplete(name)
                    raise _Malformed(
                        f"expected {a.arg_value_prefix.strip()!r} after argument {key!r}"
                    )
                v = vm.end()
            ve = re.compile(val_suf).search(self.text, v)
            if ve is None:
                if not self.final:
                    raise _Incomplete(name)
                raise _Malformed(f"unterminated value of argument {key!r}")
            raw = self.text[v : ve.start()]
            # the template's own whitespace around the value is not part of it
            if (a.arg_value_prefix or a.arg_name_suffix).endswith("\n") and raw.startswith("\n"):
                raw = raw[1:]
            if a.arg_value_suffix.startswith("\n") and raw.endswith("\n"):
                raw = raw[:-1]
            args[key] = typed_value(raw, schema_types(schema.get(key)) if has_schema else None)
            pos = ve.end()

    def call(self, pos: int) -> tuple[ParsedCall, int]:
        a = self.a
        start = pos
        cid: str | None = None
        if a.call_id_position == "pre_func_name" and a.call_id_suffix.strip():
            p = self._ws(pos)
            m = (
                re.compile(flex(a.call_id_prefix)).match(self.text, p)
                if a.call_id_prefix.strip()
                else None
            )
            id_start = (
                m.end()
                if m
                else (p if a.call_id_prefix.strip() == a.per_call_start.strip() else -1)
            )
            if id_start >= 0:
                e = self._find(id_start, a.call_id_suffix)
                if e is None and not self.final:
                    raise _Incomplete(None)
                if e is not None:
                    cid, pos = self.text[id_start : e.start()].strip(), e.end()
        name, pos, own_id = self.name(pos)
        cid = own_id or cid
        pos = self._need(pos, a.args_separator, "after the function name", name)
        if a.tool_format == "tag_tagged":
            args, pos = self.tagged_args(pos, name)
        else:
            args, pos = self.json_args(pos, name)
        if a.call_id_position == "post_args" and a.call_id_prefix.strip():
            m = re.compile(r"\s*" + flex(a.call_id_prefix)).match(self.text, pos)
            if m:
                e = self._find(m.end(), a.call_id_suffix) if a.call_id_suffix.strip() else None
                end = e.start() if e else self._eol(m.end())
                cid = self.text[m.end() : end].strip()
                pos = e.end() if e else end
        if a.function_close.strip():
            end = self._at(pos, a.function_close)
            if end is None:
                if not self.final and self._ws(pos) >= len(self.text):
                    raise _Incomplete(name)
                if self.final and self._ws(pos) >= len(self.text):
                    raise _Malformed(f"unterminated call (no {a.function_close.strip()!r})")
            else:
                pos = end
        return ParsedCall(name, args, self.text[start:pos].strip(), id=cid), pos

    def _eol(self, pos: int) -> int:
        m = re.compile(r"[\s<\[{]").search(self.text, pos)
        return m.start() if m else len(self.text)


def bare_call_prefix(a: TemplateAnalysis) -> str:
    """A tag format's name prefix (``<function=``), accepted without the section or
    per-call opener that models sometimes skip (llama.cpp's Qwen3-Coder handler does)."""
    prefix = a.name_prefix.strip()
    if (
        a.tool_format in ("tag_json", "tag_tagged")
        and prefix[:1] in ("<", "[")
        and prefix != a.trigger
    ):
        return prefix
    return ""


def scan_tagged(
    a: TemplateAnalysis, text: str, final: bool, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[ParsedCall], int, bool]:
    """(calls, end of the tool region, complete) for tag formats starting at 0."""
    sc = CallScanner(a, text, final, tools)
    calls: list[ParsedCall] = []
    pos = 0
    bare = bare_call_prefix(a)

    def bare_call_at(p: int) -> bool:
        return bool(bare) and re.compile(flex(bare)).match(text, sc._ws(p)) is not None

    if a.section_start.strip():
        end = sc._at(pos, a.section_start)
        if end is None and not bare_call_at(pos):
            return calls, 0, True
        pos = end or 0
    while True:
        p = sc._ws(pos)
        opener_skipped = False
        if a.per_call_start.strip():
            try:
                end = sc._at(p, a.per_call_start)
            except _Incomplete:
                return calls, pos, False
            if end is None:
                if not bare_call_at(p):
                    break
                end, opener_skipped = p, True
            p = end
        elif calls:
            # calls without per-call markers follow each other (", " in llama.cpp)
            q = p
            if text.startswith(",", q):
                q = sc._ws(q + 1)
            try:
                if sc._at(q, a.name_prefix) is None or not a.name_prefix.strip():
                    break
            except _Incomplete:
                return calls, pos, False
            p = q
        if p >= len(text) and not final:
            return calls, pos, False
        try:
            call, end = sc.call(p)
        except _Incomplete as inc:
            calls.append(ParsedCall(inc.name, None, text[p:].strip(), complete=False))
            return calls, pos, False
        except _Malformed as exc:
            stop = (
                sc._find(p, a.per_call_end or a.section_end)
                if (a.per_call_end or a.section_end).strip()
                else None
            )
            raw_end = stop.start() if stop else len(text)
            calls.append(ParsedCall(None, None, text[p:raw_end].strip(), error=str(exc)))
            pos = stop.end() if stop else len(text)
            if not stop:
                return calls, pos, True
            continue
        if a.per_call_end.strip():
            try:
                e = sc._at(end, a.per_call_end)
            except _Incomplete:
                calls.append(replace(call, complete=False))
                return calls, pos, False
            if e is not None:
                end = e
            elif not opener_skipped and sc._ws(end) >= len(text):
                if not final:
                    calls.append(replace(call, complete=False))
                    return calls, pos, False
                calls.append(
                    replace(
                        call,
                        args=None,
                        error=f"unterminated tool call (no {a.per_call_end.strip()})",
                    )
                )
                return calls, len(text), True
        calls.append(call)
        pos = end
    if a.section_end.strip():
        try:
            e = sc._at(pos, a.section_end)
        except _Incomplete:
            return calls, pos, False
        if e is not None:
            pos = e
        elif sc._ws(pos) >= len(text) and not final:
            return calls, pos, False
    return calls, pos, True
