"""``reasoning_effort`` in the names a chat template reads.

Callers speak OpenAI's efforts (``none`` ... ``high``); templates read them under other
variables and values: Hy3 accepts only ``no_think``/``low``/``high`` in
``reasoning_effort`` (and raises on anything else), Solar Open turns thinking off for
``minimal``, Kimi K3 reads ``thinking`` and ``thinking_effort`` (``low``/``high``/``max``),
MiniMax M3 reads ``thinking_mode`` (``disabled``/``adaptive``/``enabled``), Muse reads
``reasoning_strength``. The values a
template knows are read from its source (the string constants it compares each variable
with), so a template is given a value it renders rather than one it ignores or rejects.
"""

from __future__ import annotations

from functools import lru_cache

from jinja2 import TemplateSyntaxError, nodes

from langchain_llamacpp_local.templates.sandbox import make_env

_OPENAI = ("none", "minimal", "low", "medium", "high")
#: effort-valued variables: given the caller's effort, or the template's name for it
EFFORT_VARIABLES = ("reasoning_effort", "reasoning_strength", "thinking_effort")
#: on/off/auto-valued variables, by what each of OpenAI's efforts means to them
SWITCH_VARIABLES: dict[str, dict[str, str | bool]] = {
    # Kimi K3, Granite 3.3, DeepSeek V3.x (which otherwise read ``enable_thinking``)
    "thinking": {e: e not in ("none", "minimal") for e in _OPENAI},
    # Cohere2MoE (which otherwise derives it from ``reasoning_effort``)
    "reasoning": {e: e not in ("none", "minimal") for e in _OPENAI},
    "thinking_mode": {
        "none": "disabled",
        "minimal": "disabled",
        "low": "adaptive",
        "medium": "enabled",
        "high": "enabled",
    },
}
#: OpenAI's efforts in order (an effort a template lacks maps to its nearest known level)
LADDER = _OPENAI
#: how templates spell "no thinking" in an effort variable, preferred first (Solar Open
#: thinks for any effort but ``low`` and ``minimal``)
OFF_NAMES = ("none", "no_think", "off", "disabled", "minimal")


def _named(node: nodes.Node, name: str) -> bool:
    """``node`` is the variable ``name``, possibly through filters (``x | lower``)."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return isinstance(node, nodes.Name) and node.name == name


def _strings(node: nodes.Node) -> list[str]:
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (nodes.List, nodes.Tuple)):
        return [v for item in node.items for v in _strings(item)]
    return []


@lru_cache(maxsize=64)
def known_values(source: str, name: str) -> tuple[frozenset[str], bool]:
    """The string values ``source`` compares the variable ``name`` with, and whether it
    checks that a value is one of a list (other values are then rejected or ignored)."""
    try:
        ast = make_env().parse(source)  # the dialect templates are compiled in
    except TemplateSyntaxError:
        return frozenset(), False
    values: set[str] = set()
    closed = False
    for cmp in ast.find_all(nodes.Compare):
        operands = [cmp.expr, *(op.expr for op in cmp.ops)]
        if not any(_named(x, name) for x in operands):
            continue
        for op in cmp.ops:
            found = _strings(op.expr) or _strings(cmp.expr)
            values.update(found)
            # ``x not in [...]`` validates: the template rejects or ignores other values
            closed |= op.op == "notin" and isinstance(op.expr, (nodes.List, nodes.Tuple))
    return frozenset(values), closed


def _effort_value(effort: str, known: frozenset[str], closed: bool) -> str:
    if not known or effort in known:
        return effort
    if effort in ("none", "minimal"):
        for off in OFF_NAMES:
            if off in known:
                return off
    if not closed:  # the template renders its default for names it does not compare
        return effort
    levels = [v for v in LADDER if v in known]
    if not levels:
        return effort
    here = LADDER.index(effort)
    # nearest known level; a tie goes up (medium between low and high is high)
    return min(levels, key=lambda v: (abs(LADDER.index(v) - here), -LADDER.index(v)))


def effort_variables(
    source: str, variables: frozenset[str], effort: str, *, switches_only: bool = False
) -> dict[str, str | bool]:
    """The template variables carrying ``effort`` (one of :data:`LADDER`) for a template
    with ``source`` that reads ``variables``; ``switches_only``: only on/off variables
    (what ``reasoning_budget=0`` sets, leaving the effort level at its default)."""
    out: dict[str, str | bool] = {}
    if not switches_only:
        for name in EFFORT_VARIABLES:
            if name in variables:
                out[name] = _effort_value(effort, *known_values(source, name))
    for name, mapping in SWITCH_VARIABLES.items():
        if name in variables:
            value = mapping[effort]
            if isinstance(value, bool) or value in known_values(source, name)[0]:
                out[name] = value
    return out
