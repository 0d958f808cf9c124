"""The model-agnostic runner: batch slots, the KV cache, step planning and the sampling
hand-off, over the one shared forward (:class:`app.models.forward.decoder.DecoderModel`).

Ownership (rule R02): the runner owns the per-slot bookkeeping (``_slot_lengths``: how many
positions each slot's sequence holds, to check rows against), the paged :class:`KVCache`
tensors it passes to the forward, and the :class:`Sampler` (per-slot generators). Which blocks
hold a sequence is the scheduler's block manager's: each row brings its block table
(:class:`app.models.base.KVBlocks`), and the runner only checks it and passes it on. The
scheduler only sends frozen :class:`StepBatch` messages and ``release`` calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from app.models.base import (
    NULL_BLOCK,
    ModelCapabilities,
    RowOutput,
    StepBatch,
    StepOutput,
    StepRow,
    TokenLogprobs,
)
from app.models.base import Tokenizer as BaseTokenizer
from app.models.forward.decoder import DecoderModel
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.fused_step import greedy_argmax
from app.models.forward.kv_cache import (
    DEFAULT_POOL_SEQUENCES,
    KV_BLOCK_SIZE,
    KVCache,
    blocks_for,
)
from app.models.sampling.fused_draw import vocabulary_draw_on
from app.models.sampling.logprobs import token_logprobs
from app.models.sampling.sampler import Sampler
from app.models.sampling.verification import argmax_suffices, sample_rows
from app.models.weights.ggml import logits_in_thread_buffer
from app.models.weights.record import Quantization

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512
# Prompt positions per LM-head call when scoring a prompt (prompt logprobs): 64 x a 49k
# vocabulary is 12.6 MB of float32 logits at a time, whatever the chunk's length.
PROMPT_LOGPROBS_BLOCK = 64


# The block the warm-up step writes its keys and values into (every position of every row maps
# to it): one block of the pool, touched before serving; its content is never read again before
# a sequence the block manager gives it to has written it.
WARM_UP_BLOCK = NULL_BLOCK + 1
# Positions the warm-up's rows attend to (or max_model_len if shorter). The attention's buffers
# stop growing well before: decode rows are gathered DECODE_KEY_BUDGET positions at a time
# (full from 261 positions with 63 rows) and a chunk's keys are 0.4 MiB a layer at 1,024;
# only its time grows (SmolLM2, 64 slots, 512 tokens, 2-core AVX2: 2.9 s at 512 positions,
# 3.7 s at 1,024, 5.2 s at 2,048).
WARM_UP_CONTEXT = 1024


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What :meth:`ModelRunner.warm_up` ran.

    Attributes:
        decode_rows: one-token rows at the end of the context.
        chunk_tokens: tokens of the prompt chunk beside them (0: none).
        context: positions each row attends to (the longest a sequence holds).
        seconds: wall time of the two steps.
    """

    decode_rows: int
    chunk_tokens: int
    context: int
    seconds: float


class Tokenizer(BaseTokenizer, Protocol):
    """A model tokenizer that also says which token ids end generation."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...


class ModelRunner:
    """Steps a :class:`DecoderModel` over batch slots, keeping each slot's KV cache between
    steps: the :class:`app.models.base.Model` the scheduler drives, for every architecture.

    Args:
        num_kv_blocks: blocks of ``KV_BLOCK_SIZE`` positions in the paged KV pool, the null
            block included; None: ``max(max_num_seqs, DEFAULT_POOL_SEQUENCES)`` sequences of
            ``max_model_len``. A row without a block table (a caller stepping the runner
            without a block manager) uses its slot's fixed blocks
            (:meth:`app.models.forward.kv_cache.KVCache.slot_blocks`).

    Attributes:
        capabilities: what the scheduler may rely on (read once at start-up).
        tokenizer: the model's tokenizer.
    """

    def __init__(
        self,
        *,
        name: str,
        model: DecoderModel,
        tokenizer: Tokenizer,
        max_num_seqs: int,
        max_model_len: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        num_kv_blocks: int | None = None,
        weight_kernels: str = "",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        if num_kv_blocks is None:
            sequences = max(max_num_seqs, DEFAULT_POOL_SEQUENCES)
            num_kv_blocks = 1 + sequences * blocks_for(max_model_len)
        self.cache = KVCache(
            model.hparams,
            num_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            dtype=model.dtype,
            device=model.device,
        )
        self._sampler = Sampler(
            max_num_seqs,
            vocab_size=model.hparams.vocab_size,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            argmax=greedy_argmax(model.fused_decode),
            draw=vocabulary_draw_on(model.device),
        )
        self._slot_lengths = [0] * max_num_seqs
        # the last hidden state of a prompt chunk, which scores the next chunk's first token
        self._last_prompt_hidden: list[torch.Tensor | None] = [None] * max_num_seqs
        dtype_name = str(model.dtype).removeprefix("torch.")
        if model.quantization is not Quantization.NONE:
            dtype_name += f"-{model.quantization.value}"
        self.capabilities = ModelCapabilities(
            name=name,
            backend=f"torch-{model.device.type}-{dtype_name}",
            context_length=min(model.hparams.context_length, max_model_len),
            max_num_seqs=max_num_seqs,
            vocab_size=model.hparams.vocab_size,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            keeps_kv_cache=True,
            max_tokens_per_row=min(prefill_chunk, max_model_len),
            kv_block_size=KV_BLOCK_SIZE,
            num_kv_blocks=num_kv_blocks,
            weight_kernels=weight_kernels,
            verifies_drafts=True,
        )

    def step(self, batch: StepBatch) -> StepOutput:
        """Append every row's tokens to its slot and sample for rows with ``sample=True``.

        Inert rows (``StepRow.padding``) leave their slot alone and get None.

        Raises:
            ValueError: a row is invalid (slot out of range or repeated, no tokens, too many
                tokens, no block table or one that names a block outside the pool or does not
                cover the row, a position that neither continues the slot's sequence nor
                starts one after whole cached blocks, past ``max_model_len``, or a token id
                outside the vocabulary). Nothing changes.
        """
        if batch.has_inert_rows:
            return batch.expand(self.step(batch.compacted()))
        rows = batch.rows
        self._validate(rows)
        for row in rows:
            if row.starts_sequence:
                self._sampler.start_sequence(row.slot, row.sampling.seed, row.sampling)
                if row.kv_blocks is not None:
                    # a cached prefix is prompt the penalties must see; a sequence recomputed
                    # after a preemption had generated tokens: one draw each when sampled
                    self._sampler.feed(row.slot, row.kv_blocks.prefix_token_ids)
                    generated = row.kv_blocks.generated_token_ids
                    self._sampler.resume(
                        row.slot, generated, draws=0 if row.sampling.is_greedy else len(generated)
                    )
            self._sampler.feed(row.slot, row.token_ids)
        plan = ForwardPlan.build(
            [
                RowSpec(
                    r.slot,
                    r.token_ids,
                    r.position,
                    r.sample,
                    r.sampling.batch_invariant,
                    r.kv_blocks.block_ids if r.kv_blocks is not None else None,
                    num_logits=r.num_draft_tokens + 1,
                )
                for r in rows
            ],
            cache=self.cache,
        )
        scored = [r for r in rows if self._wants_prompt_logprobs(r)]
        hidden: list[torch.Tensor] | None = [] if scored else None
        argmax = not scored and argmax_suffices(self._sampler, rows)  # tokens, not logits
        with torch.inference_mode(), logits_in_thread_buffer():
            logits = self.model.forward(plan, self.cache, hidden_out=hidden, argmax=argmax)
            # sampled at once: a GGUF head's logits are the thread's buffer (GGMLLinear.logits)
            samples = sample_rows(self._sampler, logits, rows)
            del logits
            prompt_logprobs = self._prompt_logprobs(scored, plan, hidden[0]) if hidden else {}
        for row, sample in zip(rows, samples, strict=True):
            # a speculative row keeps its accepted positions; the rest is rolled back
            rejected = row.num_draft_tokens - (sample.num_accepted if sample else 0)
            self._slot_lengths[row.slot] = row.position + len(row.token_ids) - rejected
        return StepOutput(
            tuple(
                RowOutput(prompt_logprobs=prompt_logprobs.get(row.slot))
                if sample is None
                else RowOutput(
                    sample.token,
                    logprobs=sample.logprobs,
                    prompt_logprobs=prompt_logprobs.get(row.slot),
                    num_accepted=sample.num_accepted,
                    draft_logprobs=sample.draft_logprobs,
                )
                for row, sample in zip(rows, samples, strict=True)
            )
        )

    def warm_up(self, max_num_batched_tokens: int) -> WarmUp:
        """Run the largest step the scheduler can send once, before serving: every slot but
        one decoding at the end of the context beside one prompt chunk filling the rest of
        ``max_num_batched_tokens`` (the chunk's eager path, through the leading layers that
        cover every kind of layer: one for a Llama, six for Gemma 3's five local and one global),
        then the decode rows alone through every layer at a one-block context (the fused
        kernels' path where they apply). The 1B Llama-shaped Q4_K file's warm-up took 7.6 s
        through every layer at full context, 0.6 s so. The steps' buffers, the heap they come from,
        and oneDNN's primitives for their shapes (until its bounded caches, see
        ``app/__init__.py``, evict them) are paid for here, not by the first requests,
        and the resident memory of an idle server then holds the working set of its largest
        step: what serving adds to it is the KV cache's blocks. llama.cpp's server warms up
        with an empty run and vLLM profiles a step of ``max_num_batched_tokens`` before it
        sizes its cache; this one is the shape itself.

        Every position of every row is written to and read from ``WARM_UP_BLOCK`` (no other
        block of the pool is touched) and no slot's state changes: nothing of it is visible
        to the requests that follow (tested). Call it before the first :meth:`step`.

        Raises:
            ValueError: ``max_num_batched_tokens`` below one.
        """
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        started = time.perf_counter()
        slots = self.capabilities.max_num_seqs
        decode_rows = min(slots - 1, max_num_batched_tokens - 1)
        chunk = min(max_num_batched_tokens - decode_rows, self.capabilities.max_tokens_per_row)
        if decode_rows == 0 and chunk < 2:
            decode_rows, chunk = 1, 0  # one slot and a budget of one token: a decode step
        context = min(self.max_model_len, WARM_UP_CONTEXT)
        table = [WARM_UP_BLOCK] * blocks_for(context)
        token = min(self.tokenizer.eos_token_ids, default=0)
        decode = [
            RowSpec(slot, [token], context - 1, True, False, table) for slot in range(decode_rows)
        ]
        chunk_rows = []
        if chunk:
            start = (context - chunk) // KV_BLOCK_SIZE * KV_BLOCK_SIZE
            chunk_rows = [RowSpec(decode_rows, [token] * chunk, start, True, False, table)]
        # The decode rows again, through every layer, at the first block's end: the fused
        # path's buffers scale with rows, not with positions, and this step faults in every
        # weight page of a mapped file.
        short = [
            RowSpec(slot, [token], KV_BLOCK_SIZE - 1, True, False, [WARM_UP_BLOCK])
            for slot in range(max(decode_rows, 1))
        ]
        with torch.inference_mode():
            for rows, num_layers in ((decode + chunk_rows, self._warm_up_layers()), (short, None)):
                logits = self.model.forward(
                    ForwardPlan.build(rows, cache=self.cache), self.cache, num_layers=num_layers
                )
                logits.float().argmax(dim=-1)  # the greedy sampler's conversion
        return WarmUp(decode_rows, chunk, context, time.perf_counter() - started)

    def _warm_up_layers(self) -> int:
        """How many leading layers the warm-up's mixed step runs on the eager path: up to the
        first layer of each kind (local or global attention, experts or one MLP), since
        layers of one kind share every shape."""
        hp, layers = self.model.hparams, self.model.weights.layers
        local = hp.local_attention
        kinds = [
            (local is not None and local.layers[index], layer.experts is not None)
            for index, layer in enumerate(layers)
        ]
        return max(kinds.index(kind) for kind in set(kinds)) + 1

    def _wants_prompt_logprobs(self, row: StepRow) -> bool:
        """A prompt chunk (nothing generated yet in its slot) of a request that asked."""
        return row.sampling.prompt_logprobs is not None and self._sampler.generated(row.slot) == 0

    def _prompt_logprobs(
        self, rows: Sequence[StepRow], plan: ForwardPlan, hidden: torch.Tensor
    ) -> dict[int, tuple[TokenLogprobs | None, ...]]:
        """Each prompt chunk's token logprobs: position ``j`` is scored from the hidden state
        of position ``j - 1`` (the previous chunk's last one, kept per slot, for ``j`` = 0),
        through the LM head ``PROMPT_LOGPROBS_BLOCK`` positions at a time, so no
        ``[chunk, vocab]`` tensor is held (a prompt's first token has none)."""
        results: dict[int, tuple[TokenLogprobs | None, ...]] = {}
        assert plan.row_starts is not None
        for row in rows:
            start = plan.row_starts[row.slot]
            states = hidden[start : start + len(row.token_ids)]
            previous = self._last_prompt_hidden[row.slot] if row.position > 0 else None
            entries: list[TokenLogprobs | None] = []
            if previous is None:
                entries.append(None)
                inputs, targets = states[:-1], list(row.token_ids[1:])
            else:
                inputs = torch.cat([previous[None], states[:-1]])
                targets = list(row.token_ids)
            top, exact = row.sampling.prompt_logprobs or 0, row.sampling.batch_invariant
            for begin in range(0, len(targets), PROMPT_LOGPROBS_BLOCK):
                block = slice(begin, begin + PROMPT_LOGPROBS_BLOCK)
                entries.extend(
                    token_logprobs(
                        self.model.output_logits(inputs[block], exact=exact),
                        targets[block],
                        [top] * len(targets[block]),
                    )
                )
            self._last_prompt_hidden[row.slot] = None if row.sample else states[-1].clone()
            results[row.slot] = tuple(entries)
        return results

    def release(self, slot: int) -> None:
        """Forget the slot's sequence. Its blocks are the block manager's to free; their
        content is not cleared (it is read again only as a cached prefix, or masked)."""
        self._check_slot(slot)
        self._slot_lengths[slot] = 0
        self._sampler.release(slot)
        self._last_prompt_hidden[slot] = None

    def slot_length(self, slot: int) -> int:
        """Positions currently held for ``slot`` (read-only view for tests and metrics)."""
        return self._slot_lengths[slot]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.capabilities.max_num_seqs:
            raise ValueError(f"slot {slot} outside [0, {self.capabilities.max_num_seqs})")

    def _validate(self, rows: Sequence[StepRow]) -> None:
        if not rows:
            raise ValueError("a step needs at least one row")
        seen: set[int] = set()
        vocab = self.capabilities.vocab_size
        for row in rows:
            self._check_slot(row.slot)
            if row.slot in seen:
                raise ValueError(f"slot {row.slot} appears twice in one step")
            seen.add(row.slot)
            count = len(row.token_ids)
            most = self.capabilities.max_tokens_per_row
            if not 1 <= count <= most:
                raise ValueError(f"slot {row.slot}: {count} tokens, expected 1..{most}")
            if not 0 <= row.num_draft_tokens < count:
                raise ValueError(f"slot {row.slot}: {row.num_draft_tokens} drafted of {count}")
            self._check_blocks(row)
            if row.starts_sequence:
                if row.position % KV_BLOCK_SIZE:
                    raise ValueError(
                        f"slot {row.slot}: a sequence starts at position {row.position}, not "
                        f"after whole blocks of {KV_BLOCK_SIZE}"
                    )
            elif row.position != self._slot_lengths[row.slot]:
                raise ValueError(
                    f"slot {row.slot}: position {row.position}, expected "
                    f"{self._slot_lengths[row.slot]} (or a row that starts a sequence)"
                )
            if row.position + count > self.max_model_len:
                raise ValueError(
                    f"slot {row.slot}: positions up to {row.position + count} exceed "
                    f"max_model_len {self.max_model_len}"
                )
            if not all(0 <= t < vocab for t in row.token_ids):
                raise ValueError(f"slot {row.slot}: token id outside [0, {vocab})")

    def _check_blocks(self, row: StepRow) -> None:
        table: Sequence[int]
        if row.kv_blocks is None:
            table = self.cache.slot_blocks(row.slot)  # ValueError when the pool lacks them
        else:
            table = row.kv_blocks.block_ids
        if len(table) < blocks_for(row.position + len(row.token_ids)):
            raise ValueError(f"slot {row.slot}: block table does not cover the row")
        pool = self.cache.num_blocks
        if any(not NULL_BLOCK < block < pool for block in table):
            raise ValueError(f"slot {row.slot}: block table names a block outside [1, {pool})")
