"""The C boundary: the only package that imports ``llama_cpp``.

Backend start and native logs, load settings, loading a model and placing its weights
(:mod:`.loading`), the chat context (:class:`engine.Engine`) and what it probes at
creation (:mod:`.probes`), images (:mod:`.mtmd`), the LoRA registry, vocabulary, the
sampler chain (:mod:`.sampling`), stop strings and UTF-8 streaming (:mod:`.text_stream`),
JSON-schema grammars (:mod:`.json_grammar`), the draft and embedding contexts, LoRA files
and RPC devices.
"""
