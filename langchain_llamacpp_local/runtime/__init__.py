"""Requests at run time: request/reply types, the step scheduler (pure), the worker
thread that owns a context, speculation, LoRA per request, the model registry and
model-name resolution.
"""
