"""The C boundary: the only package that imports ``llama_cpp``.

Backend start and native logs, load settings, weight placement, the chat context
(:class:`engine.Engine`), vocabulary, sampler and JSON-schema grammars, the draft and
embedding contexts, LoRA files and RPC devices.
"""
