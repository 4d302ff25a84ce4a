"""Learn a chat template's reasoning and tool-call syntax by rendering it.

A Python port of llama.cpp's differential "auto-parser" analysis
(``common/chat-diff-analyzer.cpp``, ``chat-auto-parser-helpers.cpp``,
``chat-auto-parser-generator.cpp``; see ``docs/template-analysis.md``). The
template is rendered with pairs of synthetic conversations that differ in one
thing (a sentinel tool name, argument name or value, call id, reasoning or
content); the differences between the two renders are the markers around that
thing. From them :func:`analyze_template` builds a frozen
:class:`TemplateAnalysis` (reasoning markers R1-R3, content wrappers C1, the
tool-call layout T1-T7), and :func:`parse_with_analysis` splits model output
with it, so a model whose template no hand-written parser knows still gets its
tool calls parsed.

Everything here is pure (no model): rendering goes through
``templates.ChatTemplate`` and a template that fails to render a probe simply
teaches nothing from that probe, as in llama.cpp. Parsing never raises on model
output: malformed calls come back with an ``error`` and their raw text.

The package: ``diff`` (render diffing), ``probes`` (:class:`TemplateAnalysis`, the
probe renders and their diffs), ``analyzer`` (the steps, :func:`analyze_template`),
``tool_probes`` (its tool-call steps), ``parser`` (:func:`parse_with_analysis`) with
``call_scanner`` (the calls of one tool region).
"""

from langchain_llamacpp_local.formats.auto.analyzer import analyze_template, analyze_template_full
from langchain_llamacpp_local.formats.auto.diff import (
    DiffSplit,
    after_common_suffix,
    calculate_diff_split,
    segmentize_markers,
    until_common_prefix,
)
from langchain_llamacpp_local.formats.auto.parser import (
    AnalysisParse,
    parse_with_analysis,
)
from langchain_llamacpp_local.formats.auto.probes import TemplateAnalysis

__all__ = [
    "AnalysisParse",
    "DiffSplit",
    "TemplateAnalysis",
    "after_common_suffix",
    "analyze_template",
    "analyze_template_full",
    "calculate_diff_split",
    "parse_with_analysis",
    "segmentize_markers",
    "until_common_prefix",
]
