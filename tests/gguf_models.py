"""Tiny random-weight GGUF models for tests.

Each generator writes a deterministic (numpy-seeded, same seed -> same bytes) F32
GGUF file with the ``gguf`` package and returns its path; each loads in llama.cpp
in a few milliseconds.

Text models share a 260-token byte-level SentencePiece (``llama``) vocab:
``<unk>`` (0), ``<s>`` (1, BOS, added by default), ``</s>`` (2, EOS), the 256
BYTE tokens ``<0x00>``..``<0xFF>`` (3..258) and ``\u2581`` (259).  The last one is
needed because llama.cpp's SPM tokenizer always escapes ``" "`` to ``\u2581``: without
it a space would byte-fall-back to ``E2 96 81`` and detokenize as ``\u2581``.  With it
(and ``add_space_prefix`` off) any UTF-8 text tokenizes to its bytes (space ->
259) and detokenizes back exactly.  An optional ``chat_template`` is stored as
``tokenizer.chat_template``.

* :func:`write_tiny_llama`: ``llama``, 2 layers, n_embd 64, 4 heads (2 KV heads,
  head dim 16), n_ff 128, rope base 1e4.  KV cache: partial ``llama_memory_seq_rm`` works.
* :func:`write_tiny_mamba`: ``mamba`` (Mamba-1), 2 layers, n_embd 64, d_inner 128,
  d_state 16, d_conv 4, dt_rank 4.  ``llama_model_is_recurrent`` is true and a
  partial ``llama_memory_seq_rm`` is refused.
* :func:`write_tiny_hybrid`: ``lfm2``, layer 0 short-conv (recurrent, L_cache 3),
  layer 1 attention (4 heads, 2 KV heads, q/k norms); n_embd 64, n_ff 128.
  ``llama_model_is_hybrid`` is true and a partial ``llama_memory_seq_rm`` is refused.
* :func:`write_tiny_bert`: ``bert`` encoder (non-causal attention, learned
  positions, LayerNorm with biases), 2 layers, n_embd 64, 4 heads, n_ff 128,
  BERT-style specials (adds BOS and EOS), a GGUF ``pooling_type`` (mean by default);
  with ``rerank=True`` a classification head (``cls``, ``cls.output``, one label)
  and pooling ``rank``, as llama.cpp's reranker GGUFs.
* :func:`write_tiny_mmproj`: llava-style ``clip`` projector (``mlp``) for
  ``llama_cpp.mtmd_cpp``: 32x32 images, patch 8 -> 16 image tokens of width
  ``text_n_embd``.
* :func:`write_tiny_audio_mmproj`: Ultravox-style audio projector (a whisper encoder,
  frames stacked by 50, RMS-normed SwiGLU projector): 16 kHz audio, 16 mel bins; every
  30-second window (mtmd pads each clip to one) gives 30 tokens of width ``text_n_embd``.

Random weights: embeddings/output ~ N(0, 0.5^2) so logits vary and greedy output is
not degenerate; matrices ~ N(0, 1/fan_in); norms are ones.  Numpy shapes are the
ggml shapes reversed.  Importable as ``tests.gguf_models`` or as a top-level
``gguf_models`` (no relative imports).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "MMPROJ_IMAGE_SIZE",
    "MMPROJ_N_AUDIO_TOKENS",
    "MMPROJ_N_IMAGE_TOKENS",
    "N_VOCAB",
    "SPACE_ID",
    "UNK_ID",
    "byte_token",
    "write_scripted_llama",
    "write_tiny_audio_mmproj",
    "write_tiny_bert",
    "write_tiny_hybrid",
    "write_tiny_llama",
    "write_tiny_lora",
    "write_tiny_mamba",
    "write_tiny_mmproj",
]

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
N_BYTE_OFFSET = 3
SPACE = "\u2581"  # SentencePiece's escaped space
SPACE_ID = N_BYTE_OFFSET + 256
N_VOCAB = SPACE_ID + 1

N_EMBD = 64
N_LAYER = 2
RMS_EPS = 1e-5


def byte_token(b: int) -> int:
    """Token id of the byte ``b`` in the tiny vocab."""
    return N_BYTE_OFFSET + b


def _add_vocab(
    w: gguf.GGUFWriter,
    chat_template: str | None,
    *,
    add_eos: bool = False,
    add_bos: bool = True,
    extra_tokens: int = 0,
    renamed: dict[int, str] | None = None,
) -> None:
    """The shared byte-level vocab; ``extra_tokens``/``renamed`` make another one."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [SPACE]
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL]
    )
    for i, text in (renamed or {}).items():
        tokens[i] = text
        types[i] = gguf.TokenType.USER_DEFINED
    tokens += [f"<extra_{k}>" for k in range(extra_tokens)]
    types += [gguf.TokenType.USER_DEFINED] * extra_tokens
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


class _Weights:
    """Seeded random F32 tensors (numpy shapes are ggml shapes reversed)."""

    def __init__(self, w: gguf.GGUFWriter, seed: int) -> None:
        self.w = w
        self.rng = np.random.default_rng(seed)

    def normal(self, name: str, *shape: int, scale: float | None = None) -> None:
        if scale is None:  # ~unit-variance outputs for a matmul over shape[-1]
            scale = 1.0 / np.sqrt(shape[-1])
        data = self.rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
        self.w.add_tensor(name, data)

    def const(self, name: str, *shape: int, value: float = 1.0) -> None:
        self.w.add_tensor(name, np.full(shape, value, dtype=np.float32))

    def array(self, name: str, data: np.ndarray) -> None:
        self.w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _text_common(
    w: gguf.GGUFWriter, t: _Weights, n_ctx_train: int, *, n_vocab: int = N_VOCAB, name: str = "tiny"
) -> None:
    w.add_name(name)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    t.normal("token_embd.weight", n_vocab, N_EMBD, scale=0.5)
    t.const("output_norm.weight", N_EMBD)
    t.normal("output.weight", n_vocab, N_EMBD, scale=0.5)


def _llama_blocks(w: gguf.GGUFWriter, t: _Weights, n_vocab: int) -> None:
    """The llama hyperparameters and its layers (n_embd 64, 4 heads, 2 KV heads, n_ff 128)."""
    n_head, n_head_kv, n_ff = 4, 2, 128
    head_dim = N_EMBD // n_head
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        t.const(p + "attn_norm.weight", N_EMBD)
        t.normal(p + "attn_q.weight", n_head * head_dim, N_EMBD)
        t.normal(p + "attn_k.weight", n_head_kv * head_dim, N_EMBD)
        t.normal(p + "attn_v.weight", n_head_kv * head_dim, N_EMBD)
        t.normal(p + "attn_output.weight", N_EMBD, n_head * head_dim)
        t.const(p + "ffn_norm.weight", N_EMBD)
        t.normal(p + "ffn_gate.weight", n_ff, N_EMBD)
        t.normal(p + "ffn_up.weight", n_ff, N_EMBD)
        t.normal(p + "ffn_down.weight", N_EMBD, n_ff)


def write_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    chat_template: str | None = None,
    n_ctx_train: int = 2048,
    extra_kv: dict[str, int | str] | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Write a 2-layer ``llama`` model (n_embd 64, 4 heads, 2 KV heads, n_ff 128).

    ``extra_kv`` adds header keys (ints as uint32, strings): hostile-header tests.
    ``split_max_tensors`` > 0 writes a split GGUF (``<stem>-00001-of-0000N.gguf``...)
    and returns its first part."""
    path = Path(path)
    w = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    t = _Weights(w, seed)
    _text_common(w, t, n_ctx_train)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    _add_vocab(w, chat_template)
    _llama_blocks(w, t, N_VOCAB)
    _finish(w)
    if split_max_tensors:
        return path.with_name(f"{path.stem}-00001-of-{len(w.tensors):05d}.gguf")
    return path


def write_tiny_lora(
    path: Path,
    *,
    seed: int = 0,
    rank: int = 4,
    alpha: float = 4.0,
    arch: str = "llama",
    n_embd: int = N_EMBD,
    targets: tuple[str, ...] = ("attn_q", "attn_v", "ffn_up", "ffn_down"),
    strength: float = 1.0,
    invocation_tokens: list[int] | None = None,
) -> Path:
    """Write a LoRA adapter for :func:`write_tiny_llama`'s projections (llama.cpp's
    ``convert_lora_to_gguf.py`` layout: ``general.type=adapter``, ``adapter.type=lora``,
    ``adapter.lora.alpha``, ``<tensor>.lora_a`` [rank, in] / ``.lora_b`` [out, rank]).

    ``arch``/``n_embd`` other than the tiny llama's make an adapter for another base;
    ``invocation_tokens`` makes it an activated LoRA (``adapter.alora.invocation_tokens``).
    ``strength`` scales B: at 1 the adapter changes greedy output."""
    path = Path(path)
    w = gguf.GGUFWriter(path, arch)
    t = _Weights(w, seed + 1000)
    w.add_name("tiny-lora")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    if invocation_tokens:
        w.add_key_value(
            "adapter.alora.invocation_tokens",
            [int(x) for x in invocation_tokens],
            gguf.GGUFValueType.ARRAY,
            sub_type=gguf.GGUFValueType.UINT32,
        )
    n_head, n_head_kv, n_ff = 4, 2, 128
    head_dim = n_embd // n_head
    shapes = {  # ggml (in, out) of each projection
        "attn_q": (n_embd, n_head * head_dim),
        "attn_k": (n_embd, n_head_kv * head_dim),
        "attn_v": (n_embd, n_head_kv * head_dim),
        "attn_output": (n_head * head_dim, n_embd),
        "ffn_gate": (n_embd, n_ff),
        "ffn_up": (n_embd, n_ff),
        "ffn_down": (n_ff, n_embd),
    }
    for i in range(N_LAYER):
        for name in targets:
            n_in, n_out = shapes[name]
            base = f"blk.{i}.{name}.weight"
            t.normal(base + ".lora_a", rank, n_in)
            t.normal(base + ".lora_b", n_out, rank, scale=strength / np.sqrt(rank))
    _finish(w)
    return path


def write_tiny_mamba(
    path: Path,
    *,
    seed: int = 0,
    chat_template: str | None = None,
    n_ctx_train: int = 2048,
) -> Path:
    """Write a 2-layer Mamba-1 model (n_embd 64, d_inner 128, d_state 16)."""
    path = Path(path)
    d_inner, d_state, d_conv, dt_rank = 2 * N_EMBD, 16, 4, 4
    w = gguf.GGUFWriter(path, "mamba")
    t = _Weights(w, seed)
    _text_common(w, t, n_ctx_train)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_vocab_size(N_VOCAB)
    _add_vocab(w, chat_template)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        t.const(p + "attn_norm.weight", N_EMBD)
        t.normal(p + "ssm_in.weight", 2 * d_inner, N_EMBD)
        t.normal(p + "ssm_conv1d.weight", d_inner, d_conv, scale=0.5)
        t.normal(p + "ssm_conv1d.bias", d_inner, scale=0.1)
        t.normal(p + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
        t.normal(p + "ssm_dt.weight", d_inner, dt_rank)
        t.const(p + "ssm_dt.bias", d_inner, value=-2.0)
        # A = -exp(A_log) with the usual S4D-real init A_log = log(1..d_state)
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
        t.array(p + "ssm_a", a)
        t.const(p + "ssm_d", d_inner)
        t.normal(p + "ssm_out.weight", N_EMBD, d_inner)
    _finish(w)
    return path


def write_tiny_hybrid(
    path: Path,
    *,
    seed: int = 0,
    chat_template: str | None = None,
    n_ctx_train: int = 2048,
) -> Path:
    """Write a 2-layer ``lfm2`` hybrid: layer 0 short-conv (recurrent), layer 1 attention.

    n_embd 64, n_ff 128, 4 heads / 2 KV heads on the attention layer, conv L_cache 3.
    """
    path = Path(path)
    n_head, n_head_kv, n_ff, l_cache = 4, 2, 128, 3
    head_dim = N_EMBD // n_head
    kv_per_layer = [0, n_head_kv]  # 0 KV heads marks a recurrent (short-conv) layer
    w = gguf.GGUFWriter(path, "lfm2")
    t = _Weights(w, seed)
    w.add_name("tiny")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(kv_per_layer)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_shortconv_l_cache(l_cache)
    w.add_vocab_size(N_VOCAB)
    _add_vocab(w, chat_template)
    t.normal("token_embd.weight", N_VOCAB, N_EMBD, scale=0.5)
    t.const("token_embd_norm.weight", N_EMBD)  # lfm2's final norm lives under this name
    t.normal("output.weight", N_VOCAB, N_EMBD, scale=0.5)
    for i, kv in enumerate(kv_per_layer):
        p = f"blk.{i}."
        t.const(p + "attn_norm.weight", N_EMBD)
        if kv:
            t.const(p + "attn_q_norm.weight", head_dim)
            t.const(p + "attn_k_norm.weight", head_dim)
            t.normal(p + "attn_q.weight", n_head * head_dim, N_EMBD)
            t.normal(p + "attn_k.weight", kv * head_dim, N_EMBD)
            t.normal(p + "attn_v.weight", kv * head_dim, N_EMBD)
            t.normal(p + "attn_output.weight", N_EMBD, n_head * head_dim)
        else:
            t.normal(p + "shortconv.conv.weight", N_EMBD, l_cache, scale=0.5)
            t.normal(p + "shortconv.in_proj.weight", 3 * N_EMBD, N_EMBD)
            t.normal(p + "shortconv.out_proj.weight", N_EMBD, N_EMBD)
        t.const(p + "ffn_norm.weight", N_EMBD)
        t.normal(p + "ffn_gate.weight", n_ff, N_EMBD)
        t.normal(p + "ffn_up.weight", n_ff, N_EMBD)
        t.normal(p + "ffn_down.weight", N_EMBD, n_ff)
    _finish(w)
    return path


def write_tiny_bert(
    path: Path,
    *,
    seed: int = 0,
    pooling: str = "mean",
    rerank: bool = False,
    n_ctx_train: int = 512,
    rerank_template: str | None = None,
) -> Path:
    """Write a 2-layer ``bert`` encoder (n_embd 64, 4 heads, n_ff 128, non-causal).

    ``pooling`` is the GGUF's ``bert.pooling_type`` (``none``, ``mean``, ``cls``,
    ``last``); ``rerank=True`` adds the classifier head llama.cpp's ``rank``
    pooling reads (``cls`` dense + tanh, then ``cls.output`` to one score) and sets
    pooling ``rank``. ``rerank_template`` is stored as ``tokenizer.chat_template.rerank``.
    """
    path = Path(path)
    n_head, n_ff, n_types = 4, 128, 2
    w = gguf.GGUFWriter(path, "bert")
    t = _Weights(w, seed)
    w.add_name("tiny-bert-rerank" if rerank else "tiny-bert")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    pool = "rank" if rerank else pooling
    w.add_pooling_type(gguf.PoolingType[pool.upper()])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_token_type_count(n_types)
    w.add_vocab_size(N_VOCAB)
    _add_vocab(w, None, add_eos=True)
    if rerank:
        w.add_classifier_output_labels(["relevant"])
    if rerank_template is not None:
        w.add_chat_template([{"name": "rerank", "template": rerank_template}])
    t.normal("token_embd.weight", N_VOCAB, N_EMBD, scale=0.5)
    t.normal("token_types.weight", n_types, N_EMBD, scale=0.1)
    t.normal("position_embd.weight", n_ctx_train, N_EMBD, scale=0.1)
    t.const("token_embd_norm.weight", N_EMBD)
    t.const("token_embd_norm.bias", N_EMBD, value=0.0)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t.normal(p + name + ".weight", N_EMBD, N_EMBD)
            t.normal(p + name + ".bias", N_EMBD, scale=0.1)
        t.const(p + "attn_output_norm.weight", N_EMBD)
        t.const(p + "attn_output_norm.bias", N_EMBD, value=0.0)
        t.normal(p + "ffn_up.weight", n_ff, N_EMBD)
        t.normal(p + "ffn_up.bias", n_ff, scale=0.1)
        t.normal(p + "ffn_down.weight", N_EMBD, n_ff)
        t.normal(p + "ffn_down.bias", N_EMBD, scale=0.1)
        t.const(p + "layer_output_norm.weight", N_EMBD)
        t.const(p + "layer_output_norm.bias", N_EMBD, value=0.0)
    if rerank:
        t.normal("cls.weight", N_EMBD, N_EMBD)
        t.normal("cls.bias", N_EMBD, scale=0.1)
        t.normal("cls.output.weight", 1, N_EMBD)
        t.const("cls.output.bias", 1, value=0.0)
    _finish(w)
    return path


MMPROJ_IMAGE_SIZE = 32
MMPROJ_PATCH_SIZE = 8
MMPROJ_N_IMAGE_TOKENS = (MMPROJ_IMAGE_SIZE // MMPROJ_PATCH_SIZE) ** 2  # 16


def _encoder_block(t: _Weights, p: str, n_embd: int, n_ff: int, *, key_bias: bool) -> None:
    """One pre-norm transformer block of a projector's encoder (clip.cpp's tensor names)."""
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        t.normal(p + name + ".weight", n_embd, n_embd)
        if key_bias or name != "attn_k":
            t.normal(p + name + ".bias", n_embd, scale=0.1)
    for name in ("ln1", "ln2"):
        t.const(p + name + ".weight", n_embd)
        t.const(p + name + ".bias", n_embd, value=0.0)
    t.normal(p + "ffn_up.weight", n_ff, n_embd)
    t.normal(p + "ffn_up.bias", n_ff, scale=0.1)
    t.normal(p + "ffn_down.weight", n_embd, n_ff)
    t.normal(p + "ffn_down.bias", n_embd, scale=0.1)


def write_tiny_mmproj(path: Path, *, text_n_embd: int = N_EMBD, seed: int = 0) -> Path:
    """Write a llava-style ``clip`` vision projector (``mlp``).

    ViT: 32x32 images, patch 8 (16 patches, no class token), width 32, 2 blocks,
    4 heads, ffn 64; projector ``mm.0`` (32 -> text_n_embd), GELU, ``mm.2``
    (text_n_embd -> text_n_embd).  One image gives 16 tokens of width ``text_n_embd``.
    """
    path = Path(path)
    n_embd, n_ff, n_layer, n_head = 32, 64, 2, 4
    n_patches = MMPROJ_N_IMAGE_TOKENS
    w = gguf.GGUFWriter(path, "clip")
    t = _Weights(w, seed)
    w.add_name("tiny-mmproj")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(gguf.VISION_PROJECTOR_TYPE_NAMES[gguf.VISION_PROJECTOR_TYPE.MLP])
    w.add_vision_image_size(MMPROJ_IMAGE_SIZE)
    w.add_vision_patch_size(MMPROJ_PATCH_SIZE)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_projection_dim(text_n_embd)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    t.normal("v.patch_embd.weight", n_embd, 3, MMPROJ_PATCH_SIZE, MMPROJ_PATCH_SIZE)
    t.normal("v.patch_embd.bias", n_embd, scale=0.1)
    t.normal("v.position_embd.weight", n_patches, n_embd, scale=0.1)
    t.const("v.pre_ln.weight", n_embd)
    t.const("v.pre_ln.bias", n_embd, value=0.0)
    for i in range(n_layer):
        _encoder_block(t, f"v.blk.{i}.", n_embd, n_ff, key_bias=True)
    t.normal("mm.0.weight", text_n_embd, n_embd)
    t.normal("mm.0.bias", text_n_embd, scale=0.1)
    t.normal("mm.2.weight", text_n_embd, text_n_embd)
    t.normal("mm.2.bias", text_n_embd, scale=0.1)
    _finish(w)
    return path


#: Prompt positions of one 30-second audio window (:func:`write_tiny_audio_mmproj`):
#: 3000 mel frames, halved by the encoder's strided conv, stacked by 50.
MMPROJ_N_AUDIO_TOKENS = 30
MMPROJ_AUDIO_RATE = 16_000


def write_tiny_audio_mmproj(path: Path, *, text_n_embd: int = N_EMBD, seed: int = 0) -> Path:
    """Write an Ultravox-style audio projector (``clip.projector_type = ultravox``).

    Whisper encoder: 16 mel bins, conv1d (k3) then a stride-2 conv1d to width 16,
    1500 learned positions, one pre-norm block (2 heads, ffn 32, no k bias, GELU), a
    post norm; the projector stacks 50 frames (800 wide), RMS norm, SwiGLU to 32, RMS
    norm, and projects to ``text_n_embd``. llama.cpp fixes the rest (16 kHz, n_fft 400,
    hop 160, 30-second windows).  One clip up to 30 s gives
    :data:`MMPROJ_N_AUDIO_TOKENS` tokens.
    """
    path = Path(path)
    n_embd, n_ff, n_head, n_mel, hidden, stack = 16, 32, 2, 16, 32, 50
    w = gguf.GGUFWriter(path, "clip")
    t = _Weights(w, seed)
    w.add_name("tiny-audio-mmproj")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_vision_encoder(False)
    w.add_clip_has_audio_encoder(True)
    w.add_clip_projector_type("ultravox")
    w.add_audio_num_mel_bins(n_mel)
    w.add_audio_embedding_length(n_embd)
    w.add_audio_feed_forward_length(n_ff)
    w.add_audio_block_count(1)
    w.add_audio_head_count(n_head)
    w.add_audio_attention_layernorm_eps(1e-5)
    w.add_audio_projection_dim(text_n_embd)
    w.add_audio_stack_factor(stack)
    # conv weights are (out, in, kernel); biases (out, 1) broadcast over time
    t.normal("a.conv1d.1.weight", n_embd, n_mel, 3)
    t.normal("a.conv1d.1.bias", n_embd, 1, scale=0.1)
    t.normal("a.conv1d.2.weight", n_embd, n_embd, 3)
    t.normal("a.conv1d.2.bias", n_embd, 1, scale=0.1)
    t.normal("a.position_embd.weight", 1500, n_embd, scale=0.1)
    _encoder_block(t, "a.blk.0.", n_embd, n_ff, key_bias=False)  # whisper's key: no bias
    t.const("a.post_ln.weight", n_embd)
    t.const("a.post_ln.bias", n_embd, value=0.0)
    t.const("mm.a.norm_pre.weight", n_embd * stack)
    t.normal("mm.a.mlp.1.weight", 2 * hidden, n_embd * stack)
    t.const("mm.a.norm_mid.weight", hidden)
    t.normal("mm.a.mlp.2.weight", text_n_embd, hidden)
    _finish(w)
    return path


def write_scripted_llama(
    path: Path,
    *,
    transitions: dict[str, dict[str, float]],
    extra_tokens: tuple[str, ...] = (),
    default_next: str = "</s>",
    chat_template: str | None = None,
    n_ctx_train: int = 2048,
) -> Path:
    """Write a ``llama`` model whose next-token logits depend only on the last token.

    Attention and FFN outputs are zero, so the hidden state at a position is the
    embedding of its token; each token in ``transitions`` gets its own embedding
    direction and the output matrix maps it to ``{next token: logit}`` (other tokens
    0). Every other token maps to ``default_next`` (EOS by default) with logit 10.
    Tokens are named by their text: an ``extra_tokens`` entry (appended to the tiny
    byte vocab as user-defined tokens, detokenized verbatim), ``"</s>"``, or a single
    ASCII character (its byte token). Greedy decoding thus prints an exact script,
    and the logit gaps make sampler behaviour (bans, grammars) controllable.
    """
    path = Path(path)
    base = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [SPACE]
    tokens = base + list(extra_tokens)
    index = {t: i for i, t in enumerate(tokens)}

    def tid(name: str) -> int:
        if name in extra_tokens:
            return index[name]
        if name in ("<unk>", "<s>", "</s>"):
            return index[name]
        if len(name) == 1 and ord(name) < 128:
            return SPACE_ID if name == " " else byte_token(ord(name))
        raise ValueError(f"unknown token {name!r}")

    n_vocab = len(tokens)
    sources = [tid(s) for s in transitions]
    n_embd = max(64, 16 * ((len(sources) + 1 + 15) // 16))
    n_head, n_head_kv, n_ff = 4, 2, 32
    head_dim = n_embd // n_head
    emb = np.zeros((n_vocab, n_embd), dtype=np.float32)
    emb[:, 0] = 1.0  # direction 0: "any other token"
    out = np.zeros((n_vocab, n_embd), dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(n_embd))  # RMS norm makes a one-hot sqrt(n_embd) long
    out[tid(default_next), 0] = 10.0 * scale
    for k, (src, nexts) in enumerate(transitions.items(), start=1):
        emb[tid(src)] = 0.0
        emb[tid(src), k] = 1.0
        for nxt, logit in nexts.items():
            out[tid(nxt), k] = np.float32(logit) * scale

    w = gguf.GGUFWriter(path, "llama")
    t = _Weights(w, 0)
    w.add_name("scripted")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(N_LAYER)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL]
        + [gguf.TokenType.USER_DEFINED] * len(extra_tokens)
    )
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    t.array("token_embd.weight", emb)
    t.const("output_norm.weight", n_embd)
    t.array("output.weight", out)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        t.const(p + "attn_norm.weight", n_embd)
        t.const(p + "attn_q.weight", n_head * head_dim, n_embd, value=0.0)
        t.const(p + "attn_k.weight", n_head_kv * head_dim, n_embd, value=0.0)
        t.const(p + "attn_v.weight", n_head_kv * head_dim, n_embd, value=0.0)
        t.const(p + "attn_output.weight", n_embd, n_head * head_dim, value=0.0)
        t.const(p + "ffn_norm.weight", n_embd)
        t.const(p + "ffn_gate.weight", n_ff, n_embd, value=0.0)
        t.const(p + "ffn_up.weight", n_ff, n_embd, value=0.0)
        t.const(p + "ffn_down.weight", n_embd, n_ff, value=0.0)
    _finish(w)
    return path


def write_tiny_llama_vocab(
    path: Path,
    *,
    seed: int = 0,
    extra_tokens: int = 0,
    renamed: dict[int, str] | None = None,
    add_bos: bool = True,
    add_eos: bool = False,
) -> Path:
    """Write a :func:`write_tiny_llama`-shaped model with another vocabulary.

    ``extra_tokens`` user-defined tokens ``<extra_k>`` are appended (a vocab size
    difference), ``renamed`` replaces the text of the given token ids (a vocab whose
    texts differ), ``add_bos`` sets ``tokenizer.ggml.add_bos_token``: drafts that
    llama.cpp's speculative compatibility check must refuse. ``add_eos``: a tokenizer
    that also adds EOS at the end of a text.
    """
    path = Path(path)
    n_vocab = N_VOCAB + extra_tokens
    w = gguf.GGUFWriter(path, "llama")
    t = _Weights(w, seed)
    _text_common(w, t, 2048, n_vocab=n_vocab, name="tiny-other-vocab")
    _add_vocab(
        w, None, add_bos=add_bos, add_eos=add_eos, extra_tokens=extra_tokens, renamed=renamed
    )
    _llama_blocks(w, t, n_vocab)
    _finish(w)
    return path


__all__ += ["write_tiny_llama_vocab"]
