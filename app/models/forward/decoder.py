"""The one forward of every architecture: a Llama-style decoder over packed rows and a per-slot
KV cache.

One call to :meth:`DecoderModel.forward` computes one scheduler step for every row at once:
the tokens of all rows are packed into one sequence (:mod:`app.models.forward.forward_plan`), every
projection (fused QKV, output, fused gate/up, down, LM head) runs once over all of them, and
attention runs in the plan's groups (:mod:`app.models.forward.attention`). What differs between
architectures reaches this module as data in :class:`app.models.weights.record.LayerWeights`: a bias
inside the QKV projection, a ``qk_norm`` tensor, rope tables built from the model's own
frequencies (:mod:`app.models.forward.rope`).

Few kernels per layer (on a 2-core CPU a decode step of one row is mostly per-op overhead, see
``docs/MODEL_PERF.md``):

* the RMSNorm weights of ``attn_norm`` and ``ffn_norm`` are folded into the input columns of
  the fused QKV and gate/up matrices at load, so the normalisation is a per-token scale,
  ``x * (1 / rms(x))``: four small ops instead of ``F.rms_norm``'s eight;
* the residual adds are fused into the output and down projections (``add_to``);
* steps without a seeded row whose prompt chunks are short (decode-only steps, and short
  prompts or the uncached tail of a long one: ``ForwardPlan.token_rows``) run the glue between
  the projections in fused C kernels (:mod:`app.models.kernels.fused_decode`), a chunk's tokens as
  single-token rows, for every Llama-style block: Qwen2's biases are in the QKV projection and
  Qwen3's q/k norm is part of the fused attention kernel;
* when every projection computes on GGUF blocks (:class:`app.models.weights.ggml.GGMLLinear`),
  that fused step's whole layer loop is one C call (``sl_decode_layers``, through
  :class:`app.models.kernels.decoder_layout.DecoderLayout`): the same kernels in the same order,
  bit for bit, without ~7 Python calls per layer (SmolLM2, one row: ~3 ms of a ~12 ms step).
  Gemma 3's block (GeGLU, norms after attention and MLP, sliding-window layers with their own
  rope, a scaled embedding) is computed in both loops. ``fused_decode_status`` says which step
  a model takes.

What Gemma 3 adds to the torch path, each from :class:`app.models.hparams.HParams`: the
embedding scale, the local layers' own rope tables and window masks
(:func:`app.models.forward.attention_masks.window_masks`), the attention scale, the post norms
before the residual adds, the MLP's activation.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from app.models.forward.attention import attend
from app.models.forward.attention_masks import window_masks as local_window_masks
from app.models.forward.experts import mixture_of_experts
from app.models.forward.forward_plan import ForwardPlan
from app.models.forward.fused_step import block_layout, fused_decode_for
from app.models.forward.kv_cache import KVCache
from app.models.forward.rope import rope_tables
from app.models.hparams import Activation, HParams
from app.models.kernels.decoder_layout import DecoderLayout
from app.models.kernels.fused_decode import FusedDecodeKernels
from app.models.sampling.sampler import GreedyTokens
from app.models.weights.ggml import GGMLLinear
from app.models.weights.projections import Projection, project
from app.models.weights.record import ModelWeights, Quantization


class DecoderModel:
    """The forward pass. Holds weights and rope tables; reads and writes a :class:`KVCache`.

    ``fused_decode``: let steps without a seeded row (decode, short prompt chunks), on the CPU
    in bfloat16, use the fused kernels of :mod:`app.models.kernels.fused_decode`;
    ``fused_decode_status`` says whether they are used, and why not.
    """

    def __init__(
        self,
        hparams: HParams,
        weights: ModelWeights,
        *,
        max_model_len: int,
        fused_decode: bool = True,
    ):
        self.hparams = hparams
        self.weights = weights
        dtype, device = weights.output_norm.dtype, weights.output_norm.device
        self.dtype, self.device = dtype, device
        # [max_model_len, head_dim] each (see apply_rope)
        self._rope_cos, self._rope_sin = rope_tables(
            hparams, max_model_len, dtype=dtype, device=device
        )
        # [max_model_len, head_dim] each: the rope of layers that attend within a window
        self._local_rope = (
            None
            if hparams.local_attention is None
            else rope_tables(hparams, max_model_len, dtype=dtype, device=device, local=True)
        )
        # Gemma: sqrt(hidden), rounded to the model dtype as transformers' scaled embedding
        # (HF checkpoints), or float32 as llama.cpp's (GGUF files; see _scaled)
        self._embedding_scale = (
            None
            if hparams.embedding_scale is None
            else torch.tensor(
                hparams.embedding_scale,
                dtype=dtype if hparams.embedding_scale_rounded else torch.float32,
                device=device,
            )
        )
        self._activation = ACTIVATIONS[hparams.ffn_activation]
        self._rms_eps = torch.tensor(hparams.rms_norm_eps, dtype=torch.float32, device=device)
        self.fused_decode: FusedDecodeKernels | None = None
        self.fused_decode_status = "eager decode (--fused-decode false)"
        # With GGUF-block projections, the fused step's layer loop runs in one C call
        # (``sl_decode_layers``); false keeps it in Python (the tests compare the two).
        self.decode_layers = True
        self._layout: tuple[KVCache, tuple[DecoderLayout | None, int]] | None = None
        if fused_decode:
            self.fused_decode, self.fused_decode_status = fused_decode_for(hparams, dtype, device)

    @property
    def quantization(self) -> Quantization:
        return self.weights.quantization

    def forward(
        self,
        plan: ForwardPlan,
        cache: KVCache,
        *,
        hidden_out: list[torch.Tensor] | None = None,
        num_layers: int | None = None,
        argmax: bool = False,
    ) -> torch.Tensor | GreedyTokens:
        """Run all layers over the packed tokens, writing their K/V into ``cache``.

        Returns logits ``[len(plan.logits_index), vocab]`` in the model dtype (a bfloat16
        model's dense LM head rounds to bfloat16, as Hugging Face's does), or float32 from an
        LM head on GGUF blocks (unrounded, as llama.cpp's; bfloat16 from its dense copy in a
        step wider than the blocks take, ``GGMLLinear.out_dtype``). ``hidden_out``, when
        given, receives the last layer's hidden states of every packed token (``[N, hidden]``,
        before the output norm; :meth:`output_logits` turns rows of it into logits): prompt
        logprobs. ``num_layers``, when given, runs only the first ``num_layers`` layers on the
        eager path before the output norm and LM head: the warm-up's shape (every layer has
        the same shapes, so one layer pays for the buffers and primitives of all of them);
        the logits of such a call mean nothing. ``argmax``: only each logit row's argmax is
        wanted (every row greedy, nothing reads the logits): an LM head on GGUF blocks then
        returns :class:`GreedyTokens` in place of the logits, without storing them (Gemma 3's
        262,144-column head: steps of 16 and 32 rows 4% and 11% shorter on the AMX Xeon,
        docs/MODEL_PERF.md); other heads, and a call on a wide copy, return the logits. Call under
        ``torch.inference_mode()``.
        """
        if (
            hidden_out is None
            and num_layers is None
            and self.fused_decode is not None
            and plan.token_rows is not None
        ):
            layout = self._decoder_layout(cache, plan.token_rows.count - plan.drafted_tokens)
            return self._forward_fused_decode(plan, cache, self.fused_decode, layout, argmax)
        w, hp = self.weights, self.hparams
        hidden = self._scaled(w.embedding(plan.token_ids))
        ropes = {False: _rope_rows(self._rope_cos, self._rope_sin, plan)}
        local, window_masks = hp.local_attention, None
        if local is not None and self._local_rope is not None:
            ropes[True] = _rope_rows(*self._local_rope, plan)
            window_masks = local_window_masks(plan, local.window, dtype=self.dtype)
        qk_width = hp.q_width + hp.kv_width
        ffn = hp.feed_forward_length
        num_tokens = hidden.shape[0]
        exact = plan.exact_tokens
        for index, layer in enumerate(w.layers[:num_layers]):
            is_local = local is not None and local.layers[index]
            qkv = project(layer.qkv, self._normed(hidden, layer.attn_norm), exact)
            qk = qkv[:, :qk_width].view(num_tokens, -1, hp.head_dim)
            if layer.qk_norm is not None:
                qk = self._normed(qk, layer.qk_norm)
            qk = apply_rope(qk, *ropes[is_local])
            queries = qk[:, : hp.head_count]
            keys = qk[:, hp.head_count :]
            values = qkv[:, qk_width:].view(num_tokens, hp.head_count_kv, hp.head_dim)
            cache.write(index, plan.cache_index, keys, values)
            attended = attend(
                index,
                queries,
                plan,
                cache,
                window_masks=window_masks if is_local else None,
                scale=hp.attention_scale,
            )
            hidden = self._add_output(
                layer.attn_output, attended, exact, hidden, layer.attn_post_norm
            )
            normed = self._normed(hidden, layer.ffn_norm)
            if layer.experts is not None and hp.experts is not None:
                hidden = hidden + mixture_of_experts(layer.experts, normed, hp.experts, exact)
            else:
                assert layer.gate_up is not None and layer.down is not None
                gate_up = project(layer.gate_up, normed, exact)
                activated = self._activation(gate_up[:, :ffn]).mul_(gate_up[:, ffn:])
                hidden = self._add_output(layer.down, activated, exact, hidden, layer.ffn_post_norm)
        if hidden_out is not None:
            hidden_out.append(hidden)
        return self._logits(hidden, plan, plan.exact_logits, argmax)

    def output_logits(self, hidden: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        """The output norm and LM head of hidden states ``[n, hidden]`` (from ``hidden_out``):
        logits ``[n, vocab]`` in the model dtype; ``exact``: each row as it comes out alone
        (a seeded request's prompt logprobs), in calls the head computes alike."""
        w = self.weights
        normed = F.rms_norm(hidden, w.output_norm.shape, w.output_norm, self.hparams.rms_norm_eps)
        rows = torch.arange(normed.shape[0], device=normed.device) if exact else None
        return project(w.lm_head, normed, rows)

    def _forward_fused_decode(
        self,
        plan: ForwardPlan,
        cache: KVCache,
        kernels: FusedDecodeKernels,
        layout: DecoderLayout | None,
        argmax: bool,
    ) -> torch.Tensor | GreedyTokens:
        """:meth:`forward` for a step planned as single-token rows (``plan.token_rows``: decode
        rows and the tokens of short prompt chunks, none ``batch_invariant``), with the glue
        between projections in four fused calls per layer (:mod:`app.models.kernels.fused_decode`).
        Same results as the eager path up to rounding order (tested), not bit-equal: a seeded
        row never comes here."""
        w, hp = self.weights, self.hparams
        eps = hp.rms_norm_eps
        rows = plan.token_rows
        assert rows is not None
        # torch's threads share the attention (they sit idle between the projections), one
        # (row, KV head) pair at a time: a single long row is shared too.
        threads = min(torch.get_num_threads(), rows.count * hp.head_count_kv)
        # Softmax scores of one KV head's query group, every position up to the longest row,
        # per thread.
        scores = torch.empty((threads, hp.group_size * rows.key_length), dtype=torch.float32)
        hidden = self._scaled(w.embedding(plan.token_ids)).contiguous()
        if layout is not None:  # the loop below, in one C call
            kernels.decode_layers(
                layout,
                hidden,
                plan.positions,
                rows.block_tables,
                scores,
                threads=torch.get_num_threads(),
            )
            return self._logits(hidden, plan, None, argmax)
        gelu = hp.ffn_activation is Activation.GELU_TANH
        activate = partial(
            kernels.gelu_tanh_mul if gelu else kernels.silu_mul, threads=torch.get_num_threads()
        )
        norm = partial(kernels.rms_norm, eps=eps, threads=torch.get_num_threads())
        local = hp.local_attention
        normed = norm(hidden, w.layers[0].attn_norm)
        for index, layer in enumerate(w.layers):
            is_local = local is not None and local.layers[index]
            cos, sin = (
                self._local_rope
                if is_local and self._local_rope is not None
                else (self._rope_cos, self._rope_sin)
            )
            attended = kernels.decode_attention(
                layer.qkv(normed),
                cos,
                sin,
                plan.positions,
                rows.block_tables,
                cache.keys[index],
                cache.values[index],
                scores,
                n_heads=hp.head_count,
                n_kv_heads=hp.head_count_kv,
                threads=threads,
                qk_norm=layer.qk_norm,
                eps=eps,
                window=local.window if is_local and local is not None else 0,
                scale=hp.attention_scale,
            )
            attn_out = layer.attn_output(attended)
            if layer.attn_post_norm is not None:  # Gemma 3: normalised before the residual add
                attn_out = norm(attn_out, layer.attn_post_norm)
            normed = norm(attn_out, layer.ffn_norm, residual=hidden)
            hidden = attn_out  # now holds the residual sum
            down = layer.down(activate(layer.gate_up(normed)))
            if layer.ffn_post_norm is not None:
                down = norm(down, layer.ffn_post_norm)
            # The next layer's attention norm (None: folded into its QKV). After the last layer
            # only the residual add is wanted: the output norm is torch's, as on the eager path
            # (through this kernel, greedy agreement with float32 fell from 98.7% to 98.3% at
            # 32 rows x 24 steps).
            following = w.layers[index + 1].attn_norm if index + 1 < len(w.layers) else None
            normed = norm(down, following, residual=hidden)
            hidden = down
        return self._logits(hidden, plan, None, argmax)

    def _decoder_layout(self, cache: KVCache, num_rows: int) -> DecoderLayout | None:
        """The C view of this model's layers for ``sl_decode_layers`` when every projection
        computes on GGUF blocks for a step of ``num_rows`` rows (its drafted tokens not
        counted: ``ForwardPlan.drafted_tokens``; built once per cache), else None: the layer
        loop stays in Python (dense or int4 projections, a mixture of experts, a wide copy
        taking the call, ``decode_layers`` false)."""
        if not self.decode_layers:
            return None
        if self._layout is None or self._layout[0] is not cache:
            rope = (self._rope_cos, self._rope_sin)
            built = block_layout(self.hparams, self.weights, cache, rope, self._local_rope)
            self._layout = (cache, built)
        layout, max_rows = self._layout[1]
        return layout if layout is not None and num_rows <= max_rows else None

    def _scaled(self, embedded: torch.Tensor) -> torch.Tensor:
        """The embedded tokens ``[N, hidden]`` times the embedding scale (Gemma), in the model
        dtype: with a float32 scale the product is float32, rounded once."""
        scale = self._embedding_scale
        if scale is None:
            return embedded
        if scale.dtype == embedded.dtype:
            return embedded * scale
        return (embedded.float() * scale).to(embedded.dtype)

    def _logits(
        self, hidden: torch.Tensor, plan: ForwardPlan, exact: torch.Tensor | None, argmax: bool
    ) -> torch.Tensor | GreedyTokens:
        """The output norm and LM head for the rows that want logits (a head on GGUF blocks
        picks its path by the rows without the drafted ones, as the layers do); their argmax
        alone where ``argmax`` and the head's call takes the blocks (:meth:`forward`). In the
        runner's steps a GGUF head's logits are the thread's buffer (``GGMLLinear.logits``)."""
        if plan.logits_index.numel() == 0:  # only prompt chunks that sample nothing
            return hidden.new_empty((0, self.hparams.vocab_size))
        w = self.weights
        last = F.rms_norm(
            hidden[plan.logits_index], w.output_norm.shape, w.output_norm, self.hparams.rms_norm_eps
        )
        if exact is None and isinstance(w.lm_head, GGMLLinear):
            as_rows = last.shape[0] - plan.drafted_tokens
            tokens = w.lm_head.argmax(last, as_rows=as_rows) if argmax else None
            if tokens is not None:
                return GreedyTokens(tokens)
            return w.lm_head.logits(last, as_rows=as_rows)  # (the thread's buffer)
        return project(w.lm_head, last, exact)

    def _add_output(
        self,
        projection: Projection,
        x: torch.Tensor,
        exact: torch.Tensor | None,
        residual: torch.Tensor,
        post_norm: torch.Tensor | None,
    ) -> torch.Tensor:
        """``residual + projection(x)``, the projection's output RMS-normalised first when the
        block has a norm there (``post_norm [hidden]``, Gemma); the add is fused into the
        projection otherwise."""
        if post_norm is None:
            return project(projection, x, exact, residual=residual)
        return residual + self._normed(project(projection, x, exact), post_norm)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """RMSNorm over the last axis of ``x`` (``[N, hidden]``, or ``[N, heads, head_dim]``
        for the q/k norm): ``x / rms(x)``, times ``weight`` (broadcast over the leading axes)
        unless it was folded into the next projection (``weight`` None)."""
        normed = x * self._inv_rms(x)
        return normed if weight is None else normed.mul_(weight)

    def _inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        """``1 / sqrt(mean(x ** 2) + eps)`` over the last axis, keepdim, in the dtype of ``x``.

        Computed in float32 and rounded once, as Hugging Face's RMSNorm does. (Rounding the
        norm to bfloat16 first saves one small op but measurably costs: greedy agreement with
        float32 fell from 98.4% to 96.9% on the benchmark's prompts.)"""
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        inv = torch.rsqrt(torch.addcmul(self._rms_eps, norm, norm, value=1.0 / x.shape[-1]))
        return inv if inv.dtype == x.dtype else inv.to(x.dtype)


def _rope_rows(
    cos: torch.Tensor, sin: torch.Tensor, plan: ForwardPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rope tables' rows of the step's tokens, ``[N, 1, head_dim]`` each."""
    return cos[plan.positions][:, None, :], sin[plan.positions][:, None, :]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The gated MLP's activation of each kind (transformers' ACT2FN "silu", "gelu_pytorch_tanh")
ACTIVATIONS = {Activation.SILU: F.silu, Activation.GELU_TANH: _gelu_tanh}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face rotary embedding on ``x [N, heads, D]``.

    ``cos`` is ``[N, 1, R]`` (the angle cosines repeated for both halves) and ``sin`` is
    ``[N, 1, R]`` with the first half negated, so that with ``swapped = (x2, x1)`` the result
    ``x * cos + swapped * sin`` is ``(x1 cos - x2 sin, x2 cos + x1 sin)``: pairs are
    ``(x[i], x[i + R/2])`` (``rotate_half``; see :mod:`app.models.forward.rope`). ``R`` is
    ``D`` or, for partial rotary, the rotated leading dimensions (the others pass unchanged).
    """
    rows, heads, head_dim = x.shape
    rotary = cos.shape[-1]
    if rotary < head_dim:  # partial rotary: the rest of each head passes unchanged
        rotated = apply_rope(x[..., :rotary].contiguous(), cos, sin)
        return torch.cat((rotated, x[..., rotary:]), dim=-1)
    swapped = x.view(rows, heads, 2, head_dim // 2).flip(-2).view(rows, heads, head_dim)
    return torch.addcmul(x * cos, swapped, sin)
