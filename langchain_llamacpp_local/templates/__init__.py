"""Chat templates: the Jinja sandbox and :class:`chat_template.ChatTemplate`.

Converting LangChain messages (:mod:`.messages`), rendering a model's template and
adapting a request to it (:mod:`.adaptation`), the built-in templates and choosing one
(:mod:`.builtin_templates`); no llama.cpp. The one tool-call syntax here is the Hermes
prompt of :mod:`.hermes_prompt`, for templates that cannot render tools themselves.
"""
