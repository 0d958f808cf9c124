"""A checkpoint's tensors under the shared forward's names, in Hugging Face layout.

:class:`ModelTensors` joins a file reader (:class:`app.models.checkpoints.checkpoint.Checkpoint`)
to an
architecture: it finds each weight under the format's name (:class:`TensorNames`), checks that
every weight the forward needs is there with the shape the hyper-parameters imply, and undoes
llama.cpp's Q/K row permutation for the architectures whose GGUFs have it.

The permutation. ``convert_hf_to_gguf.py`` stores, within each head of ``attn_q`` / ``attn_k``
(and their biases), Hugging Face row ``i`` at ``2i`` and row ``i + head_dim/2`` at ``2i + 1``,
so that llama.cpp's rope, which rotates *adjacent* pairs ``(x[2i], x[2i+1])``, computes what
Hugging Face's ``rotate_half`` computes on *split halves* ``(x[i], x[i + head_dim/2])``. We undo
it and apply the split-half rope (:mod:`app.models.forward.rope`): outputs compare tensor for tensor
with transformers (which un-permutes the same way when it loads a GGUF), and rotating halves
is two contiguous slices instead of a strided even/odd gather. A permutation of rows keeps
every 32-column block whole, so 4-bit codes are un-permuted with their scales.
"""

from __future__ import annotations

import numpy as np

from app.models.architectures import Architecture, TensorNames
from app.models.checkpoints.checkpoint import Checkpoint, CheckpointFormat, TensorRows
from app.models.checkpoints.q4_codes import Q4Codes
from app.models.hparams import HParams
from app.models.refusal import UnsupportedModel

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Each expert's matrices of a mixture-of-experts layer (HParams.experts)
EXPERT_MATRICES = ("expert_gate", "expert_up", "expert_down")
# The RMSNorm weights (Architecture.hf_norm_shift applies to these)
NORMS = frozenset(
    {
        "output_norm",
        "attn_norm",
        "ffn_norm",
        "attn_q_norm",
        "attn_k_norm",
        "attn_post_norm",
        "ffn_post_norm",
    }
)


def unpermute_order(rows: int, num_heads: int) -> np.ndarray:
    """int64 ``[rows]``: ``permuted[order]`` is in Hugging Face order for rows
    ``[num_heads * head_dim]`` written by the converter's ``permute``."""
    head_dim = rows // num_heads
    return np.arange(rows).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(rows)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo ``convert_hf_to_gguf.py``'s ``permute`` of a Q or K projection (rows of a matrix,
    or elements of a bias). Returns a new array in Hugging Face order."""
    return weight[unpermute_order(weight.shape[0], num_heads)]


class ModelTensors:
    """Reads the weights of one model from its checkpoint, by the forward's part names
    (:class:`TensorNames` fields: ``"attn_q"``, ``"ffn_down"``, ...).

    Args:
        checkpoint: the opened file.
        architecture: what the file holds.
        hparams: the file's hyper-parameters (shapes are checked against them).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        architecture: Architecture,
        hparams: HParams,
    ) -> None:
        self.checkpoint = checkpoint
        self.hparams = hparams
        gguf = checkpoint.format is CheckpointFormat.GGUF
        self.names: TensorNames = architecture.gguf_names if gguf else architecture.hf_names
        self._architecture = architecture
        self._permuted = gguf and architecture.gguf_permutes_qk
        self._norm_shift = 0.0 if gguf else architecture.hf_norm_shift

    # ------------------------------------------------------------------ checks

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """File name -> shape of every tensor the forward needs (optional biases excluded)."""
        hp = self.hparams
        hidden, ffn = hp.embedding_length, hp.feed_forward_length
        shapes = {
            self.names.of("token_embedding"): (hp.vocab_size, hidden),
            self.names.of("output_norm"): (hidden,),
        }
        if not hp.tied_embeddings:
            shapes[self.names.of("output")] = (hp.vocab_size, hidden)
        for i in range(hp.block_count):
            layer = {
                "attn_norm": (hidden,),
                "attn_q": (hp.q_width, hidden),
                "attn_k": (hp.kv_width, hidden),
                "attn_v": (hp.kv_width, hidden),
                "attn_output": (hidden, hp.q_width),
                "ffn_norm": (hidden,),
                "ffn_gate": (ffn, hidden),
                "ffn_up": (ffn, hidden),
                "ffn_down": (hidden, ffn),
            }
            if hp.qk_norm:
                layer |= {"attn_q_norm": (hp.head_dim,), "attn_k_norm": (hp.head_dim,)}
            if hp.post_norms:
                layer |= {"attn_post_norm": (hidden,), "ffn_post_norm": (hidden,)}
            if self._architecture.fused_qkv:
                del layer["attn_q"], layer["attn_k"], layer["attn_v"]
                layer["attn_qkv"] = (hp.q_width + 2 * hp.kv_width, hidden)
            if self._architecture.fused_gate_up:
                del layer["ffn_gate"], layer["ffn_up"]
                layer["ffn_gate_up"] = (2 * ffn, hidden)
            if hp.experts is not None:
                del layer["ffn_gate"], layer["ffn_up"], layer["ffn_down"]
                layer["ffn_router"] = (hp.experts.count, hidden)
                shapes |= self._expert_shapes(i)
            shapes |= {self.names.of(part, i): shape for part, shape in layer.items()}
            if self._architecture.qkv_bias:
                for part, width in (("attn_q", hp.q_width), ("attn_k", hp.kv_width)):
                    shapes[self.names.bias_of(part, i)] = (width,)
                shapes[self.names.bias_of("attn_v", i)] = (hp.kv_width,)
        return shapes

    def _expert_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The expert matrices of a layer: each expert's, or the stacks of a GGUF."""
        hp = self.hparams
        assert hp.experts is not None
        hidden, ffn, count = hp.embedding_length, hp.experts.feed_forward_length, hp.experts.count
        matrix = {"expert_gate": (ffn, hidden), "expert_up": (ffn, hidden)}
        matrix["expert_down"] = (hidden, ffn)
        if self.names.stacks_experts():
            return {self.names.of(p, layer): (count, *shape) for p, shape in matrix.items()}
        return {
            self.names.of(p, layer, e): shape for p, shape in matrix.items() for e in range(count)
        }

    def check(self) -> None:
        """Raises UnsupportedModel naming the first weight that is missing or misshapen."""
        for name, shape in self.expected_shapes().items():
            if not self.checkpoint.has_tensor(name):
                raise UnsupportedModel(f"tensor {name} is missing")
            found = self.checkpoint.tensor_shape(name)
            if found != shape:
                raise UnsupportedModel(
                    f"tensor {name} has shape {list(found)}, expected {list(shape)}"
                )

    # ------------------------------------------------------------------ reading

    def name(self, part: str, layer: int | None = None) -> str:
        """The file's tensor holding ``part`` (the fused matrix of a part stored in one)."""
        fused = self._fused_rows(part)
        return self.names.of(part if fused is None else fused[0], layer)

    def tensor_type(self, part: str, layer: int | None = None) -> str:
        return self.checkpoint.tensor_type(self.name(part, layer))

    def read_expert(self, part: str, layer: int, expert: int) -> np.ndarray:
        """float32 ``[out, in]`` of one expert's matrix (``part`` in :data:`EXPERT_MATRICES`;
        a GGUF's stack is read whole and the expert's matrix taken)."""
        name = self.names.of(part, layer, expert)
        array = self.checkpoint.read_tensor(name)
        return array[expert] if self.names.stacks_experts() else array

    def expert_blocks(self, part: str, layer: int, expert: int) -> np.ndarray | None:
        """One expert's rows of a stack's blocks (:meth:`raw_blocks`), or None for a checkpoint
        without quantised blocks."""
        blocks = self.checkpoint.raw_blocks(self.names.of(part, layer, expert))
        experts = self.hparams.experts
        if blocks is None or experts is None or not self.names.stacks_experts():
            return blocks
        rows = blocks.shape[0] // experts.count
        return blocks[expert * rows : (expert + 1) * rows]

    def expert_type(self, part: str, layer: int) -> str:
        return self.checkpoint.tensor_type(self.names.of(part, layer, 0))

    def read(self, part: str, layer: int | None = None) -> np.ndarray:
        """float32 weight of ``part`` in Hugging Face layout (a writable copy). A norm's weight
        is the multiplier the forward applies: a Gemma HF checkpoint's ``w`` comes back as
        ``1 + w``, as llama.cpp's converter stores it (``Architecture.hf_norm_shift``)."""
        array = self.checkpoint.read_tensor(self.name(part, layer))
        if part in NORMS and self._norm_shift:
            array = array + np.float32(self._norm_shift)  # never in place: see read_tensor
        order = self._row_order(part)
        return array if order is None else array[order]

    def read_bias(self, part: str, layer: int) -> np.ndarray | None:
        """float32 bias of the projection ``part``, or None when the checkpoint has none."""
        fused = self._fused_rows(part)
        name = self.names.bias_of(part if fused is None else fused[0], layer)
        if not self.checkpoint.has_tensor(name):
            return None
        array = self.checkpoint.read_tensor(name).reshape(-1)
        order = self._row_order(part)
        return array if order is None else array[order]

    def q4_codes(self, part: str, layer: int) -> Q4Codes | None:
        """The 4-bit codes of ``part`` when the file stores it as Q4_0/Q4_1, else None."""
        codes = self.checkpoint.q4_codes(self.name(part, layer))
        if codes is None:
            return None
        order = self._row_order(part)
        return codes if order is None else codes.rows_permuted(order)

    def raw_blocks(self, part: str, layer: int | None = None) -> np.ndarray | None:
        """The blocks of ``part`` as the file stores them, uint8 ``[rows, bytes per row]``, rows
        in Hugging Face order (a copy when llama.cpp's Q/K permutation is undone, else a view
        of the file), or None for a checkpoint without quantised blocks."""
        blocks = self.checkpoint.raw_blocks(self.name(part, layer))
        if blocks is None:
            return None
        order = self._row_order(part)
        return blocks if order is None else blocks[order]

    def rows(self, part: str) -> TensorRows:
        """Memory-mapped rows of the embedding or output matrix (never permuted)."""
        return self.checkpoint.tensor_rows(self.name(part))

    def projection_types(self) -> dict[str, str]:
        """File name -> type of every layer matrix (the input of ``--quantization auto``)."""
        return {
            self.name(part, i): self.tensor_type(part, i)
            for i in range(self.hparams.block_count)
            for part in self.layer_matrices()
        }

    def layer_matrices(self) -> tuple[str, ...]:
        """The parts of a layer's matrices: :data:`LAYER_MATRICES`, or with a mixture of
        experts the attention's and :data:`EXPERT_MATRICES` (a stack or expert 0 of each)."""
        if self.hparams.experts is None:
            return LAYER_MATRICES
        return (*LAYER_MATRICES[:4], *EXPERT_MATRICES)

    def _fused_rows(self, part: str) -> tuple[str, slice] | None:
        """``(fused part, its rows)`` of a part the file stores inside a fused matrix (Q, K, V
        in ``attn_qkv``; gate, up in ``ffn_gate_up``), or None."""
        hp = self.hparams
        if self._architecture.fused_qkv and part in ("attn_q", "attn_k", "attn_v"):
            q, kv = hp.q_width, hp.kv_width
            starts = {"attn_q": (0, q), "attn_k": (q, q + kv), "attn_v": (q + kv, q + 2 * kv)}
            return "attn_qkv", slice(*starts[part])
        if self._architecture.fused_gate_up and part in ("ffn_gate", "ffn_up"):
            ffn = hp.feed_forward_length
            return "ffn_gate_up", slice(0, ffn) if part == "ffn_gate" else slice(ffn, 2 * ffn)
        return None

    def _row_order(self, part: str) -> np.ndarray | None:
        """The rows of the file's tensor that make ``part`` in Hugging Face order, or None for
        all of them as stored: a fused matrix's share, or llama.cpp's Q/K permutation undone."""
        fused = self._fused_rows(part)
        if fused is not None:
            return np.arange(fused[1].start, fused[1].stop)
        if not self._permuted:
            return None
        if part == "attn_q":
            return unpermute_order(self.hparams.q_width, self.hparams.head_count)
        if part == "attn_k":
            return unpermute_order(self.hparams.kv_width, self.hparams.head_count_kv)
        return None
