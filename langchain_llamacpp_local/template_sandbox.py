"""The Jinja sandbox chat templates run in, with resource limits.

Chat templates are untrusted code from a downloaded GGUF file. Jinja's
``SandboxedEnvironment`` already blocks attribute escapes (``__class__``,
``mro``, function globals…) and offers no file or process access; on top of it
this module:

* allows the in-place mutations real templates use (``list.append``,
  ``dict.update``, ``namespace`` attributes) — the caller passes deep copies of
  its data, so a template can only mutate its own objects;
* bounds every way a template can burn time or memory: a wall-clock deadline
  checked on every loop iteration, call and operator, an output size cap, caps on
  ``range()``, string/list repetition, ``**``, concatenation, format widths and
  ``lipsum``. Each limit raises :class:`TemplateLimitError` naming the limit, so
  the worker never hangs on a template.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import wraps
from typing import Any

from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Context, Undefined
from jinja2.sandbox import SandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

__all__ = [
    "RenderLimits",
    "TemplateLimitError",
    "TemplateRaised",
    "guarded_render",
    "make_env",
]


@dataclass(frozen=True)
class RenderLimits:
    """Resource caps for one render. Real templates stay far below every one."""

    timeout_s: float = 5.0
    """Wall-clock time for one render."""
    max_output_chars: int = 64 * 1024 * 1024
    """Size of the rendered prompt, and of any single string or list built while rendering."""
    max_range: int = 100_000
    """Length of one ``range()``."""
    max_repeat: int = 1_000_000
    """Length of a ``str * n`` / ``list * n`` result."""
    max_pow_bits: int = 4096
    """Bits of an integer ``**`` result."""
    max_lipsum: int = 100
    """Paragraphs (and words per paragraph) of ``lipsum()``."""


DEFAULT_LIMITS = RenderLimits()


class TemplateLimitError(RuntimeError):
    """A template exceeded a :class:`RenderLimits` cap (the message names it)."""


class TemplateRaised(Exception):
    """The template called ``raise_exception`` (its own error message)."""


# --------------------------------------------------------------------------- per-render budget

_state = threading.local()


class _Budget:
    __slots__ = ("deadline", "limits")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s


def _budget() -> _Budget:
    budget = getattr(_state, "budget", None)
    if budget is None:  # rendering outside guarded_render (e.g. a direct Template.render)
        budget = _state.budget = _Budget(DEFAULT_LIMITS)
    return budget


def _tick() -> _Budget:
    budget = _budget()
    if time.monotonic() > budget.deadline:
        raise TemplateLimitError(
            f"template rendering exceeded its time limit of {budget.limits.timeout_s:g} s"
        )
    return budget


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, (str, list, tuple, dict)):
        cap = _budget().limits.max_output_chars
        if len(value) > cap:
            raise TemplateLimitError(f"{what} of {len(value)} items exceeds the cap of {cap}")
    return value


_BIG_WIDTH = re.compile(r"\d{7,}")


def _check_format_string(fmt: Any) -> None:
    if isinstance(fmt, str) and _BIG_WIDTH.search(fmt):
        raise TemplateLimitError(
            "a format string with a field width of a million or more exceeds the template limits"
        )


# --------------------------------------------------------------------------- guarded operations


def _guard_iter(iterable: Any) -> Iterator[Any]:
    """Wraps every ``for`` loop's iterable: the deadline is checked on each iteration."""
    if isinstance(iterable, Undefined):
        yield from iterable  # raises or yields nothing, as Jinja would
        return
    for item in iterable:
        _tick()
        yield item


def _concat(*parts: Any) -> str:
    """Jinja's ``~`` with the size cap."""
    _tick()
    # as llama.cpp's runtime: none concatenates as the empty string (Jinja would write "None")
    out = "".join("" if p is None else str(p) for p in parts)
    return _check_size(out, "a concatenated string")


def _safe_range(*args: Any) -> range:
    rng = range(*args)
    cap = _budget().limits.max_range
    if len(rng) > cap:
        raise TemplateLimitError(f"range() of {len(rng)} items exceeds the cap of {cap}")
    return rng


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    cap = _budget().limits.max_lipsum
    if n > cap or max > cap * 10 or min > cap * 10:
        raise TemplateLimitError(f"lipsum(n={n}, min={min}, max={max}) exceeds the cap of {cap}")
    return str(generate_lorem_ipsum(n=n, html=html, min=min, max=max))


def _repeat(left: Any, right: Any) -> Any:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            cap = _budget().limits.max_repeat
            if len(seq) * max(count, 0) > cap:
                raise TemplateLimitError(
                    f"repetition producing {len(seq) * count} items exceeds the cap of {cap}"
                )
    return left * right


def _power(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        cap = _budget().limits.max_pow_bits
        if abs(left).bit_length() * right > cap:
            raise TemplateLimitError(f"{left} ** {right} exceeds the cap of {cap} bits")
    if isinstance(left, float) or isinstance(right, float):
        return float(left) ** float(right)
    return left**right


def _add(left: Any, right: Any) -> Any:
    # llama.cpp's runtime: none/undefined + string concatenates as the empty string
    if isinstance(left, str) and (right is None or isinstance(right, Undefined)):
        right = ""
    elif isinstance(right, str) and (left is None or isinstance(left, Undefined)):
        left = ""
    if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _check_size(left, "an operand")
        cap = _budget().limits.max_output_chars
        if len(left) + len(right) > cap:
            raise TemplateLimitError(
                f"a '+' result of {len(left) + len(right)} items exceeds the cap of {cap}"
            )
    return left + right


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        _check_format_string(left)
    return _check_size(left % right, "a formatted string")


# --------------------------------------------------------------------------- compile-time rewrite


def _instrument(ast: nodes.Template) -> nodes.Template:
    """Wrap every ``for`` iterable in ``_jj_iter`` and turn ``~`` into ``_jj_concat``."""
    for loop in ast.find_all(nodes.For):
        loop.iter = nodes.Call(
            nodes.Name("_jj_iter", "load"), [loop.iter], [], None, None, lineno=loop.lineno
        )
    for parent in list(ast.find_all(nodes.Node)):
        for field in parent.fields:
            value = getattr(parent, field, None)
            if isinstance(value, nodes.Concat):
                setattr(parent, field, _concat_call(value))
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, nodes.Concat):
                        value[i] = _concat_call(item)
    return ast


def _concat_call(node: nodes.Concat) -> nodes.Call:
    return nodes.Call(
        nodes.Name("_jj_concat", "load"), node.nodes, [], None, None, lineno=node.lineno
    )


# --------------------------------------------------------------------------- environment


class _GenerationTagExtension(Extension):
    """Accept ``{% generation %}…{% endgeneration %}`` (HF assistant-mask markers),
    rendering the body unchanged: only training code cares about the masks."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _json_default(value: Any) -> Any:
    """``tojson`` of what Jinja expressions produce besides plain data (generators,
    ``selectattr``/``map`` results); an undefined value stays an error, as in transformers."""
    if isinstance(value, Undefined):
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Like transformers' filter: Jinja's own HTML-escapes ``<``/``&``, corrupting tool JSON."""
    if isinstance(indent, int) and indent > 64:
        raise TemplateLimitError(f"tojson(indent={indent}) exceeds the cap of 64")
    out = json.dumps(
        x,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_default,
    )
    return _check_size(out, "a tojson result")


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    _check_format_string(fmt)
    return datetime.now().strftime(fmt)


_WIDTH_FILTERS = frozenset({"do_center", "do_indent"})  # allocate their width argument


def _guard_filter(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Filters bypass ``call()``: check the deadline, width arguments (``center(10**9)``),
    format strings and the result size around each."""
    value_at = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0
    name = fn.__name__

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _tick()
        if name in _WIDTH_FILTERS:
            cap = budget.limits.max_repeat
            for arg in (*args[value_at + 1 :], *kwargs.values()):
                if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > cap:
                    raise TemplateLimitError(
                        f"filter {name!r} argument {arg} exceeds the cap of {cap}"
                    )
        elif name == "do_format" and len(args) > value_at:
            _check_format_string(args[value_at])
        return _check_size(fn(*args, **kwargs), f"the result of filter {name!r}")

    return wrapper


class LimitedSandbox(SandboxedEnvironment):
    """Jinja's sandbox, mutations of template data allowed, every operation budgeted."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationTagExtension],
        )
        self.binop_table = {
            **self.binop_table,
            "*": _repeat,
            "**": _power,
            "+": _add,
            "%": _modulo,
        }
        self.filters = {name: _guard_filter(f) for name, f in self.filters.items()}
        self.filters["tojson"] = _tojson
        self.globals.update(
            range=_safe_range,
            lipsum=_lipsum,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            _jj_iter=_guard_iter,
            _jj_concat=_concat,
        )

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _tick()
        name = getattr(__obj, "__name__", "")
        if name in ("format", "format_map"):  # the sandbox wraps str.format (``__wrapped__``)
            _check_format_string(getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None))
        elif name in ("ljust", "rjust", "center", "zfill", "expandtabs"):
            for arg in args:
                if isinstance(arg, int) and arg > budget.limits.max_repeat:
                    raise TemplateLimitError(
                        f"{name}({arg}) exceeds the cap of {budget.limits.max_repeat}"
                    )
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_size(result, f"the result of {name or 'a call'}")


def make_env() -> LimitedSandbox:
    return LimitedSandbox()


def compile_template(env: LimitedSandbox, source: str) -> tuple[Any, nodes.Template]:
    """Parse, instrument and compile ``source``; returns the template and the original AST."""
    ast = env.parse(source)
    instrumented = _instrument(env.parse(source))
    return env.from_string(instrumented), ast


def guarded_render(template: Any, variables: dict[str, Any], limits: RenderLimits) -> str:
    """Render within ``limits`` (deadline checked between output chunks too)."""
    previous = getattr(_state, "budget", None)
    budget = _state.budget = _Budget(limits)
    try:
        parts: list[str] = []
        size = 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > limits.max_output_chars:
                raise TemplateLimitError(
                    f"rendered prompt exceeds the output cap of {limits.max_output_chars} characters"
                )
            if time.monotonic() > budget.deadline:
                raise TemplateLimitError(
                    f"template rendering exceeded its time limit of {limits.timeout_s:g} s"
                )
            parts.append(chunk)
        return "".join(parts)
    finally:
        _state.budget = previous
