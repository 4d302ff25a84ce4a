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

#: llama.cpp's specialized handler -> our format of the same syntax.
_SPECIALIZED_FORMAT = {
    "ministral_3": "ministral_3",
    "gpt_oss": "gpt_oss",
    "muse_glimmer": "muse_glimmer",
    "functionary_v3_2": "functionary_v3_2",
    "kimi_k2": "kimi_k2",
    "kimi_k3": "kimi_k3",
    "ling3": "glm45",
    "cohere2moe": "cohere2moe",
    "lfm2": "pythonic",
    "lfm2_5": "pythonic",
    "gigachat_v3": "gigachat_v3",
    "minimax_m3": "minimax_m3",
    "deepseek_v3_2": "deepseek_v3_2",
    "gemma4": "gemma4",
    "minicpm5": "minicpm5",
    "qwen3_coder": "qwen3_coder",
}


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

    Recognised from the markers the template writes, in llama.cpp's legacy detection
    order (``chat.cpp`` @34df42f7b), which its auto-parser tests reproduce.
    """
    if "<｜tool▁calls▁begin｜>" in s or "tool▁calls▁begin" in s:
        if "message['prefix'] is defined and message['prefix'] and thinking" in s:
            return "deepseek_v3_1"
        return "deepseek_r1"
    if "<|END_THINKING|><|START_ACTION|>" in s or "<|START_ACTION|>" in s:
        return "command_r7b"
    if "<|CHATBOT_TOKEN|>" in s and "Action:" in s:
        return "command_r_plus"
    if "<|tool_call|>" in s:
        return "granite"
    if "<arg_key>" in s:
        return "glm45"
    if "<seed:tool_call>" in s or "<seed:think>" in s:
        return "seed_oss"
    if "<tool_call>" in s and "<function=" in s and "<parameter=" in s:
        return "qwen3_coder"
    if "<minimax:tool_call>" in s:
        return "minimax_m2"
    if "<TOOLCALL>" in s:
        return "nemotron_v2"
    if "<|tools_prefix|>" in s:
        return "apertus"
    if "<tool_calls>[" in s or "<tool_calls>" in s and "<|begin_assistant|>" in s:
        return "apriel"
    if "<tool_calls" in s and "HYTK" in s:
        return "hy3"
    if "<|tool_call:begin|>" in s:
        return "solar_open"
    if "<tool_calls>" in s and "ai name=assistant" in s:
        return "minimax_m1"
    if "<|function_call|>" in s and "<|role_sep|>" in s:
        return "gigachat_v3_1"
    if "<tool_call>" in s:
        return "hermes"
    if " functools[" in s:
        return "firefunction_v2"
    if "<|start_header_id|>" in s and "<function=" in s:
        return "functionary_v3_1"
    if "<|start_header_id|>ipython<|end_header_id|>" in s or "<|python_tag|>" in s:
        return "llama3_json"
    if "[THINK]" in s:
        return "ministral_3"
    if "[TOOL_CALLS]" in s:
        return "mistral"
    if "<|tool_call_start|>" in s or "[func_name1(" in s or "func_name1(params_name1" in s:
        return "pythonic"
    if "<|start_header_id|>" in s and "tools" in s:
        return "llama3_json"
    return "generic"


def detect_format(chat_template: str) -> str:
    """The output format (one of :data:`~.core.FORMATS`) to parse for a chat template."""
    handler = detect_handler(chat_template)
    if handler != "autoparser":
        return _SPECIALIZED_FORMAT[handler]
    return _autoparser_format(chat_template or "")
