"""The C boundary: the only package that imports ``llama_cpp``.

Backend start and native logs, load settings, weight placement, the chat context
(:class:`engine.Engine`), vocabulary, sampler and JSON-schema grammars, the draft and
embedding contexts, LoRA files and RPC devices.
"""

# Every module here that loads llama.cpp is imported through this package, so this runs
# first: OpenMP reads how its threads wait once, when llama.cpp loads it
# (docs/configuration.md#threads).
from langchain_llamacpp_local.llama.threads import prepare_openmp

prepare_openmp()
