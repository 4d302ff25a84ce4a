"""Token sampling, stop strings, incremental UTF-8 decoding and constraint grammars.

* :class:`SamplingParams` is the validated, immutable set of sampling settings of one
  request; :class:`Sampler` turns it into a llama.cpp sampler chain.
* :class:`StopMatcher` and :class:`Utf8Decoder` make streaming safe: a stop string
  is never partly emitted and a character split over tokens is emitted once whole.
* :func:`json_schema_to_grammar` and :data:`JSON_OBJECT_GRAMMAR` build GBNF grammars
  for structured output on top of llama-cpp-python's JSON-schema converter (the
  tool-call grammars of :mod:`~langchain_llamacpp_local.formats.grammars` use it too).
"""

from __future__ import annotations

import codecs
import contextlib
import copy
import ctypes
import dataclasses
import math
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import llama_cpp.llama_cpp as C
import numpy as np
from llama_cpp import llama_grammar as G

from langchain_llamacpp_local.errors import (
    GrammarTooLargeError,
    InvalidSamplingParams,
    SamplingError,
)

__all__ = [
    "JSON_OBJECT_GRAMMAR",
    "GrammarTooLargeError",
    "InvalidSamplingParams",
    "Sampler",
    "SamplingError",
    "SamplingParams",
    "StopMatcher",
    "Utf8Decoder",
    "json_schema_to_grammar",
    "penalty_window",
]

# --------------------------------------------------------------------------- params


_UINT32 = 0xFFFFFFFF
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request, validated on construction (and ``replace``)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int = -1
    """-1 picks a random seed."""
    grammar: str | None = None
    """GBNF grammar with root rule ``root``, or None for unconstrained sampling."""
    grammar_lazy_triggers: tuple[str, ...] = ()
    """Literal strings; if given, the grammar applies only once one of them has been
    generated, and it must match the text from the trigger on (trigger included)."""

    def __post_init__(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidSamplingParams(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidSamplingParams(f"{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("top_k", "penalty_last_n", "seed"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
                object.__setattr__(self, name, value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidSamplingParams(f"{name} must be an integer, got {value!r}")
        if self.temperature < 0:
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise InvalidSamplingParams(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.repeat_penalty <= 0:
            raise InvalidSamplingParams(
                f"repeat_penalty must be > 0 (1.0: off), got {self.repeat_penalty}"
            )
        if not -1 <= self.penalty_last_n <= _INT32_MAX:
            raise InvalidSamplingParams(
                "penalty_last_n must be -1 (the whole context), 0 (off) or a positive "
                f"token count (at most the context size is used), got {self.penalty_last_n}"
            )
        if self.seed < -1:
            raise InvalidSamplingParams(f"seed must be >= -1 (-1: random), got {self.seed}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidSamplingParams(f"grammar must be a string or None, got {self.grammar!r}")
        triggers = self.grammar_lazy_triggers
        if isinstance(triggers, str):
            triggers = (triggers,)
        triggers = tuple(triggers)
        if any(not isinstance(t, str) or not t or "\0" in t for t in triggers):
            raise InvalidSamplingParams(
                f"grammar_lazy_triggers must be non-empty strings, got {triggers!r}"
            )
        if triggers and self.grammar is None:
            raise InvalidSamplingParams("grammar_lazy_triggers needs a grammar")
        object.__setattr__(self, "grammar_lazy_triggers", triggers)

    @property
    def penalties_active(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def replace(self, **changes: Any) -> SamplingParams:
        """Copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def model_copy(self, *, update: dict[str, Any] | None = None) -> SamplingParams:
        """Pydantic-style alias of :meth:`replace`."""
        return dataclasses.replace(self, **(update or {}))


def penalty_window(penalty_last_n: int, n_ctx: int | None) -> int:
    """The token count llama.cpp's penalties sampler should look back over.

    llama.cpp itself reads ``-1`` as 0 (off) and allocates a ring buffer of the
    requested size; here ``-1`` means the whole context (as in llama.cpp's common
    params) and a larger window is clamped to the context size: the history can
    never be longer, so the clamp changes nothing but the memory used.
    """
    if penalty_last_n == -1:
        if n_ctx is None:
            raise InvalidSamplingParams(
                "penalty_last_n=-1 (whole context) needs the context size (Sampler n_ctx=...)"
            )
        return n_ctx
    if n_ctx is not None:
        return min(penalty_last_n, n_ctx)
    return penalty_last_n


# --------------------------------------------------------------------------- sampler

#: Overrunning tokens refused one by one before the whole vocabulary is scanned.
_TRIAL_BANS = 8

_REGEX_SPECIAL = re.compile(r"[.^$|()*+?\[\]{}\\]")


def _trigger_pattern(words: Sequence[str]) -> str:
    """The ECMAScript regex llama.cpp itself builds for lazy trigger words: the
    grammar is fed the output from the first trigger on."""
    alts = "|".join(_REGEX_SPECIAL.sub(lambda m: "\\" + m.group(0), w) for w in words)
    return rf"[\s\S]*?({alts})[\s\S]*"


class Sampler:
    """A llama.cpp sampler chain built from :class:`SamplingParams`.

    The chain is penalties -> grammar -> greedy (temperature 0) or
    top-k -> top-p -> min-p -> temperature -> seeded draw. It owns native memory:
    call :meth:`close` (or use it as a context manager) when the request ends.
    """

    def __init__(self, vocab: Any, params: SamplingParams, *, n_ctx: int | None = None) -> None:
        self.params = params
        self._n_ctx = n_ctx
        self._chain: int | None = None
        self._grammar: int | None = None
        self._n_vocab = int(C.llama_vocab_n_tokens(vocab))
        self._cand: np.ndarray | None = None
        self._vocab = vocab
        self._tail = ""  # recent text, to see a lazy grammar's trigger coming
        self._pieces: list[str] | None = None  # token texts, read if many tokens overrun
        self._triggered = not params.grammar_lazy_triggers
        cparams = C.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = C.llama_sampler_chain_init(cparams)
        if not chain:
            raise MemoryError("llama_sampler_chain_init failed")
        self._chain = chain
        try:
            self._build(vocab, params)
        except BaseException:
            self.close()
            raise

    def _add(self, smpl: int | None, what: str) -> None:
        if not smpl:
            raise SamplingError(f"llama.cpp could not create the {what} sampler")
        C.llama_sampler_chain_add(self._chain, smpl)  # the chain takes ownership

    def _build(self, vocab: Any, p: SamplingParams) -> None:
        if p.penalties_active:
            self._add(
                C.llama_sampler_init_penalties(
                    C.llama_vocab_n_tokens(vocab),
                    penalty_window(p.penalty_last_n, self._n_ctx),
                    p.repeat_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                ),
                "penalties",
            )
        if p.grammar is not None:
            # Kept outside the chain: checking only the chosen token against the
            # grammar (and re-sampling under it when rejected) is what llama.cpp's
            # common sampler does; applying it to all 100k+ candidates each step is slow.
            self._grammar = _grammar_sampler(vocab, p.grammar, p.grammar_lazy_triggers)
        if p.temperature == 0:
            self._add(C.llama_sampler_init_greedy(), "greedy")
            return
        if p.top_k > 0:
            self._add(C.llama_sampler_init_top_k(p.top_k), "top-k")
        if p.top_p < 1:
            self._add(C.llama_sampler_init_top_p(p.top_p, 1), "top-p")
        if p.min_p > 0:
            self._add(C.llama_sampler_init_min_p(p.min_p, 1), "min-p")
        self._add(C.llama_sampler_init_temp(p.temperature), "temperature")
        # 0xFFFFFFFF is llama.cpp's "random seed"; keep explicit seeds off it.
        seed = C.LLAMA_DEFAULT_SEED if p.seed == -1 else p.seed % _UINT32
        self._add(C.llama_sampler_init_dist(seed), "dist")

    def sample(self, ctx: Any, idx: int) -> int:
        """Sample from output ``idx`` of the last decode; the token is also accepted
        by the chain (penalty history, grammar state)."""
        if self._chain is None:
            raise RuntimeError("sampler is closed")
        if self._grammar is None:
            return int(C.llama_sampler_sample(self._chain, ctx, idx))
        logits = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, idx), shape=(self._n_vocab,))
        if not self._triggered:
            tok = self._sample_before_trigger(logits)
        else:
            tok = self._apply(logits, grammar_first=False)
            one = np.zeros(1, dtype=_TOKEN_DATA)
            one["id"], one["logit"] = tok, logits[tok]
            arr = _token_array(one)
            C.llama_sampler_apply(self._grammar, ctypes.byref(arr))
            if not np.isfinite(one["logit"][0]):  # the grammar rejects it: sample under it
                tok = self._apply(logits, grammar_first=True)
                assert self._cand is not None
                if not np.isfinite(self._cand["logit"][self._cand["id"] == tok]).all():
                    # accepting a token the grammar refuses aborts llama.cpp
                    raise SamplingError(
                        "the grammar allows no token the model can produce here "
                        "(the constrained output cannot be completed)"
                    )
        C.llama_sampler_accept(self._grammar, tok)
        C.llama_sampler_accept(self._chain, tok)
        return tok

    def _sample_before_trigger(self, logits: np.ndarray) -> int:
        """Free sampling while a lazy grammar waits for its trigger.

        A token that completes the trigger *and* runs on past it would hand the grammar
        text it never checked (llama.cpp aborts on that), so such tokens are refused:
        the trigger always ends on a token boundary and the grammar takes over there.
        A few refusals are tried one by one; after that every overrunning token of the
        vocabulary is banned at once, so the draw always ends on an allowed token (or,
        if the model allows nothing else at all, on end-of-generation).
        """
        banned: set[int] = set()
        for attempt in range(_TRIAL_BANS + 2):
            if attempt == _TRIAL_BANS:
                banned |= self._overrunning_tokens()
            if attempt > _TRIAL_BANS or not self._any_allowed(logits, banned):
                tok = self._eog_id()  # nothing else may follow: end the generation
                self._tail = ""
                return tok
            tok = self._apply(logits, grammar_first=False, banned=sorted(banned))
            overrun, triggered, text = self._trigger_check(tok)
            if overrun:
                banned.add(tok)
                continue
            self._triggered = triggered
            self._tail = text[-self._longest_trigger :]
            return tok
        raise AssertionError("unreachable")  # pragma: no cover

    @property
    def _longest_trigger(self) -> int:
        return max(len(t) for t in self.params.grammar_lazy_triggers)

    def _trigger_check(self, tok: int) -> tuple[bool, bool, str]:
        """(runs past a trigger, completes one exactly, new text) if ``tok`` comes next."""
        text = self._tail + self._piece(tok)
        hits = [(i, len(t)) for t in self.params.grammar_lazy_triggers if (i := text.find(t)) >= 0]
        if not hits:
            return False, False, text
        start, n = min(hits)
        return start + n < len(text), True, text

    def _overrunning_tokens(self) -> set[int]:
        """Every token that would complete a trigger and run past it after the current tail.

        Only pieces holding a trigger's last character before their own end can do
        that, so the full check runs on few tokens; the pieces are read once per sampler.
        """
        if self._pieces is None:
            self._pieces = [self._piece(t) for t in range(self._n_vocab)]
        ends = {t[-1] for t in self.params.grammar_lazy_triggers}
        return {
            tok
            for tok, piece in enumerate(self._pieces)
            if any(c in piece[:-1] for c in ends) and self._trigger_check(tok)[0]
        }

    def _any_allowed(self, logits: np.ndarray, banned: set[int]) -> bool:
        if not banned:
            return bool(np.isfinite(logits).any())
        mask = np.isfinite(logits)
        mask[list(banned)] = False
        return bool(mask.any())

    def _eog_id(self) -> int:
        eos = int(C.llama_vocab_eos(self._vocab))
        return eos if eos >= 0 else int(C.llama_vocab_eot(self._vocab))

    def _piece(self, tok: int) -> str:
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self._vocab, tok, buf, 64, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, tok, buf, -n, 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def _apply(self, logits: np.ndarray, *, grammar_first: bool, banned: Sequence[int] = ()) -> int:
        cand = self._cand
        if cand is None:
            cand = self._cand = np.zeros(self._n_vocab, dtype=_TOKEN_DATA)
        cand["id"] = np.arange(self._n_vocab, dtype=np.int32)
        cand["logit"] = logits
        cand["p"] = 0.0
        if banned:
            cand["logit"][list(banned)] = -np.inf
        arr = _token_array(cand)
        if grammar_first:
            C.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        C.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if arr.selected < 0 or arr.selected >= arr.size:
            raise SamplingError("the sampler chain selected no token")
        return int(arr.data[arr.selected].id)

    def close(self) -> None:
        chain, self._chain = self._chain, None
        if chain:
            C.llama_sampler_free(chain)
        grammar, self._grammar = self._grammar, None
        if grammar:
            C.llama_sampler_free(grammar)

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the bindings may be gone
            pass


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def _token_array(cand: np.ndarray) -> Any:
    """A ``llama_token_data_array`` viewing ``cand`` (which must outlive it)."""
    return C.llama_token_data_array(
        data=cand.ctypes.data_as(C.llama_token_data_p),
        size=len(cand),
        selected=-1,
        sorted=False,
    )


def _grammar_sampler(vocab: Any, grammar: str, triggers: Sequence[str]) -> int:
    gbytes = grammar.encode("utf-8")
    if b"\0" in gbytes:
        raise ValueError("invalid grammar: it contains a NUL character")
    check_grammar(grammar)
    if not triggers:
        smpl = C.llama_sampler_init_grammar(vocab, gbytes, b"root")
    else:
        pattern = _trigger_pattern(triggers).encode("utf-8")
        patterns = (ctypes.c_char_p * 1)(pattern)
        no_tokens = (C.llama_token * 1)()
        smpl = C.llama_sampler_init_grammar_lazy_patterns(
            vocab, gbytes, b"root", patterns, 1, no_tokens, 0
        )
    if not smpl:
        head = grammar if len(grammar) <= 200 else grammar[:200] + "..."
        raise ValueError(
            "invalid grammar: llama.cpp could not parse it or it has no 'root' rule "
            f"(the llama.cpp log has the position): {head!r}"
        )
    return smpl


# --------------------------------------------------------------------------- streaming


class StopMatcher:
    """Applies stop strings to generated text while streaming, never emitting a
    partial stop string.

    Text is held back only while its tail could still become a stop string; the
    emitted text is always the generated text cut at the earliest stop occurrence.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = sorted({s for s in stop if s}, key=len)
        self._buf = ""
        self.stopped = False

    def _potential_start(self) -> int | None:
        """Earliest index whose suffix is a proper prefix of some stop string."""
        buf = self._buf
        longest = max((len(s) for s in self._stops), default=0)
        for j in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return j
        return None

    def _first_match(self) -> int | None:
        found = [i for s in self._stops if (i := self._buf.find(s)) >= 0]
        return min(found) if found else None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        self._buf += text
        match = self._first_match()
        held = self._potential_start()
        if match is not None and (held is None or match <= held):
            out, self._buf, self.stopped = self._buf[:match], "", True
            return out, True
        cut = len(self._buf) if held is None else held
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, False

    def flush(self) -> str:
        """Held-back text at the end of generation (cut at a stop string that matched
        while a longer, earlier one could still have completed)."""
        if self.stopped:
            return ""
        match = self._first_match()
        out = self._buf if match is None else self._buf[:match]
        self.stopped = match is not None
        self._buf = ""
        return out


class Utf8Decoder:
    """Turns token pieces (bytes) into text incrementally; a multi-byte character
    split across tokens is emitted once complete."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._dec.decode(piece, final=False)

    def flush(self) -> str:
        """Pending bytes of an incomplete character become U+FFFD."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


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


class _Converter(G.SchemaConverter):
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


def _relocate(schema: Any, prefix: str, defs_out: dict[str, Any]) -> dict[str, Any]:
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


def _convert(root: dict[str, Any], defs: dict[str, Any], root_name: str = "") -> str:
    """Run the converter on ``root`` (with ``defs`` as its ``$defs``)."""
    with converting():
        schema = copy.deepcopy(root)
        if defs:
            schema["$defs"] = copy.deepcopy(defs)
        conv = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
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
    body = _relocate(schema, "ref-", defs)
    return _convert(body, defs)
