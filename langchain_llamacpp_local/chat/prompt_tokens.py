"""A rendered prompt's tokens, one message at a time, each message tokenized once.

An agent loop sends the whole conversation again at every turn and only its last
messages are new; tokenizing the whole text again is the largest cost of a turn before
its decode (llama.cpp's BPE pre-tokenizer: about a millisecond per 3,000 characters).

llama.cpp tokenizes with ``parse_special`` in two steps: it first splits the text at the
special tokens' texts (longest first, each scanned left to right), then tokenizes every
text fragment between them on its own. So where a special token is matched whatever
text surrounds it, the prompt can be cut just before it and the pieces tokenized apart:
their tokens, joined, are the whole text's tokens. :func:`safe_cuts` decides which
tokens allow that (a pure function of the vocabulary's special-token table);
:class:`PromptTokenizer` cuts before the template's message markers and remembers each
piece's tokens, so a turn tokenizes only the messages it adds.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from langchain_llamacpp_local.llama.engine import Engine
    from langchain_llamacpp_local.llama.vocab import SpecialToken

#: what C's ``isspace`` strips next to a token with the lstrip/rstrip attribute
_C_SPACE = " \t\n\v\f\r"

#: tokens the pieces' memo holds at most (least recently used pieces go first)
MEMO_TOKENS = 1 << 18


def _overlaps(a: bytes, b: bytes) -> bool:
    """Whether a proper suffix of ``a`` is a proper prefix of ``b`` (``a`` starts before
    ``b`` and ends inside it)."""
    i = a.find(b[:1], 1)
    while i > 0:
        if len(a) - i < len(b) and b.startswith(a[i:]):
            return True
        i = a.find(b[:1], i + 1)
    return False


def safe_cuts(specials: Sequence[SpecialToken], candidates: Iterable[int]) -> tuple[str, ...]:
    """The texts of the ``candidates`` (special-token ids) before whose every occurrence
    a prompt can be cut, its pieces tokenized apart with the whole text's result.

    ``specials`` is llama.cpp's special-token table (every control, user-defined and
    unknown token). A candidate qualifies when its match at any position is certain and
    changes nothing before it:

    - no special token contains its text, and none that is scanned before it (at least
      as long, in bytes) overlaps it partly, so no other match takes its characters;
    - its own text does not overlap itself (a left-to-right scan matches every one);
    - it has no lstrip attribute (that would strip the whitespace before the cut) and
      neither starts nor ends with whitespace (a neighbour's strip would eat into it).
    """
    by_id = {s.id: s for s in specials}
    out: list[str] = []
    for tok in dict.fromkeys(candidates):
        cand = by_id.get(tok)
        if cand is None or cand.lstrip or not cand.text:
            continue
        text = cand.text
        if text[0] in _C_SPACE or text[-1] in _C_SPACE:
            continue
        t = text.encode("utf-8")
        if _overlaps(t, t):
            continue
        safe = True
        for other in specials:
            if other.id == tok:
                continue
            s = other.text.encode("utf-8")
            if t in s or (len(s) >= len(t) and (_overlaps(s, t) or _overlaps(t, s))):
                safe = False
                break
        if safe and text not in out:
            out.append(text)
    return tuple(out)


class PromptTokenizer:
    """Tokenizes one model's rendered prompts piece by piece, cut before each occurrence
    of the safe ones among ``candidates`` (special-token ids: the template's message
    markers), remembering each piece's tokens: the text before the first cut with the
    model's added tokens (BOS), every later piece without. Safe to share between
    threads; what it needs of the vocabulary is read at its first use."""

    def __init__(self, candidates: Sequence[int], *, memo_tokens: int = MEMO_TOKENS) -> None:
        self.candidates = tuple(candidates)
        self.cuts: tuple[str, ...] | None = None
        self._re: re.Pattern[str] | None = None
        self._memo: OrderedDict[tuple[bool, str], tuple[int, ...]] = OrderedDict()
        self._held = 0
        self._limit = memo_tokens
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Tokens the memo holds now."""
        return self._held

    def _setup(self, eng: Engine) -> None:
        from langchain_llamacpp_local.chat.special_tokens import vocab_info

        cuts = safe_cuts(vocab_info(eng).specials, self.candidates) if self.candidates else ()
        # a tokenizer that adds a token at the end (EOS, BERT's SEP) would add it to every
        # piece: such prompts are tokenized whole
        probe = eng.tokenize("a", add_special=False, parse_special=True)
        added = eng.tokenize("a", add_special=True, parse_special=True)
        if added[len(added) - len(probe) :] != probe:
            cuts = ()
        if cuts:
            self._re = re.compile(
                "|".join(re.escape(c) for c in sorted(cuts, key=len, reverse=True))
            )
        self.cuts = cuts

    def pieces(self, text: str) -> list[str]:
        """``text`` cut before every occurrence of a cut token after its start."""
        if self._re is None:
            return [text]
        bounds = [0, *(m.start() for m in self._re.finditer(text, 1)), len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def tokenize(self, eng: Engine, text: str) -> list[int]:
        """The tokens of ``text`` with the model's added tokens, as
        ``eng.tokenize(text, add_special=True, parse_special=True)`` gives them."""
        if self.cuts is None:
            self._setup(eng)
        if self._re is None:
            return eng.tokenize(text, add_special=True, parse_special=True)
        out: list[int] = []
        for i, piece in enumerate(self.pieces(text)):
            out.extend(self._piece(eng, piece, first=i == 0))
        return out

    def plain(self, eng: Engine, text: str) -> tuple[int, ...]:
        """``text``'s tokens without added tokens, control-token texts parsed (a marker
        every request of the model asks for: tokenized once)."""
        return self._piece(eng, text, first=False)

    def _piece(self, eng: Engine, piece: str, *, first: bool) -> tuple[int, ...]:
        """``piece``'s tokens from the memo, or tokenized and remembered (``first``: with
        the model's added tokens)."""
        key = (first, piece)
        with self._lock:
            toks = self._memo.get(key)
            if toks is not None:
                self._memo.move_to_end(key)
                return toks
        toks = tuple(eng.tokenize(piece, add_special=first, parse_special=True))
        if len(toks) > self._limit:
            return toks
        with self._lock:
            if key not in self._memo:
                self._memo[key] = toks
                self._held += len(toks)
                while self._held > self._limit:
                    _, old = self._memo.popitem(last=False)
                    self._held -= len(old)
        return toks
