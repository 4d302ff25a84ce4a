"""One record per tool-call family: everything the package knows about one syntax.

A :class:`Family` says how llama.cpp picks the syntax for a chat template (its
specialized handlers, or the markers its auto-parser route recognises), which markers
are held back while streaming, how a call is read (a :class:`~.families.Spec` of
markers and body readers, a classic :class:`~.classic.Reader`, or a message scanner
from :mod:`.messages`), how its calls' arguments stream (each body reader names its
stream, :mod:`.syntax`; a family with no calls to stream says ``streams=False``), how
a forced call is written (:class:`~.grammar_shapes.JsonCalls` or
:class:`~.grammar_shapes.Markup`, built by :mod:`.grammars`), which markers switch a
lazy grammar on, where a reasoning budget's thinking block starts and ends, and whether
plain chat output carries channel markup. :mod:`.detect`, :mod:`.parsers`,
:mod:`.grammars`, the stream parser and the prompt preparation read these records;
adding a family is adding one record here (with its body reader and stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.formats import classic, messages
from langchain_llamacpp_local.formats.classic import Reader
from langchain_llamacpp_local.formats.families import (
    DS_CALL,
    DS_CALLS,
    GEMMA_END,
    KIMI_CALL,
    MISTRAL_CALLS,
    MM_MARKER,
    Spec,
    apertus_body,
    command_r_body,
    deepseek_v3_1_body,
    functionary_v3_1_body,
    gemma4_body,
    json_call_body,
    json_lines_body,
    json_list_body,
    kimi_k2_body,
    minimax_m3_body,
    mistral_body,
    solar_body,
)
from langchain_llamacpp_local.formats.grammar_shapes import JsonCalls, Markup, gbnf_literal, repeat
from langchain_llamacpp_local.formats.markup_bodies import (
    DSML_MARKER,
    HY_MARKER,
    dsml_body,
    glm_body,
    hy3_body,
    kimi_k3_body,
    minicpm5_body,
    minimax_body,
    muse_body,
    qwen3_coder_body,
    seed_oss_body,
)
from langchain_llamacpp_local.formats.messages import Scanner
from langchain_llamacpp_local.formats.syntax import NAMED_ARGUMENTS, rewrap, streams
from langchain_llamacpp_local.formats.values import GEMMA_QUOTE

# --------------------------------------------------------------------------- the record

#: (rank, needles): the template contains every needle; the lowest rank that matches wins
Clue = tuple[int, tuple[str, ...]]


@dataclass(frozen=True)
class Family:
    """One tool-call syntax, as detection, parsing, grammars and prompts see it."""

    name: str
    #: llama.cpp's specialized handlers (``common_chat_try_specialized_template``) whose
    #: output is this syntax
    handlers: tuple[str, ...] = ()
    #: how a template the auto-parser takes is recognised (llama.cpp's legacy order)
    clues: tuple[Clue, ...] = ()
    #: markers of the classic formats held back while streaming (a spec adds its own)
    markers: tuple[str, ...] = ()
    #: reasoning and call-region markers with their body readers (None: a classic
    #: ``reader`` reads what follows the ``<think>`` block, or a ``scanner`` the output)
    spec: Spec | None = None
    #: how a classic family (no spec) reads what follows its ``<think>`` block
    reader: Reader | None = None
    #: the whole output is addressed messages, read by this scanner (gpt-oss, Muse)
    scanner: Scanner | None = None
    #: how a forced call is written; None: the generic JSON object instead
    grammar: JsonCalls | Markup | None = None
    #: markers that switch the grammar on under ``tool_choice="auto"`` (llama.cpp's lazy
    #: grammar); none: calls stay free
    triggers: tuple[str, ...] = ()
    #: plain chat output carries channel/turn markup: always parsed (reasoning
    #: extracted) so the markup never reaches ``content``
    channel_markup: bool = False
    #: plain chat output carries turn or wrapper markup outside the spec's ``strip``
    #: (Granite's ``<response>``, Functionary's ``all`` recipient)
    turn_markup: bool = False
    #: call syntaxes its scanner reads beyond the spec's regions (gpt-oss: a message to
    #: ``functions.NAME`` is the call's arguments)
    message_calls: tuple[Any, ...] = ()
    #: its calls' arguments stream while written (``stream_tool_args``): every call
    #: syntax it reads names its stream; False: it reads no calls to stream
    streams: bool = True
    #: a reasoning budget's (start, end, forced end) where the thinking block is not the
    #: spec's marker pair (gpt-oss's analysis channel)
    budget: tuple[str, str, str] | None = None

    @property
    def call_syntaxes(self) -> tuple[Any, ...]:
        """Every call syntax (body reader) the family reads, each naming its stream."""
        spec, reader = self.spec, self.reader
        bodies = [body for _start, _end, body in spec.regions] if spec is not None else []
        return (*bodies, *(reader.bodies if reader is not None else ()), *self.message_calls)

    @property
    def streamed(self) -> bool:
        """Whether the record holds a stream for every call syntax it reads."""
        syntaxes = self.call_syntaxes
        return bool(syntaxes) and all(streams(body) for body in syntaxes)

    @property
    def budget_markers(self) -> tuple[str, str, str] | None:
        """(start, end, what to force to end it) of the thinking block a reasoning budget
        counts, or None when the family has no thinking block we know."""
        if self.budget is not None:
            return self.budget
        spec = self.spec
        think = ("<think>", "</think>") if spec is None else spec.think
        if think is None or not think[1]:
            return None
        start, end = think
        if not start:  # Apriel: the generation prompt's lead-in opens the block
            if spec is None or not spec.reasoning_lead:
                return None
            start = spec.reasoning_lead
        return start, end, end

    @property
    def plain_markup(self) -> bool:
        """Whether plain chat output (no tools bound) carries markup the parser removes."""
        spec = self.spec
        strips = spec is not None and bool(spec.strip or spec.strip_re)
        return self.channel_markup or self.turn_markup or strips

    @property
    def own_think(self) -> bool:
        """Whether the family thinks in markers of its own (not ``<think>``)."""
        spec = self.spec
        if spec is None or spec.think is None:
            return False
        return (
            spec.think != ("<think>", "</think>")
            or spec.think_implicit
            or bool(spec.reasoning_lead)
        )


def wrapped_between(
    opening: str, closing: str, shape: str = "list", **kw: str
) -> dict[str, object]:
    """``grammar`` and ``triggers`` of a family writing JSON after ``opening``."""
    return {"grammar": JsonCalls(opening, closing, shape, **kw), "triggers": (opening,)}  # type: ignore[arg-type]


def _markup(*triggers: str, **kw: object) -> dict[str, object]:
    return {"grammar": Markup(**kw), "triggers": triggers}  # type: ignore[arg-type]


_lit = gbnf_literal
_CMD = ("<|START_THINKING|>", "<|END_THINKING|>")
_QWEN_XML = dict(
    call=lambda name, args: f'"<function=" {name} ">\\n" {args} "</function>"',
    closer="</parameter>",
)

_RECORDS: tuple[Family, ...] = (
    Family(
        "hermes",
        clues=((170, ("<tool_call>",)),),
        markers=("<tool_call>", "<function="),
        reader=classic.HERMES,
        grammar=JsonCalls("<tool_call>\n", "\n</tool_call>", "each", sep="\n"),
        triggers=("<tool_call>",),
    ),
    Family(
        "qwen3_coder",
        handlers=("qwen3_coder",),
        clues=((80, ("<tool_call>", "<function=", "<parameter=")),),
        markers=("<tool_call>", "<function="),
        spec=Spec(
            regions=(
                ("<tool_call>", "</tool_call>", qwen3_coder_body),
                (
                    "<function=",
                    "</function>",
                    rewrap("<function=", "</function>", qwen3_coder_body),
                ),
            ),
            section=("</tool_call>",),
            think_stops=("<tool_call>",),
        ),
        **_markup(
            "<tool_call>",
            block=lambda call, par: repeat(f'"<tool_call>\\n" {call} "\\n</tool_call>"', par, "\n"),
            arg=lambda k, v, raw: f'"<parameter=" {_lit(k)} ">\\n" {v} "\\n</parameter>\\n"',
            **_QWEN_XML,
        ),
    ),
    Family(
        "llama3_json",
        clues=(
            (200, ("<|start_header_id|>ipython<|end_header_id|>",)),
            (200, ("<|python_tag|>",)),
            (240, ("<|start_header_id|>", "tools")),
        ),
        markers=("<|python_tag|>",),
        reader=classic.LLAMA3_JSON,
        grammar=JsonCalls(shape="each", sep="; ", args_key="parameters"),
    ),
    Family(
        "mistral",
        clues=((220, ("[TOOL_CALLS]",)),),
        markers=(MISTRAL_CALLS,),
        spec=Spec(think=None, regions=((MISTRAL_CALLS, None, mistral_body),)),
        grammar=JsonCalls(MISTRAL_CALLS),
        triggers=(MISTRAL_CALLS,),
    ),
    Family(
        "pythonic",
        handlers=("lfm2", "lfm2_5"),
        clues=(
            (230, ("<|tool_call_start|>",)),
            (230, ("[func_name1(",)),
            (230, ("func_name1(params_name1",)),
        ),
        markers=("<|tool_call_start|>",),
        reader=classic.PYTHONIC,
    ),
    Family(
        "granite",
        clues=((50, ("<|tool_call|>",)),),
        markers=("<|tool_call|>", "<response>", "</response>"),
        reader=classic.GRANITE,
        **wrapped_between("<|tool_call|>", ""),
        turn_markup=True,
    ),
    Family(
        "functionary_v3_2",
        handlers=("functionary_v3_2",),
        markers=(">>>",),
        reader=classic.FUNCTIONARY_V3_2,
        turn_markup=True,
    ),
    Family(
        "deepseek_r1",
        clues=((20, ("tool▁calls▁begin",)),),
        markers=(
            DS_CALLS[0],
            DS_CALL[0],
            DS_CALLS[1],
            "<｜tool▁calls｜>",
        ),
        reader=classic.DEEPSEEK_R1,
    ),
    Family(
        "command_r7b",
        clues=((30, ("<|START_ACTION|>",)),),
        markers=(
            "<|START_ACTION|>",
            "<|START_RESPONSE|>",
            "<|END_RESPONSE|>",
            "<|START_THINKING|>",
        ),
        spec=Spec(
            think=_CMD,
            regions=(("<|START_ACTION|>", "<|END_ACTION|>", command_r_body),),
            strip=("<|START_RESPONSE|>", "<|END_RESPONSE|>"),
        ),
        **wrapped_between(
            "<|START_ACTION|>", "<|END_ACTION|>", call="cohere", args_key="parameters"
        ),
        channel_markup=True,
    ),
    Family(
        "gpt_oss",
        handlers=("gpt_oss",),
        scanner=messages.harmony,
        message_calls=(NAMED_ARGUMENTS,),
        # the analysis channel, closed and followed by the final channel
        budget=(
            "<|channel|>analysis<|message|>",
            "<|end|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
        ),
        markers=(
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
            "<|message|>",
            "to=",
        ),
        channel_markup=True,
    ),
    Family("generic", reader=classic.GENERIC, grammar=JsonCalls(shape="document")),
    Family("content", reader=classic.CONTENT, streams=False),  # (no calls)
    Family(
        "ministral_3",
        handlers=("ministral_3",),
        clues=((210, ("[THINK]",)),),
        spec=Spec(think=("[THINK]", "[/THINK]"), regions=((MISTRAL_CALLS, None, mistral_body),)),
        **_markup(
            MISTRAL_CALLS,
            block=lambda call, par: repeat(call, par),
            call=lambda name, args: f'"[TOOL_CALLS]" {name} "[ARGS]" {args}',
        ),
        channel_markup=True,
    ),
    Family(
        "seed_oss",
        clues=((70, ("<seed:tool_call>",)), (70, ("<seed:think>",))),
        spec=Spec(
            think=("<seed:think>", "</seed:think>"),
            regions=(("<seed:tool_call>", "</seed:tool_call>", seed_oss_body),),
        ),
        **_markup(
            "<seed:tool_call>",
            block=lambda call, par: repeat(
                f'"<seed:tool_call>\\n" {call} "\\n</seed:tool_call>"', par, "\n"
            ),
            arg=lambda k, v, raw: f'"<parameter=" {_lit(k)} ">" {v} "</parameter>\\n"',
            **_QWEN_XML,
        ),
    ),
    Family(
        "glm45",
        handlers=("ling3",),
        clues=((60, ("<arg_key>",)),),
        spec=Spec(
            regions=(("<tool_call>", "</tool_call>", glm_body),),
            strip=("<|role_end|>",),
            # a call written before the think block is closed ends the reasoning (Ling 3.0)
            think_stops=("<tool_call>",),
            rethinks=True,
        ),
        **_markup(
            "<tool_call>",
            # GLM 4.5/4.6 put a newline before each tag, GLM 4.7 none: both are read
            block=lambda call, par: repeat(f'"<tool_call>" {call} "</tool_call>"', par, "\n"),
            call=lambda name, args: f'{name} "\\n"? {args}',
            arg=lambda k, v, raw: (
                f'"<arg_key>" {_lit(k)} "</arg_key>" "\\n"? "<arg_value>" {v} "</arg_value>" "\\n"?'
            ),
            closer="</arg_value>",
        ),
    ),
    Family(
        "minimax_m2",
        clues=((90, ("<minimax:tool_call>",)),),
        spec=Spec(regions=(("<minimax:tool_call>", "</minimax:tool_call>", minimax_body),)),
        **_markup(
            "<minimax:tool_call>",
            block=lambda call, par: (
                f'"<minimax:tool_call>\\n" {repeat(call, par)} "</minimax:tool_call>"'
            ),
            call=lambda name, args: f'"<invoke name=\\"" {name} "\\">\\n" {args} "</invoke>\\n"',
            arg=lambda k, v, raw: f'"<parameter name=\\"" {_lit(k)} "\\">" {v} "</parameter>\\n"',
            closer="</parameter>",
        ),
    ),
    Family(
        "deepseek_v3_1",
        clues=(
            (
                10,
                (
                    "tool▁calls▁begin",
                    "message['prefix'] is defined and message['prefix'] and thinking",
                ),
            ),
        ),
        spec=Spec(
            regions=((DS_CALLS[0], DS_CALLS[1], deepseek_v3_1_body),),
            held=(DS_CALLS[0],),
        ),
        **_markup(
            DS_CALLS[0],
            block=lambda call, par: (
                f'"<｜tool▁calls▁begin｜>" {repeat(call, par)} "<｜tool▁calls▁end｜>"'
            ),
            call=lambda name, args: (
                f'"<｜tool▁call▁begin｜>" {name} "<｜tool▁sep｜>" {args} "<｜tool▁call▁end｜>"'
            ),
        ),
    ),
    Family(
        "deepseek_v3_2",
        handlers=("deepseek_v3_2",),
        spec=Spec(
            regions=(
                (f"<{DSML_MARKER}function_calls>", f"</{DSML_MARKER}function_calls>", dsml_body),
                (f"<{DSML_MARKER}tool_calls>", f"</{DSML_MARKER}tool_calls>", dsml_body),
            ),
            think_stops=(f"<{DSML_MARKER}function_calls>", f"<{DSML_MARKER}tool_calls>"),
        ),
        **_markup(
            f"<{DSML_MARKER}function_calls>",
            f"<{DSML_MARKER}tool_calls>",
            # V3.2 writes function_calls, V4 tool_calls (same invoke syntax)
            block=lambda call, par: " | ".join(
                f"({_lit(f'<{DSML_MARKER}{tag}>' + chr(10))} {repeat(call, par)} {_lit(f'</{DSML_MARKER}{tag}>')})"
                for tag in ("function_calls", "tool_calls")
            ),
            call=lambda name, args: (
                f"{_lit(f'<{DSML_MARKER}invoke name=' + chr(34))} {name} "
                f"{_lit(chr(34) + '>' + chr(10))} {args} {_lit(f'</{DSML_MARKER}invoke>' + chr(10))}"
            ),
            arg=lambda k, v, raw: (
                f"{_lit(f'<{DSML_MARKER}parameter name={json.dumps(k, ensure_ascii=False)} ')} "
                f'"string=\\"{"true" if raw else "false"}\\">" {v} '
                f"{_lit(f'</{DSML_MARKER}parameter>' + chr(10))}"
            ),
            closer=f"</{DSML_MARKER}parameter>",
            raw_unions=False,
        ),
    ),
    Family(
        "kimi_k2",
        handlers=("kimi_k2",),
        spec=Spec(
            regions=(
                ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", kimi_k2_body),
                (KIMI_CALL[0], None, rewrap(KIMI_CALL[0], "", kimi_k2_body)),
            ),
            strip=("<|tool_calls_section_end|>",),
            think_stops=("<|tool_calls_section_begin|>", KIMI_CALL[0]),
        ),
        **_markup(
            "<|tool_calls_section_begin|>",
            block=lambda call, par: (
                f'"<|tool_calls_section_begin|>" {repeat(call, par)} "<|tool_calls_section_end|>"'
            ),
            call=lambda name, args: (
                f'"<|tool_call_begin|>functions." {name} ":" [0-9] [0-9]? '
                f'"<|tool_call_argument_begin|>" {args} "<|tool_call_end|>"'
            ),
        ),
    ),
    Family(
        "nemotron_v2",
        clues=((100, ("<TOOLCALL>",)),),
        spec=Spec(regions=(("<TOOLCALL>", "</TOOLCALL>", json_list_body),)),
        **wrapped_between("<TOOLCALL>", "</TOOLCALL>"),
    ),
    Family(
        "apertus",
        clues=((110, ("<|tools_prefix|>",)),),
        spec=Spec(
            think=("<|inner_prefix|>", "<|inner_suffix|>"),
            regions=(("<|tools_prefix|>", "<|tools_suffix|>", apertus_body),),
        ),
        **wrapped_between("<|tools_prefix|>", "<|tools_suffix|>", call="name_key"),
    ),
    Family(
        "apriel",
        clues=((120, ("<tool_calls>[",)), (120, ("<tool_calls>", "<|begin_assistant|>"))),
        spec=Spec(
            think=("", "[BEGIN FINAL RESPONSE]"),
            reasoning_lead="Here are my reasoning steps:\n",
            regions=(("<tool_calls>", "</tool_calls>", json_list_body),),
        ),
        **wrapped_between("<tool_calls>", "</tool_calls>"),
        channel_markup=True,
    ),
    Family(
        "firefunction_v2",
        clues=((180, (" functools[",)),),
        spec=Spec(think=None, regions=(("functools[", None, rewrap("[", "", json_list_body)),)),
        **wrapped_between("functools", ""),
    ),
    Family(
        "functionary_v3_1",
        clues=((190, ("<|start_header_id|>", "<function=")),),
        spec=Spec(
            think=None,
            regions=(("<function=", "</function>", functionary_v3_1_body),),
            held=("<|python_tag|>",),
            code_tag="<|python_tag|>",
        ),
    ),
    Family(
        "cohere2moe",
        handlers=("cohere2moe",),
        spec=Spec(
            think=_CMD,
            regions=(("<|START_ACTION|>", "<|END_ACTION|>", command_r_body),),
            strip=("<|START_TEXT|>", "<|END_TEXT|>"),
        ),
        **wrapped_between(
            "<|START_ACTION|>", "<|END_ACTION|>", call="cohere", args_key="parameters"
        ),
        channel_markup=True,
    ),
    Family(
        "command_r_plus",
        clues=((40, ("<|CHATBOT_TOKEN|>", "Action:")),),
        spec=Spec(
            think=None,
            regions=(("Action:", None, command_r_body),),
            strip=("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        ),
    ),
    Family(
        "minimax_m1",
        clues=((150, ("<tool_calls>", "ai name=assistant")),),
        spec=Spec(regions=(("<tool_calls>", "</tool_calls>", json_lines_body),)),
        **wrapped_between("<tool_calls>\n", "\n</tool_calls>", "lines"),
    ),
    Family(
        "gemma4",
        handlers=("gemma4",),
        spec=Spec(
            think=("<|channel>thought", "<channel|>"),
            regions=(("<|tool_call>", GEMMA_END, gemma4_body),),
            # stray channel markup a model writes around its answer never reaches content
            strip=(
                "<|channel>thought\n<channel|>",
                "<|channel>thought<channel|>",
                "<channel|>",
                "<|channel>",
            ),
        ),
        **_markup(
            "<|tool_call>",
            block=lambda call, par: repeat(call, par),
            call=lambda name, args: f'"<|tool_call>call:" {name} "{{" {args} "}}<tool_call|>"',
            arg=lambda k, v, raw: f'{_lit(k)} ":" {v}',
            closer=GEMMA_QUOTE,
            quote=GEMMA_QUOTE,
            sep=",",
            sorted_keys=True,
        ),
        channel_markup=True,
    ),
    Family(
        "minimax_m3",
        handlers=("minimax_m3",),
        spec=Spec(
            think=("<mm:think>", "</mm:think>"),
            think_implicit=True,
            regions=((MM_MARKER + "<tool_call>", MM_MARKER + "</tool_call>", minimax_m3_body),),
            held=(MM_MARKER,),
        ),
    ),
    Family(
        "kimi_k3",
        handlers=("kimi_k3",),
        spec=Spec(
            think=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
            regions=(("<|open|>tools<|sep|>", "<|close|>tools<|sep|>", kimi_k3_body),),
            think_stops=("<|open|>response<|sep|>", "<|open|>tools<|sep|>"),
            strip=(
                "<|open|>response<|sep|>",
                "<|close|>response<|sep|>",
                "<|close|>message<|sep|>",
            ),
        ),
        channel_markup=True,
    ),
    Family(
        "gigachat_v3",
        handlers=("gigachat_v3",),
        spec=Spec(
            think=None,
            regions=(("<|message_sep|>\n\nfunction call<|role_sep|>\n", None, json_call_body),),
        ),
    ),
    Family(
        "gigachat_v3_1",
        clues=((160, ("<|function_call|>", "<|role_sep|>")),),
        spec=Spec(think=None, regions=(("<|function_call|>", None, json_call_body),)),
        **wrapped_between("<|function_call|>", "", "object"),
    ),
    Family(
        "muse_glimmer",
        handlers=("muse_glimmer",),
        scanner=messages.muse,
        spec=Spec(
            think=(" to=self<|message|>", "<|eom|>"),
            regions=(("<atem:function_calls>", "</atem:function_calls>", muse_body),),
            strip=("<|eot|>", "<|eom|>"),
            held=("to=",),
            strip_re=r"(?:<\|start\|>assistant)?(?: to=[^<\s]*)?<\|message\|>",
        ),
        channel_markup=True,
    ),
    Family(
        "hy3",
        clues=((130, ("<tool_calls", "HYTK")),),
        spec=Spec(
            think=(f"<think{HY_MARKER}>", f"</think{HY_MARKER}>"),
            regions=((f"<tool_calls{HY_MARKER}>", f"</tool_calls{HY_MARKER}>", hy3_body),),
        ),
        **_markup(
            "<tool_calls:opensource>",
            block=lambda call, par: (
                f'"<tool_calls:opensource>\\n" {repeat(call, par)} "</tool_calls:opensource>"'
            ),
            call=lambda name, args: (
                f'"<tool_call:opensource>" {name} "<tool_sep:opensource>\\n" {args} '
                '"</tool_call:opensource>\\n"'
            ),
            arg=lambda k, v, raw: (
                f'"<arg_key:opensource>" {_lit(k)} "</arg_key:opensource>\\n" '
                f'"<arg_value:opensource>" {v} "</arg_value:opensource>\\n"'
            ),
            closer="</arg_value:opensource>",
        ),
    ),
    Family(
        "solar_open",
        clues=((140, ("<|tool_call:begin|>",)),),
        spec=Spec(
            think=("<|think|>", "<|end|>"),
            regions=(("<|tool_call:begin|>", "<|tool_call:end|>", solar_body),),
            strip=("<|begin|>assistant", "<|content|>", "<|end|>"),
            section=("<|tool_calls|>", "<|calls|>"),
        ),
        **_markup(
            "<|tool_call:begin|>",
            block=lambda call, par: repeat(call, par),
            call=lambda name, args: (
                f'"<|tool_call:begin|>" [a-zA-Z0-9]{{1,12}} "<|tool_call:name|>" {name} '
                f'"<|tool_call:args|>" {args} "<|tool_call:end|>"'
            ),
        ),
        channel_markup=True,
    ),
    Family(
        "minicpm5",
        handlers=("minicpm5",),
        spec=Spec(
            regions=(("<function", "</function>", rewrap("", "</function>", minicpm5_body)),)
        ),
        **_markup(
            '<function name="',
            block=lambda call, par: repeat(call, par, "\n"),
            call=lambda name, args: f'"<function name=\\"" {name} "\\">" {args} "</function>"',
            arg=lambda k, v, raw: f'"<param name=\\"" {_lit(k)} "\\">" {v} "</param>"',
            closer="</param>",
        ),
    ),
)

#: Every family by name, in the order :data:`~.parsers.FORMATS` lists them.
FAMILIES: dict[str, Family] = {f.name: f for f in _RECORDS}


def budget_markers(fmt: str | None) -> tuple[str, str, str] | None:
    """:attr:`Family.budget_markers` of ``fmt`` (a format with no record, a learned
    one, thinks in ``<think>``)."""
    return FAMILIES.get(fmt or "", Family(fmt or "")).budget_markers
