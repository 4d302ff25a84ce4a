"""``ChatLlamaCpp``: a LangChain chat model running a local GGUF model in-process."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import (
    Runnable,
    RunnableGenerator,
    RunnableMap,
    RunnablePassthrough,
)
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    StrictBool,
    model_validator,
)
from typing_extensions import Self

from langchain_llamacpp_local.chat.preview import RenderedPrompt
from langchain_llamacpp_local.copies import ConfigOnlyCopies
from langchain_llamacpp_local.errors import (
    RequestCancelledError,
    RequestTimeoutError,
    StructuredOutputTruncatedError,
    model_errors,
)
from langchain_llamacpp_local.formats import StreamDelta
from langchain_llamacpp_local.llama.engine import check_gguf_file
from langchain_llamacpp_local.llama.gguf import read_gguf_metadata
from langchain_llamacpp_local.llama.model_handle import model_file
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.llama.settings import DEFAULT_MAX_CTX, check_load_settings
from langchain_llamacpp_local.model_selection import ModelSelection, duration_seconds
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.lora import parse_adapters, request_key, resolve_adapter_path
from langchain_llamacpp_local.runtime.model_resolution import (
    MMPROJ_AUTO,
    MMPROJ_NONE,
    ModelEntry,
    ResolvedModel,
    models_dir_from,
    resolve_model,
)
from langchain_llamacpp_local.runtime.model_resolution import list_models as _list_models
from langchain_llamacpp_local.runtime.worker import (
    CacheOptions,
    ChatJob,
    Done,
    ModelInfo,
    ModelWorker,
)
from langchain_llamacpp_local.templates.chat_template import convert_messages
from langchain_llamacpp_local.validation import (
    check_argument_names,
    check_call_options,
    check_max_tokens,
    check_speculative,
    check_timeout,
    normalize_stop,
    unknown_names_error,
)

if TYPE_CHECKING:
    from langchain_llamacpp_local.decisions import LlamaCppDecisionModel

logger = logging.getLogger(__name__)

_PARSED_KEY = "_llamacpp_parsed"
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "penalty_last_n",
    "seed",
)
_CALL_KWARGS = {
    *_SAMPLING_FIELDS,
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "reasoning",
    "max_tokens",
    "chat_template",
    "chat_template_kwargs",
    "logprobs",
    "top_logprobs",
    "cache_prompt",
    "speculative",
    "speculative_max_draft",
    "lora",
    "timeout",
    "model",
    "keep_alive",
    "strict",
    "ls_structured_output_format",
}


_LOAD_FIELDS = (
    "n_ctx",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "n_threads_batch",
    "n_gpu_layers",
    "type_k",
    "type_v",
    "rope_freq_base",
    "rope_freq_scale",
    "image_min_tokens",
    "image_max_tokens",
    "n_slots",
    "prompt_cache_bytes",
    "prompt_cache_dir_bytes",
    "checkpoint_max_count",
    "checkpoint_max_bytes",
    "checkpoint_min_step",
)


class ChatLlamaCpp(ConfigOnlyCopies, ModelSelection, BaseChatModel):
    """Chat model that runs a GGUF model in-process with llama.cpp.

    Requests go to one worker thread per loaded model, which keeps a persistent
    context: each turn decodes only the tokens that are not already in the KV
    cache (reported as ``usage_metadata["input_token_details"]["cache_read"]``).
    The weights load on first use (or :meth:`load`), and instances with the same
    file and load settings share one model.

    Setup:
        ``pip install langchain-llamacpp-local``

    Example:
        .. code-block:: python

            from langchain_llamacpp_local import ChatLlamaCpp

            llm = ChatLlamaCpp(model_path="model.gguf", temperature=0)
            llm.invoke("Hello!")
            for chunk in llm.stream("Tell me a story"):
                print(chunk.content, end="")
    """

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    # ------------------------------------------------------------------ loading
    model_name: str | None = None
    """Name reported in ``response_metadata`` and traces. Default: the ``model`` asked
    for; for a ``model_path``, the file's stem in traces (``ls_model_name``, stable
    whether or not the model is loaded) and the GGUF's ``general.name`` in
    ``response_metadata``."""
    n_ctx: int | None = None
    """Context window in tokens (default: the model's trained context, capped at 8192).
    By default the ``n_slots`` slots share one KV pool of ``n_ctx`` positions, as in
    llama.cpp's server; with per-slot streams (``kv_unified=False``, the default of
    ``deterministic=True``) each slot gets a window of its own and the KV cache holds
    ``n_ctx * n_slots`` positions."""
    n_batch: int = 512
    """Maximum tokens per ``llama_decode`` call while reading a prompt."""
    n_ubatch: int | None = None
    """Physical micro-batch size (default: ``n_batch``)."""
    n_threads: int | None = None
    """Threads for generation (default: one per usable physical core, from the affinity
    mask and cgroup quota, shared with the process's other models through a CPU budget;
    docs/configuration.md#threads)."""
    n_threads_batch: int | None = None
    """Threads for prompt processing (default: ``n_threads``)."""
    n_gpu_layers: int = 0
    """Layers to offload to the GPU (-1: all). Needs a GPU build of llama-cpp-python.
    With ``rpc_servers`` the default is all layers."""
    rpc_servers: list[str] | None = None
    """``host:port`` of llama.cpp RPC servers (``python -m langchain_llamacpp_local.rpc_server``)
    whose devices hold this model's offloaded layers and their KV cache, for a model
    too large for one machine. Needs llama-cpp-python built with ``-DGGML_RPC=ON``;
    see docs/distributed.md."""
    tensor_split: list[float] | None = None
    """Proportion of the offloaded layers per device: the RPC servers' devices in
    order, then the local GPUs (default: by free memory)."""
    flash_attn: bool | None = None
    """Flash attention: True/False, or None for llama.cpp's own default ("auto"); with
    ``deterministic=True`` None means off unless a quantized ``type_v`` needs it (off
    keeps warm and fresh prompts bit-identical: llama.cpp's CPU kernel rounds a row
    differently with the micro-batch shape)."""
    type_k: str | None = None
    """KV cache type for keys (``f16``, ``q8_0``, ``q4_0``...; default f16)."""
    type_v: str | None = None
    """KV cache type for values (quantized V needs flash attention)."""
    kv_unified: bool | None = None
    """Share one KV buffer of ``n_ctx`` positions between all slots (True) instead of a
    window per slot (False): ``n_slots`` times less KV memory, but a request's logits
    then depend on what runs beside it. None: shared, or per slot with
    ``deterministic=True``."""
    swa_full: bool = False
    """Keep the full KV cache for sliding-window layers. Off saves memory; state
    checkpoints keep prefix reuse exact without it."""
    use_mmap: bool = True
    """Memory-map the model file."""
    use_mlock: bool = False
    """Lock the model in RAM."""
    cpu_amx: StrictBool | None = None
    """Let llama.cpp put weights in ggml's AMX buffer type on Intel CPUs with AMX.
    None (default) or False: no weight goes there, because its matrix kernel crashes the
    process on some CPUs (ggml-org/llama.cpp#20824); every other repacking is kept.
    Part of the load settings; see docs/configuration.md."""
    rope_freq_base: float = 0.0
    """RoPE base frequency; 0 uses the model's own value."""
    rope_freq_scale: float = 0.0
    """RoPE frequency scale; 0 uses the model's own value."""
    mmproj_path: str | None = None
    """Vision projector GGUF (llama.cpp mtmd) for image input. None: only the one in a
    ``models_dir`` model's own folder; ``"auto"``: also beside a path and in a Hugging
    Face repo; ``"none"``: never (see docs/models.md)."""
    image_min_tokens: int | None = None
    """Fewest tokens an image may take (models with dynamic resolution)."""
    image_max_tokens: int | None = None
    """Most tokens an image may take (models with dynamic resolution)."""
    allow_local_image_files: bool = False
    """Accept image blocks that name a local file path (off: a prompt could read files)."""
    allow_remote_image_urls: bool = False
    """Fetch ``http(s)`` image URLs (off: a model call makes no network access)."""
    n_slots: int = 4
    """Conversations kept live in the context at once (llama.cpp ``n_seq_max``).

    A request goes to the slot sharing the longest prefix with it, and concurrent
    requests run together in one batch (see ``kv_unified`` for how they share KV memory)."""
    prompt_cache_bytes: int = 1024 * 1024 * 1024
    """Host-RAM budget for conversations evicted from the slots (0 disables it)."""
    prompt_cache_dir: str | None = None
    """Directory of a prompt cache on disk that outlives the process: a new process's
    first call restores the longest saved prefix (system prompt, tools, history) instead
    of reading it again. None: the ``LLAMACPP_PROMPT_CACHE_DIR`` environment variable,
    else off. Files are keyed by the model file, the load settings and the llama.cpp
    build, and signed with a per-user secret; the directory must be the user's and not
    writable by others (created 0700, files 0600; docs/cache.md)."""
    prompt_cache_dir_bytes: int = 4 * 1024**3
    """Byte budget of ``prompt_cache_dir`` (least recently used files go first)."""
    checkpoint_max_count: int = 16
    """Most state checkpoints kept per conversation (recurrent/hybrid/SWA models)."""
    checkpoint_max_bytes: int = 256 * 1024 * 1024
    """Byte budget for the checkpoints of one conversation."""
    checkpoint_min_step: int = 512
    """Minimum spacing in tokens between periodic checkpoints."""
    deterministic: bool = False
    """Bit-exact mode (docs/cache.md): a greedy answer does not depend on what runs beside
    it nor on what the cache holds (warm equals fresh). At load it turns flash attention
    off by default, gives each slot its own KV stream and probes the kernels; per request
    it decodes prompts on a fixed grid, reuses only grid-exact prefixes (a previous reply
    is decoded again), batches generation steps only in exact groups and verifies only
    exact draft lengths. Slower; off by default (llama.cpp's behaviour)."""

    # ------------------------------------------------------------------ speculative decoding
    speculative: Literal["ngram", "draft"] | None = None
    """Speculative decoding (docs/speculative.md): ``"ngram"`` drafts the continuation of
    the longest recent n-gram match in the conversation's own tokens (no second model);
    ``"draft"`` asks ``draft_model_path``'s model. Verified by this model with the
    request's own sampler, so the output is the same as without it; overridable per call.
    None: ``"draft"`` when ``draft_model_path`` is set, else off."""
    speculative_max_draft: int = 16
    """Most draft tokens per verify step (adapted per request below it). With
    ``deterministic`` a step also stays within what the model's kernels verify exactly
    (probed at load; a model that allows no multi-token step then does not speculate)."""
    draft_model_path: str | None = None
    """A small GGUF with this model's vocabulary that proposes draft tokens
    (``speculative="draft"``); loaded beside the model, checked at load."""

    # ------------------------------------------------------------------ LoRA adapters
    lora_adapters: dict[str, str | dict[str, Any]] | None = None
    """LoRA adapters over this model (docs/lora.md): name -> a GGUF path or a name in
    ``models_dir``, or name -> ``{"path": ..., "scale": s}``. Loaded once per base model
    and shared by every instance on it. A bare path is loaded but off by default; a
    ``scale`` applies it to every request that does not pass ``lora``."""
    lora: dict[str, float] | None = None
    """The adapters (name -> scale) a request runs with, replacing the defaults of
    ``lora_adapters`` (unnamed adapters are off; ``{}``: the base model). Overridable
    per call (``invoke(..., lora={"sql": 1.0})``) and through ``configurable_fields``."""

    # ------------------------------------------------------------------ model selection
    # model, model_path, models_dir, keep_alive, validate_model_on_init: ModelSelection;
    # ``model`` and ``keep_alive`` are overridable per call (``invoke(..., model=...)``)
    max_loaded_models: int | None = None
    """Process-wide limit on loaded models; loading one more evicts the least recently
    used idle one (default: ``LLAMACPP_MAX_LOADED_MODELS`` or 3)."""

    # ------------------------------------------------------------------ sampling
    seed: int = -1
    """Sampling seed; -1 picks a random one."""
    temperature: float = 0.8
    """Sampling temperature; 0 is greedy."""
    top_p: float = 0.95
    """Nucleus sampling threshold."""
    top_k: int = 40
    """Sample from the k most likely tokens (0: all)."""
    min_p: float = 0.05
    """Drop tokens below this fraction of the top token's probability."""
    repeat_penalty: float = 1.0
    """Penalty for repeated tokens (1.0: off)."""
    presence_penalty: float = 0.0
    """OpenAI-style presence penalty."""
    frequency_penalty: float = 0.0
    """OpenAI-style frequency penalty."""
    penalty_last_n: int = 64
    """How many recent tokens the penalties look at (-1: the whole context)."""
    max_tokens: int | None = 256
    """Most tokens to generate; None generates until the model stops or the context is full."""
    stop: list[str] | None = None
    """Stop strings; generation ends before the first one and it is not returned."""

    # ------------------------------------------------------------------ prompting
    chat_template: str | None = None
    """Jinja chat template, or the name of a built-in one (``chatml``, ``gemma``,
    ``llama3``, ``mistral``, ``phi3``), overriding the GGUF's template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template, e.g. ``{"enable_thinking": False}``."""
    reasoning: bool | None = None
    """True: move ``<think>`` blocks into ``additional_kwargs["reasoning_content"]``;
    False: ask the template not to think and strip stray blocks; None: leave text as is."""
    logprobs: bool = False
    """Return the log-probability of each generated token in ``response_metadata``."""
    top_logprobs: int = 0
    """Also return this many most likely alternatives per token."""
    timeout: float | None = None
    """Seconds a call may take (queueing included) before it is cancelled."""
    streaming: bool = False
    """Kept for compatibility with langchain-community: ``invoke`` always streams internally."""

    list_models: ClassVar[Any]  # see _ClassOrInstanceMethod below the class
    _worker: ModelWorker | None = PrivateAttr(default=None)
    _closed: bool = PrivateAttr(default=False)
    _inflight: weakref.WeakSet[threading.Event] = PrivateAttr(default_factory=weakref.WeakSet)

    # ------------------------------------------------------------------ setup

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_arguments(cls, data: Any) -> Any:
        """A misspelt argument (``n_gpu_layer=10``) must not be silently ignored."""
        if isinstance(data, dict):
            return _check_constructor_arguments(cls, data)
        return data

    @model_validator(mode="after")
    def _check_settings(self) -> Self:
        check_load_settings({name: getattr(self, name) for name in _LOAD_FIELDS})
        check_max_tokens(self.max_tokens)
        check_timeout(self.timeout)
        check_call_options({"top_logprobs": self.top_logprobs, "logprobs": self.logprobs})
        check_speculative(
            self.speculative, self.speculative_max_draft, draft_model=self.draft_model_path
        )
        self._check_placement()
        request_key(parse_adapters(self.lora_adapters), self.lora)  # names and scales
        self._sampling()  # validates the sampling fields
        return self

    def _validate_model(self) -> None:
        """``validate_model_on_init``: the model, and a projector given by path."""
        super()._validate_model()
        if self.mmproj_path not in (None, MMPROJ_AUTO, MMPROJ_NONE):
            assert self.mmproj_path is not None
            check_gguf_file(str(Path(self.mmproj_path).expanduser()))

    @model_validator(mode="after")
    def _check_loaded_models(self) -> Self:
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError("max_loaded_models must be at least 1 (or None for the default)")
        return self

    def _check_placement(self) -> None:
        """Fail at construction on RPC/split settings llama.cpp would ignore or abort on."""
        from langchain_llamacpp_local.llama.rpc import parse_endpoint, rpc_unavailable_reason

        if self.rpc_servers is not None:
            if not self.rpc_servers:
                raise ValueError("rpc_servers is empty; leave it None to run on this machine")
            endpoints = [parse_endpoint(e) for e in self.rpc_servers]
            if len(set(endpoints)) != len(endpoints):
                raise ValueError(f"rpc_servers lists an endpoint twice: {self.rpc_servers}")
            reason = rpc_unavailable_reason()
            if reason:
                raise ValueError(f"rpc_servers needs llama.cpp's RPC backend: {reason}")
            if "n_gpu_layers" in self.model_fields_set and self.n_gpu_layers == 0:
                raise ValueError(
                    "n_gpu_layers=0 keeps every layer on this machine, so rpc_servers would "
                    "be unused; leave n_gpu_layers unset (all layers) or give a count"
                )
        if self.tensor_split is not None:
            if not self.tensor_split or any(not v >= 0 for v in self.tensor_split):
                raise ValueError("tensor_split needs one non-negative proportion per device")
            if sum(self.tensor_split) <= 0:
                raise ValueError("tensor_split proportions must not all be zero")

    def _resolve_model_profile(self) -> ModelProfile | None:
        n_ctx = self.n_ctx
        local = self._local_model_file()
        if n_ctx is None and local is not None:
            try:
                meta = read_gguf_metadata(local, ["*.context_length"])
                trained = next(iter(meta.values()), None)
                n_ctx = min(int(trained), DEFAULT_MAX_CTX) if trained else None
            except (OSError, ValueError):
                n_ctx = None
        profile: ModelProfile = {
            "text_inputs": True,
            "text_outputs": True,
            "image_inputs": self.mmproj_path not in (None, "none"),
            "tool_calling": True,
            "tool_choice": True,
            "tool_call_streaming": True,
            "structured_output": True,
            "temperature": True,
            "open_weights": True,
            "mid_conversation_system_messages": True,
        }
        if n_ctx:
            profile["max_input_tokens"] = n_ctx
        return profile

    @property
    def _llm_type(self) -> str:
        return "llamacpp-local"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "model": self.model,
            "n_ctx": self.n_ctx,
            **{k: getattr(self, k) for k in _SAMPLING_FIELDS},
            "max_tokens": self.max_tokens,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="llamacpp",
            ls_model_name=kwargs.get("model") or self._display_name(),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        ls_stop = stop or kwargs.get("stop") or self.stop
        if ls_stop:
            params["ls_stop"] = ls_stop
        return params

    def _display_name(self) -> str:
        """The traced name (LangSmith groups runs by it): from the configuration only, so
        it is the same before and after the model loads."""
        if self.model_name:
            return self.model_name
        if self.model is not None:
            return self.model
        return Path(self.model_path or "model").stem

    # ------------------------------------------------------------------ lifecycle

    def _load_config(self, resolved: ResolvedModel | None = None) -> Any:
        from langchain_llamacpp_local.llama.engine import LoadConfig

        if resolved is None:
            resolved = self._resolve(None)
        return LoadConfig(
            model_path=model_file(resolved.model_path),
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads_batch,
            n_gpu_layers=(
                -1
                if self.rpc_servers and "n_gpu_layers" not in self.model_fields_set
                else self.n_gpu_layers
            ),
            flash_attn=self.flash_attn,
            type_k=self.type_k,
            type_v=self.type_v,
            swa_full=self.swa_full,
            n_seq_max=self.n_slots,
            kv_unified=(not self.deterministic) if self.kv_unified is None else self.kv_unified,
            deterministic=self.deterministic,
            use_mmap=self.use_mmap,
            use_mlock=self.use_mlock,
            cpu_amx=self.cpu_amx,
            rope_freq_base=self.rope_freq_base,
            rope_freq_scale=self.rope_freq_scale,
            mmproj_path=(model_file(resolved.mmproj_path) if resolved.mmproj_path else None),
            image_min_tokens=self.image_min_tokens,
            image_max_tokens=self.image_max_tokens,
            rpc_servers=tuple(self.rpc_servers or ()),
            tensor_split=tuple(self.tensor_split) if self.tensor_split is not None else None,
            draft_model_path=(model_file(self.draft_model_path) if self.draft_model_path else None),
            lora_adapters=tuple(
                (a.name, resolve_adapter_path(a.path, models_dir_from(self.models_dir)), a.scale)
                for a in parse_adapters(self.lora_adapters)
            ),
        )

    def load(self) -> Self:
        """Load the model now (otherwise the first call does); returns ``self``.

        The model then stays loaded for ``keep_alive`` seconds of idleness."""
        lease, _ = self._lease(None, None)
        lease.release()
        return self

    # -- model selection (docs/models.md): resolution, leases, unload, listing

    def _cache_options(self) -> CacheOptions:
        return CacheOptions(
            checkpoint_max_count=self.checkpoint_max_count,
            checkpoint_max_bytes=self.checkpoint_max_bytes,
            checkpoint_min_step=self.checkpoint_min_step,
            prompt_cache_bytes=self.prompt_cache_bytes,
            prompt_cache_dir=self._prompt_cache_dir(),
            prompt_cache_dir_bytes=self.prompt_cache_dir_bytes,
        )

    def _prompt_cache_dir(self) -> str | None:
        from langchain_llamacpp_local.cache.disk import ENV_DIR

        raw = self.prompt_cache_dir or os.environ.get(ENV_DIR) or None
        if raw is None:
            return None
        setting = "prompt_cache_dir" if self.prompt_cache_dir else ENV_DIR
        try:
            path = Path(raw).expanduser()
        except RuntimeError as exc:  # "~user" of no such user, or no home directory
            raise ValueError(f"{setting}={str(raw)!r}: cannot expand '~': {exc}") from None
        if path.exists() and not path.is_dir():
            raise ValueError(f"{setting}={str(raw)!r} exists and is not a directory")
        return str(path.absolute())

    def _resolve(self, spec: str | None = None, mmproj: str | None = None) -> ResolvedModel:
        """The files for ``spec`` (a per-call ``model=``) or, if None, this instance's
        model, with this instance's projector setting."""
        return super()._resolve(spec, self.mmproj_path if mmproj is None else mmproj)

    def _local_model_file(self) -> str | None:
        """This instance's model file if it can be found without a download (or None)."""
        if self.model is None:
            return self.model_path
        try:
            return resolve_model(
                self.model, models_dir=self.models_dir, mmproj="none", offline=True
            ).model_path
        except Exception:  # not resolvable offline (yet): no profile figures
            return None

    def _lease(
        self, spec: str | None, deadline: float | None, keep_alive: float | None = None
    ) -> tuple[registry.Lease, ResolvedModel]:
        """Hold the model for one request, loading it (or waiting for room) if needed."""
        resolved = self._resolve(spec)
        if self.verbose:
            _enable_native_log()
        lease = registry.acquire(
            self._load_config(resolved),
            self._cache_options(),
            _log_progress(resolved.model_path) if self.verbose else None,
            keep_alive=self.keep_alive if keep_alive is None else keep_alive,
            max_loaded_models=self.max_loaded_models,
            deadline=deadline,
        )
        if spec is None:
            self._worker = lease.worker
            self._closed = False
        return lease, resolved

    async def _alease(
        self, spec: str | None, deadline: float | None, keep_alive: float | None = None
    ) -> tuple[registry.Lease, ResolvedModel]:
        """:meth:`_lease` off the event loop; a cancelled task never strands a lease."""
        box: list[Any] = []
        abandoned: list[bool] = []

        def get() -> tuple[registry.Lease, ResolvedModel]:
            got = self._lease(spec, deadline, keep_alive)
            box.append(got)
            if abandoned:
                got[0].release()
            return got

        try:
            return await anyio.to_thread.run_sync(get, abandon_on_cancel=True)
        except BaseException:
            abandoned.append(True)
            for lease, _ in box:
                lease.release()
            raise

    def _reported_name(self, spec: str | None, resolved: ResolvedModel) -> str | None:
        """``response_metadata["model_name"]``: ``model_name``, else a per-call ``model=``
        as given, else the instance's ``model`` unless it is a path (None: the GGUF's name)."""
        if self.model_name:
            return self.model_name
        if spec is not None:
            return spec
        return resolved.spec if resolved.source != "path" else None

    def unload(self) -> int:
        """Free this instance's model now (if busy, as soon as its requests finish).

        Returns how many models were freed now. A later call loads it again."""
        return registry.unload(self._load_config(), None)

    @staticmethod
    def unload_all() -> int:
        """Free every idle model of the process now; busy ones once they finish."""
        return registry.unload()

    def _list_models(self_or_cls: Any, models_dir: str | None = None) -> list[ModelEntry]:
        """The models in ``models_dir`` (this instance's, else ``LLAMACPP_MODELS_DIR``)
        and in the Hugging Face cache; each entry's ``name`` works as ``model=``."""
        if models_dir is None and isinstance(self_or_cls, ChatLlamaCpp):
            models_dir = self_or_cls.models_dir
        return _list_models(models_dir)

    @property
    def model_info(self) -> ModelInfo:
        """Facts about the loaded model (loads it if needed)."""
        info = self.load()._worker.info  # type: ignore[union-attr]
        assert info is not None
        return info

    # -- what the model reads: the rendered prompt and token counts

    def render_prompt(
        self,
        messages: LanguageModelInput,
        *,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool] | None = None,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> RenderedPrompt:
        """The prompt a call with these messages, tools and options would decode, without
        generating (like llama.cpp server's ``/apply-template`` plus ``/tokenize``).

        Accepts what :meth:`invoke` accepts (``tool_choice``, ``chat_template``,
        ``chat_template_kwargs``, ``reasoning``, ``response_format``, ``model``...). Returns
        :class:`RenderedPrompt`: ``text``, ``tokens``, ``n_tokens``, ``stop``, ``grammar``
        and ``tool_format``. Text-only prompts need only the GGUF's vocabulary (the
        weights are not loaded); prompts with images are prepared by the loaded model.
        """
        with model_errors():
            return self._render_prompt(messages, tools, stop, kwargs)

    def _render_prompt(
        self,
        messages: LanguageModelInput,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool] | None,
        stop: list[str] | None,
        kwargs: dict[str, Any],
    ) -> RenderedPrompt:
        from langchain_llamacpp_local.chat import preview as prompt_preview

        call = dict(kwargs)
        if tools is not None:
            call["tools"] = [convert_to_openai_tool(t) for t in tools]
        msgs = self._convert_input(messages).to_messages()
        job = self._make_job(msgs, stop, call)
        spec = call.get("model")
        if not _has_images(job.messages):
            path = self._resolve(spec).model_path
            return prompt_preview.prepare_without_weights(path, job)
        from langchain_llamacpp_local.chat.prompts import prepare

        lease, _ = self._lease(spec, job.deadline)
        try:
            return lease.worker.call(
                lambda state: prompt_preview.from_prepared(prepare(state.format, job, state.engine))
            )
        finally:
            lease.release()

    def as_decision_model(self) -> LlamaCppDecisionModel:
        """A :class:`~langchain_llamacpp_local.decisions.LlamaCppDecisionModel` on this
        model: it shares the loaded worker (weights, slots, prompt caches) and answers
        LangChain decision questions from next-token probabilities (docs/decisions.md)."""
        from langchain_llamacpp_local.decisions import LlamaCppDecisionModel

        return LlamaCppDecisionModel(chat_model=self)

    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s tokens in the model's own vocabulary (no BOS, special-token text
        read as plain text); reads only the vocabulary when the model is not loaded."""
        from langchain_llamacpp_local.chat import preview as prompt_preview

        return prompt_preview.tokenize_text(self._resolve(None).model_path, text)

    def get_num_tokens_from_messages(
        self,
        messages: list[BaseMessage],
        tools: Sequence[Any] | None = None,
    ) -> int:
        """Exact size of the prompt these messages (and tools) render to: chat template,
        tool prompt, BOS and generation prompt included (see :meth:`render_prompt`)."""
        return self.render_prompt(messages, tools=tools).n_tokens

    def close(self) -> None:
        """Cancel this instance's running calls and release its hold on the model.

        The model stays loaded for ``keep_alive`` seconds of idleness (other instances
        reuse it); :meth:`unload` frees it now.
        """
        for cancel in list(self._inflight):
            cancel.set()
        self._worker = None
        self._closed = True

    def __enter__(self) -> Self:
        return self.load()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def _sampling(self, overrides: dict[str, Any] | None = None) -> SamplingParams:
        values = {k: getattr(self, k) for k in _SAMPLING_FIELDS}
        if overrides:
            values.update({k: v for k, v in overrides.items() if k in _SAMPLING_FIELDS})
        return SamplingParams(**values)

    def _make_job(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> ChatJob:
        unknown = set(kwargs) - _CALL_KWARGS
        if unknown:
            raise unknown_names_error(unknown, _CALL_KWARGS, "keyword arguments for ChatLlamaCpp")
        kwargs.pop("ls_structured_output_format", None)
        check_call_options(kwargs)
        if kwargs.get("tool_choice") is not None:
            from langchain_llamacpp_local.chat.prompts import check_tool_choice

            check_tool_choice(kwargs["tool_choice"], kwargs.get("tools"))
        stops = normalize_stop(stop if stop is not None else self.stop)
        template_kwargs = dict(self.chat_template_kwargs or {})
        template_kwargs.update(kwargs.get("chat_template_kwargs") or {})
        timeout = check_timeout(kwargs.get("timeout", self.timeout))
        max_tokens = check_max_tokens(kwargs.get("max_tokens", self.max_tokens))
        speculative = kwargs.get("speculative", self.speculative)
        if speculative is None and "speculative" not in kwargs and self.draft_model_path:
            speculative = "draft"
        max_draft = kwargs.get("speculative_max_draft", self.speculative_max_draft)
        check_speculative(speculative, max_draft, draft_model=self.draft_model_path)
        specs = parse_adapters(self.lora_adapters)
        requested = kwargs.get("lora", self.lora)
        # before anything runs: unknown names and bad scales are the caller's error
        lora = request_key(specs, requested) if specs or requested else None
        return ChatJob(
            messages=self._decode_images(convert_messages(messages)),
            sampling=self._sampling(kwargs),
            max_tokens=max_tokens,
            max_tokens_default="max_tokens" not in kwargs
            and "max_tokens" not in self.model_fields_set,
            stop=stops,
            tools=kwargs.get("tools"),
            tool_choice=kwargs.get("tool_choice"),
            parallel_tool_calls=kwargs.get("parallel_tool_calls"),
            response_format=kwargs.get("response_format"),
            chat_template=kwargs.get("chat_template", self.chat_template),
            chat_template_kwargs=template_kwargs,
            reasoning=kwargs.get("reasoning", self.reasoning),
            logprobs=bool(kwargs.get("logprobs", self.logprobs)),
            top_logprobs=int(kwargs.get("top_logprobs", self.top_logprobs) or 0),
            cache_prompt=bool(kwargs.get("cache_prompt", True)),
            speculative=speculative,
            speculative_max_draft=max_draft,
            lora=lora,
            deadline=None if timeout is None else time.monotonic() + timeout,
        )

    def _decode_images(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Decode image parts here, in the caller's thread, so the worker never waits on
        pillow (or a permitted download); refused forms raise ``ImageInputError``."""
        for m in messages:
            content = m.get("content")
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    from langchain_llamacpp_local.chat.images import load_image

                    part["image"] = load_image(
                        part["image"],
                        allow_local_files=self.allow_local_image_files,
                        allow_remote_urls=self.allow_remote_image_urls,
                    )
        return messages

    def _submit(self, job: ChatJob, lease: registry.Lease) -> None:
        self._inflight.add(job.cancel)
        # the model is free for others (keep-alive, max_loaded_models) once the reply is
        # complete, even if the caller never reads it to the end
        job.channel.on_final(lease.release)
        lease.worker.submit(job)

    def _replies(self, job: ChatJob) -> Iterator[tuple[str, Any]]:
        """Reply items of a submitted job; cancels it if the consumer goes away."""
        finished = False
        try:
            while True:
                remaining = None if job.deadline is None else job.deadline - time.monotonic()
                try:
                    item = job.channel.get(
                        timeout=max(remaining, 0) if remaining is not None else None
                    )
                except TimeoutError:
                    job.cancel.set()
                    raise RequestTimeoutError("ChatLlamaCpp call timed out") from None
                kind, value = item
                if kind == "error":
                    finished = True
                    raise value
                yield kind, value
                if kind == "done":
                    finished = True
                    return
        finally:
            if not finished:
                job.cancel.set()

    async def _areplies(self, job: ChatJob) -> AsyncIterator[tuple[str, Any]]:
        finished = False
        try:
            while True:
                remaining = None if job.deadline is None else job.deadline - time.monotonic()
                try:
                    if remaining is None:
                        item = await job.channel.aget()
                    else:
                        with anyio.fail_after(max(remaining, 0)):
                            item = await job.channel.aget()
                except TimeoutError:
                    job.cancel.set()
                    raise RequestTimeoutError("ChatLlamaCpp call timed out") from None
                kind, value = item
                if kind == "error":
                    finished = True
                    raise value
                yield kind, value
                if kind == "done":
                    finished = True
                    return
        finally:
            if not finished:
                job.cancel.set()

    def _chunk(self, kind: str, value: Any, name: str | None = None) -> ChatGenerationChunk:
        if kind == "delta":
            return ChatGenerationChunk(message=_delta_message(value))
        done: Done = value
        meta: dict[str, Any] = {
            "model_name": name or done.model_name,
            "model_provider": "llamacpp",
            "finish_reason": done.finish_reason,
            "timings": done.timings,
        }
        if done.logprobs is not None:
            meta["logprobs"] = {"content": done.logprobs}
        if done.speculative is not None:
            meta["speculative"] = done.speculative
        if done.lora is not None:
            meta["lora"] = done.lora
        msg = AIMessageChunk(
            content="",
            usage_metadata=done.usage,
            response_metadata=meta,  # type: ignore[arg-type]
        )
        info: dict[str, Any] = {"finish_reason": done.finish_reason}
        if done.parsed is not None:
            info[_PARSED_KEY] = done.parsed
        return ChatGenerationChunk(message=msg, generation_info=info)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        with model_errors():
            job = self._make_job(messages, stop, kwargs)
            spec = kwargs.get("model")
            lease, resolved = self._lease(spec, job.deadline, _keep_alive_kwarg(kwargs))
            try:
                self._submit(job, lease)
                name = self._reported_name(spec, resolved)
                for kind, value in self._replies(job):
                    chunk = self._chunk(kind, value, name)
                    if run_manager and kind == "delta":
                        run_manager.on_llm_new_token(_text_of(value), chunk=chunk)
                    yield chunk
            finally:
                lease.release()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # Off the event loop: image decoding (pillow, permitted downloads) in _make_job
        # and, on the first call, loading the model.
        with model_errors():
            job = await anyio.to_thread.run_sync(self._make_job, messages, stop, kwargs)
            job.channel.bind_loop()
            spec = kwargs.get("model")
            lease, resolved = await self._alease(spec, job.deadline, _keep_alive_kwarg(kwargs))
            try:
                self._submit(job, lease)
                name = self._reported_name(spec, resolved)
                async for kind, value in self._areplies(job):
                    chunk = self._chunk(kind, value, name)
                    if run_manager and kind == "delta":
                        await run_manager.on_llm_new_token(_text_of(value), chunk=chunk)
                    yield chunk
            finally:
                lease.release()

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = list(
            self._stream(messages, stop, run_manager if self.streaming else None, **kwargs)
        )
        return _aggregate(chunks)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = [
            c
            async for c in self._astream(
                messages, stop, run_manager if self.streaming else None, **kwargs
            )
        ]
        return _aggregate(chunks)

    # ------------------------------------------------------------------ tools

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict[str, Any] | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, pydantic models, functions or OpenAI dicts).

        ``tool_choice``: ``None``/``"auto"`` lets the model decide, ``"none"`` hides
        the tools, ``"any"``/``"required"``/``True`` forces some call and a tool name
        (or ``{"type": "function", "function": {"name": ...}}``) forces that tool; a
        forced call is grammar-constrained so its arguments match the schema.
        ``response_format`` (OpenAI ``json_schema``/``json_object``) constrains the
        final answer.
        """
        from langchain_llamacpp_local.chat.prompts import check_tool_choice

        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        check_tool_choice(tool_choice, formatted)  # fail now, not at invoke time
        bound: dict[str, Any] = {"tools": formatted, **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        if response_format is not None:
            bound["response_format"] = response_format
        return super().bind(**bound)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Return output matching ``schema`` (pydantic v1/v2 class, TypedDict or JSON schema).

        ``json_schema`` (default) constrains generation with a grammar built from the
        schema; ``function_calling`` forces a call of a tool shaped like the schema;
        ``json_mode`` constrains output to some JSON object (describe the keys in the prompt).
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        is_pydantic = isinstance(schema, type) and (
            is_basemodel_subclass(schema) or _is_pydantic_v1(schema)
        )
        if method == "function_calling":
            tool = convert_to_openai_tool(schema, strict=strict)
            name = tool["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=name,
                parallel_tool_calls=False,
                ls_structured_output_format={
                    "kwargs": {"method": method, "strict": strict},
                    "schema": tool,
                },
            )
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                json_schema = _json_schema_of(schema)
                response_format: dict[str, Any] = {
                    "type": "json_schema",
                    "json_schema": {
                        "name": json_schema.get("title", "output"),
                        "schema": json_schema,
                        "strict": strict,
                    },
                }
            else:
                response_format = {"type": "json_object"}
            try:
                ls_schema: Any = convert_to_json_schema(schema)
            except (TypeError, ValueError):
                ls_schema = schema
            llm = self.bind(
                response_format=response_format,
                ls_structured_output_format={
                    "kwargs": {"method": method, "strict": strict},
                    "schema": ls_schema,
                },
            )
            parser = (
                PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
                if is_pydantic
                else JsonOutputParser()
            )
        else:
            raise ValueError(
                f"method must be 'json_schema', 'function_calling' or 'json_mode', not {method!r}"
            )
        # Partial-JSON parsing would read output cut off by max_tokens as a valid answer.
        parser = _complete_output(method) | parser
        if not include_raw:
            return llm | parser
        parser_assign = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        )
        parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
        parser_with_fallback = parser_assign.with_fallbacks(
            [parser_none], exception_key="parsing_error"
        )
        return RunnableMap(raw=llm) | parser_with_fallback


class _ClassOrInstanceMethod:
    """``ChatLlamaCpp.list_models()`` and ``llm.list_models()`` (which uses ``llm.models_dir``)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, cls: type) -> Callable[..., Any]:
        return functools.partial(self.fn, obj if obj is not None else cls)


ChatLlamaCpp.list_models = _ClassOrInstanceMethod(ChatLlamaCpp._list_models)


# --------------------------------------------------------------------------- helpers


def _complete_output(method: str) -> Runnable[Any, Any]:
    """Passes the model's output through and then checks it was not cut off by the token
    limit: ``finish_reason == "length"`` with output that does not parse whole raises
    :class:`StructuredOutputTruncatedError`. A generator, so the parser after it still
    streams partial output."""

    def transform(chunks: Iterator[Any]) -> Iterator[Any]:
        total = None
        for chunk in chunks:
            total = chunk if total is None else total + chunk
            yield chunk
        _check_complete(total, method)

    async def atransform(chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        total = None
        async for chunk in chunks:
            total = chunk if total is None else total + chunk
            yield chunk
        _check_complete(total, method)

    return RunnableGenerator(transform, atransform, name="check_complete")


def _check_complete(message: Any, method: str) -> None:
    if not isinstance(message, AIMessage):
        return
    if message.response_metadata.get("finish_reason") != "length":
        return
    if method == "function_calling":
        if isinstance(message, AIMessageChunk):  # merged chunks: arguments as streamed
            whole = bool(message.tool_call_chunks) and all(
                _is_json(c.get("args") or "{}") for c in message.tool_call_chunks
            )
        else:
            whole = bool(message.tool_calls) and not message.invalid_tool_calls
        what = "the forced tool call"
    else:
        whole = _is_json(message.text)
        what = "the structured output"
    if whole:  # complete exactly at the limit
        return
    usage = message.usage_metadata or {}
    raise StructuredOutputTruncatedError(
        f"{what} was cut off by max_tokens after {usage.get('output_tokens', '?')} tokens "
        "(finish_reason='length') before it was complete; raise max_tokens (with "
        "max_tokens=None, the context window n_ctx is the limit)",
        llm_output=message.text,
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _has_images(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") == "image"
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
    )


def _keep_alive_kwarg(kwargs: dict[str, Any]) -> float | None:
    if "keep_alive" not in kwargs or kwargs["keep_alive"] is None:
        return None
    value = duration_seconds(kwargs["keep_alive"])
    if not isinstance(value, (int, float)):
        raise TypeError(f"keep_alive must be seconds or a duration like '5m', not {value!r}")
    return float(value)


def _delta_message(d: StreamDelta) -> AIMessageChunk:
    """One streamed piece; with ``logprobs``, those of its own tokens, shaped as
    ChatOpenAI's chunks carry them (merging the chunks concatenates the lists)."""
    meta: dict[str, Any] = {} if d.logprobs is None else {"logprobs": {"content": d.logprobs}}
    if d.kind == "content":
        return AIMessageChunk(content=d.text, response_metadata=meta)
    if d.kind == "reasoning":
        return AIMessageChunk(
            content="", additional_kwargs={"reasoning_content": d.text}, response_metadata=meta
        )
    return AIMessageChunk(
        content="",
        tool_call_chunks=[tool_call_chunk(name=d.name, args=d.args, id=d.id, index=d.index)],
        response_metadata=meta,
    )


def _text_of(d: Any) -> str:
    return d.text if isinstance(d, StreamDelta) and d.kind == "content" else ""


def _aggregate(chunks: list[ChatGenerationChunk]) -> ChatResult:
    """Merge streamed chunks into the ``invoke`` result.

    Tool calls come from the parser's final result: chunk merging would read a
    truncated call's arguments as valid partial JSON, where the parser reports
    it in ``invalid_tool_calls``.
    """
    if not chunks:
        raise RequestCancelledError("no reply from the model")
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    msg = total.message
    assert isinstance(msg, AIMessageChunk)
    info = dict(total.generation_info or {})
    parsed = info.pop(_PARSED_KEY, None)
    invalid = list(parsed.invalid_tool_calls if parsed is not None else msg.invalid_tool_calls)
    if invalid and info.get("finish_reason") == "length":
        # the call still being written when the token limit came: say so
        last = invalid[-1]
        error = f"cut off by max_tokens before the call was complete ({last.get('error')})"
        invalid[-1] = {**last, "error": error}
    message = AIMessage(
        content=msg.content,
        additional_kwargs=msg.additional_kwargs,
        response_metadata=msg.response_metadata,
        usage_metadata=msg.usage_metadata,
        tool_calls=parsed.tool_calls if parsed is not None else msg.tool_calls,
        invalid_tool_calls=invalid,
        id=msg.id,
    )
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])


def _check_constructor_arguments(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Refuse unknown constructor arguments (naming the closest field) and booleans
    given for numbers (``max_tokens=True`` would silently mean 1); a single ``stop``
    string is one stop string."""
    check_argument_names(cls, data, "ChatLlamaCpp")
    for name, value in data.items():
        field = cls.model_fields.get(name)
        if field is None or not isinstance(value, bool):
            continue
        if field.annotation is not None and _is_number_annotation(field.annotation):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if isinstance(data.get("stop"), str):
        data = {**data, "stop": [data["stop"]]}
    return data


def _is_number_annotation(annotation: Any) -> bool:
    args = getattr(annotation, "__args__", None) or (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


def _is_pydantic_v1(schema: type) -> bool:
    try:
        from pydantic.v1 import BaseModel as V1BaseModel
    except ImportError:  # pragma: no cover
        return False
    return issubclass(schema, V1BaseModel)


def _json_schema_of(schema: dict[str, Any] | type) -> dict[str, Any]:
    if isinstance(schema, type) and _is_pydantic_v1(schema):
        return schema.schema()  # type: ignore[attr-defined]
    if isinstance(schema, type) and is_basemodel_subclass(schema):
        return schema.model_json_schema()
    return convert_to_json_schema(schema)


def _log_progress(path: str) -> Callable[[float], None]:
    state = {"last": -1}

    def report(p: float) -> None:
        pct = int(p * 100)
        if pct // 10 != state["last"] // 10 or pct == 100:
            state["last"] = pct
            logger.info("loading %s: %d%%", path, pct)

    return report


def _enable_native_log() -> None:
    """``verbose=True``: show llama.cpp's own log and load progress on stderr."""
    for name in ("langchain_llamacpp_local",):
        lg = logging.getLogger(name)
        if not lg.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            lg.addHandler(h)
        lg.setLevel(logging.DEBUG)
