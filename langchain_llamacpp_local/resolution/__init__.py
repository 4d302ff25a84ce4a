"""Finding a model's files: local paths, the Hugging Face cache and hub, the projector
beside a GGUF. Above ``errors`` only: no llama.cpp, no runtime."""
