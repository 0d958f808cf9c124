"""Will the model and its KV cache fit? An estimate from the hyper-parameters, before loading.

The estimate counts what stays resident once every block of the KV pool is written: the
weights in the format they are loaded in (with float32 copies of a bfloat16 model's dense
weights on a CPU without bfloat16 matmuls) (the lookups that read the file's rows count nothing:
those pages are file cache, reclaimable), the rope tables and the full KV pool (lazily zeroed,
so a server that never fills it uses less; refusing on the full size is what keeps a busy one
from being killed later). It is compared with the memory available now: psutil's
``available`` for the CPU, the device's free memory for CUDA. What a gguf load keeps as blocks
is counted from the file (``block_bytes``), with what its dense copies or its decode buffer
would take (``wide_copy_bytes``, ``decode_buffer_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from app.models.forward.kv_cache import kv_block_bytes
from app.models.hparams import HParams
from app.models.kernels.ggml_quant import KERNEL_TYPES
from app.models.load.source import ModelSource
from app.models.weights.head_sketch import sketch_bytes
from app.models.weights.projections import widens_to_float32
from app.models.weights.record import Quantization

MIB = 2**20

# Bytes per weight of a projection, besides the model dtype's own copy (int8 and int4 keep a
# bfloat16 copy for wide steps: app.models.weights.int8, app.models.weights.int4).
_EXTRA_BYTES_PER_WEIGHT = {
    Quantization.NONE: 0.0,
    Quantization.INT8: 1.0,  # int8 values (scales per row: negligible)
    Quantization.INT4: 0.5 + 4 / 32,  # 4-bit codes, a bfloat16 scale and zero per 32
    Quantization.GGUF: 0.0,  # the blocks are counted from the file (block_bytes)
}


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes the loaded model will hold, and bytes available to hold them.

    Attributes:
        weights: projections, LM head, embedding (when not read from the file), norms, rope.
        kv_cache: the paged KV pool with every block written.
        available: free memory of the device now.
        where: "RAM" or the device's name.
    """

    weights: int
    kv_cache: int
    available: int
    where: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def describe(self, *, max_num_seqs: int, max_model_len: int) -> str:
        return (
            f"model {self.weights / MIB:.0f} MiB + KV cache {self.kv_cache / MIB:.0f} MiB "
            f"({max_num_seqs} slots x {max_model_len} positions) = {self.total / MIB:.0f} MiB, "
            f"more than the {self.available / MIB:.0f} MiB of {self.where} available "
            "(lower --kv-cache-memory, --max-num-seqs or --max-model-len)"
        )


def estimate_memory(
    hparams: HParams,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization,
    max_model_len: int,
    num_kv_blocks: int,
    block_bytes: dict[str, int] | None = None,
    extra_bytes: int = 0,
) -> MemoryEstimate:
    """The estimate for one load (see the module docstring).

    ``block_bytes`` (gguf): bytes in the file of the matrices kept as blocks, by part
    (``attn_q`` ... ``ffn_down`` summed over layers, ``token_embedding`` or ``output`` for the
    head): those count their file bytes, every other matrix its dense size. ``extra_bytes``:
    dense copies kept beside the blocks (``wide_copies``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    # the dense copy every projection computes wide steps with: float32 where this CPU has no
    # bfloat16 matmul (app.models.weights.projections.LinearKernel.ONEDNN_FLOAT32)
    wide_itemsize = 4 if widens_to_float32(device, dtype) else itemsize
    hidden = hparams.embedding_length
    ffn = hparams.feed_forward_length
    widths = {
        "attn_q": hidden * hparams.q_width,
        "attn_k": hidden * hparams.kv_width,
        "attn_v": hidden * hparams.kv_width,
        "attn_output": hidden * hparams.q_width,
        "ffn_gate": hidden * ffn,
        "ffn_up": hidden * ffn,
        "ffn_down": hidden * ffn,
    }
    if hparams.experts is not None:  # every expert's gate, up and down instead
        del widths["ffn_gate"], widths["ffn_up"], widths["ffn_down"]
        size = hparams.experts.count * hidden * hparams.experts.feed_forward_length
        widths |= dict.fromkeys(("expert_gate", "expert_up", "expert_down"), size)
    per_weight = wide_itemsize + _EXTRA_BYTES_PER_WEIGHT[quantization]
    stored = block_bytes or {}
    projections = sum(
        stored[part] if part in stored else hparams.block_count * size * per_weight
        for part, size in widths.items()
    )
    head_part = "token_embedding" if hparams.tied_embeddings else "output"
    int8_head = quantization in (Quantization.INT8, Quantization.INT4)
    head = stored.get(head_part, hparams.vocab_size * hidden * (wide_itemsize + int8_head))
    embedding = 0 if (hparams.tied_embeddings or device.type == "cpu") else head
    rope = 2 * max_model_len * hparams.head_dim * itemsize
    weights = int(projections + head + embedding + rope + extra_bytes)
    kv = kv_block_bytes(hparams, dtype=dtype) * num_kv_blocks
    available, where = available_memory(device)
    return MemoryEstimate(weights=weights, kv_cache=kv, available=available, where=where)


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free now on ``device`` (psutil's ``available`` for the CPU), and where."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), torch.cuda.get_device_name(device)
    return int(psutil.virtual_memory().available), "RAM"


# --wide-copies auto keeps the dense copies when they come to at most this, and only where they
# compute in bfloat16 (docs/MODEL_PERF.md, "GGUF files on their own blocks": on a CPU with
# native bfloat16, SmolLM2's 270 MiB buy 2-2.6x the tok/s at 16-64 streams; on an AVX2 CPU the
# copies would be float32 and the AVX2 tile kernels beat them at every row count, 1.35-2.1x
# from 8 to 256 rows; a 1B file's 2.4 GiB would break the point of computing on its blocks).
WIDE_COPY_LIMIT = 512 * 2**20


def keeps_wide_copies(mode: str, wide_bytes: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on GGUF blocks also keeps dense copies (``wide_bytes`` of them) for wide
    steps: ``--wide-copies`` ``on``, ``off``, or ``auto`` (bfloat16 copies of at most
    :data:`WIDE_COPY_LIMIT`)."""
    if wide_bytes <= 0 or mode == "off":
        return False
    if mode == "on":
        return True
    return wide_bytes <= WIDE_COPY_LIMIT and not widens_to_float32(device, dtype)


def block_matrices(source: ModelSource) -> list[tuple[str, str]]:
    """``(part, file name)`` of every matrix a gguf load keeps as blocks: the layer matrices
    and the LM head (or tied embedding) whose type the kernels compute."""
    tensors, hp = source.tensors, source.hparams
    parts = [(part, i) for i in range(hp.block_count) for part in tensors.layer_matrices()]
    parts.append(("token_embedding" if hp.tied_embeddings else "output", None))
    kept = {  # by file name: the parts of a fused matrix (Phi-3's attn_qkv) are one matrix
        tensors.name(part, i): part
        for part, i in parts
        if tensors.tensor_type(part, i) in KERNEL_TYPES
    }
    return [(part, name) for name, part in kept.items()]


def block_bytes(source: ModelSource) -> dict[str, int]:
    """Bytes in the file of the matrices a gguf load keeps as blocks, by part, summed over
    layers (``output`` / ``token_embedding`` for the head, with its sketch where a large Q8_0
    head gets one: :func:`app.models.weights.head_sketch.sketch_bytes`)."""
    sizes: dict[str, int] = {}
    for part, name in block_matrices(source):
        raw = source.checkpoint.raw_blocks(name)
        sizes[part] = sizes.get(part, 0) + (0 if raw is None else raw.nbytes)
        if part in ("output", "token_embedding") and raw is not None:
            rows, columns = source.checkpoint.tensor_shape(name)
            sizes[part] += sketch_bytes(source.tensors.tensor_type(part, None), rows, columns)
    return sizes


def decode_buffer_bytes(source: ModelSource) -> int:
    """Bytes of the model thread's buffer for a wide call's blocks decoded to bfloat16
    (``GGMLLinear.decoded``): at most a fused gate/up projection, twice the largest matrix."""
    shapes = [source.checkpoint.tensor_shape(name) for _, name in block_matrices(source)]
    return 2 * max((rows * columns for rows, columns in shapes), default=0) * 2


def wide_copy_bytes(source: ModelSource, itemsize: int) -> int:
    """Bytes of dense copies, ``itemsize`` bytes a weight (the dense kernel's dtype), of the
    matrices a gguf load keeps as blocks (what ``wide_copies`` costs)."""
    shapes = [source.checkpoint.tensor_shape(name) for _, name in block_matrices(source)]
    return sum(rows * columns for rows, columns in shapes) * itemsize
