"""The Jinja sandbox chat templates run in, with resource limits.

Chat templates are untrusted code from a downloaded GGUF file. Jinja's
``SandboxedEnvironment`` already blocks attribute escapes (``__class__``,
``mro``, function globals…) and offers no file or process access; on top of it
this module:

* allows the in-place mutations real templates use (``list.append``,
  ``dict.update``, ``namespace`` attributes) — the caller passes deep copies of
  its data, so a template can only mutate its own objects;
* bounds every way a template can burn time or memory: a wall-clock deadline
  checked on every token parsed, loop iteration, call and operator (and inside
  long filters such as ``wordwrap``), an output size cap, caps on ``range()``,
  string/list repetition, integer size, concatenation, format widths and
  ``lipsum``. Each limit raises :class:`TemplateLimitError` naming the limit, so
  the worker never hangs on a template.

Sizes are *predicted from the operands before* the operation runs (``'%*s' %
(n, x)``, ``'{:>{}}'.format(x, n)``, ``join``, ``replace``, ``str(list)``,
integer ``*``): checking a result after building it is too late when building it
is what exhausts memory or holds the GIL. The deadline is per request: one
:func:`request_budget` covers every render, probe and compilation of a request.
"""

from __future__ import annotations

import copy
import json
import operator
import re
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import update_wrapper, wraps
from types import BuiltinMethodType, MethodType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.idtracking import (
    VAR_LOAD_ALIAS,
    VAR_LOAD_PARAMETER,
    VAR_LOAD_RESOLVE,
    VAR_LOAD_UNDEFINED,
)
from jinja2.lexer import Token, TokenStream
from jinja2.parser import Parser
from jinja2.runtime import ChainableUndefined, Context, Macro, Undefined
from jinja2.sandbox import (
    SandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
    SecurityError,
)
from jinja2.utils import generate_lorem_ipsum, missing
from jinja2.utils import pass_environment as _pass_environment
from markupsafe import Markup

__all__ = [
    "RenderLimits",
    "TemplateLimitError",
    "TemplateRaised",
    "guarded_render",
    "make_env",
    "request_budget",
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
    """Bits of an integer ``*`` or ``**`` result."""
    max_int_bits: int = 65536
    """Bits of any integer operand of an arithmetic operator (caller data included)."""
    max_source_chars: int = 512 * 1024
    """Length of a template's source (compiling is linear in it and cannot be interrupted)."""
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
    __slots__ = ("cancelled", "deadline", "limits", "next_poll")

    def __init__(self, limits: RenderLimits, cancelled: Callable[[], bool] | None = None) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.cancelled = cancelled
        self.next_poll = 0.0


def _budget() -> _Budget:
    budget = getattr(_state, "budget", None)
    if budget is None:  # rendering outside guarded_render (e.g. a direct Template.render)
        return _Budget(DEFAULT_LIMITS)
    return budget


def _tick() -> _Budget:
    budget = _budget()
    now = time.monotonic()
    if now > budget.deadline:
        raise TemplateLimitError(
            f"template rendering exceeded its time limit of {budget.limits.timeout_s:g} s"
        )
    if budget.cancelled is not None and now >= budget.next_poll:
        budget.next_poll = now + 0.02
        if budget.cancelled():
            raise TemplateLimitError("the request was cancelled or timed out during templating")
    return budget


@contextmanager
def request_budget(
    limits: RenderLimits = DEFAULT_LIMITS, cancelled: Callable[[], bool] | None = None
) -> Iterator[_Budget]:
    """One time budget for everything a request does with templates (compiling, probing,
    rendering): renders inside it share its deadline instead of getting one each.

    ``cancelled`` is polled (every 20 ms at most) so a caller's cancel or timeout stops
    the template too. Nested uses keep the outer budget.
    """
    outer = getattr(_state, "budget", None)
    if outer is not None:
        yield outer
        return
    budget = _state.budget = _Budget(limits, cancelled)
    try:
        yield budget
    finally:
        _state.budget = None


def budget_remaining() -> float | None:
    """Seconds left in the current :func:`request_budget` (None outside one)."""
    budget = getattr(_state, "budget", None)
    return None if budget is None else budget.deadline - time.monotonic()


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, (str, list, tuple, dict)):
        cap = _budget().limits.max_output_chars
        if len(value) > cap:
            raise TemplateLimitError(f"{what} of {len(value)} items exceeds the cap of {cap}")
    return value


def _over(size: int, what: str) -> None:
    cap = _budget().limits.max_output_chars
    if size > cap:
        raise TemplateLimitError(f"{what} of {size} characters exceeds the cap of {cap}")


def _str_len(value: Any, cap: int) -> int:
    """An upper bound on ``len(str(value))``, computed without building it; stops counting
    past ``cap`` (containers nest and share items, so ``str(list)`` can be far larger than
    the memory the list takes)."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            total += len(item) * 6 + 2 if depth else len(item)  # repr may escape
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, (list, tuple, set, frozenset, dict)) and depth < 64:
            total += 2 + 2 * len(item)
            if isinstance(item, dict):
                total += 2 * len(item)
                for k, v in item.items():
                    if total > cap:
                        break
                    stack.append((k, depth + 1))
                    stack.append((v, depth + 1))
            else:
                for v in item:
                    if total > cap:
                        break
                    stack.append((v, depth + 1))
        else:
            total += 256  # objects, Undefined, namespaces: short reprs
        if total > cap:
            return total
    return total


def _check_str(value: Any, what: str) -> Any:
    """Raise if ``str(value)`` would exceed the cap; strings pass at no cost."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        cap = _budget().limits.max_output_chars
        _over(_str_len(value, cap), what)
    return value


_BIG_WIDTH = re.compile(r"\d{7,}")


def _check_format_string(fmt: Any) -> None:
    if isinstance(fmt, str) and _BIG_WIDTH.search(fmt):
        raise TemplateLimitError(
            "a format string with a field width of a million or more exceeds the template limits"
        )


_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])")


def _check_printf(fmt: str, args: Any) -> None:
    """Predict the size of ``fmt % args`` (``*`` widths taken from ``args``) before it runs."""
    _check_format_string(fmt)
    budget = _budget()
    cap, wcap = budget.limits.max_output_chars, budget.limits.max_repeat
    positional = list(args) if isinstance(args, tuple) else [args]
    total = len(fmt)
    i = 0
    for m in _PRINTF.finditer(fmt):
        key, width, prec, conv = m.groups()
        if conv == "%":
            continue
        sizes = []
        for part in (width, prec):
            if part == "*":
                n = positional[i] if i < len(positional) else 0
                i += 1
                if isinstance(n, int) and abs(n) > wcap:
                    raise TemplateLimitError(
                        f"a '%' format width or precision of {n} exceeds the cap of {wcap}"
                    )
                sizes.append(abs(n) if isinstance(n, int) else 0)
            elif part:
                sizes.append(int(part))
        if key is not None and isinstance(args, Mapping):
            value = args.get(key)
        else:
            value = positional[i] if i < len(positional) else None
            i += 1
        total += max(sizes, default=0) + _str_len(value, cap)
        if total > cap:
            break
    _over(total, "a '%' formatted string")


_SPEC_NUMBERS = re.compile(r"\d+")


class _FormatBudget:
    """``str.format`` with each field's resolved spec (nested ``{}`` widths included)
    and the running size checked before the field is formatted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.total = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = _tick()
        wcap = budget.limits.max_repeat
        for number in _SPEC_NUMBERS.findall(format_spec):
            if len(number) > 7 or int(number) > wcap:
                raise TemplateLimitError(
                    f"a format field width or precision of {number} exceeds the cap of {wcap}"
                )
        self.total += _str_len(value, budget.limits.max_output_chars) + (
            int(max(_SPEC_NUMBERS.findall(format_spec), key=len, default="0") or 0)
        )
        _over(self.total, "a formatted string")
        return super().format_field(value, format_spec)  # type: ignore[misc]


class _LimitedFormatter(_FormatBudget, SandboxedFormatter):
    pass


class _LimitedEscapeFormatter(_FormatBudget, SandboxedEscapeFormatter):
    pass


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
    budget = _tick()
    cap = budget.limits.max_output_chars
    _over(sum(_str_len(p, cap) for p in parts if p is not None), "a concatenated string")
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


def _int_bits(*values: Any) -> None:
    cap = _budget().limits.max_int_bits
    for v in values:
        if isinstance(v, int) and v.bit_length() > cap:
            raise TemplateLimitError(
                f"an integer of {v.bit_length()} bits exceeds the cap of {cap} bits"
            )


def _repeat(left: Any, right: Any) -> Any:
    _int_bits(left, right)
    if isinstance(left, int) and isinstance(right, int):
        cap = _budget().limits.max_pow_bits
        if left.bit_length() + right.bit_length() > cap:
            raise TemplateLimitError(
                f"an integer product of about {left.bit_length() + right.bit_length()} bits "
                f"exceeds the cap of {cap} bits"
            )
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            cap = _budget().limits.max_repeat
            if len(seq) * max(count, 0) > cap:
                raise TemplateLimitError(
                    f"repetition producing {len(seq) * count} items exceeds the cap of {cap}"
                )
    return left * right


def _power(left: Any, right: Any) -> Any:
    _int_bits(left, right)
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        cap = _budget().limits.max_pow_bits
        if abs(left).bit_length() * right > cap:
            raise TemplateLimitError(f"{left} ** {right} exceeds the cap of {cap} bits")
    if isinstance(left, float) or isinstance(right, float):
        return float(left) ** float(right)
    return left**right


def _add(left: Any, right: Any) -> Any:
    # two strings, the common case, need only the size check of the result
    if not (type(left) is str and type(right) is str):
        # llama.cpp's runtime: none/undefined + string concatenates as the empty string
        if isinstance(left, str) and (right is None or isinstance(right, Undefined)):
            right = ""
        elif isinstance(right, str) and (left is None or isinstance(left, Undefined)):
            left = ""
        _int_bits(left, right)
        if not (isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple))):
            return left + right
        _check_size(left, "an operand")
    cap = _budget().limits.max_output_chars
    if len(left) + len(right) > cap:
        raise TemplateLimitError(
            f"a '+' result of {len(left) + len(right)} items exceeds the cap of {cap}"
        )
    return left + right


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        _check_printf(left, right)
    else:
        _int_bits(left, right)
    return _check_size(left % right, "a formatted string")


def _arith(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def guarded(left: Any, right: Any) -> Any:
        _int_bits(left, right)
        return op(left, right)

    return guarded


def _finalize(value: Any) -> Any:
    """Every ``{{ expression }}``: a container's text size is checked before ``str()``."""
    return _check_str(value, "an output value")


def _replace_size(s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        if len(new) <= len(old):
            return
        n = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _over(len(s) + n * (len(new) - len(old)), "a replace() result")


def _join_size(sep: Any, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        cap = _budget().limits.max_output_chars
        total = len(str(sep)) * max(len(items) - 1, 0)
        for item in items:
            total += _str_len(item, cap)
            if total > cap:
                break
        _over(total, "a join() result")


class _TickingWrapper(textwrap.TextWrapper):
    """``textwrap`` that checks the deadline for each line it breaks out of a long word
    (a width of 1 over a long word is quadratic)."""

    def _handle_long_word(self, *args: Any) -> None:
        _tick()
        super()._handle_long_word(*args)  # type: ignore[misc]


def _wordwrap(
    environment: Any,
    s: str,
    width: int = 79,
    break_long_words: bool = True,
    wrapstring: str | None = None,
    break_on_hyphens: bool = True,
) -> str:
    """Jinja's ``wordwrap`` with the deadline checked inside and its size predicted."""
    if wrapstring is None:
        wrapstring = environment.newline_sequence
    s = str(s)
    _over(len(s) * (1 + len(wrapstring)), "a wordwrap result")
    wrapper = _TickingWrapper(
        width=width,
        expand_tabs=False,
        replace_whitespace=False,
        break_long_words=break_long_words,
        break_on_hyphens=break_on_hyphens,
    )
    lines = []
    for line in s.splitlines():
        _tick()
        lines.append(wrapstring.join(wrapper.wrap(line)))
    return wrapstring.join(lines)


_wordwrap = _pass_environment(_wordwrap)


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


class _ParseBudget(Extension):
    """Check the deadline on every token the parser reads, so compiling counts against the
    request's time budget and a huge template stops at it."""

    def filter_stream(self, stream: TokenStream) -> Iterator[Token]:
        for token in stream:
            _tick()
            yield token


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
    _check_str(x, "a tojson result")
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
# filters that turn their input into text (a container's str() can dwarf its memory)
_STRING_FILTERS = frozenset(
    {
        "soft_str",
        "do_pprint",
        "do_xmlattr",
        "_wordwrap",
        "do_upper",
        "do_lower",
        "do_capitalize",
        "do_title",
        "do_trim",
        "do_center",
        "do_indent",
        "do_truncate",
        "do_striptags",
        "do_replace",
        "do_wordcount",
        "do_urlize",
        "do_forceescape",
        "escape",
        "do_mark_safe",
        "do_urlencode",
        "do_format",
    }
)


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
            if isinstance(args[value_at], str):
                _check_printf(args[value_at], kwargs or tuple(args[value_at + 1 :]))
        elif name == "do_join" and len(args) > value_at:
            items = args[value_at]
            sep = args[value_at + 1] if len(args) > value_at + 1 else kwargs.get("d", "")
            _join_size(sep, list(items) if isinstance(items, (set, frozenset)) else items)
        elif name == "do_replace" and len(args) > value_at + 2:
            _replace_size(*args[value_at:])
        if name in _STRING_FILTERS and len(args) > value_at:
            _check_str(args[value_at], f"the text of filter {name!r}'s input")
        return _check_size(fn(*args, **kwargs), f"the result of filter {name!r}")

    return wrapper


#: the keyword a call to a template's macro carries the caller's variables in
_SCOPE_KW = "_jj_scope"


class _CodeGenerator(CodeGenerator):
    """Jinja2's code generator, with two rules of llama.cpp's template engine
    (``common/jinja/runtime.cpp``) that real templates rely on.

    * ``{% set obj.attr = value %}`` works on a mapping as well as on a ``namespace()``
      (MiroThinker marks the tools and messages it has seen, ``{% set tool.mt_visited =
      1 %}``). Jinja2 compiles the assignment to ``obj[attr] = value`` behind a check
      that ``obj`` is a namespace; only that check is widened, to ``dict``. The
      template's own data is copied per render, so nothing of the caller's changes.
    * A macro sees its caller's variables. llama.cpp runs a macro's body in a copy of
      the *calling* scope with the parameters bound on top (``context macro_ctx(args.ctx)``),
      so a macro may read the caller's loop variable (MiroThinker's ``function_name()``
      reads the ``tool`` of the loop it is called from); Jinja2 resolves a macro's free
      names where the macro is defined. Each call of one of the template's macros passes
      the caller's variables (:data:`_SCOPE_KW`, taken off again in
      :meth:`LimitedSandbox.call`), and a macro's free names read them first, then fall
      back to where Jinja2 would look.
    """

    _CHECK = ", Namespace):"

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        self._macro_names = {m.name for m in node.find_all(nodes.Macro)}
        self._macro_frame: nodes.Macro | None = None
        super().visit_Template(node, frame)

    def writeline(self, x: str, node: nodes.Node | None = None, extra: int = 0) -> None:
        if x.startswith("if not isinstance(") and x.endswith(self._CHECK):
            x = x[: -len(self._CHECK)] + ", (Namespace, dict)):"
        super().writeline(x, node, extra)

    def signature(
        self,
        node: nodes.Call | nodes.Filter | nodes.Test,
        frame: Frame,
        extra_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        callee = node.node if isinstance(node, nodes.Call) else None
        if isinstance(callee, nodes.Name) and callee.name in self._macro_names:
            extra_kwargs = {**(extra_kwargs or {}), _SCOPE_KW: self.dump_local_context(frame)}
        super().signature(node, frame, extra_kwargs)

    def macro_body(self, node: nodes.Macro | nodes.CallBlock, frame: Frame) -> Any:
        # a call block's body keeps its own (lexical) scope, as in llama.cpp
        self._macro_frame = node if isinstance(node, nodes.Macro) else None
        return super().macro_body(node, frame)

    def enter_frame(self, frame: Frame) -> None:
        macro = self._macro_frame
        if macro is None:
            super().enter_frame(frame)
            return
        self._macro_frame = None  # the macro's own frame is the first entered
        symbols = frame.symbols
        # a name the body reads from an enclosing frame (a top-level variable) gets a
        # variable of the macro's own, so the caller's value can take its place
        for name in macro.find_all(nodes.Name):
            if name.ctx == "load" and name.name not in symbols.refs:
                outer = symbols.find_ref(name.name)
                if outer is not None:
                    symbols._define_ref(name.name, load=(VAR_LOAD_ALIAS, outer))
        names = {target: name for name, target in symbols.refs.items()}
        for target, (action, param) in symbols.loads.items():
            if action == VAR_LOAD_PARAMETER:
                continue
            if action == VAR_LOAD_RESOLVE:
                fallback = f"{self.get_resolve_func()}({param!r})"
            elif action == VAR_LOAD_ALIAS:
                fallback = str(param)
            elif action == VAR_LOAD_UNDEFINED:
                fallback = "missing"
            else:
                raise NotImplementedError("unknown load instruction")
            self.writeline(
                f"{target} = environment.caller_value(context, {names[target]!r}, {fallback})"
            )


class LimitedSandbox(SandboxedEnvironment):
    """Jinja's sandbox, mutations of template data allowed, every operation budgeted."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "-", "/", "//"})
    code_generator_class = _CodeGenerator

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationTagExtension, _ParseBudget],
            finalize=_finalize,
            # as llama.cpp's engine: an attribute or item of an undefined value is
            # undefined (``tool.function is defined`` where no ``tool`` is), not an error
            undefined=ChainableUndefined,
        )
        self.binop_table = {
            **self.binop_table,
            "*": _repeat,
            "**": _power,
            "+": _add,
            "%": _modulo,
            "-": _arith(operator.sub),
            "/": _arith(operator.truediv),
            "//": _arith(operator.floordiv),
        }
        self.filters["wordwrap"] = _wordwrap
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

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        """An unsafe attribute (``__globals__``, ``__class__``…) fails the render at once:
        with undefined values chainable, the undefined Jinja2 returns for it would render
        as empty text and hide the attempt."""
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    @staticmethod
    def caller_value(context: Context, name: str, fallback: Any) -> Any:
        """A macro's free variable: the calling scope's value, else ``fallback`` (where
        Jinja2 would have found it)."""
        scopes = getattr(context, "_jj_scopes", None)
        if scopes:
            value = scopes[-1].get(name, missing)
            if value is not missing:
                return value
        return fallback

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        scope = kwargs.pop(_SCOPE_KW, None)
        if scope is not None and isinstance(__obj, Macro):
            # the macro runs in its caller's scope: what the caller sees (its own caller's
            # variables included) with the caller's variables on top
            scopes = __context.__dict__.setdefault("_jj_scopes", [])
            visible = dict(scopes[-1]) if scopes else {}
            visible.update((k, v) for k, v in scope.items() if v is not missing)
            scopes.append(visible)
            try:
                return __self._call(__context, __obj, *args, **kwargs)
            finally:
                scopes.pop()
        return __self._call(__context, __obj, *args, **kwargs)

    def _call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
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
        elif name in ("join", "replace"):
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                if name == "join" and args:
                    _join_size(owner, args[0])
                elif name == "replace" and len(args) >= 2:
                    _replace_size(owner, *args[:3])
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_size(result, f"the result of {name or 'a call'}")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """Jinja's safe ``str.format``, with each field's width and size checked first."""
        if not isinstance(value, (MethodType, BuiltinMethodType)) or value.__name__ not in (
            "format",
            "format_map",
        ):
            return None
        f_self: Any = value.__self__
        if not isinstance(f_self, str):
            return None
        str_type: type[str] = type(f_self)
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            formatter: SandboxedFormatter
            if isinstance(f_self, Markup):
                formatter = _LimitedEscapeFormatter(self, escape=f_self.escape)
            else:
                formatter = _LimitedFormatter(self)
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs = args[0]
                args = ()
            return str_type(formatter.vformat(f_self, args, kwargs))

        return update_wrapper(wrapper, value)


def make_env() -> LimitedSandbox:
    return LimitedSandbox()


def compile_template(
    env: LimitedSandbox, source: str, limits: RenderLimits = DEFAULT_LIMITS
) -> tuple[Any, nodes.Template]:
    """Parse, instrument and compile ``source``; returns the template and the original AST.

    Bounded like a render: the source length is capped and the parser checks the
    deadline (of the current :func:`request_budget`, or its own) on every token.
    """
    if len(source) > limits.max_source_chars:
        raise TemplateLimitError(
            f"a template source of {len(source)} characters exceeds the cap of "
            f"{limits.max_source_chars}"
        )
    with request_budget(limits):
        ast = env.parse(source)
        instrumented = _instrument(copy.deepcopy(ast))
        return env.from_string(instrumented), ast


def guarded_render(template: Any, variables: dict[str, Any], limits: RenderLimits) -> str:
    """Render within ``limits`` (deadline checked between output chunks too); inside a
    :func:`request_budget` the request's deadline applies."""
    with request_budget(limits) as budget:
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
                    f"template rendering exceeded its time limit of {budget.limits.timeout_s:g} s"
                )
            parts.append(chunk)
        return "".join(parts)
