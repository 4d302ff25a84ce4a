"""A reply's output pipeline: sampled token → detokenized text → stop strings → channel.

The loop (:mod:`~.loop`) hands each sampled token to :meth:`OutputPipeline.take`, which
streams the request's text and, when the reply ends, returns its last item instead of
sending it: the loop first frees the request's slot and takes its disk-cache place.
After each step the pipeline may hold the worker for a reader taking a reply's first
text (:meth:`OutputPipeline.hand_to_reader`).
"""

from __future__ import annotations

import time
from typing import Any

from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.llama.omp import release_team
from langchain_llamacpp_local.runtime.active import Active
from langchain_llamacpp_local.runtime.logprobs import logprob_entry
from langchain_llamacpp_local.runtime.requests import (
    Finished,
    SpeculationReport,
    TextDelta,
    Timings,
)

#: How long the worker waits at most for a streaming reader to take a reply's first
#: text before decoding on (see runtime.channel): a reader's turn through LangChain's
#: stream machinery takes well under a millisecond; this bounds a slow one's cost.
READER_WAIT_S = 0.005


class OutputPipeline:
    """Turns a request's sampled tokens into its reply items (see module docstring).

    Its one state across a step is the request whose first text went out in it, for
    the reader hand-off after the step."""

    def __init__(self) -> None:
        self.first_text: Active | None = None

    def next_token(self, eng: Engine, act: Active, idx: int) -> int:
        """The token ``act`` samples from row ``idx`` (or the one its thinking budget forces)."""
        assert act.sampler is not None
        forced = act.think.next_forced() if act.think is not None else None
        return act.sampler.sample(eng.ctx, idx) if forced is None else act.sampler.force(forced)

    def take(self, eng: Engine, act: Active, idx: int, tok: int) -> Finished | None:
        """Handle one sampled token (logprobs, end of generation, stop strings, length);
        the reply's last item once the request has finished, else None."""
        if act.logprobs is not None:
            act.logprobs.append(logprob_of(eng, idx, tok, act.job.top_logprobs))
        if eng.is_eog(tok):
            return self.finished(act, "stop")
        act.n_gen += 1
        if act.think is not None:
            act.think.feed(tok)
        if act.spec is not None:
            act.spec.history.append(tok)
        if self.emit(act, act.decoder.feed(eng.token_piece(tok))):
            return self.finished(act, "stop", stopped=True)
        if act.n_gen >= act.max_new:
            return self.finished(act, "length")
        return None

    def emit(self, act: Active, text: str) -> bool:
        """Stream ``text`` through stop strings; True if a stop matched."""
        if not text:
            return False
        out, stopped = act.stopper.feed(text)
        if out:
            self.put_text(act, out)
        return stopped

    def put_text(self, act: Active, text: str) -> None:
        """Send text with the logprobs of the tokens sampled since the last item sent."""
        logprobs = None
        if act.logprobs is not None:
            logprobs = act.logprobs[act.logprobs_sent :]
            act.logprobs_sent = len(act.logprobs)
        act.job.channel.put(TextDelta(text, logprobs))
        if not act.text_sent:
            act.text_sent = True
            self.first_text = act

    def finished(self, act: Active, reason: str, *, stopped: bool = False) -> Finished:
        """Send the text still held back (unless a stop string ended it) and make the
        reply's last item: counts, timings, speculation totals."""
        if not stopped:
            if self.emit(act, act.decoder.flush()):
                reason = "stop"
            else:
                rest = act.stopper.flush()
                if rest:
                    self.put_text(act, rest)
        now = time.perf_counter()
        t_prefill = act.t_prefill or now
        n_prompt = len(act.tokens)
        n_decoded = n_prompt - act.n_keep
        prompt_ms = (t_prefill - act.t_start) * 1000
        gen_ms = (now - t_prefill) * 1000
        spec = None
        if act.spec is not None:
            sp = act.spec
            spec = SpeculationReport(sp.kind, sp.drafted, sp.accepted)
        timings = Timings(
            prompt_n=float(n_decoded),
            prompt_ms=prompt_ms,
            prompt_per_second=n_decoded / (prompt_ms / 1000) if prompt_ms > 0 else 0.0,
            predicted_n=float(act.n_gen),
            predicted_ms=gen_ms,
            predicted_per_second=act.n_gen / (gen_ms / 1000) if gen_ms > 0 else 0.0,
            draft_n=None if spec is None else float(spec.drafted),
            draft_n_accepted=None if spec is None else float(spec.accepted),
        )
        return Finished(
            reason,
            n_prompt=n_prompt,
            n_cached=act.n_keep,
            n_generated=act.n_gen,
            timings=timings,
            # the tokens no text item carried (an end-of-generation token)
            logprobs=None if act.logprobs is None else act.logprobs[act.logprobs_sent :],
            speculative=spec,
            lora=None if act.job.lora is None else dict(act.job.lora),
            cache=act.cache,
            n_reasoning=None if act.think is None else act.think.n,
        )

    def hand_to_reader(self, active: list[Active]) -> None:
        """Before decoding on, let the reader of a reply's first text take it, when that
        request runs alone: the time to first token is what a streaming caller waits
        for, and the team's next decode would hold the CPUs the reader needs
        (runtime.channel). Beside other requests nothing waits: it would stall them."""
        act, self.first_text = self.first_text, None
        if act is None or len(active) != 1 or active[0] is not act:
            return
        channel = act.job.channel
        if channel.wakes_for_text:
            # the team's helpers spin on their CPUs for a while after a decode; ended,
            # they leave them to the reader (the next decode starts them again)
            release_team()
            channel.wait_reader(READER_WAIT_S)


def logprob_of(eng: Engine, idx: int, tok: int, top: int) -> dict[str, Any]:
    """The logprobs entry of token ``tok`` sampled from row ``idx``."""

    def piece(t: int) -> str:
        return eng.token_piece(t).decode("utf-8", errors="replace")

    return logprob_entry(eng.logits(idx), tok, top, piece)
