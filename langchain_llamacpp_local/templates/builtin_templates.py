"""Built-in chat templates (lenient, Hermes-style tools) and choosing a model's template."""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Mapping

from langchain_llamacpp_local.errors import ChatTemplateError
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from langchain_llamacpp_local.templates.hermes_prompt import TOOL_SYSTEM_PROMPT

logger = logging.getLogger(__name__)


_HEAD, _TAIL = TOOL_SYSTEM_PROMPT.split("\n{tools}\n")

# Shared macros: content (string or text/image parts), Hermes tool calls and tool prompt.
_MACROS = r"""{%- macro render_content(content, image_token) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is string -%}{{ part }}
{%- elif part is mapping and part.type == 'text' -%}{{ part.text }}
{%- elif part is mapping and part.type in ['image', 'image_url'] -%}{{ image_token }}
{%- endif -%}
{%- endfor -%}
{%- elif content is defined and content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(message) -%}
{%- for tc in message.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if not loop.first -%}{{ '\n' }}{%- endif -%}
{{- '<tool_call>\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{ fn.arguments }}
{%- elif fn.arguments is defined and fn.arguments is not none -%}{{ fn.arguments | tojson }}
{%- else -%}{{ '{}' }}
{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endmacro -%}
{%- macro render_assistant(message, image_token) -%}
{%- set text = render_content(message.content, image_token) -%}
{{- text -}}
{%- if message.tool_calls -%}
{%- if text -%}{{ '\n' }}{%- endif -%}
{{- render_tool_calls(message) -}}
{%- endif -%}
{%- endmacro -%}
{%- macro tool_prompt(tools) -%}
{{- @HEAD@ -}}
{%- for tool in tools -%}{{ '\n' }}{{ tool | tojson }}{%- endfor -%}
{{- @TAIL@ -}}
{%- endmacro -%}
{%- macro tool_response(message, image_token) -%}
{{- '<tool_response>\n' ~ render_content(message.content, image_token) ~ '\n</tool_response>' -}}
{%- endmacro -%}
""".replace("@HEAD@", json.dumps(_HEAD)).replace("@TAIL@", json.dumps("\n" + _TAIL))

# Gemma 3: no system role (leading system text and the tool prompt open the first
# user turn, later system messages become user turns), tool results as user turns.
_GEMMA = r"""{{- bos_token -}}
{%- set ns = namespace(prefix='', leading=true) -%}
{%- for message in messages -%}
{%- if message.role == 'system' and ns.leading -%}
{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ (render_content(message.content, '<start_of_image>') | trim) -%}
{%- else -%}
{%- if ns.leading -%}
{%- set ns.leading = false -%}
{%- if tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix and message.role != 'user' -%}
{{- '<start_of_turn>user\n' ~ ns.prefix ~ '<end_of_turn>\n' -}}
{%- set ns.prefix = '' -%}
{%- endif -%}
{%- endif -%}
{%- if message.role == 'user' -%}
{{- '<start_of_turn>user\n' ~ (ns.prefix ~ '\n\n' if ns.prefix else '') ~ (render_content(message.content, '<start_of_image>') | trim) ~ '<end_of_turn>\n' -}}
{%- set ns.prefix = '' -%}
{%- elif message.role == 'assistant' -%}
{{- '<start_of_turn>model\n' ~ (render_assistant(message, '<start_of_image>') | trim) ~ '<end_of_turn>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<start_of_turn>user\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<start_of_image>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<end_of_turn>\n' -}}{%- endif -%}
{%- else -%}
{{- '<start_of_turn>user\n' ~ (render_content(message.content, '<start_of_image>') | trim) ~ '<end_of_turn>\n' -}}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.leading and tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix -%}{{- '<start_of_turn>user\n' ~ ns.prefix ~ '<end_of_turn>\n' -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

# ChatML / Qwen 2.5: tool prompt after the first system message (or as its own).
_CHATML = r"""{%- if tools and (not messages or messages[0].role != 'system') -%}
{{- '<|im_start|>system\n' ~ tool_prompt(tools) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{{- '<|im_start|>system\n' ~ render_content(message.content, '<__media__>') -}}
{%- if loop.first and tools -%}{{- '\n\n' ~ tool_prompt(tools) -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' ~ render_assistant(message, '<__media__>') ~ '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' ~ message.role ~ '\n' ~ render_content(message.content, '<__media__>') ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

_LLAMA3 = r"""{{- bos_token -}}
{%- if tools and (not messages or messages[0].role != 'system') -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' ~ tool_prompt(tools) ~ '<|eot_id|>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' ~ (render_content(message.content, '<__media__>') | trim) -}}
{%- if loop.first and tools -%}{{- '\n\n' ~ tool_prompt(tools) -}}{%- endif -%}
{{- '<|eot_id|>' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' ~ (render_assistant(message, '<__media__>') | trim) ~ '<|eot_id|>' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|eot_id|>' -}}{%- endif -%}
{%- else -%}
{{- '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\n\n' ~ (render_content(message.content, '<__media__>') | trim) ~ '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# Mistral [INST] format: like Gemma, no system role.
_MISTRAL = r"""{{- bos_token -}}
{%- set ns = namespace(prefix='', leading=true) -%}
{%- for message in messages -%}
{%- if message.role == 'system' and ns.leading -%}
{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ render_content(message.content, '<__media__>') -%}
{%- else -%}
{%- if ns.leading -%}
{%- set ns.leading = false -%}
{%- if tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix and message.role != 'user' -%}
{{- '[INST] ' ~ ns.prefix ~ ' [/INST]' -}}
{%- set ns.prefix = '' -%}
{%- endif -%}
{%- endif -%}
{%- if message.role == 'assistant' -%}
{{- ' ' ~ render_assistant(message, '<__media__>') ~ eos_token -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '[INST] ' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- ' [/INST]' -}}{%- endif -%}
{%- else -%}
{{- '[INST] ' ~ (ns.prefix ~ '\n\n' if ns.prefix else '') ~ render_content(message.content, '<__media__>') ~ ' [/INST]' -}}
{%- set ns.prefix = '' -%}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.leading and tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix -%}{{- '[INST] ' ~ ns.prefix ~ ' [/INST]' -}}{%- endif -%}
"""

_PHI3 = r"""{%- if tools and (not messages or messages[0].role != 'system') -%}
{{- '<|system|>\n' ~ tool_prompt(tools) ~ '<|end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{{- '<|system|>\n' ~ render_content(message.content, '<__media__>') -}}
{%- if loop.first and tools -%}{{- '\n\n' ~ tool_prompt(tools) -}}{%- endif -%}
{{- '<|end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|assistant|>\n' ~ render_assistant(message, '<__media__>') ~ '<|end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|user|>\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|user|>\n' ~ render_content(message.content, '<__media__>') ~ '<|end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": _MACROS + _GEMMA,
    "chatml": _MACROS + _CHATML,
    "llama3": _MACROS + _LLAMA3,
    "mistral": _MACROS + _MISTRAL,
    "phi3": _MACROS + _PHI3,
}
"""Lenient fallback templates (Hermes-style tools), by name; usable as overrides."""


# --------------------------------------------------------------------------- selection


def _builtin_for(metadata: Mapping[str, str]) -> str:
    """The built-in template matching a GGUF's architecture and name."""
    arch = str(metadata.get("general.architecture") or "").lower()
    name = str(metadata.get("general.name") or "").lower()
    if arch.startswith("gemma"):
        return "gemma"
    if arch.startswith("mistral") or "mistral" in name or "mixtral" in name:
        return "mistral"
    if arch == "llama" and any(k in name for k in ("llama-3", "llama3", "llama 3")):
        return "llama3"
    if arch == "phi3":
        return "phi3"
    return "chatml"


def is_template_source(text: str) -> bool:
    """The rule telling a template name from template source: source has Jinja markup.

    Without it a typo such as ``"chatmlx"`` would be compiled as a template that
    prints the word ``chatmlx`` for every prompt.
    """
    return any(mark in text for mark in ("{{", "{%", "{#"))


def _named_template(metadata: Mapping[str, str], name: str, tokens: dict[str, str]) -> ChatTemplate:
    gguf_key = f"tokenizer.chat_template.{name}"
    if metadata.get(gguf_key):
        return ChatTemplate(str(metadata[gguf_key]), origin=f"gguf:{gguf_key}", **tokens)
    if name.lower() in BUILTIN_TEMPLATES:
        key = name.lower()
        return ChatTemplate(BUILTIN_TEMPLATES[key], origin=f"builtin:{key}", **tokens)
    variants = sorted(
        k.removeprefix("tokenizer.chat_template.")
        for k in metadata
        if k.startswith("tokenizer.chat_template.")
    )
    close = difflib.get_close_matches(name.lower(), [*BUILTIN_TEMPLATES, *variants], n=1)
    raise ChatTemplateError(
        f"chat_template={name!r} is not a built-in template name "
        f"({', '.join(BUILTIN_TEMPLATES)})"
        + (f" nor one of the model's named templates ({', '.join(variants)})" if variants else "")
        + (f"; did you mean {close[0]!r}?" if close else "")
        + " (Jinja template source must contain '{{' or '{%')"
    )


def select_template(
    metadata: Mapping[str, str], *, override: str | None = None, with_tools: bool = False
) -> ChatTemplate:
    """Pick and compile the chat template for a model.

    Order: ``override`` (a built-in name, a GGUF named variant such as ``"tool_use"``,
    or Jinja source — see :func:`is_template_source`; an unknown name raises); the GGUF ``tokenizer.chat_template.tool_use`` when
    ``with_tools``; the GGUF ``tokenizer.chat_template``; a built-in chosen from
    ``general.architecture``/``general.name``. A GGUF template that fails to compile
    is logged and replaced by the built-in, so the model stays usable; a bad
    override raises. ``_bos_token``/``_eos_token`` in ``metadata`` are the special
    token texts (looked up in the vocab by the caller).
    """
    tokens = {
        "bos_token": str(metadata.get("_bos_token") or ""),
        "eos_token": str(metadata.get("_eos_token") or ""),
    }
    if override is not None:
        if not is_template_source(override):
            return _named_template(metadata, override.strip(), tokens)
        return ChatTemplate(override, origin="override", **tokens)
    keys = ["tokenizer.chat_template"]
    if with_tools:
        keys.insert(0, "tokenizer.chat_template.tool_use")
    for key in keys:
        source = metadata.get(key)
        if source:
            try:
                return ChatTemplate(str(source), origin=f"gguf:{key}", **tokens)
            except ChatTemplateError as exc:
                logger.warning("%s; falling back to a built-in template", exc)
    name = _builtin_for(metadata)
    return ChatTemplate(BUILTIN_TEMPLATES[name], origin=f"builtin:{name}", **tokens)
