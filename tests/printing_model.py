"""A tiny GGUF model that prints one exact text, for end-to-end tests of output parsing.

Built on :func:`tests.gguf_models.write_scripted_llama` (the next token depends only on
the last one): the text is cut into pieces of distinct texts, each a user-defined token
whose successor is the next piece; whatever the prompt ends with is followed by the
first piece, the last piece by EOS. Greedy decoding then prints exactly the text, as
the worker's real request path sees it (stop strings, grammar, parser, streaming), and
``max_tokens=k`` cuts it after ``k`` pieces.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.gguf_models import write_scripted_llama


def pieces_of(
    text: str, size: int = 3, cuts: tuple[str, ...] = (), taken: frozenset[str] = frozenset()
) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, no two pieces alike.

    A piece never runs past the end of one of ``cuts`` (a lazy grammar's trigger such
    as ``<tool_call>`` must end on a token boundary, as llama.cpp requires), nor
    equals one of ``taken`` (another text's pieces).
    """
    ends = {m.end() for c in cuts if c for m in re.finditer(re.escape(c), text)}
    out: list[str] = []
    seen: set[str] = set(taken)
    pos = 0
    while pos < len(text):
        stop = min([len(text)] + [e for e in ends if e > pos])
        end = min(pos + size, stop)
        while text[pos:end] in seen and end < len(text):
            end += 1
        piece = text[pos:end]
        if piece in seen:  # the text's tail repeats an earlier piece: join it to the last
            out[-1] += piece
            seen.add(out[-1])
        else:
            out.append(piece)
            seen.add(piece)
        pos = end
    return out


def write_printing_llama(
    path: Path,
    text: str,
    *,
    chat_template: str | None = None,
    size: int = 3,
    cuts: tuple[str, ...] = (),
) -> tuple[Path, list[str]]:
    """Write a model that answers every prompt with ``text``; returns (path, its pieces)."""
    pieces = pieces_of(text, size, cuts)
    transitions = {p: {nxt: 20.0} for p, nxt in zip(pieces, [*pieces[1:], "</s>"], strict=True)}
    path = write_scripted_llama(
        path,
        transitions=transitions,
        extra_tokens=tuple(pieces),
        default_next=pieces[0],
        chat_template=chat_template,
    )
    return path, pieces


def write_turns_llama(
    path: Path,
    turns: dict[str, str],
    *,
    chat_template: str,
    size: int = 3,
    cuts: tuple[str, ...] = (),
) -> Path:
    """A model that prints ``turns[c]`` after a prompt ending in the character ``c``
    (a scripted agent: one text after the question, another after the tool results).

    The texts are cut into pieces jointly, so no piece serves two of them."""
    pieces: list[str] = []
    transitions: dict[str, dict[str, float]] = {}
    for last, text in turns.items():
        own = pieces_of(text, size, cuts, frozenset(pieces))
        pieces += own
        transitions[last] = {own[0]: 20.0}
        for p, nxt in zip(own, [*own[1:], "</s>"], strict=True):
            transitions[p] = {nxt: 20.0}
    return write_scripted_llama(
        path, transitions=transitions, extra_tokens=tuple(pieces), chat_template=chat_template
    )
