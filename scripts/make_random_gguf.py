"""A random-weight GGUF of a real model's shape, for memory and speed side by side with
llama.cpp (not for quality: its text is noise).

    python scripts/make_random_gguf.py out/llama-1b-q4_k_m.gguf      # Llama-3.2-1B's shape

Default shape: Llama 3.2 1B (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, FFN 8192,
tied embedding), with SmolLM2's tokenizer (49,152 tokens, its ``tokenizer.*`` keys copied from
the bundled GGUF). Types: Q4_K projections and a Q6_K embedding (issue 28's file, 602 MiB);
norms F32. ``--types`` picks another mix: ``Q4_K,Q6_K,Q6_K`` gives ``attn_v`` and ``ffn_down``
Q6_K as ``llama-quantize``'s Q4_K_M does for half of them; ``Q8_0`` alone, all Q8_0.

The blocks are random bytes with the fp16 scale fields set so that weights come out with a
standard deviation of ~0.02 and the activations stay finite through the layers; no float
weights are made, so a 1B file is written in seconds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.load.smollm2 import smollm2_gguf_path

GGMLType = gguf.GGMLQuantizationType
# Byte offset of each fp16 scale field in a block, and its value (weights of std ~0.02).
SCALES = {
    "Q4_0": {0: 2.5e-3},
    "Q4_1": {0: 2.5e-3, 2: -0.02},
    "Q5_0": {0: 1.2e-3},
    "Q5_1": {0: 1.2e-3, 2: -0.02},
    "Q8_0": {0: 2.7e-4},
    "Q4_K": {0: 1.0e-4, 2: 0.75e-3},  # d, dmin: w = d*sc*q - dmin*m, sc and m 6-bit
    "Q5_K": {0: 0.5e-4, 2: 0.75e-3},
    "Q6_K": {208: 1.3e-4},
}


def random_blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, bytes per row]``: random codes and sub-block scales, fixed fp16 scales."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[GGMLType[kind]]
    blocks = rng.integers(0, 256, (rows, columns // block_size, block_bytes), dtype=np.uint8)
    if kind == "Q6_K":  # int8 sub-block scales at bytes 192..207: small and positive
        blocks[:, :, 192:208] = rng.integers(1, 17, blocks[:, :, 192:208].shape, dtype=np.uint8)
    for offset, value in SCALES[kind].items():
        blocks[:, :, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_random_gguf(
    out: Path,
    *,
    hidden: int = 2048,
    layers: int = 16,
    heads: int = 32,
    kv_heads: int = 8,
    ffn: int = 8192,
    types: str = "Q4_K,Q4_K,Q6_K",
) -> Path:
    """Write the file (see the module docstring) and return ``out``. ``types``: the
    projections', ``attn_v`` and ``ffn_down``'s, and the embedding's, or one for all."""
    kinds = types.split(",") * (3 if "," not in types else 1)
    projection_type, heavy_type, embedding_type = kinds
    head_dim = hidden // heads
    source = GGUFFile(smollm2_gguf_path())
    vocab = source.tensor_shape("token_embd.weight")[0]
    rng = np.random.default_rng(0)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(f"random {layers}-layer {hidden} {types}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, field in source.fields_with_prefix("tokenizer."):
        value = field.contents()
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, field.types[0])

    def matrix(name: str, kind: str, rows: int, columns: int) -> None:
        blocks = random_blocks(kind, rows, columns, rng)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLType[kind])

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    matrix("token_embd.weight", embedding_type, vocab, hidden)
    norm("output_norm.weight", hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        matrix(f"blk.{i}.attn_q.weight", projection_type, q_width, hidden)
        matrix(f"blk.{i}.attn_k.weight", projection_type, kv_width, hidden)
        matrix(f"blk.{i}.attn_v.weight", heavy_type, kv_width, hidden)
        matrix(f"blk.{i}.attn_output.weight", projection_type, hidden, q_width)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        matrix(f"blk.{i}.ffn_gate.weight", projection_type, ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", projection_type, ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", heavy_type, hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument(
        "--types",
        default="Q4_K,Q4_K,Q6_K",
        help="projections, attn_v and ffn_down, embedding (one name: all three)",
    )
    args = parser.parse_args()
    out = write_random_gguf(
        args.out,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        types=args.types,
    )
    print(f"{out}: {out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
