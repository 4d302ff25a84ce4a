"""``ChatLlamaCpp``: a LangChain chat model running a local GGUF model in-process."""

from __future__ import annotations

import functools
import logging
import re
import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from langchain_core import exceptions as lc_exceptions
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    StrictInt,
    model_validator,
)
from typing_extensions import Self

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.chat import progress
from langchain_llamacpp_local.chat.cache_report import MissWarnings, warn_on_miss
from langchain_llamacpp_local.chat.frontend import frontend_for
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.chat.leases import ChatAccess, hold, leasing, submitting
from langchain_llamacpp_local.chat.messages import aggregate, chunk_of, text_of
from langchain_llamacpp_local.chat.preview import RenderedPrompt
from langchain_llamacpp_local.chat.progress import emit_progress, progress_only
from langchain_llamacpp_local.chat.reply import Done, Progress
from langchain_llamacpp_local.chat.request_options import (
    SAMPLING_OPTIONS,
    build_job,
    check_call,
    check_call_defaults,
    check_logprobs_flag,
    has_images,
    sampling_params,
)
from langchain_llamacpp_local.chat.steps import Call, Notify, OffLoop, Sleep, Steps
from langchain_llamacpp_local.chat.structured import structured_output
from langchain_llamacpp_local.errors import ResponseFormatBesideToolsError, model_errors
from langchain_llamacpp_local.llama.gguf import projector_inputs, read_gguf_metadata
from langchain_llamacpp_local.llama.loading import LoadConfig, check_gguf_file
from langchain_llamacpp_local.llama.model_handle import model_file
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.llama.settings import DEFAULT_MAX_CTX
from langchain_llamacpp_local.resolution.model_resolution import (
    MMPROJ_AUTO,
    MMPROJ_NONE,
    ModelEntry,
    ResolvedModel,
    list_models,
    models_dir_from,
)
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.lora import parse_adapters, resolve_adapter_path
from langchain_llamacpp_local.runtime.stats import ModelInfo
from langchain_llamacpp_local.runtime.worker import ModelWorker
from langchain_llamacpp_local.settings_base import ModelSettings, settings_from
from langchain_llamacpp_local.validation import (
    check_chat_settings,
    check_constructor_arguments,
    check_keep_alive_option,
    check_prompt_cache_dir,
)

if TYPE_CHECKING:
    from langchain_llamacpp_local.decisions import LlamaCppDecisionModel

logger = logging.getLogger(__name__)


class ChatLlamaCpp(ModelSettings, BaseChatModel):
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
    n_ctx: int | None = LoadConfig.n_ctx
    """Context window in tokens (default: the model's trained context, capped at 8192).
    By default the ``n_slots`` slots share one KV pool of ``n_ctx`` positions, as in
    llama.cpp's server; with per-slot streams (``kv_unified=False``, the default of
    ``deterministic=True``) each slot gets a window of its own and the KV cache holds
    ``n_ctx * n_slots`` positions."""
    n_batch: int = LoadConfig.n_batch
    """Maximum tokens per ``llama_decode`` call while reading a prompt."""
    n_ubatch: int | None = LoadConfig.n_ubatch
    """Physical micro-batch size (default: ``n_batch``)."""
    n_threads_batch: int | None = LoadConfig.n_threads_batch
    """Threads for prompt processing (default: ``n_threads``)."""
    rpc_servers: list[str] | None = None
    """``host:port`` of llama.cpp RPC servers (``python -m langchain_llamacpp_local.rpc_server``)
    whose devices hold this model's offloaded layers and their KV cache, for a model
    too large for one machine. Needs llama-cpp-python built with ``-DGGML_RPC=ON``;
    see docs/distributed.md."""
    tensor_split: list[float] | None = None
    """Proportion of the offloaded layers per device: the RPC servers' devices in
    order, then the local GPUs (default: by free memory)."""
    flash_attn: bool | None = LoadConfig.flash_attn
    """Flash attention: True/False, or None for llama.cpp's own default ("auto"); with
    ``deterministic=True`` None means off unless a quantized ``type_v`` needs it (off
    keeps warm and fresh prompts bit-identical: llama.cpp's CPU kernel rounds a row
    differently with the micro-batch shape)."""
    type_k: str | None = LoadConfig.type_k
    """KV cache type for keys (``f16``, ``q8_0``, ``q4_0``...; default f16)."""
    type_v: str | None = LoadConfig.type_v
    """KV cache type for values (quantized V needs flash attention)."""
    kv_unified: bool | None = None
    """Share one KV buffer of ``n_ctx`` positions between all slots (True) instead of a
    window per slot (False): ``n_slots`` times less KV memory, but a request's logits
    then depend on what runs beside it. None: shared, or per slot with
    ``deterministic=True``."""
    swa_full: bool = LoadConfig.swa_full
    """Keep the full KV cache for sliding-window layers. Off saves memory; state
    checkpoints keep prefix reuse exact without it."""
    rope_freq_base: float = LoadConfig.rope_freq_base
    """RoPE base frequency; 0 uses the model's own value."""
    rope_freq_scale: float = LoadConfig.rope_freq_scale
    """RoPE frequency scale; 0 uses the model's own value."""
    mmproj_path: str | None = None
    """Vision projector GGUF (llama.cpp mtmd) for image input. None: only the one in a
    ``models_dir`` model's own folder; ``"auto"``: also beside a path and in a Hugging
    Face repo; ``"none"``: never (see docs/models.md)."""
    image_min_tokens: int | None = LoadConfig.image_min_tokens
    """Fewest tokens an image may take (models with dynamic resolution)."""
    image_max_tokens: int | None = LoadConfig.image_max_tokens
    """Most tokens an image may take (models with dynamic resolution)."""
    allow_local_image_files: bool = False
    """Accept image blocks that name a local file path (off: a prompt could read files)."""
    allow_remote_image_urls: bool = False
    """Fetch ``http(s)`` image URLs (off: a model call makes no network access)."""
    n_slots: int = 4
    """Conversations kept live in the context at once (llama.cpp ``n_seq_max``).

    A request goes to the slot sharing the longest prefix with it, and concurrent
    requests run together in one batch (see ``kv_unified`` for how they share KV memory)."""
    priority: Literal["interactive", "background"] = ChatJob.priority
    """``"interactive"``: a caller waits on the reply; ``"background"`` (decisions,
    summaries of a middleware): its prompt is read after interactive prompts, until it
    has waited 5 s (docs/concurrency.md); per call too."""
    stall_budget_ms: float | None = ChatJob.stall_budget_ms
    """While this model's reply streams, the longest one worker step may take: another
    caller's prompt is read in pieces cut from the measured call costs to fit it, with a
    margin for the machine's jitter (at least 8 tokens a step; docs/concurrency.md).
    None: its tokens may wait for whole ``n_batch`` pieces. Per call too."""
    prompt_cache_bytes: int = CacheOptions.prompt_cache_bytes
    """Host-RAM budget for conversations evicted from the slots, and for idle ones parked
    while a request decodes alone in the unified KV pool (so it attends over its own cells
    only). 0 disables it: they then stay in the pool."""
    prompt_cache_dir: str | None = None
    """Directory of a prompt cache on disk that outlives the process: a new process's
    first call restores the longest saved prefix (system prompt, tools, history) instead
    of reading it again. None: the ``LLAMACPP_PROMPT_CACHE_DIR`` environment variable,
    else off. Files are keyed by the model file, the load settings and the llama.cpp
    build, and signed with a per-user secret; the directory must be the user's and not
    writable by others (created 0700, files 0600; docs/cache.md)."""
    prompt_cache_dir_bytes: int = CacheOptions.prompt_cache_dir_bytes
    """Byte budget of ``prompt_cache_dir`` (least recently used files go first)."""
    checkpoint_max_count: int = CacheOptions.checkpoint_max_count
    """Most state checkpoints kept per conversation (recurrent/hybrid/SWA models)."""
    checkpoint_max_bytes: int = CacheOptions.checkpoint_max_bytes
    """Byte budget for the checkpoints of one conversation."""
    checkpoint_min_step: int = CacheOptions.checkpoint_min_step
    """Minimum spacing in tokens between periodic checkpoints."""
    deterministic: bool = LoadConfig.deterministic
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
    speculative_max_draft: int = ChatJob.speculative_max_draft
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
    seed: int = SamplingParams.seed
    """Sampling seed; -1 picks a random one."""
    temperature: float = SamplingParams.temperature
    """Sampling temperature; 0 is greedy."""
    top_p: float = SamplingParams.top_p
    """Nucleus sampling threshold."""
    top_k: int = SamplingParams.top_k
    """Sample from the k most likely tokens (0: all)."""
    min_p: float = SamplingParams.min_p
    """Drop tokens below this fraction of the top token's probability."""
    repeat_penalty: float = SamplingParams.repeat_penalty
    """Penalty for repeated tokens (1.0: off)."""
    presence_penalty: float = SamplingParams.presence_penalty
    """OpenAI-style presence penalty."""
    frequency_penalty: float = SamplingParams.frequency_penalty
    """OpenAI-style frequency penalty."""
    penalty_last_n: int = SamplingParams.penalty_last_n
    """How many recent tokens the penalties look at (-1: the whole context)."""
    dry_multiplier: float = SamplingParams.dry_multiplier
    """DRY ("don't repeat yourself") penalty on tokens that extend a repeated sequence
    (0: off); llama.cpp's ``dry_multiplier``."""
    dry_base: float = SamplingParams.dry_base
    """How fast the DRY penalty grows with the repeat's length (>= 1)."""
    dry_allowed_length: int = SamplingParams.dry_allowed_length
    """Repeats up to this many tokens go unpenalized by DRY."""
    dry_penalty_last_n: int = SamplingParams.dry_penalty_last_n
    """How many recent tokens DRY scans (-1: the whole context, 0: off)."""
    dry_sequence_breakers: tuple[str, ...] = SamplingParams.dry_sequence_breakers
    """Texts that end a repeat for DRY (at most 32, each at most 40 bytes)."""
    top_n_sigma: float = SamplingParams.top_n_sigma
    """Keep tokens within n standard deviations of the top logit (-1: off)."""
    typical_p: float = SamplingParams.typical_p
    """Locally typical sampling (1.0: off)."""
    xtc_probability: float = SamplingParams.xtc_probability
    """XTC ("exclude top choices"): the chance per token that every choice above
    ``xtc_threshold`` but the least likely one is removed (0: off); seeded by ``seed``."""
    xtc_threshold: float = SamplingParams.xtc_threshold
    """The probability a choice needs for XTC to remove it (0 to 0.5)."""
    dynatemp_range: float = SamplingParams.dynatemp_range
    """Dynamic temperature: ``temperature`` +- this range, by the candidates' entropy
    (0: off)."""
    dynatemp_exponent: float = SamplingParams.dynatemp_exponent
    """How the entropy maps to the dynamic temperature."""
    mirostat: int = SamplingParams.mirostat
    """1 or 2: Mirostat (v1/v2) in place of the truncation samplers (0: off)."""
    mirostat_tau: float = SamplingParams.mirostat_tau
    """Mirostat's target surprise."""
    mirostat_eta: float = SamplingParams.mirostat_eta
    """Mirostat's learning rate."""
    logit_bias: dict[int | str, float | str | bool] | None = SamplingParams.logit_bias
    """Token -> bias added to its logit: a token id or one token's text; ``-inf`` (or
    False) bans the token (docs/configuration.md)."""
    grammar: str | None = SamplingParams.grammar
    """A GBNF grammar (root rule ``root``) every reply must match; not together with
    tools or ``response_format``, which build their own."""
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
    False: ask the template not to think and strip stray blocks; None: extract them when
    the chat template thinks (llama.cpp's ``reasoning_format=auto``), else leave the text
    as is. A model that thinks may think before a constrained call or answer."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """How hard the model should think, as OpenAI's API names it (also per call). Passed
    to templates that read ``reasoning_effort`` (gpt-oss); for templates with only an
    ``enable_thinking`` switch (Qwen3), "none" and "minimal" turn thinking off and the
    others on. An explicit ``chat_template_kwargs`` entry wins."""
    reasoning_budget: int | None = None
    """Most tokens the model may think (also per call): once its thinking block reaches
    it, the family's own end-of-thinking marker is forced and the answer follows.
    ``0`` turns thinking off where the template can (``enable_thinking=False``), else
    ends it at once. None: unbounded."""
    reasoning_budget_message: str | None = None
    """Text forced before the end marker when the budget is reached (llama.cpp's
    ``--reasoning-budget-message``), e.g. "Time to answer."."""
    stream_tool_args: bool = ChatJob.stream_tool_args
    """Stream tool-call arguments while the model writes them (also per call): the
    first ``tool_call_chunks`` entry of a call carries its id, name and the start of its
    arguments, later ones more argument text under the same ``index``, as OpenAI streams
    them. Merged, the chunks equal ``invoke``'s message; a call cut off by ``max_tokens``
    ends with a fragment that leaves it in ``invalid_tool_calls`` (docs/tools.md).
    False: each call is sent whole once complete."""
    logprobs: bool = ChatJob.logprobs
    """Return the log-probability of each generated token in ``response_metadata``."""
    top_logprobs: int = ChatJob.top_logprobs
    """Also return this many most likely alternatives per token."""
    timeout: float | None = None
    """Seconds a call may take (queueing included) before it is cancelled."""
    max_retries: int = Field(default=0, ge=0)
    """Attempts after the first for a call that fails with a retryable error (LangChain's
    ``is_retryable``: a worker that died, a decode error, a timeout), with exponential
    backoff, as ChatOpenAI retries API errors; never once a reply has started streaming.
    0 by default: agents retry in ``ModelRetryMiddleware``, and a timeout retried here
    would outlast the call's ``timeout``."""
    api_key: SecretStr | None = None
    """Accepted for LangChain's standard parameters and ignored: a local model has no
    API to authenticate to."""
    streaming: bool = False
    """Kept for compatibility with langchain-community: ``invoke`` always streams internally."""
    cache_reuse: StrictInt = ChatJob.cache_reuse
    """llama.cpp's ``--cache-reuse``: after a history edit (oldest turns trimmed or
    summarised, a tool result cleared), move cached chunks of at least this many tokens
    that match the prompt to their new positions instead of reading them again. 0 (the
    default): off. The moved entries were computed attending to the old history, so
    answers can differ from a fresh read; never applied to recurrent, hybrid,
    sliding-window or M-RoPE models, nor with ``deterministic=True``
    (``response_metadata["cache"]["reuse_off"]`` says why). Per call too; docs/cache.md."""
    cache_miss_warning_tokens: int | None = None
    """Log a warning (``logging``, logger ``langchain_llamacpp_local.chat.cache_report``)
    when a call left the cached prompt and re-read more than this many prompt tokens,
    naming the message, offset and likely cause of ``response_metadata["cache"]``. Once
    per conversation (identified by its first non-system message; the last 1,024 are
    remembered per instance). None: off (docs/cache.md)."""

    list_models: ClassVar[Any]  # see _ClassOrInstanceMethod below the class
    _worker: ModelWorker | None = PrivateAttr(default=None)
    _inflight: weakref.WeakSet[threading.Event] = PrivateAttr(default_factory=weakref.WeakSet)
    _miss_warnings: MissWarnings = PrivateAttr(default_factory=MissWarnings)
    _reuse_scope: str = PrivateAttr(default_factory=lambda: secrets.token_hex(16))

    @property
    def reuse_scope(self) -> str:
        """Whose cached entries ``cache_reuse`` may move: this instance's requests only
        (a moved entry carries what it attended to; another instance's history, maybe
        another caller's, must not reach this one's answers)."""
        return self._reuse_scope

    # ------------------------------------------------------------------ setup

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_arguments(cls, data: Any) -> Any:
        """A misspelt argument (``n_gpu_layer=10``) must not be silently ignored."""
        if isinstance(data, dict):
            data = check_constructor_arguments(cls, data, "ChatLlamaCpp")
            check_logprobs_flag(data.get("logprobs"))  # a count says top_logprobs
        return data

    @model_validator(mode="after")
    def _check_settings(self) -> Self:
        check_chat_settings(self)
        check_call_defaults(self)
        return self

    def _validate_model(self) -> None:
        """``validate_model_on_init``: the model, and a projector given by path."""
        super()._validate_model()
        if self.mmproj_path not in (None, MMPROJ_AUTO, MMPROJ_NONE):
            assert self.mmproj_path is not None
            check_gguf_file(str(Path(self.mmproj_path).expanduser()))

    def _resolve_model_profile(self) -> ModelProfile | None:
        n_ctx = self.n_ctx
        local = self._local_model_file()
        meta: dict[str, Any] = {}
        if local is not None:
            try:
                meta = read_gguf_metadata(local, ["*.context_length", "tokenizer.chat_template"])
            except (OSError, ValueError):
                meta = {}
        if n_ctx is None:
            trained = next((v for k, v in meta.items() if k.endswith(".context_length")), None)
            n_ctx = min(int(trained), DEFAULT_MAX_CTX) if trained else None
        # a projector given by path says what it reads; one found beside the model
        # ("auto") is counted as a vision projector until it is loaded
        media = (False, False) if self.mmproj_path in (None, MMPROJ_NONE) else (True, False)
        if self.mmproj_path not in (None, MMPROJ_AUTO, MMPROJ_NONE):
            media = projector_inputs(self.mmproj_path) or media
        profile: ModelProfile = {
            "text_inputs": True,
            "text_outputs": True,
            "image_inputs": media[0],
            "audio_inputs": media[1],
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
            profile["max_output_tokens"] = n_ctx  # the prompt and the reply share it
        template = self.chat_template if "{" in (self.chat_template or "") else None
        profile.update(reasoning_profile(template or meta.get("tokenizer.chat_template")))
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
            **{k: getattr(self, k) for k in SAMPLING_OPTIONS},
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

    def _load_config(self, resolved: ResolvedModel | None = None) -> LoadConfig:
        """The load settings: the fields of LoadConfig's names, and those that differ."""
        if resolved is None:
            resolved = self._resolve(None)
        return settings_from(
            self,
            LoadConfig,
            model_path=model_file(resolved.model_path),
            n_gpu_layers=(
                -1
                if self.rpc_servers and "n_gpu_layers" not in self.model_fields_set
                else self.n_gpu_layers
            ),
            kv_unified=(not self.deterministic) if self.kv_unified is None else self.kv_unified,
            mmproj_path=(model_file(resolved.mmproj_path) if resolved.mmproj_path else None),
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
        return settings_from(
            self, CacheOptions, prompt_cache_dir=check_prompt_cache_dir(self.prompt_cache_dir)
        )

    def _resolve(
        self, spec: str | None = None, mmproj: str | None = None, deadline: float | None = None
    ) -> ResolvedModel:
        """The files for ``spec`` (a per-call ``model=``) or, if None, this instance's
        model, with this instance's projector setting."""
        return super()._resolve(spec, self.mmproj_path if mmproj is None else mmproj, deadline)

    def _lease(
        self, spec: str | None, deadline: float | None, keep_alive: float | None = None
    ) -> tuple[registry.Lease, ResolvedModel]:
        """Hold the model for one request, loading it (or waiting for room) if needed."""
        resolved = self._resolve(spec, deadline=deadline)
        lease = hold(
            self._load_config(resolved),
            self._cache_options(),
            keep_alive=self.keep_alive if keep_alive is None else keep_alive,
            max_loaded_models=self.max_loaded_models,
            deadline=deadline,
            verbose_name=resolved.model_path if self.verbose else None,
        )
        if spec is None:
            self._worker = lease.worker
        return lease, resolved

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
        return list_models(models_dir)

    @property
    def model_info(self) -> ModelInfo:
        """Facts about the loaded model (loads it if needed)."""
        worker = self.load()._worker
        assert worker is not None
        return frontend_for(worker).info

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
        if not has_images(job.messages):
            path = self._resolve(spec).model_path
            return prompt_preview.prepare_without_weights(path, job)
        lease, _ = self._lease(spec, job.deadline)
        try:
            return frontend_for(lease.worker).render(job)
        finally:
            lease.release()

    def as_decision_model(self, **settings: Any) -> LlamaCppDecisionModel:
        """A :class:`~langchain_llamacpp_local.decisions.LlamaCppDecisionModel` on this
        model: it shares the loaded worker (weights, slots, prompt caches) and answers
        LangChain decision questions from next-token probabilities (docs/decisions.md).
        ``settings``: the decision model's own fields (``debias="cyclic"``, ``model``).

        Needs langchain-core's decision API (langchain-core 1.8+, Python 3.11+); the chat
        model itself does not, so it is imported here, on first use."""
        from langchain_llamacpp_local.decisions import LlamaCppDecisionModel

        return LlamaCppDecisionModel(chat_model=self, **settings)

    def chat_access(self) -> ChatAccess:
        """Package-internal: what the decision model (and other code of this package
        beside the chat model) needs to make requests on this model, typed, so that none
        of it reaches into the chat model's private methods."""
        return ChatAccess(
            make_job=self._make_job,
            lease=functools.partial(self._lease, None),
            inflight=self._inflight,
            name=self._display_name(),
        )

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

    # ------------------------------------------------------------------ requests

    def _sampling(self, overrides: dict[str, Any] | None = None) -> SamplingParams:
        return sampling_params(self, overrides)

    def _make_job(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> ChatJob:
        return build_job(self, messages, check_call(kwargs, stop, self))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        return iter(ChatCall(self, messages, stop, run_manager, kwargs, whole=False))

    def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        return aiter(ChatCall(self, messages, stop, run_manager, kwargs, whole=False))

    def _warn_miss(self, last: ChatGenerationChunk, job: ChatJob) -> None:
        """``cache_miss_warning_tokens``: warn once per conversation of a costly miss
        (read from the reply's last chunk, as the caller sees it)."""
        msg = last.message
        assert isinstance(msg, AIMessageChunk)
        warn_on_miss(
            msg.response_metadata.get("cache"),
            dict(msg.usage_metadata or {}),
            self.cache_miss_warning_tokens,
            job.messages,
            self._miss_warnings,
        )

    # LangChain's streaming paths give ``_stream`` no run manager; these pass the run on
    # (chat.progress.CURRENT_RUN) so prompt progress reaches callbacks there too.

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        config, run = progress.stream_run(
            config, self.callbacks, self.tags, self.metadata, is_async=False
        )
        return progress.first_step_with(
            run, lambda: super(ChatLlamaCpp, self).stream(input, config, stop=stop, **kwargs)
        )

    def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        config, run = progress.stream_run(
            config, self.callbacks, self.tags, self.metadata, is_async=True
        )
        return progress.afirst_step_with(
            run, lambda: super(ChatLlamaCpp, self).astream(input, config, stop=stop, **kwargs)
        )

    def _generate_with_cache(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with progress.run_set(run_manager):
            return super()._generate_with_cache(messages, stop, run_manager, **kwargs)

    async def _agenerate_with_cache(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with progress.run_set(run_manager):
            return await super()._agenerate_with_cache(messages, stop, run_manager, **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return aggregate(list(self._whole_call(messages, stop, run_manager, kwargs)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return aggregate([c async for c in self._whole_call(messages, stop, run_manager, kwargs)])

    def _whole_call(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> ChatCall:
        """``invoke``'s call: without ``streaming``, the reply is read only at its end
        and its run gets progress events but no tokens."""
        if self.streaming:
            return ChatCall(self, messages, stop, run_manager, kwargs, whole=False)
        return ChatCall(self, messages, stop, progress_only(run_manager), kwargs, whole=True)

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
        ``parallel_tool_calls``: None allows several calls when more than one tool is
        bound and the template shows parallel calls; calls past the first that a reply
        holds when one is allowed are reported in ``response_metadata
        ["dropped_tool_calls"]``. ``response_format`` (OpenAI ``json_schema``/
        ``json_object``) makes the reply either calls or the typed answer (what
        ``create_agent``'s provider strategy binds); a template whose calls could not
        be told apart from a JSON answer raises ``ResponseFormatBesideToolsError`` here.
        """
        from langchain_llamacpp_local.chat.request_options import check_tool_choice

        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        with model_errors():
            check_tool_choice(tool_choice, formatted)  # fail now, not at invoke time
        bound: dict[str, Any] = {"tools": formatted, **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        if response_format is not None:
            bound["response_format"] = response_format
            if formatted:
                self._check_answer_beside_tools(bound)
        return super().bind(**bound)

    def _check_answer_beside_tools(self, bound: dict[str, Any]) -> None:
        """Refuse at bind time a ``response_format`` the template cannot offer beside
        calls (:class:`ResponseFormatBesideToolsError`), by preparing a probe prompt from
        the GGUF's vocabulary; a model that cannot be read now is checked per call."""
        options = {k: v for k, v in bound.items() if k != "tools"}
        try:
            self.render_prompt("probe", tools=bound["tools"], **options)
        except ResponseFormatBesideToolsError:
            raise
        except Exception:  # noqa: BLE001 - any other problem surfaces at invoke
            logger.debug("response_format beside tools not checked at bind", exc_info=True)

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
        return structured_output(
            self, schema, method=method, include_raw=include_raw, strict=strict, **kwargs
        )


def reasoning_profile(template: object) -> ModelProfile:
    """The profile's reasoning keys for a chat template's source (None: unknown): a
    template that thinks reports ``reasoning_output``, the efforts ``reasoning_effort``
    accepts, and the default effort its source names, if any."""
    if not isinstance(template, str):
        return {}
    if "think" not in template.lower() and "reasoning_effort" not in template:
        return {"reasoning_output": False}
    from langchain_llamacpp_local.chat.request_options import EFFORTS

    profile: ModelProfile = {"reasoning_output": True, "reasoning_effort_levels": list(EFFORTS)}
    found = re.search(
        r"""reasoning_effort\s*(?:\|\s*default\(\s*|(?:=|is not defined.{0,80}?=)\s*)['"](\w+)['"]""",
        template,
        re.S,
    )
    if found and found.group(1) in EFFORTS:
        profile["reasoning_effort_default"] = found.group(1)
    return profile


def retry_delay(attempt: int) -> float:
    """Seconds before retry ``attempt + 1``: the OpenAI client's backoff (0.5 s doubling,
    at most 8 s), without its jitter so runs repeat."""
    return float(min(0.5 * 2**attempt, 8.0))


class ChatCall(Call[ChatGenerationChunk]):
    """One chat call's chunks, read with ``for`` (``stream``, ``invoke``) or ``async
    for`` (``astream``, ``ainvoke``): the call is written once, as steps (:mod:`.chat.steps`).
    A retryable error (``max_retries``) tries the call again while nothing has been sent;
    ``whole``: the caller reads the chunks only at the end (the worker does not wake it
    for each token). Closing the reader, or cancelling its task, cancels the request."""

    def __init__(
        self,
        model: ChatLlamaCpp,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        *,
        whole: bool,
    ) -> None:
        super().__init__(self._steps)
        self.model = model
        self.messages = messages
        self.stop = stop
        self.run_manager = run_manager
        self.kwargs = kwargs
        self.whole = whole
        #: a chunk of the current attempt has been sent (it is not retried then)
        self.started = False

    def _steps(self) -> Steps[None]:
        for attempt in range(self.model.max_retries + 1):
            self.started = False
            try:
                yield from self._attempt()
                return
            except lc_exceptions.ModelError as exc:
                if self.started or not exc.is_retryable or attempt >= self.model.max_retries:
                    raise
                delay = retry_delay(attempt)
                logger.warning("retrying a call in %.1f s after %r", delay, exc)
                yield Sleep(delay)

    def _attempt(self) -> Steps[None]:
        """One attempt. For an async caller, what blocks runs off the event loop: image
        decoding (pillow, permitted downloads) in the job, on the first call loading the
        model, and preparing the prompt (template, tokens, grammar)."""
        model, run_manager, kwargs = self.model, self.run_manager, self.kwargs
        # LangChain's streaming paths pass no run manager: progress goes to their run
        progress_run = run_manager if run_manager is not None else progress.CURRENT_RUN.get()
        with model_errors():
            job = yield OffLoop(
                functools.partial(model._make_job, self.messages, self.stop, kwargs)
            )
            spec = kwargs.get("model")
            keep_alive = check_keep_alive_option(kwargs)
            lease, resolved = yield leasing(
                functools.partial(model._lease, spec, job.deadline, keep_alive)
            )
            try:
                reply = yield from submitting(
                    job, lease, model._inflight, progress=progress_run is not None, whole=self.whole
                )
                name = model._reported_name(spec, resolved)
                try:
                    while not reply.finished:
                        for item in (yield from reply.read()):
                            if isinstance(item, Progress):  # as custom callback events
                                if progress_run:
                                    yield Notify(
                                        functools.partial(emit_progress, progress_run, asdict(item))
                                    )
                                continue
                            chunk = chunk_of(item, name)
                            if isinstance(item, Done):
                                model._warn_miss(chunk, job)
                            elif run_manager:
                                token = functools.partial(
                                    run_manager.on_llm_new_token, text_of(item.piece), chunk=chunk
                                )
                                yield Notify(token)
                            self.started = True
                            yield chunk
                finally:
                    reply.close()
            finally:
                lease.release()


class _ClassOrInstanceMethod:
    """``ChatLlamaCpp.list_models()`` and ``llm.list_models()`` (which uses ``llm.models_dir``)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, cls: type) -> Callable[..., Any]:
        return functools.partial(self.fn, obj if obj is not None else cls)


ChatLlamaCpp.list_models = _ClassOrInstanceMethod(ChatLlamaCpp._list_models)
