"""Chat templates: the Jinja sandbox and :class:`chat_template.ChatTemplate`.

Rendering a model's template and adapting LangChain messages to it; no llama.cpp, no
tool-call syntax.
"""
