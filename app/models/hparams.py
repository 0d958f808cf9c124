"""The hyper-parameters of a decoder-only transformer, whatever file they were read from.

:class:`HParams` is what the shared forward (:mod:`app.models.forward.decoder`), the KV cache and
the
weight loader need to know about a model. The file readers fill it: a GGUF file from its
``{arch}.*`` metadata (:meth:`app.models.checkpoints.gguf_file.GGUFFile.hparams`), a Hugging Face
directory
from ``config.json`` (:func:`app.models.checkpoints.hf_config.hparams_from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RopeScalingKind(Enum):
    """How the rotary frequencies of a model are changed from the plain ``theta ** (-2i / d)``.

    LINEAR: every frequency divided by ``factor`` (positions interpolated; transformers'
        ``rope_type: "linear"``, GGUF ``rope.scaling.type = linear``).
    LLAMA3: Llama 3.1's frequency-dependent division (transformers' ``rope_type: "llama3"``):
        long wavelengths divided by ``factor``, short ones kept, a smooth blend between.
    FREQ_FACTORS: one divisor per frequency given by the file: llama.cpp's converter writes
        Llama 3.1's scaling as the tensor ``rope_freqs.weight`` of these divisors.
    LONGROPE: Phi-3's (transformers' ``"longrope"``, legacy ``"su"``): one divisor per
        frequency, the ``long_factors`` when the served context exceeds the original one, else
        the ``short_factors``; cos and sin multiplied by ``attention_factor``.
    """

    LINEAR = "linear"
    LLAMA3 = "llama3"
    FREQ_FACTORS = "freq_factors"
    LONGROPE = "longrope"


class Activation(Enum):
    """The activation of the gated MLP's gate: ``down(act(gate(x)) * up(x))``.

    SILU: SwiGLU (Llama, Qwen; transformers' ``"silu"``).
    GELU_TANH: GeGLU with the tanh approximation of GELU (Gemma; transformers'
        ``"gelu_pytorch_tanh"``, llama.cpp's ``ggml_gelu``).
    """

    SILU = "silu"
    GELU_TANH = "gelu_tanh"


@dataclass(frozen=True, slots=True)
class Experts:
    """A mixture-of-experts MLP in every layer (Qwen3-MoE, Mixtral): a router scores the
    ``count`` experts of a token, the ``used`` best run (each a SwiGLU MLP of inner size
    ``feed_forward_length``) and their outputs are summed, weighted by the router's softmax
    probabilities of the chosen ones, renormalised to sum 1 when ``normalize`` (Qwen3's
    ``norm_topk_prob``; Mixtral's top-k-then-softmax is the same thing, always).
    """

    count: int
    used: int
    feed_forward_length: int
    normalize: bool


@dataclass(frozen=True, slots=True)
class LocalAttention:
    """Layers that attend within a sliding window while the others attend to every position
    (Gemma 3's local/global layers).

    The paged KV cache keeps every layer's blocks (llama.cpp's ``--swa-full``): a local layer
    masks out keys at a distance of ``window`` or more, so its answers are exactly those of
    the window, with prefix caching and preemption as for any layer.

    Attributes:
        window: a key at position ``k`` is visible to a query at ``q >= k`` when
            ``q - k < window`` (transformers' ``sliding_window_overlay``, llama.cpp's
            ``LLAMA_SWA_TYPE_STANDARD``).
        layers: one flag per layer, True for a local (windowed) layer.
        rope_freq_base: rotary theta of the local layers, which take no rope scaling (the
            global ones use :attr:`HParams.rope_freq_base` and :attr:`HParams.rope_scaling`).
    """

    window: int
    layers: tuple[bool, ...]
    rope_freq_base: float


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A rope scaling and its parameters (see :class:`RopeScalingKind`).

    Attributes:
        kind: which scaling.
        factor: LINEAR and LLAMA3: the largest divisor.
        low_freq_factor, high_freq_factor, original_context_length: LLAMA3 only (transformers'
            names ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
        freq_factors: FREQ_FACTORS only, ``head_dim / 2`` divisors, one per frequency.
        short_factors, long_factors: LONGROPE only, ``rotary_dims / 2`` divisors each.
        attention_factor: LONGROPE only, the factor of cos and sin (transformers' default
            ``sqrt(1 + ln(factor) / ln(original))`` for ``factor = context / original``, 1
            when the context is not extended).
    """

    kind: RopeScalingKind
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192
    freq_factors: tuple[float, ...] = ()
    short_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class HParams:
    """Hyper-parameters of one model of the Llama family.

    Attributes:
        architecture: the architecture's name (``app.models.architectures``), e.g. "qwen2".
        block_count: transformer layers.
        embedding_length: hidden size.
        feed_forward_length: inner size of the SwiGLU MLP.
        head_count: query heads.
        head_count_kv: key/value heads (grouped-query attention when < head_count).
        head_dim: size of one head (Qwen3: its own key, not ``embedding_length / head_count``).
        rope_freq_base: rotary theta.
        rms_norm_eps: epsilon of every RMSNorm.
        context_length: positions the model serves: the trained context, capped at the sliding
            window when the model has one (attention over at most ``sliding_window`` positions
            is then exactly full attention).
        vocab_size: rows of the embedding and of the output head.
        tied_embeddings: the output head is the token embedding (no separate output matrix).
        rope_scaling: None for plain rope.
        qkv_bias: the Q, K and V projections have biases (Qwen2).
        qk_norm: each query and key head is RMS-normalised before rope (Qwen3).
        sliding_window: the attention window the model was trained with, None when it attends
            to every position; ``context_length`` is already capped at it.
        local_attention: per-layer windows (Gemma 3), None when every layer attends alike;
            the context is not capped by them.
        ffn_activation: the gated MLP's activation.
        post_norms: each block also RMS-normalises the attention output and the MLP output
            before their residual adds (Gemma's four norms per block).
        embedding_scale: the token embedding rows are multiplied by this (Gemma:
            ``sqrt(embedding_length)``), or None.
        embedding_scale_rounded: the scale is rounded to the model dtype first, as
            transformers does (HF checkpoints); false: the product is taken in float32 and
            rounded once, as llama.cpp does (``ggml_scale`` by ``sqrtf(n_embd)``; GGUF files).
            In bfloat16 the rounded scale is 25.25 for 25.30 (Gemma 3 270M): on the real file
            that alone moved a decode logit gap against llama.cpp's from -0.01 to +0.21
            (llama.cpp: +0.25).
        attention_scale: the factor of the attention scores; None: ``1 / sqrt(head_dim)``.
        rope_dims: the leading dimensions of each head that rope rotates (Phi-4-mini's
            ``partial_rotary_factor`` 0.75: 96 of 128), None for all of them.
        experts: the mixture of experts replacing every layer's MLP, None for a dense MLP.
    """

    architecture: str
    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    head_dim: int
    rope_freq_base: float
    rms_norm_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    local_attention: LocalAttention | None = None
    ffn_activation: Activation = Activation.SILU
    post_norms: bool = False
    embedding_scale: float | None = None
    embedding_scale_rounded: bool = True
    attention_scale: float | None = None
    rope_dims: int | None = None
    experts: Experts | None = None

    @property
    def rotary_dims(self) -> int:
        """The dimensions of each head that rope rotates."""
        return self.head_dim if self.rope_dims is None else self.rope_dims

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.head_count // self.head_count_kv

    @property
    def q_width(self) -> int:
        """Columns of the query projection's output: ``head_count * head_dim``."""
        return self.head_count * self.head_dim

    @property
    def kv_width(self) -> int:
        """Columns of the key (and of the value) projection's output."""
        return self.head_count_kv * self.head_dim

    def inconsistency(self) -> str | None:
        """Why these numbers cannot describe a model the forward can run, or None."""
        positive = {
            "block_count": self.block_count,
            "embedding_length": self.embedding_length,
            "feed_forward_length": self.feed_forward_length,
            "head_count": self.head_count,
            "head_count_kv": self.head_count_kv,
            "head_dim": self.head_dim,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
        }
        for name, value in positive.items():
            if value < 1:
                return f"{name} is {value}"
        if self.head_count % self.head_count_kv:
            return (
                f"{self.head_count} query heads are not a multiple of {self.head_count_kv} KV heads"
            )
        if self.head_dim % 2:
            return f"head_dim {self.head_dim} is odd (rope rotates pairs)"
        if self.rotary_dims % 2 or not 0 < self.rotary_dims <= self.head_dim:
            return f"rope over {self.rotary_dims} of {self.head_dim} dimensions a head"
        experts = self.experts
        if experts is not None and not 0 < experts.used <= experts.count:
            return f"{experts.used} experts used of {experts.count}"
        local = self.local_attention
        if local is not None and (len(local.layers) != self.block_count or local.window < 1):
            return (
                f"sliding window of {local.window} over {len(local.layers)} layer flags for "
                f"{self.block_count} layers"
            )
        scaling = self.rope_scaling
        if scaling is not None and scaling.kind is RopeScalingKind.FREQ_FACTORS:
            if len(scaling.freq_factors) != self.head_dim // 2:
                return (
                    f"{len(scaling.freq_factors)} rope frequency factors for head_dim "
                    f"{self.head_dim} (expected {self.head_dim // 2})"
                )
        if scaling is not None and scaling.kind is RopeScalingKind.LONGROPE:
            half = self.rotary_dims // 2
            if len(scaling.short_factors) != half or len(scaling.long_factors) != half:
                return (
                    f"longrope factors of {len(scaling.short_factors)} and "
                    f"{len(scaling.long_factors)} for {self.rotary_dims} rotary dimensions"
                )
        return None
