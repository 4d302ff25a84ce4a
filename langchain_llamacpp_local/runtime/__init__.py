"""The engine core: token-level requests and typed reply items, the step scheduler
(pure), the worker thread that owns a context, speculation, per-token log-probabilities,
LoRA per request and the model registry. Nothing here knows chat messages, templates or
output formats (``chat/`` does); model names are resolved below it (``resolution/``).
"""
