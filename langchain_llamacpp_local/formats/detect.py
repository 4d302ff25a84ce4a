"""Which output syntax a chat template teaches its model, chosen the way llama.cpp chooses.

llama.cpp 0.3.36 (``common/chat.cpp``) first tries its specialized handlers, by substring
tests on the template source in a fixed order (``common_chat_try_specialized_template``),
and hands every other template to its differential auto-parser, which learns the markers
by rendering the template. :func:`detect_handler` is an exact port of the first step;
:func:`detect_format` maps a specialized handler to our parser of the same syntax and, for
auto-parser templates, recognises the syntax the auto-parser would find from the markers
the template writes (the hand-written families of llama.cpp's legacy detection order).
"""

from __future__ import annotations

from langchain_llamacpp_local.formats.registry import FAMILIES

#: llama.cpp's specialized handler -> our format of the same syntax.
_SPECIALIZED_FORMAT = {h: f.name for f in FAMILIES.values() for h in f.handlers}

#: The auto-parser route's clues, in llama.cpp's legacy detection order.
_CLUES = sorted(
    ((rank, needles, f.name) for f in FAMILIES.values() for rank, needles in f.clues),
    key=lambda clue: clue[0],
)


def detect_handler(chat_template: str) -> str:
    """The handler llama.cpp 0.3.36 picks: a specialized family name or ``"autoparser"``.

    Port of ``common_chat_try_specialized_template`` (``common/chat.cpp``), same tests,
    same order.
    """
    s = chat_template or ""

    def has(*needles: str) -> bool:
        return all(n in s for n in needles)

    if has("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]") and "[CALL_ID]" not in s:
        return "ministral_3"
    if has("<|channel|>"):
        return "gpt_oss"
    if has("<atem:function_calls>", "<|eom|>"):
        return "muse_glimmer"
    if has(">>>all", ">>>${recipient}"):
        return "functionary_v3_2"
    if has("<|tool_calls_section_begin|>", "<|tool_call_begin|>"):
        return "kimi_k2"
    if has("<|open|>", "<|close|>", "<|end_of_msg|>"):
        return "kimi_k3"
    if has("<role>ASSISTANT</role>", "<arg_key>"):
        return "ling3"
    if has("<|START_TEXT|>", "<|START_ACTION|>"):
        return "cohere2moe"
    if has("<|tool_list_start|>", "<|tool_list_end|>"):
        return "lfm2"
    if has("List of tools: [") and "<|tool_list_start|>" not in s:
        return "lfm2_5"
    if has("<|role_sep|>", "<|message_sep|>") and "<|function_call|>" not in s:
        return "gigachat_v3"
    if has("]<]minimax[>[", "<tool_call>", "<invoke name="):
        return "minimax_m3"
    if has("dsml_token", "DSML") and ("function_calls" in s or "tool_calls" in s):
        return "deepseek_v3_2"
    if has("'<|tool_call>call:'"):
        return "gemma4"
    if has("Tool usage guidelines:", '<function name="', '<param name="'):
        return "minicpm5"
    if (
        has("<tool_call>", "<function=", "<parameter=")
        and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in s
    ):
        return "qwen3_coder"
    return "autoparser"


def _autoparser_format(s: str) -> str:
    """The syntax llama.cpp's auto-parser finds in a template no specialized handler took.

    Recognised from the markers the template writes (each family's ``clues``), in
    llama.cpp's legacy detection order (``chat.cpp`` @34df42f7b), which its auto-parser
    tests reproduce.
    """
    for _rank, needles, name in _CLUES:
        if all(n in s for n in needles):
            return name
    return "generic"


def detect_format(chat_template: str) -> str:
    """The output format (one of :data:`~.parsers.FORMATS`) to parse for a chat template."""
    handler = detect_handler(chat_template)
    if handler != "autoparser":
        return _SPECIALIZED_FORMAT[handler]
    return _autoparser_format(chat_template or "")
