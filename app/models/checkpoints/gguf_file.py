"""Reading a GGUF file: its metadata under the architecture's own keys, its tensors, their blocks.

GGUF (llama.cpp's format) names its hyper-parameters ``{arch}.*`` after ``general.architecture``
(``llama.block_count``, ``qwen2.block_count``, ...); :meth:`GGUFFile.hparams` reads them for any
architecture of :mod:`app.models.architectures`.

Tensors are dequantised with the ``gguf`` package (``gguf.quants.dequantize``) to float32 numpy
arrays. GGUF stores a 2-D tensor with ``shape == [ne0, ne1] == [in_features, out_features]``;
the numpy array the reader gives is ``[out_features, in_features]``, the layout of a
``torch.nn.Linear.weight``, so no transpose is needed. Rows are returned as stored: undoing the
converter's Q/K permutation is the architecture's business
(:mod:`app.models.checkpoints.model_tensors`).

Raw blocks are read for two fast paths: :meth:`GGUFFile.q4_codes` gives Q4_0/Q4_1 matrices as
codes + scales for the int4 kernel (:mod:`app.models.weights.int4`), and
:meth:`GGUFFile.tensor_rows`
maps any matrix's rows for token lookups without a copy in memory.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from app.models.architectures import Architecture, for_gguf
from app.models.checkpoints.checkpoint import CheckpointFormat
from app.models.checkpoints.gguf_reader import parsed_reader
from app.models.checkpoints.local_layers import gguf_attention_scale, gguf_local_attention
from app.models.checkpoints.q4_codes import Q4_BLOCK, Q4Codes
from app.models.hparams import Experts, HParams, RopeScaling, RopeScalingKind
from app.models.refusal import UnsupportedModel, whole_number

logger = logging.getLogger(__name__)

GGMLType = gguf.GGMLQuantizationType

# What gguf.quants.dequantize decodes and this server is tested with (issue 8's list).
SUPPORTED_TENSOR_TYPES = frozenset(
    GGMLType[name]
    for name in (
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)  # fmt: skip

ROPE_FREQS_TENSOR = "rope_freqs.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"  # Phi-3's longrope factors
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


class GGUFFile:
    """A GGUF file opened read-only (memory-mapped by ``gguf.GGUFReader``; the parse is shared
    by every ``GGUFFile`` of the same unchanged file in this process, see
    :func:`parsed_reader`).

    Raises (constructor): UnsupportedModel when the file is not a GGUF (bad magic, truncated).
    """

    format = CheckpointFormat.GGUF

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            stat = path.stat()
            self._reader = parsed_reader(path.resolve(), stat.st_size, stat.st_mtime_ns)
        except (ValueError, OSError, IndexError) as error:  # bad magic, truncated file
            with path.open("rb") as stream:
                magic = stream.read(4)
            if magic == b"GGUF":  # a GGUF that ends early or is damaged: say so
                raise UnsupportedModel(
                    f"a truncated or damaged GGUF file ({path.stat().st_size} bytes; {error})"
                ) from None
            raise UnsupportedModel(f"not a GGUF file ({error})") from None
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}

    # ------------------------------------------------------------------ metadata

    def field(self, key: str) -> Any:
        """Value of a metadata key (str, number, or list of them). Raises KeyError if absent."""
        return self._reader.fields[key].contents()

    def fields_with_prefix(self, prefix: str) -> list[tuple[str, Any]]:
        """``(key, field)`` of every metadata key starting with ``prefix``, in file order
        (``gguf.ReaderField``: ``contents()`` and ``types``), e.g. to copy a tokenizer."""
        return [(k, f) for k, f in self._reader.fields.items() if k.startswith(prefix)]

    def field_or(self, key: str, default: Any) -> Any:
        """Value of a metadata key, or ``default`` when the file does not have it."""
        return self.field(key) if key in self._reader.fields else default

    @property
    def architecture_name(self) -> str:
        """``general.architecture``. Raises UnsupportedModel when the key is missing."""
        try:
            return str(self.field("general.architecture"))
        except KeyError:
            raise UnsupportedModel("no general.architecture key (not a model GGUF)") from None

    @property
    def default_name(self) -> str:
        """``general.name``, else the file name without ``.gguf``."""
        return str(self.field_or("general.name", "") or self.path.stem)

    def architecture(self) -> Architecture:
        return for_gguf(self.architecture_name)

    def hparams(self, architecture: Architecture) -> HParams:
        """The hyper-parameters under the file's ``{arch}.*`` keys.

        Raises:
            UnsupportedModel: a required key is missing, per-layer head counts, partial rotary,
                different key and value head sizes, an unsupported rope scaling, or sizes that
                do not agree with the tensors.
        """
        arch = self.architecture_name

        def number(key: str, default: Any = None) -> Any:
            value = self.field_or(f"{arch}.{key}", default)
            if value is None:
                raise UnsupportedModel(f"missing metadata key {arch}.{key}")
            if isinstance(value, list):
                raise UnsupportedModel(f"{arch}.{key} varies per layer: not supported")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise UnsupportedModel(f"{arch}.{key} is {value!r}, not a number")
            return value

        def whole(key: str, default: Any = None) -> int:
            return whole_number(f"{arch}.{key}", number(key, default))

        embedding_length = whole("embedding_length")
        head_count = whole("attention.head_count")
        head_dim = whole("attention.key_length", embedding_length // max(head_count, 1))
        value_length = whole("attention.value_length", head_dim)
        if value_length != head_dim:
            raise UnsupportedModel(f"key heads of {head_dim} and value heads of {value_length}")
        rope_dims = whole("rope.dimension_count", head_dim)
        if rope_dims != head_dim and not architecture.partial_rotary:
            raise UnsupportedModel(f"partial rotary ({rope_dims} of {head_dim}) not supported")
        if not self.has_tensor("token_embd.weight"):
            raise UnsupportedModel("no token_embd.weight tensor")
        vocab_size = self.tensor_shape("token_embd.weight")[0]
        block_count = whole("block_count")
        return HParams(
            architecture=architecture.name,
            block_count=block_count,
            embedding_length=embedding_length,
            feed_forward_length=whole("feed_forward_length"),
            head_count=head_count,
            head_count_kv=whole("attention.head_count_kv", head_count),
            head_dim=head_dim,
            rope_freq_base=float(number("rope.freq_base", 10000.0)),
            rms_norm_eps=float(number("attention.layer_norm_rms_epsilon")),
            context_length=whole("context_length"),
            vocab_size=vocab_size,
            tied_embeddings=not self.has_tensor("output.weight"),
            rope_scaling=self._rope_scaling(arch),
            qkv_bias=architecture.qkv_bias or self.has_tensor("blk.0.attn_q.bias"),
            qk_norm=architecture.qk_norm,
            local_attention=gguf_local_attention(self.field_or, arch, architecture, block_count),
            ffn_activation=architecture.ffn_activation,
            post_norms=architecture.post_norms,
            embedding_scale=(
                math.sqrt(embedding_length) if architecture.scaled_embedding else None
            ),
            embedding_scale_rounded=False,  # llama.cpp's float32 product
            attention_scale=gguf_attention_scale(
                architecture,
                block_count=block_count,
                hidden=embedding_length,
                heads=head_count,
                head_dim=head_dim,
            ),
            rope_dims=None if rope_dims == head_dim else rope_dims,
            experts=self._experts(arch),
        )

    def _experts(self, arch: str) -> Experts | None:
        """``{arch}.expert_count`` and its companions (llama.cpp's names), or None."""
        count = int(self.field_or(f"{arch}.expert_count", 0) or 0)
        if not count:
            return None
        used = self.field_or(f"{arch}.expert_used_count", None)
        if used is None:
            raise UnsupportedModel(f"missing metadata key {arch}.expert_used_count")
        length = self.field_or(f"{arch}.expert_feed_forward_length", None)
        length = length or self.field_or(f"{arch}.feed_forward_length", 0)
        return Experts(
            count=count,
            used=int(used),
            feed_forward_length=int(length),
            normalize=bool(self.field_or(f"{arch}.expert_weights_norm", True)),
        )

    def _rope_scaling(self, arch: str) -> RopeScaling | None:
        if self.has_tensor(ROPE_FACTORS_LONG) and self.has_tensor(ROPE_FACTORS_SHORT):
            return self._longrope(arch)
        kind = str(self.field_or(f"{arch}.rope.scaling.type", "none"))
        factor = float(self.field_or(f"{arch}.rope.scaling.factor", 1.0))
        if self.has_tensor(ROPE_FREQS_TENSOR):  # Llama 3.1's scaling, as the converter writes it
            if kind not in ("none", "linear") or (kind == "linear" and factor != 1.0):
                raise UnsupportedModel(f"rope_freqs.weight together with rope scaling {kind!r}")
            factors = self.read_tensor(ROPE_FREQS_TENSOR).reshape(-1)
            return RopeScaling(
                RopeScalingKind.FREQ_FACTORS, freq_factors=tuple(float(f) for f in factors)
            )
        if kind == "none" or (kind == "linear" and factor == 1.0):
            return None
        if kind == "linear":
            return RopeScaling(RopeScalingKind.LINEAR, factor=factor)
        raise UnsupportedModel(
            f"rope scaling {kind!r} is not supported (supported: linear, llama3)"
        )

    def _longrope(self, arch: str) -> RopeScaling:
        """Phi-3's scaling as llama.cpp's converter writes it: the factors as tensors, the
        original context and the attention factor as keys."""
        original = self.field_or(f"{arch}.rope.scaling.original_context_length", None)
        if original is None:
            raise UnsupportedModel(
                f"longrope factors without {arch}.rope.scaling.original_context_length"
            )
        return RopeScaling(
            RopeScalingKind.LONGROPE,
            original_context_length=int(original),
            short_factors=tuple(float(f) for f in self.read_tensor(ROPE_FACTORS_SHORT).ravel()),
            long_factors=tuple(float(f) for f in self.read_tensor(ROPE_FACTORS_LONG).ravel()),
            attention_factor=float(self.field_or(f"{arch}.rope.scaling.attn_factor", 1.0)),
        )

    # ------------------------------------------------------------------ tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """numpy order: ``(out, in)`` for a matrix."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def unsupported_tensor(self) -> tuple[str, str] | None:
        for tensor in self._reader.tensors:
            if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
                return tensor.name, tensor.tensor_type.name
        return None

    def read_tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32 (a writable copy), in numpy order."""
        tensor = self._tensors[name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if array.dtype != np.float32 or not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")  # F32 tensors are a memmap view
        return array.reshape(self.tensor_shape(name))

    def tensor(self, name: str) -> np.ndarray:
        """:meth:`read_tensor` (the name the tokenizer code uses)."""
        return self.read_tensor(name)

    def tensor_rows(self, name: str) -> GGUFRows:
        """The raw rows of the matrix ``name`` through a new read-only memory map of just that
        tensor's bytes: nothing is read until indexed, and pages the reader already touched at
        load are not carried over. Row order is the file's."""
        tensor = self._tensors[name]
        rows, columns = self.tensor_shape(name)
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        raw = np.memmap(
            self.path,
            dtype=np.uint8,
            mode="r",
            offset=int(tensor.data_offset),
            shape=(rows, columns // block_size * block_bytes),
        )
        return GGUFRows(raw, tensor.tensor_type, columns)

    def raw_blocks(self, name: str) -> np.ndarray:
        """The matrix ``name``'s blocks as stored: uint8 ``[rows, bytes per row]`` (a stack of
        experts' matrices: their rows one after another), a read-only view of the file's
        mapping (nothing is copied or read until indexed)."""
        tensor = self._tensors[name]
        *leading, columns = self.tensor_shape(name)  # stacked experts: [experts, out, in]
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        flat = np.asarray(tensor.data).view(np.uint8).reshape(-1)
        return flat.reshape(math.prod(leading), columns // block_size * block_bytes)

    def release_pages(self) -> None:
        """The file's mapping let go (:func:`release_view_pages`): the pages the load read stop
        counting in this process's resident memory."""
        release_view_pages(self._reader.data)

    def q4_codes(self, name: str) -> Q4Codes | None:
        """The codes and scales of a Q4_0 or Q4_1 matrix as stored, or None for another type.

        Both types hold 32 weights per block: an fp16 scale ``d`` (Q4_1: then an fp16 minimum
        ``m``), then 16 bytes whose low nibbles are elements 0..15 of the block and high nibbles
        elements 16..31. Q4_0 is ``d * (q - 8)``, which is Q4_1's ``d * q + m`` with
        ``m = -8d`` (exact in float32), so both come back as Q4_1 codes.
        """
        tensor = self._tensors[name]
        kind = tensor.tensor_type
        if kind not in (GGMLType.Q4_0, GGMLType.Q4_1):
            return None
        out_features, in_features = self.tensor_shape(name)
        header = 2 if kind is GGMLType.Q4_0 else 4
        block_bytes = header + Q4_BLOCK // 2
        assert gguf.GGML_QUANT_SIZES[kind] == (Q4_BLOCK, block_bytes)
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out_features, -1, block_bytes)
        d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        if kind is GGMLType.Q4_1:
            m = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
        else:
            m = d * np.float32(-8.0)
        packed = raw[:, :, header:]
        codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)
        return Q4Codes(
            codes=np.ascontiguousarray(codes.reshape(out_features, in_features)),
            d=np.ascontiguousarray(d),
            m=np.ascontiguousarray(m),
        )


@dataclass(frozen=True, slots=True)
class GGUFRows:
    """Rows of one GGUF matrix on demand (:class:`app.models.checkpoints.checkpoint.TensorRows`):
    the
    memory-mapped raw blocks ``uint8 [rows, bytes per row]``, decoded by
    ``gguf.quants.dequantize`` as :meth:`GGUFFile.read_tensor` decodes the whole matrix, so the
    values are the same bit for bit."""

    raw: np.ndarray
    tensor_type: GGMLType
    columns: int

    def rows(self, ids: np.ndarray) -> np.ndarray:
        picked = self.raw[ids]  # a copy: [n, bytes per row]
        values = gguf.quants.dequantize(picked, self.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape(len(ids), self.columns)


def release_view_pages(view: np.ndarray) -> None:
    """``madvise(MADV_DONTNEED)`` over the whole pages inside ``view``'s bytes: they stop
    counting in this process's resident memory. For a view of a read-only file mapping nothing
    is lost (a later read faults them in again from the page cache); anonymous memory reads
    back as zeros (the block arena's unused end). Best effort: a platform without ``madvise``
    keeps them."""
    page = mmap.PAGESIZE
    start = -(-view.ctypes.data // page) * page
    stop = (view.ctypes.data + view.nbytes) // page * page
    if stop <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass
