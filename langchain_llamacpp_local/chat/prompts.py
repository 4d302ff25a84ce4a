"""From a chat request to prompt tokens, grammar and output parser.

This is where templates, tool formats and grammars meet: it picks the template
(GGUF, named variant, override or built-in), decides how tools reach the model
(the template's own ``tools`` support, or the documented Hermes-style system
prompt), which format the output is parsed with, and which grammar constrains
sampling (forced tool calls, JSON schema, JSON mode).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from langchain_llamacpp_local.chat.prompt_tokens import PromptTokenizer
from langchain_llamacpp_local.chat.request_options import (
    EFFORTS_OFF,
    check_effort,
    check_reasoning_budget,
    normalize_tool_choice,
    response_schema,
)
from langchain_llamacpp_local.chat.special_tokens import (
    check_fits,
    content_has_control_text,
    protect_content,
    protected_parts,
    restore,
    tokenize_protected,
    vocab_info,
)
from langchain_llamacpp_local.chat.thinking import can_think_first, grammar_after_thinking, markers
from langchain_llamacpp_local.errors import ResponseFormatBesideToolsError
from langchain_llamacpp_local.formats import (
    DeltaKind,
    ParsedOutput,
    StreamDelta,
    StreamParser,
    detect_format,
)
from langchain_llamacpp_local.formats.auto import TemplateAnalysis, analyze_template
from langchain_llamacpp_local.formats.grammars import either_grammar, tool_call_grammar
from langchain_llamacpp_local.formats.registry import FAMILIES
from langchain_llamacpp_local.llama.json_grammar import (
    JSON_OBJECT_GRAMMAR,
    json_schema_to_grammar,
)
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.templates.adaptation import adapt_messages
from langchain_llamacpp_local.templates.builtin_templates import select_template
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from langchain_llamacpp_local.templates.efforts import effort_variables
from langchain_llamacpp_local.templates.hermes_prompt import inject_tool_prompt
from langchain_llamacpp_local.templates.sandbox import request_budget

if TYPE_CHECKING:
    from langchain_llamacpp_local.chat.jobs import ChatJob
    from langchain_llamacpp_local.llama.engine import Engine

logger = logging.getLogger(__name__)


class OutputParser(Protocol):
    def feed(self, delta: str) -> list[StreamDelta]: ...
    def finish(self) -> list[StreamDelta]: ...

    @property
    def result(self) -> ParsedOutput | None:
        """The reply split into its parts, after :meth:`finish` (None: not parsed)."""
        ...


class PlainParser:
    """Content passes through unchanged (no tools bound, reasoning left as generated)."""

    def feed(self, delta: str) -> list[StreamDelta]:
        return [StreamDelta(kind=DeltaKind.CONTENT, text=delta)] if delta else []

    def finish(self) -> list[StreamDelta]:
        return []

    @property
    def result(self) -> ParsedOutput | None:
        return None  # nothing parsed: the content is the reply


@dataclass
class ChatFormat:
    """The model's templates and tool format, resolved once per loaded model."""

    metadata: dict[str, str]
    template: ChatTemplate
    tool_template: ChatTemplate | None
    tool_format: str
    bos_text: str
    eos_text: str
    _overrides: dict[str, ChatTemplate] = field(default_factory=dict)
    analysis: TemplateAnalysis | None = None  # the learned syntax when tool_format is "auto"
    #: token sequences prompts are cut after (:func:`chunk_markers`: message boundaries)
    markers: tuple[tuple[int, ...], ...] = ()
    #: the prompts' tokenizer, cut before the markers' control tokens
    tokenizer: PromptTokenizer = field(default_factory=lambda: PromptTokenizer(()))

    @classmethod
    def from_engine(cls, eng: Engine) -> ChatFormat:
        meta = dict(eng.metadata)
        bos = eng.token_text(eng.bos_id) if eng.bos_id >= 0 else ""
        eos = eng.token_text(eng.eos_id) if eng.eos_id >= 0 else ""
        meta["_bos_token"] = bos
        meta["_eos_token"] = eos
        template = select_template(meta)
        tool_template = (
            select_template(meta, with_tools=True)
            if "tokenizer.chat_template.tool_use" in meta
            else None
        )
        tool_format, analysis = resolve_format(tool_template or template)
        logger.debug("chat template %s, tool format %s", template.origin, tool_format)
        markers = chunk_markers(template, eng)
        return cls(
            meta,
            template,
            tool_template,
            tool_format,
            bos,
            eos,
            analysis=analysis,
            markers=markers,
            tokenizer=PromptTokenizer([m[0] for m in markers]),
        )

    @property
    def call_format(self) -> str:
        """The syntax tool calls are prompted and parsed in: the template's own, or Hermes
        when the template cannot show tools (:func:`prepare` then adds the Hermes prompt)."""
        template = self.tool_template or self.template
        return self.tool_format if template.supports_tools else "hermes"

    def override(self, source: str) -> ChatTemplate:
        """Compile (once) a per-request template override or built-in name."""
        tpl = self._overrides.get(source)
        if tpl is None:
            tpl = select_template(self.metadata, override=source)
            if len(self._overrides) > 32:
                self._overrides.clear()
            self._overrides[source] = tpl
        return tpl


def resolve_format(template: ChatTemplate) -> tuple[str, TemplateAnalysis | None]:
    """The template's tool format, as llama.cpp picks it: a hand-written family first, then
    the differential analysis of the template (format ``"auto"``) for templates that write
    tool calls in a syntax no family knows."""
    fmt = detect_format(template.source)
    if fmt != "generic" or not template.supports_tools:
        return fmt, None
    analysis = analyze_template(template)
    if analysis is None:
        return fmt, None
    logger.info("chat template %s: tool-call syntax learned by analysis", template.origin)
    return "auto", analysis


@dataclass
class PreparedPrompt:
    text: str
    tokens: list[Any]  # token ids, and ("media", digest, k) entries for image positions
    sampling: SamplingParams
    stop: list[str]
    boundaries: tuple[int, ...] = ()
    media: dict[int, Any] = field(default_factory=dict)  # start position -> MediaChunk
    parse_format: str | None = None
    reasoning: bool | None = None
    think_open: bool = False
    tools: tuple[dict[str, Any], ...] = ()  # bound tools: their schemas type tagged arguments
    prefill: str = ""  # the end of the rendered prompt (what the template already opened)
    analysis: TemplateAnalysis | None = None  # for parse_format "auto"
    lora_start: int = 0  # where the LoRA adapters take effect (an activated LoRA's invocation)
    calls: bool = False  # tools are bound: the output may hold calls
    #: the request's messages and tools as rendered (the cache report maps a miss to them)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_specs: list[dict[str, Any]] = field(default_factory=list)
    stream_args: bool = False  # tool-call arguments streamed while written
    #: this conversation last rendered with other template arguments (cache report)
    kwargs_changed: bool = False
    #: more than one call may be made (else calls past the first are reported dropped)
    parallel: bool = True

    def make_parser(self) -> OutputParser:
        if self.parse_format is None and self.reasoning is None:
            return PlainParser()
        return StreamParser(
            self.parse_format or "content",
            reasoning=self.reasoning,
            think_open=self.think_open,
            # with no tools bound nothing is a call: markup stays content, as in llama.cpp
            tools=list(self.tools) if self.calls else [],
            prefill=self.prefill,
            analysis=self.analysis,
            stream_args=self.stream_args,
        )


#: Formats that are not a family's own call syntax (no template-taught markup to parse).
_NO_OWN_SYNTAX = frozenset({"hermes", "generic", "content", "auto"})
#: How much of the rendered prompt's end the parser sees (generation prompts are short).
_PREFILL_CHARS = 256


def _lazy_triggers(fmt: str | None) -> tuple[str, ...]:
    """The markers where ``fmt``'s calls start and its lazy grammar switches on (none:
    the format has no grammar our parser reads back from a marker)."""
    family = FAMILIES.get(fmt or "")
    return family.triggers if family is not None else ()


def _channel_markup(fmt: str | None) -> bool:
    """Whether ``fmt``'s output carries channel/turn markup even in plain chat: it is then
    always parsed (reasoning extracted) so the markup never reaches ``content``."""
    family = FAMILIES.get(fmt or "")
    return family is not None and family.channel_markup


def template_kwargs(
    template: ChatTemplate,
    given: dict[str, Any],
    *,
    effort: object = None,
    budget: object = None,
    reasoning: bool | None = None,
) -> dict[str, Any]:
    """The chat template's variables for a request's reasoning options.

    ``effort`` reaches the template as ``reasoning_effort`` and in the names and values
    the template reads (:func:`~..templates.efforts.effort_variables`), and as the
    ``enable_thinking`` switch of templates that have only that; ``budget`` reaches a
    template that reads ``thinking_budget`` (Seed-OSS), and ``budget=0`` turns the
    switches off. A variable the caller gives in ``chat_template_kwargs`` wins.
    """
    kwargs = dict(given)
    if effort is not None:
        effort = check_effort(effort)
        for name, value in effort_variables(template.source, template.variables, effort).items():
            kwargs.setdefault(name, value)
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort not in EFFORTS_OFF)
    if budget is not None:
        check_reasoning_budget(budget)
    if budget is not None and "thinking_budget" in template.variables:
        kwargs.setdefault("thinking_budget", budget)  # Seed-OSS tells the model its budget
    if budget == 0:
        off = effort_variables(template.source, template.variables, "none", switches_only=True)
        for name, value in off.items():
            kwargs.setdefault(name, value)
        kwargs.setdefault("enable_thinking", False)
    if reasoning is not None:
        kwargs.setdefault("enable_thinking", bool(reasoning))
    return kwargs


def _plain_format(fmt: str | None, reasoning: bool | None) -> str | None:
    """The parser for a request with no tools bound, as llama.cpp keeps the family's own:
    its turn and channel markup is removed and its own think markers are read; call markup
    stays content. None: the text needs no parsing beyond generic ``<think>`` blocks."""
    family = FAMILIES.get(fmt or "")
    if family is not None and (family.plain_markup or (reasoning is not None and family.own_think)):
        return fmt
    return None


def template_thinks(template: ChatTemplate) -> bool:
    """Whether the template belongs to a model that thinks (it writes or switches a
    thinking block): its replies are then read with reasoning extracted by default."""
    return "think" in template.source.lower()


def think_room(
    job: ChatJob, thinks: bool, kwargs: dict[str, Any], fmt: str | None, prefill: str
) -> bool:
    """Whether a constrained reply may start with a thinking block: reasoning asked for
    (or budgeted), or left to a template that thinks, unless told not to or its
    generation prompt already closed the block (thinking off, as DeepSeek V3.1 and
    Qwen3 with ``enable_thinking=False`` write it)."""
    if job.reasoning is not None:
        return job.reasoning or job.reasoning_budget is not None
    if job.reasoning_budget is not None:
        return True
    found = markers(fmt)
    if found is not None and prefill.rstrip().endswith(found[1].rstrip()):
        return False
    return thinks and kwargs.get("enable_thinking") is not False


def parallel_calls(
    asked: bool | None, tools: Sequence[dict[str, Any]], template: ChatTemplate
) -> bool:
    """Whether a reply may hold several calls: as asked, else when more than one tool is
    bound and the chat template shows an assistant message's parallel calls (so the
    conversation reads back as the model wrote it)."""
    if asked is not None:
        return asked
    return len(tools) > 1 and template.supports_parallel_tool_calls


#: calls a grammar allows where one is: the first, and one more that is written only to
#: be reported (``response_metadata["dropped_tool_calls"]``), never cut off unseen
_ONE_AND_REPORTED = 2


def answer_beside_calls(
    tools: Sequence[dict[str, Any]], fmt: str, answer: str, calls: int | bool, prefill: str
) -> str:
    """GBNF for a reply that is either calls in ``fmt``'s own syntax or the typed answer
    (``answer``'s grammar): OpenAI's ``response_format`` beside tools; ``calls`` as
    :func:`~..formats.grammars.tool_call_grammar`'s ``parallel``. The calls must
    start with a marker of their own, else a JSON answer could read as a call; formats
    without one raise, naming ToolStrategy."""
    grammar, used = tool_call_grammar(tools, fmt, parallel=calls, prefill=prefill)
    if used != fmt or not _lazy_triggers(fmt):
        raise ResponseFormatBesideToolsError(
            f"the {fmt!r} tool-call syntax of this chat template cannot be told apart from a "
            "JSON answer, so response_format cannot be combined with tools here: use "
            "create_agent(..., response_format=ToolStrategy(Schema)) (the answer as a tool "
            "call), or with_structured_output without tools"
        )
    return either_grammar(grammar, answer)


#: ``Engine.tokenize_multimodal``'s signature: (text or parts, images) -> (positions, media)
TokenizeMedia = Callable[[Any, list[Any]], tuple[list[Any], dict[int, Any]]]


def prepare(
    fmt: ChatFormat, job: ChatJob, eng: Engine, tokenize_media: TokenizeMedia | None = None
) -> PreparedPrompt:
    """Render, tokenize and choose grammar and parser for ``job``.

    Every template operation of the request (compiling an override, probing, each
    render) shares one time budget, which also stops at the caller's cancel or timeout.
    ``tokenize_media`` tokenizes a prompt with images (default: the engine's own; the
    front end passes the worker's, where the projector's context lives).
    """
    with request_budget(fmt.template.limits, cancelled=job.cancelled):
        return _prepare(fmt, job, eng, tokenize_media or eng.tokenize_multimodal)


def _prepare(
    fmt: ChatFormat, job: ChatJob, eng: Engine, tokenize_media: TokenizeMedia
) -> PreparedPrompt:
    tools = job.tools or []
    choice = normalize_tool_choice(job.tool_choice, tools) if tools else None
    use_tools = bool(tools) and choice != "none"

    if job.chat_template:
        template = fmt.override(job.chat_template)
    elif use_tools and fmt.tool_template is not None:
        template = fmt.tool_template
    else:
        template = fmt.template
    if job.chat_template:
        tool_format, analysis = resolve_format(template)
    else:
        tool_format, analysis = fmt.tool_format, fmt.analysis

    # a template that writes calls in its family's syntax but cannot describe tools (the
    # DeepSeek R1 distills, V3.1): llama.cpp parses that syntax; the tools are listed in
    # the system prompt without the Hermes call instruction, so the model writes its own
    own_syntax = (
        use_tools
        and not template.supports_tools
        and template.supports_tool_calls
        and tool_format not in _NO_OWN_SYNTAX
    )
    messages, render_tools = adapt_messages(
        template, job.messages, tools if use_tools and not own_syntax else None
    )
    if own_syntax:
        messages = inject_tool_prompt(messages, tools, instruction=False)
    parse_format: str | None = None
    if use_tools:
        parse_format = tool_format if template.supports_tools or own_syntax else "hermes"

    kwargs = template_kwargs(
        template,
        job.chat_template_kwargs,
        effort=job.reasoning_effort,
        budget=job.reasoning_budget,
        reasoning=job.reasoning,
    )
    images: list[Any] = []
    messages = _inline_images(messages, images)
    text = template.render(messages, tools=render_tools, add_generation_prompt=True, **kwargs)
    # before anything that scales with the prompt (a default max_tokens is fitted later)
    check_fits(eng, text, None if job.max_tokens_default else job.max_tokens)
    info = vocab_info(eng)
    # Everything the template sees goes through one check: message content, tool names,
    # descriptions and schemas, argument keys and values, template kwargs.
    inputs = {"messages": messages, "tools": render_tools, "kwargs": kwargs}
    injected = content_has_control_text(info, inputs)
    mapping: dict[str, str] = {}
    rendered = text
    if injected:  # text that spells control tokens: render again with placeholders
        logger.debug("prompt inputs contain control-token text %s", injected[:5])
        protected, mapping = protect_content(inputs, injected)
        rendered = template.render(
            protected["messages"],
            tools=protected["tools"],
            add_generation_prompt=True,
            **protected["kwargs"],
        )
        text = restore(rendered, mapping)

    media: dict[int, Any] = {}
    if images:
        pictures = [im.mtmd_input for im in images]
        if mapping:  # control-token text in content stays plain text, as without images
            parts = protected_parts(info, _strip_bos(eng, fmt, rendered), mapping, MEDIA_MARKER)
            tokens, media = tokenize_media(parts, pictures)
        else:
            tokens, media = tokenize_media(_strip_bos(eng, fmt, text), pictures)
        boundaries: tuple[int, ...] = ()
    elif mapping:
        tokens = tokenize_protected(eng, info, _strip_bos(eng, fmt, rendered), mapping)
        boundaries = ()
    else:
        tokens = _tokenize(eng, fmt, text)
        boundaries = _last_user_boundary(
            eng, fmt, template, messages, render_tools, kwargs, text, tokens
        )

    sampling = job.sampling
    prefill = text[-_PREFILL_CHARS:]
    thinks = template_thinks(template)
    think_first = can_think_first(tool_format) and think_room(
        job, thinks, kwargs, tool_format, prefill
    )
    # a think block the grammar opens itself is not also closed by the call grammar
    call_prefill = "" if think_first else prefill
    answer: str | None = None  # the typed answer's grammar (response_format)
    if job.response_format is not None and (not use_tools or choice is None):
        schema = response_schema(job.response_format)
        answer = JSON_OBJECT_GRAMMAR if schema is None else json_schema_to_grammar(schema)
    parallel = use_tools and parallel_calls(job.parallel_tool_calls, tools, template)
    grammar: str | None = None
    lazy: tuple[str, ...] = ()
    if use_tools and choice is not None:
        name = choice[5:] if choice.startswith("name:") else None
        grammar, parse_format = tool_call_grammar(
            tools,
            parse_format or "hermes",
            # a named tool: that one call; without parallel calls, a second one is
            # written only to be reported (a bound: a small model under a repeatable
            # forced grammar keeps adding calls until max_tokens)
            parallel=1 if name is not None else True if parallel else _ONE_AND_REPORTED,
            name=name,
            prefill=call_prefill,
        )
    elif use_tools and answer is not None:
        # the model answers with calls in its own syntax or with the typed answer
        assert parse_format is not None
        grammar = answer_beside_calls(
            tools, parse_format, answer, True if parallel else _ONE_AND_REPORTED, call_prefill
        )
    elif use_tools and choice is None and _lazy_triggers(parse_format):
        # "auto": free text, but once the model starts a call it must be a valid one
        grammar, used = tool_call_grammar(
            tools, parse_format, parallel=True if parallel else _ONE_AND_REPORTED
        )
        if used == parse_format:
            lazy = _lazy_triggers(parse_format)
        else:  # no grammar in the model's own syntax for these tools: calls stay free
            grammar = None
    elif answer is not None:
        grammar = answer
    if grammar is not None and not lazy and think_first:  # think, then answer or call
        grammar = grammar_after_thinking(grammar, tool_format, prefill)
    if grammar is not None:
        if sampling.grammar is not None:  # check_call refuses it first; never overwrite
            raise ValueError("grammar cannot be combined with tools or response_format")
        sampling = replace(sampling, grammar=grammar, grammar_lazy_triggers=lazy)

    reasoning = job.reasoning
    if reasoning is None and thinks:
        reasoning = True  # as llama.cpp's reasoning_format=auto: thoughts never reach content
    if not use_tools:
        parse_format = _plain_format(tool_format, reasoning)
    if reasoning is None and _channel_markup(parse_format):
        reasoning = False  # extract what the model thinks uninvited; never leak markup
    return PreparedPrompt(
        text=text,
        tokens=tokens,
        media=media,
        sampling=sampling,
        stop=list(job.stop),
        boundaries=boundaries,
        parse_format=parse_format,
        reasoning=reasoning,
        tools=tuple(tools) if use_tools else (),
        prefill=prefill,
        analysis=analysis if parse_format == "auto" else None,
        calls=use_tools,
        messages=job.messages,
        tool_specs=list(job.tools or ()),
        stream_args=job.stream_tool_args,
        parallel=parallel,
    )


def chunk_markers(template: ChatTemplate, eng: Engine) -> tuple[tuple[int, ...], ...]:
    """Token sequences after which prompts are cut (:func:`~.chunking.marker_cuts`).

    The template's generation prompt (e.g. ``<start_of_turn>model\n``: a prompt ends
    with it, so the next turn of a conversation reuses the previous prompt whole) and
    its end of a message (e.g. ``<end_of_turn>\n``: every message then starts on a
    cut, so an edited last message resumes from a checkpoint at its start). Only
    sequences that start with a control token count: message text cannot spell one
    (see :mod:`~.special_tokens`), so the cuts stay on message boundaries.
    """
    probe = [{"role": "user", "content": "\x01probe\x02"}]
    try:
        with_prompt = template.render(probe, add_generation_prompt=True)
        without = template.render(probe, add_generation_prompt=False)
    except Exception:
        logger.debug("no chunk markers: the template did not render a probe", exc_info=True)
        return ()
    texts: list[str] = []
    if with_prompt.startswith(without) and with_prompt[len(without) :].strip():
        texts.append(with_prompt[len(without) :])
    at = without.find("\x02")
    if at >= 0 and without[at + 1 :].strip():
        texts.append(without[at + 1 :])
    out: list[tuple[int, ...]] = []
    for text in texts:
        toks = eng.tokenize(text, add_special=False, parse_special=True)
        if toks and eng.is_control(toks[0]) and tuple(toks) not in out:
            out.append(tuple(toks))
    return tuple(out)


def _strip_bos(eng: Engine, fmt: ChatFormat, text: str) -> str:
    """Drop a template-written BOS when the tokenizer adds one itself (no double BOS)."""
    if eng.add_bos and fmt.bos_text and text.startswith(fmt.bos_text):
        return text[len(fmt.bos_text) :]
    return text


def _tokenize(eng: Engine, fmt: ChatFormat, text: str) -> list[int]:
    """Tokenize a rendered prompt with exactly one BOS where the model wants one (only
    the messages the format's tokenizer has not seen before are tokenized)."""
    return fmt.tokenizer.tokenize(eng, _strip_bos(eng, fmt, text))


MEDIA_MARKER = "<__media__>"  # llama.cpp mtmd's default marker


def _inline_images(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """Replace image and audio parts by mtmd's media marker (collecting them in order).

    The marker, not a template's own image token, is what mtmd splits the prompt on;
    it then inserts the model's image tokens (and wrappers) itself, as llama.cpp's
    server does.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        pieces: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                from langchain_llamacpp_local.chat.images import DecodedImage, load_image

                img = part.get("image")
                images.append(img if isinstance(img, DecodedImage) else load_image(img))
                pieces.append(MEDIA_MARKER)
            elif isinstance(part, dict) and part.get("type") == "audio":
                from langchain_llamacpp_local.chat.audio import load_audio

                images.append(load_audio(part.get("audio")))
                pieces.append(MEDIA_MARKER)
            elif isinstance(part, dict):
                pieces.append(str(part.get("text", "")))
            else:
                pieces.append(str(part))
        out.append({**m, "content": "\n".join(pieces)})
    return out


def _last_user_boundary(
    eng: Engine,
    fmt: ChatFormat,
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    text: str,
    tokens: list[int],
) -> tuple[int, ...]:
    """Token offset where the last user message starts (a checkpoint point).

    Only computed for memory that needs checkpoints; found by rendering the
    conversation before that message and matching it against the full prompt.
    """
    from langchain_llamacpp_local.llama.probes import MemoryKind  # local: probes import llama.cpp

    if eng.memory_kind is MemoryKind.PARTIAL:
        return ()
    idx = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    if idx <= 0:
        return ()
    try:
        head = template.render(messages[:idx], tools=tools, add_generation_prompt=False, **kwargs)
    except Exception:
        return ()
    if not text.startswith(head):
        return ()
    head_tokens = _tokenize(eng, fmt, head)
    n = 0
    for a, b in zip(head_tokens, tokens, strict=False):
        if a != b:
            break
        n += 1
    return (n,) if 0 < n < len(tokens) else ()
