"""Token sampling: the validated settings of one request and the llama.cpp sampler
chain built from them.

* :class:`SamplingParams` is the validated, immutable set of sampling settings of one
  request; :func:`chain_plan` decides which of llama.cpp's samplers it makes, in
  llama.cpp's order, and :class:`Sampler` builds that chain, with the request's grammar
  (:mod:`.json_grammar` builds JSON ones, or the user gives one) checked beside it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import InvalidSamplingParams, SamplingError
from langchain_llamacpp_local.llama.json_grammar import check_grammar

# --------------------------------------------------------------------------- params


_UINT32 = 0xFFFFFFFF
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request, validated on construction (and ``replace``).

    The defaults are llama.cpp's: DRY, top-n-sigma, typical, XTC, dynamic temperature,
    Mirostat and the logit bias are off (the chain they make: :func:`chain_plan`).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    dry_multiplier: float = 0.0
    """DRY repetition penalty (0: off): a token extending a repeat longer than
    ``dry_allowed_length`` loses ``multiplier * base ** (length - allowed)``."""
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    """How many recent tokens DRY scans (-1: the whole context, 0: off)."""
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    """Texts that end a repeat DRY tracks (llama.cpp's defaults)."""
    top_n_sigma: float = -1.0
    """Keep tokens within n standard deviations of the top logit (-1: off)."""
    typical_p: float = 1.0
    """Locally typical sampling (1.0: off)."""
    xtc_probability: float = 0.0
    """Chance, per token, that XTC removes every choice above ``xtc_threshold`` but the
    least likely of them (0: off); drawn from the request's seed."""
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    """Dynamic temperature: the temperature moves within ``temperature`` +- this range
    with the entropy of the candidates (0: off)."""
    dynatemp_exponent: float = 1.0
    mirostat: int = 0
    """0: off; 1 or 2: Mirostat (v1/v2) replaces top-k/top-p/min-p and the other
    truncations, aiming at a surprise of ``mirostat_tau``."""
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: tuple[tuple[int | str, float], ...] | None = None
    """(token, bias) pairs, given as a mapping or pairs: a token id, or a text that is
    one token of the model's vocabulary; ``-inf`` (or False) bans the token."""
    seed: int = -1
    """-1 picks a random seed."""
    grammar: str | None = None
    """GBNF grammar with root rule ``root``, or None for unconstrained sampling."""
    grammar_lazy_triggers: tuple[str, ...] = ()
    """Literal strings; if given, the grammar applies only once one of them has been
    generated, and it must match the text from the trigger on (trigger included)."""

    def __post_init__(self) -> None:
        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidSamplingParams(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidSamplingParams(f"{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in _INTS:
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
        for name in ("penalty_last_n", "dry_penalty_last_n"):
            if not -1 <= getattr(self, name) <= _INT32_MAX:
                raise InvalidSamplingParams(
                    f"{name} must be -1 (the whole context), 0 (off) or a positive "
                    f"token count (at most the context size is used), got {getattr(self, name)}"
                )
        if self.seed < -1:
            raise InvalidSamplingParams(f"seed must be >= -1 (-1: random), got {self.seed}")
        self._check_added_samplers()
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidSamplingParams(f"grammar must be a string or None, got {self.grammar!r}")
        if self.grammar is not None and "\0" in self.grammar:
            raise InvalidSamplingParams("grammar must not contain a NUL character")
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

    def _check_added_samplers(self) -> None:
        """Ranges of DRY, top-n-sigma, typical, XTC, dynamic temperature, Mirostat and
        the logit bias (their types were checked with the others)."""
        if self.dry_multiplier < 0:
            raise InvalidSamplingParams(
                f"dry_multiplier must be >= 0 (0: off), got {self.dry_multiplier}"
            )
        if self.dry_base < 1:
            raise InvalidSamplingParams(
                f"dry_base must be >= 1 (llama.cpp turns DRY off below 1), got {self.dry_base}"
            )
        if not 0 <= self.dry_allowed_length <= _INT32_MAX:
            raise InvalidSamplingParams(
                f"dry_allowed_length must be >= 0, got {self.dry_allowed_length}"
            )
        object.__setattr__(
            self, "dry_sequence_breakers", _sequence_breakers(self.dry_sequence_breakers)
        )
        if self.top_n_sigma != -1 and self.top_n_sigma <= 0:
            raise InvalidSamplingParams(
                f"top_n_sigma must be > 0 (-1: off), got {self.top_n_sigma}"
            )
        if not 0 < self.typical_p <= 1:
            raise InvalidSamplingParams(
                f"typical_p must be in (0, 1] (1.0: off), got {self.typical_p}"
            )
        if not 0 <= self.xtc_probability <= 1:
            raise InvalidSamplingParams(
                f"xtc_probability must be in [0, 1] (0: off), got {self.xtc_probability}"
            )
        if not 0 <= self.xtc_threshold <= 0.5:
            raise InvalidSamplingParams(
                "xtc_threshold must be in [0, 0.5] (above 0.5 no two choices can pass it, "
                f"so XTC would never remove one), got {self.xtc_threshold}"
            )
        if self.dynatemp_range < 0:
            raise InvalidSamplingParams(
                f"dynatemp_range must be >= 0 (0: off), got {self.dynatemp_range}"
            )
        if self.dynatemp_exponent <= 0:
            raise InvalidSamplingParams(
                f"dynatemp_exponent must be > 0, got {self.dynatemp_exponent}"
            )
        if self.mirostat not in (0, 1, 2):
            raise InvalidSamplingParams(
                f"mirostat must be 0 (off), 1 or 2 (the Mirostat version), got {self.mirostat}"
            )
        if self.mirostat_tau <= 0:
            raise InvalidSamplingParams(f"mirostat_tau must be > 0, got {self.mirostat_tau}")
        if not 0 < self.mirostat_eta <= 1:
            raise InvalidSamplingParams(f"mirostat_eta must be in (0, 1], got {self.mirostat_eta}")
        if self.temperature == 0:
            for name, on in (
                ("dynatemp_range", self.dynatemp_range > 0),
                ("mirostat", self.mirostat),
            ):
                if on:
                    raise InvalidSamplingParams(
                        f"{name} samples, but temperature=0 is greedy: give a temperature "
                        f"> 0 or leave {name} off"
                    )
        if self.mirostat:
            skipped = [name for name, on in self._mirostat_skips() if on]
            if skipped:
                raise InvalidSamplingParams(
                    f"mirostat={self.mirostat} replaces the sampler chain (llama.cpp's "
                    f"mirostat chain is logit bias, temperature, mirostat): turn off "
                    f"{', '.join(skipped)} or mirostat"
                )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    def _mirostat_skips(self) -> list[tuple[str, bool]]:
        """The samplers turned on that llama.cpp's mirostat chain leaves out (top-k,
        top-p and min-p, on by default, are documented as replaced)."""
        return [
            ("the penalties", self.penalties_active),
            ("dry_multiplier", self.dry_active),
            ("top_n_sigma", self.top_n_sigma > 0),
            ("typical_p", self.typical_p < 1),
            ("xtc_probability", self.xtc_active),
            ("dynatemp_range", self.dynatemp_range > 0),
        ]

    @property
    def penalties_active(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def dry_active(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def xtc_active(self) -> bool:
        return self.xtc_probability > 0

    def replace(self, **changes: Any) -> SamplingParams:
        """Copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def model_copy(self, *, update: dict[str, Any] | None = None) -> SamplingParams:
        """Pydantic-style alias of :meth:`replace`."""
        return dataclasses.replace(self, **(update or {}))


_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "top_n_sigma",
    "typical_p",
    "xtc_probability",
    "xtc_threshold",
    "dynatemp_range",
    "dynatemp_exponent",
    "mirostat_tau",
    "mirostat_eta",
)
_INTS = ("top_k", "penalty_last_n", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "seed")

#: Most DRY sequence breakers: llama.cpp scans the whole vocabulary for each one when
#: the sampler is built (on every request), so a long list is slow, not useful.
MAX_DRY_SEQUENCE_BREAKERS = 32
#: Longest breaker, in UTF-8 bytes: llama.cpp cuts longer ones to this, silently.
MAX_DRY_BREAKER_BYTES = 40
#: Most logit bias entries (more than any vocabulary has tokens) and the longest text
#: key: a key names one token, never a document.
MAX_LOGIT_BIAS_ENTRIES = 1 << 20
MAX_LOGIT_BIAS_KEY_CHARS = 256
#: Largest bias magnitude: past float32's range a bias would turn a logit infinite
#: (OpenAI's own limit is 100); use -inf to ban a token.
MAX_LOGIT_BIAS = 1e6


def _sequence_breakers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        raise InvalidSamplingParams(
            "dry_sequence_breakers must be a list of strings, not one string "
            f"(each character would be a breaker): {value[:40]!r}"
        )
    if not isinstance(value, (list, tuple)):
        raise InvalidSamplingParams(
            f"dry_sequence_breakers must be a list of strings, got {type(value).__name__}"
        )
    if len(value) > MAX_DRY_SEQUENCE_BREAKERS:
        raise InvalidSamplingParams(
            f"dry_sequence_breakers holds {len(value)} strings, more than the "
            f"{MAX_DRY_SEQUENCE_BREAKERS} allowed (llama.cpp scans the vocabulary for each)"
        )
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s or "\0" in s:
            raise InvalidSamplingParams(
                f"dry_sequence_breakers[{i}] must be a non-empty string without NUL, got {s!r}"
            )
        try:
            n = len(s.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidSamplingParams(
                f"dry_sequence_breakers[{i}] is not valid Unicode: {s!r}"
            ) from None
        if n > MAX_DRY_BREAKER_BYTES:
            raise InvalidSamplingParams(
                f"dry_sequence_breakers[{i}] is {n} bytes long, more than the "
                f"{MAX_DRY_BREAKER_BYTES} llama.cpp keeps of a breaker: {s[:40]!r}..."
            )
    return tuple(value)


def _bias_value(key: Any, value: Any) -> float:
    """A bias as a float: a finite number, or ``-inf`` / ``"-inf"`` / False (a ban)."""
    if value is False or (
        isinstance(value, str) and value.strip().lower() in ("-inf", "-infinity")
    ):
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingParams(
            f"logit_bias[{key!r}] must be a number or -inf (a ban), got {value!r}"
        )
    value = float(value)
    if value == -math.inf:
        return value
    if not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
        raise InvalidSamplingParams(
            f"logit_bias[{key!r}] must be a finite number within +-{MAX_LOGIT_BIAS:g} "
            f"or -inf (a ban), got {value!r}"
        )
    return value


def _bias_key(key: Any) -> int | str:
    """A token id, or a non-empty text to look up in the vocabulary (a string of
    digits is an id, as JSON keys and OpenAI's API give them)."""
    if isinstance(key, bool):
        raise InvalidSamplingParams(f"logit_bias keys must be token ids or texts, got {key!r}")
    if isinstance(key, int):
        if not 0 <= key <= _INT32_MAX:
            raise InvalidSamplingParams(f"logit_bias token id {key} is negative or too large")
        return key
    if not isinstance(key, str):
        raise InvalidSamplingParams(
            f"logit_bias keys must be token ids or texts, got {type(key).__name__} {key!r}"
        )
    if key.isascii() and key.isdigit():
        return _bias_key(int(key))
    if not key or "\0" in key or len(key) > MAX_LOGIT_BIAS_KEY_CHARS:
        raise InvalidSamplingParams(
            "logit_bias text keys must be non-empty, without NUL and at most "
            f"{MAX_LOGIT_BIAS_KEY_CHARS} characters (one token's text), got {key[:60]!r}"
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidSamplingParams(f"logit_bias key {key!r} is not valid Unicode") from None
    return key


def _logit_bias(value: Any) -> tuple[tuple[int | str, float], ...] | None:
    """``logit_bias`` as (token id or text, bias) pairs, from a mapping or pairs."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise InvalidSamplingParams(
                    f"logit_bias must be a mapping of token -> bias or (token, bias) pairs, "
                    f"got the entry {item!r}"
                )
    else:
        raise InvalidSamplingParams(
            "logit_bias must be a mapping of token -> bias (a token id or its text), got "
            f"{type(value).__name__}"
        )
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidSamplingParams(
            f"logit_bias holds {len(items)} entries, more than the {MAX_LOGIT_BIAS_ENTRIES} allowed"
        )
    out = tuple((_bias_key(k), _bias_value(k, v)) for k, v in items)
    return out or None


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


def chain_plan(p: SamplingParams) -> tuple[str, ...]:
    """The samplers of ``p``'s chain, in order: llama.cpp's ``common_sampler_init``
    with each sampler that is off left out (the grammar is checked beside the chain).

    Temperature 0 ends in a greedy pick; truncation (top-n-sigma, top-k, top-p, min-p)
    never drops the most likely token, so it is left out there unless a sampler after
    it (typical, XTC) reads the probabilities it leaves. Mirostat replaces everything
    between the logit bias and the draw, as in llama.cpp.
    """
    head = ("logit-bias",) if p.logit_bias else ()
    if p.mirostat:
        return (*head, "temp", "mirostat" if p.mirostat == 1 else "mirostat-v2")
    plan = [*head]
    if p.penalties_active:
        plan.append("penalties")
    if p.dry_active:
        plan.append("dry")
    greedy = p.temperature == 0
    if not greedy or p.typical_p < 1 or p.xtc_active:
        for name, on in (
            ("top-n-sigma", p.top_n_sigma > 0),
            ("top-k", p.top_k > 0),
            ("typical", p.typical_p < 1),
            ("top-p", p.top_p < 1),
            ("min-p", p.min_p > 0),
            ("xtc", p.xtc_active),
        ):
            if on:
                plan.append(name)
    if greedy:
        plan.append("greedy")
    else:
        plan += ["temp-ext" if p.dynatemp_range > 0 else "temp", "dist"]
    return tuple(plan)


class Sampler:
    """A llama.cpp sampler chain built from :class:`SamplingParams` (the samplers of
    :func:`chain_plan`), with the request's grammar checked beside it.

    It owns native memory: call :meth:`close` (or use it as a context manager) when
    the request ends.
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
        self._argmax_only = False  # the chain is greedy alone (set by _build)
        #: a view on the logits row last read, and its address in llama.cpp's buffer
        self._row: np.ndarray | None = None
        self._row_at: int | None = None
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

    def _add(self, smpl: Any, what: str) -> None:
        if not smpl:
            raise SamplingError(f"llama.cpp could not create the {what} sampler")
        C.llama_sampler_chain_add(self._chain, smpl)  # the chain takes ownership

    def _build(self, vocab: Any, p: SamplingParams) -> None:
        if p.grammar is not None:
            # Kept outside the chain: checking only the chosen token against the
            # grammar (and re-sampling under it when rejected) is what llama.cpp's
            # common sampler does; applying it to all 100k+ candidates each step is slow.
            self._grammar = _grammar_sampler(vocab, p.grammar, p.grammar_lazy_triggers)
        plan = chain_plan(p)
        for name in plan:
            self._add(self._make(name, vocab, p), name)
        self._argmax_only = plan == ("greedy",)

    def _make(self, name: str, vocab: Any, p: SamplingParams) -> Any:
        """llama.cpp's sampler ``name`` (a :func:`chain_plan` entry) with ``p``'s values."""
        # 0xFFFFFFFF is llama.cpp's "random seed"; keep explicit seeds off it. Every
        # random sampler (XTC, Mirostat, the draw) takes the request's seed, as in
        # llama.cpp, so a seeded request is reproduced whole.
        seed = C.LLAMA_DEFAULT_SEED if p.seed == -1 else p.seed % _UINT32
        if name == "logit-bias":
            assert p.logit_bias is not None
            return _logit_bias_sampler(vocab, self._n_vocab, p.logit_bias)
        if name == "penalties":
            return C.llama_sampler_init_penalties(
                self._n_vocab,
                penalty_window(p.penalty_last_n, self._n_ctx),
                p.repeat_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            )
        if name == "dry":
            return _dry_sampler(vocab, p, self._n_ctx)
        makers: dict[str, Callable[[], Any]] = {
            "top-n-sigma": lambda: C.llama_sampler_init_top_n_sigma(p.top_n_sigma),
            "top-k": lambda: C.llama_sampler_init_top_k(p.top_k),
            "typical": lambda: C.llama_sampler_init_typical(p.typical_p, 1),
            "top-p": lambda: C.llama_sampler_init_top_p(p.top_p, 1),
            "min-p": lambda: C.llama_sampler_init_min_p(p.min_p, 1),
            "xtc": lambda: C.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, seed),
            "temp": lambda: C.llama_sampler_init_temp(p.temperature),
            "temp-ext": lambda: C.llama_sampler_init_temp_ext(
                p.temperature, p.dynatemp_range, p.dynatemp_exponent
            ),
            "greedy": C.llama_sampler_init_greedy,
            "dist": lambda: C.llama_sampler_init_dist(seed),
            "mirostat": lambda: C.llama_sampler_init_mirostat(
                self._n_vocab, seed, p.mirostat_tau, p.mirostat_eta, _MIROSTAT_M
            ),
            "mirostat-v2": lambda: C.llama_sampler_init_mirostat_v2(
                seed, p.mirostat_tau, p.mirostat_eta
            ),
        }
        return makers[name]()

    def sample(self, ctx: Any, idx: int) -> int:
        """Sample from output ``idx`` of the last decode; the token is also accepted
        by the chain (penalty history, grammar state)."""
        if self._chain is None:
            raise RuntimeError("sampler is closed")
        if self._grammar is None:
            if self._argmax_only:
                # the chain is llama.cpp's greedy sampler alone: it copies all n_vocab
                # logits into a candidate array to take their first maximum, about 0.3 ms
                # a token for a 49k vocabulary (a few % of a small model's decode step);
                # numpy's argmax picks the same first maximum in a few µs. A NaN (which
                # numpy would pick) goes to llama.cpp as before.
                logits = self._logits(ctx, idx)
                tok = int(logits.argmax())
                if logits[tok] == logits[tok]:
                    C.llama_sampler_accept(self._chain, tok)
                    return tok
            return int(C.llama_sampler_sample(self._chain, ctx, idx))
        logits = self._logits(ctx, idx)
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

    def _logits(self, ctx: Any, idx: int) -> np.ndarray:
        """Output ``idx``'s logits: a view on llama.cpp's output buffer, made again only
        when the row's address changes (a request's steps read the same row; making the
        view is most of a greedy step's sampling time)."""
        ptr = C.llama_get_logits_ith(ctx, idx)
        at = ctypes.cast(ptr, ctypes.c_void_p).value
        if at != self._row_at or self._row is None:
            self._row = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            self._row_at = at
        return self._row

    def force(self, tok: int) -> int:
        """Take ``tok`` as if it had been sampled (a forced end of thinking): the chain
        and the grammar accept it; a grammar that refuses it is an error, never an abort."""
        if self._chain is None:
            raise RuntimeError("sampler is closed")
        if self._grammar is not None:
            if not self._triggered:
                _, self._triggered, text = self._trigger_check(tok)
                self._tail = text[-self._longest_trigger :]
            else:  # under the grammar: only a token it allows
                one = np.zeros(1, dtype=_TOKEN_DATA)
                one["id"], one["logit"] = tok, 0.0
                C.llama_sampler_apply(self._grammar, ctypes.byref(_token_array(one)))
                if not np.isfinite(one["logit"][0]):
                    raise SamplingError("the grammar does not allow the forced end of thinking")
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


#: Tokens Mirostat 1 estimates the distribution's shape from (llama.cpp's value).
_MIROSTAT_M = 100


def _dry_sampler(vocab: Any, p: SamplingParams, n_ctx: int | None) -> Any:
    breakers = [b.encode("utf-8") for b in p.dry_sequence_breakers]
    arr = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
    return C.llama_sampler_init_dry(
        vocab,
        p.dry_multiplier,
        p.dry_base,
        p.dry_allowed_length,
        penalty_window(p.dry_penalty_last_n, n_ctx),
        arr,
        len(breakers),
    )


def logit_bias_tokens(
    vocab: Any, n_vocab: int, bias: Sequence[tuple[int | str, float]]
) -> list[tuple[int, float]]:
    """``bias`` with each key as a token id of ``vocab``: a text must be exactly one
    token (no BOS; special-token texts such as ``<|im_end|>`` name their token), an id
    must be in the vocabulary, and no token may be given twice."""
    from langchain_llamacpp_local.llama.vocab import token_piece, tokenize

    out: list[tuple[int, float]] = []
    named: dict[int, int | str] = {}
    for key, value in bias:
        if isinstance(key, str):
            toks = tokenize(vocab, key, add_special=False, parse_special=True)
            if len(toks) != 1:
                pieces = [token_piece(vocab, t).decode("utf-8", "replace") for t in toks[:8]]
                raise InvalidSamplingParams(
                    f"logit_bias key {key!r} is {len(toks)} tokens of this model "
                    f"({pieces}{'...' if len(toks) > 8 else ''}), not one: give one "
                    "token's text or its id (get_token_ids() shows them)"
                )
            tok = toks[0]
            if C.llama_vocab_get_attr(vocab, tok) & C.LLAMA_TOKEN_ATTR_UNKNOWN:
                raise InvalidSamplingParams(
                    f"logit_bias key {key!r} is not in this model's vocabulary (it reads "
                    "as the unknown token)"
                )
        else:
            tok = key
            if tok >= n_vocab:
                raise InvalidSamplingParams(
                    f"logit_bias token id {tok} is not in this model's vocabulary of "
                    f"{n_vocab} tokens"
                )
        if tok in named:
            raise InvalidSamplingParams(
                f"logit_bias gives token {tok} twice (as {named[tok]!r} and {key!r})"
            )
        named[tok] = key
        out.append((tok, value))
    return out


def _logit_bias_sampler(vocab: Any, n_vocab: int, bias: Sequence[tuple[int | str, float]]) -> Any:
    pairs = logit_bias_tokens(vocab, n_vocab, bias)
    arr = (C.llama_logit_bias * len(pairs))()
    for i, (tok, value) in enumerate(pairs):
        arr[i].token, arr[i].bias = tok, value
    return C.llama_sampler_init_logit_bias(n_vocab, len(pairs), arr)


# --------------------------------------------------------------------------- streaming
