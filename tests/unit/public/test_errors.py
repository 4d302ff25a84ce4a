"""Every public error is also LangChain's standard model error of its kind, and keeps
its Python base (docs/concurrency.md, "Errors")."""

from __future__ import annotations

import inspect

import pytest
from langchain_core import exceptions as lc

import langchain_llamacpp_local
from langchain_llamacpp_local import errors
from langchain_llamacpp_local.errors import as_model_error

# (error, its Python base kept from before, LangChain's type, retryable)
TABLE = [
    (errors.ContextOverflowError, ValueError, lc.ContextOverflowError, False),
    (errors.RequestTimeoutError, TimeoutError, lc.ModelTimeoutError, True),
    (errors.ModelNotFoundError, errors.ModelLoadError, lc.ModelNotFoundError, False),
    (errors.InvalidRequestError, ValueError, lc.ModelInvalidRequestError, False),
    (errors.InvalidArgumentError, TypeError, lc.ModelInvalidRequestError, False),
    (errors.ChatTemplateError, ValueError, lc.ModelInvalidRequestError, False),
    (errors.ImageInputError, ValueError, lc.ModelInvalidRequestError, False),
    (errors.AudioInputError, ValueError, lc.ModelInvalidRequestError, False),
    (errors.InvalidSamplingParams, ValueError, lc.ModelInvalidRequestError, False),
    (errors.GrammarTooLargeError, ValueError, lc.ModelInvalidRequestError, False),
    (errors.ResponseFormatBesideToolsError, ValueError, lc.ModelInvalidRequestError, False),
    (errors.DecodeError, errors.LlamaCppError, lc.ModelAPIError, True),
    (errors.WorkerDeadError, errors.LlamaCppError, lc.ModelAPIError, True),
    (errors.SamplingError, RuntimeError, lc.ModelAPIError, False),
    (errors.NonFiniteOutputError, errors.DecodeError, lc.ModelAPIError, False),
    (errors.ModelLoadError, errors.LlamaCppError, lc.ModelError, False),
    (errors.RpcError, errors.ModelLoadError, lc.ModelError, False),
    (errors.IncompatibleDraftModelError, errors.ModelLoadError, lc.ModelError, False),
    (errors.GGUFHeaderError, ValueError, lc.ModelError, False),
    (errors.StructuredOutputTruncatedError, ValueError, lc.OutputParserException, False),
]


@pytest.mark.parametrize(("cls", "base", "standard", "retryable"), TABLE)
def test_each_error_is_also_langchains(
    cls: type[Exception], base: type[Exception], standard: type[Exception], retryable: bool
) -> None:
    assert issubclass(cls, base)
    assert issubclass(cls, standard)
    if issubclass(cls, lc.ModelError):
        assert cls.is_retryable is retryable


def test_the_table_covers_every_public_error() -> None:
    public = {
        obj
        for name in errors.__all__
        if isinstance(obj := getattr(errors, name), type) and issubclass(obj, Exception)
    }
    covered = {row[0] for row in TABLE}
    # not failures of a request: a cancel, a debugging assertion, an agent's verdict, a base
    others = {
        errors.RequestCancelledError,
        errors.KVDesyncError,
        errors.InvalidToolCallError,
        errors.LlamaCppError,
    }
    assert public == covered | others
    assert not issubclass(errors.RequestCancelledError, lc.ModelError)  # unchanged semantics


def test_every_exception_class_of_the_package_lives_in_errors() -> None:
    """Modules re-export from ``errors`` (their old names still import); none defines one."""
    import pkgutil

    stray = []
    for info in pkgutil.walk_packages(
        langchain_llamacpp_local.__path__, "langchain_llamacpp_local."
    ):
        if info.name.endswith(("rpc_server", ".errors")):
            continue
        module = __import__(info.name, fromlist=["_"])
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == info.name
                and not name.startswith("_")
            ):
                stray.append(f"{info.name}.{name}")
    # internal signals that never leave their module
    assert sorted(stray) == [
        # the cache layer's refusal, raised to the caller as a ValueError naming the setting
        "langchain_llamacpp_local.cache.disk_key.UnsafeCacheError",
        "langchain_llamacpp_local.formats.grammars.NotTagShaped",
        "langchain_llamacpp_local.templates.sandbox.TemplateLimitError",
        "langchain_llamacpp_local.templates.sandbox.TemplateRaised",
    ]


def test_every_public_error_class_is_exported() -> None:
    """From ``errors.__all__`` and the package root: a caller's ``except`` needs the name."""
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
        and not name.startswith("_")
    }
    assert defined <= set(errors.__all__)
    assert defined <= set(langchain_llamacpp_local.__all__)
    for name in defined:
        assert getattr(langchain_llamacpp_local, name) is getattr(errors, name)


def test_old_import_paths_still_work() -> None:
    from langchain_llamacpp_local.agents import InvalidToolCallError
    from langchain_llamacpp_local.chat.images import ImageInputError
    from langchain_llamacpp_local.llama.json_grammar import GrammarTooLargeError
    from langchain_llamacpp_local.llama.sampling import InvalidSamplingParams, SamplingError
    from langchain_llamacpp_local.resolution.model_resolution import ModelNotFoundError
    from langchain_llamacpp_local.templates.chat_template import ChatTemplateError

    assert InvalidToolCallError is errors.InvalidToolCallError
    assert ImageInputError is errors.ImageInputError
    assert GrammarTooLargeError is errors.GrammarTooLargeError
    assert InvalidSamplingParams is errors.InvalidSamplingParams
    assert SamplingError is errors.SamplingError
    assert ModelNotFoundError is errors.ModelNotFoundError
    assert ChatTemplateError is errors.ChatTemplateError


@pytest.mark.parametrize(
    ("raised", "expected", "base"),
    [
        (ValueError("bad"), lc.ModelInvalidRequestError, ValueError),
        (TypeError("bad"), lc.ModelInvalidRequestError, TypeError),
        (TimeoutError("slow"), lc.ModelTimeoutError, TimeoutError),
    ],
)
def test_plain_errors_from_deeper_code_are_classified(
    raised: Exception, expected: type[Exception], base: type[Exception]
) -> None:
    out = as_model_error(raised)
    assert isinstance(out, expected) and isinstance(out, base)
    assert out.args == raised.args


def test_classified_and_foreign_errors_pass_unchanged() -> None:
    for exc in (
        errors.ContextOverflowError("x"),
        errors.RequestCancelledError("x"),
        errors.StructuredOutputTruncatedError("x"),
        KeyError("x"),
    ):
        assert as_model_error(exc) is exc


def test_errors_survive_pickling() -> None:
    """Errors cross processes (multiprocessing, a LangGraph checkpoint of a failed run)."""
    import pickle

    for exc in (
        errors.ModelNotFoundError("qwen3", ["models_dir: not set"]),
        errors.ModelNotFoundError("x.gguf", ["x.gguf"], message="model file not found: x.gguf"),
        errors.ChatTemplateError("broken", limit=True),
        errors.RequestTimeoutError("slow"),
        errors.ContextOverflowError("long"),
        errors.StructuredOutputTruncatedError("cut", llm_output='{"a": '),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert vars(back) == vars(exc)
