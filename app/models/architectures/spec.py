"""What an architecture is to the model layer: a declaration, not code.

Every architecture served here is a Llama-style decoder (RMSNorm, rotary attention with grouped
KV heads, a gated MLP), so one forward (:mod:`app.models.forward.decoder`) runs them all. An
architecture says only how its checkpoints differ: which optional weights exist (QKV biases,
per-head q/k norms, norms after attention and MLP), the MLP's activation, a scaled embedding,
how its norm weights are stored, whether llama.cpp's converter permuted its Q/K rows, how its
config.json switches a sliding window on (or which layers attend locally), and under which
names its files know it. The readers turn that
into :class:`app.models.hparams.HParams` and the per-layer weight record.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.models.hparams import Activation


@dataclass(frozen=True, slots=True)
class TensorNames:
    """Where each weight of the shared forward lives in one checkpoint format.

    Per-layer names hold ``{i}`` for the layer index. Matrices are ``[out, in]``. A
    projection's bias, where a checkpoint has one, is named as its weight with ``.bias`` for
    ``.weight`` (both formats do so).
    """

    token_embedding: str
    output: str
    output_norm: str
    attn_norm: str
    attn_q: str
    attn_k: str
    attn_v: str
    attn_output: str
    attn_q_norm: str
    attn_k_norm: str
    ffn_norm: str
    ffn_gate: str
    ffn_up: str
    ffn_down: str
    attn_post_norm: str | None = None
    ffn_post_norm: str | None = None
    attn_qkv: str | None = None
    ffn_gate_up: str | None = None
    ffn_router: str | None = None
    expert_gate: str | None = None
    expert_up: str | None = None
    expert_down: str | None = None

    def of(self, part: str, layer: int | None = None, expert: int = 0) -> str:
        """The file's name of ``part`` (a field name), for ``layer`` when it is per layer and
        ``expert`` where the format names each expert's matrix (Hugging Face's ``{e}``; a GGUF
        stacks them in one tensor). Raises KeyError for a part these names do not have (a post
        norm of Llama's names)."""
        name: str | None = getattr(self, part)
        if name is None:
            raise KeyError(f"no tensor name for {part}")
        return name if layer is None else name.format(i=layer, e=expert)

    def stacks_experts(self) -> bool:
        """The experts of a layer are one tensor ``[experts, out, in]`` (GGUF's ``*_exps``)."""
        return self.expert_gate is not None and "{e}" not in self.expert_gate

    def bias_of(self, part: str, layer: int | None = None) -> str:
        """The name of ``part``'s bias (which a checkpoint may or may not hold)."""
        return self.of(part, layer).removesuffix(".weight") + ".bias"


# transformers' module names (LlamaForCausalLM and the models derived from it).
HF_NAMES = TensorNames(
    token_embedding="model.embed_tokens.weight",
    output="lm_head.weight",
    output_norm="model.norm.weight",
    attn_norm="model.layers.{i}.input_layernorm.weight",
    attn_q="model.layers.{i}.self_attn.q_proj.weight",
    attn_k="model.layers.{i}.self_attn.k_proj.weight",
    attn_v="model.layers.{i}.self_attn.v_proj.weight",
    attn_output="model.layers.{i}.self_attn.o_proj.weight",
    attn_q_norm="model.layers.{i}.self_attn.q_norm.weight",
    attn_k_norm="model.layers.{i}.self_attn.k_norm.weight",
    ffn_norm="model.layers.{i}.post_attention_layernorm.weight",
    ffn_gate="model.layers.{i}.mlp.gate_proj.weight",
    ffn_up="model.layers.{i}.mlp.up_proj.weight",
    ffn_down="model.layers.{i}.mlp.down_proj.weight",
)

# llama.cpp's names (gguf-py's MODEL_TENSOR names, the same for llama, qwen2 and qwen3).
GGUF_NAMES = TensorNames(
    token_embedding="token_embd.weight",
    output="output.weight",
    output_norm="output_norm.weight",
    attn_norm="blk.{i}.attn_norm.weight",
    attn_q="blk.{i}.attn_q.weight",
    attn_k="blk.{i}.attn_k.weight",
    attn_v="blk.{i}.attn_v.weight",
    attn_output="blk.{i}.attn_output.weight",
    attn_q_norm="blk.{i}.attn_q_norm.weight",
    attn_k_norm="blk.{i}.attn_k_norm.weight",
    ffn_norm="blk.{i}.ffn_norm.weight",
    ffn_gate="blk.{i}.ffn_gate.weight",
    ffn_up="blk.{i}.ffn_up.weight",
    ffn_down="blk.{i}.ffn_down.weight",
    attn_post_norm="blk.{i}.post_attention_norm.weight",
    ffn_post_norm="blk.{i}.post_ffw_norm.weight",
    ffn_router="blk.{i}.ffn_gate_inp.weight",
    expert_gate="blk.{i}.ffn_gate_exps.weight",
    expert_up="blk.{i}.ffn_up_exps.weight",
    expert_down="blk.{i}.ffn_down_exps.weight",
)


@dataclass(frozen=True, slots=True)
class Architecture:
    """One architecture of the Llama family.

    Attributes:
        name: our name for it (``/info``, errors, logs).
        hf_model_types: config.json ``model_type`` values it serves.
        gguf_architectures: ``general.architecture`` values it serves. llama.cpp's converter
            writes Mistral models as ``llama``, so only the llama architecture claims that name.
        qkv_bias: the Q, K and V projections carry biases (required tensors).
        qk_norm: per-head RMSNorm of queries and keys before rope (required tensors).
        gguf_permutes_qk: llama.cpp's converter permuted the rows of ``attn_q``/``attn_k`` (and
            of their biases) for its adjacent-pair rope; the loader undoes it.
        sliding_window_switch: the config.json key that turns the window on (Qwen's
            ``use_sliding_window``); None when a non-null ``sliding_window`` means it is used
            (Mistral).
        ffn_activation: the gated MLP's activation (SwiGLU unless said).
        post_norms: RMSNorms of the attention output and of the MLP output before their
            residual adds (required tensors ``attn_post_norm``, ``ffn_post_norm``).
        scaled_embedding: the embedding rows are multiplied by ``sqrt(hidden)`` (Gemma).
        hf_norm_shift: added to every RMSNorm weight of a Hugging Face checkpoint (Gemma's
            ``Gemma3RMSNorm`` multiplies by ``1 + weight``; llama.cpp's converter stores the
            sum, its ``norm_shift``), so both formats reach the forward as the multiplier.
        sliding_window_pattern: local and global layers: every ``n``-th layer global, the
            others windowed (Gemma 3: 6, transformers' ``sliding_window_pattern`` default and
            llama.cpp's ``set_swa_pattern(6)``), where the file does not list the layers;
            None: the architecture has no per-layer windows.
        local_rope_freq_base: rotary theta of local layers when the file does not give it
            (transformers' ``rope_local_base_freq`` default, llama.cpp's
            ``rope_freq_base_train_swa`` for gemma3: 10,000).
        fused_qkv: the file holds Q, K and V as one matrix (``attn_qkv``: rows ``[q | k | v]``,
            Phi-3's ``qkv_proj``); ``attn_q`` / ``attn_k`` / ``attn_v`` are read as its rows.
        fused_gate_up: the file holds gate and up as one matrix (``ffn_gate_up``: the gate's
            rows first, Phi-3's ``gate_up_proj``; llama.cpp's ``ffn_up`` of twice the rows).
        partial_rotary: rope may rotate only the leading dimensions of each head
            (``partial_rotary_factor``; GGUF ``rope.dimension_count``); refused otherwise.
        expert_norm_key: the config.json key saying whether the chosen experts' weights are
            renormalised (Qwen3-MoE's ``norm_topk_prob``); None: always (Mixtral). A GGUF's
            ``{arch}.expert_weights_norm``, default true (llama.cpp's for both).
        query_pre_attn_scalar: the attention scale is config.json's
            ``query_pre_attn_scalar ** -0.5`` and, from a GGUF, llama.cpp's rule for it
            (:mod:`app.models.checkpoints.local_layers`); False: ``1 / sqrt(head_dim)``.
        hf_names, gguf_names: where the weights are in each format.
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf_permutes_qk: bool = False
    sliding_window_switch: str | None = None
    ffn_activation: Activation = Activation.SILU
    post_norms: bool = False
    scaled_embedding: bool = False
    hf_norm_shift: float = 0.0
    sliding_window_pattern: int | None = None
    local_rope_freq_base: float = 10000.0
    query_pre_attn_scalar: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    partial_rotary: bool = False
    expert_norm_key: str | None = None
    hf_names: TensorNames = HF_NAMES
    gguf_names: TensorNames = GGUF_NAMES
