"""The model-agnostic runner: batch slots, the KV cache, step planning and the sampling
hand-off, over the one shared forward (:class:`app.models.decoder.DecoderModel`).

Ownership (rule R02): the runner owns the per-slot bookkeeping (``_slot_lengths``: how many
positions each slot's sequence holds, to check rows against), the paged :class:`KVCache`
tensors it passes to the forward, and the :class:`Sampler` (per-slot generators). Which blocks
hold a sequence is the scheduler's block manager's: each row brings its block table
(:class:`app.models.base.KVBlocks`), and the runner only checks it and passes it on. The
scheduler only sends frozen :class:`StepBatch` messages and ``release`` calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from app.models.base import NULL_BLOCK, ModelCapabilities, StepBatch, StepOutput, StepRow
from app.models.base import Tokenizer as BaseTokenizer
from app.models.decoder import DecoderModel
from app.models.forward_plan import ForwardPlan, RowSpec
from app.models.kv_cache import (
    DEFAULT_POOL_SEQUENCES,
    KV_BLOCK_SIZE,
    KVCache,
    blocks_for,
)
from app.models.sampler import Sampler, SampleRequest
from app.models.weights import Quantization

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512


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
            (:meth:`app.models.kv_cache.KVCache.slot_blocks`).

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
        self._sampler = Sampler(max_num_seqs)
        self._slot_lengths = [0] * max_num_seqs
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
                self._sampler.start_sequence(row.slot, row.sampling.seed)
                if row.kv_blocks is not None and not row.sampling.is_greedy:
                    # Recomputed after a preemption: its generated tokens took one draw each.
                    self._sampler.skip_draws(row.slot, row.kv_blocks.num_generated)
        plan = ForwardPlan.build(
            [
                RowSpec(
                    r.slot,
                    r.token_ids,
                    r.position,
                    r.sample,
                    r.sampling.batch_invariant,
                    r.kv_blocks.block_ids if r.kv_blocks is not None else None,
                )
                for r in rows
            ],
            cache=self.cache,
        )
        with torch.inference_mode():
            logits = self.model.forward(plan, self.cache)
            sampled = self._sampler.sample(
                logits, [SampleRequest(r.slot, r.sampling) for r in rows if r.sample]
            )
        for row in rows:
            self._slot_lengths[row.slot] = row.position + len(row.token_ids)
        tokens = iter(sampled)
        return StepOutput(tuple(next(tokens) if row.sample else None for row in rows))

    def release(self, slot: int) -> None:
        """Forget the slot's sequence. Its blocks are the block manager's to free; their
        content is not cleared (it is read again only as a cached prefix, or masked)."""
        self._check_slot(slot)
        self._slot_lengths[slot] = 0

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
