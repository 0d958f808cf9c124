"""Hyper-parameters and tensor layout read from the SmolLM2 GGUF."""

from __future__ import annotations

import shutil

import numpy as np

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.checkpoints.model_tensors import unpermute_rope_rows
from app.models.load.smollm2 import smollm2_gguf_path


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order convert_hf_to_gguf.py writes: halves of each head interleaved."""
    out_features, in_features = weights.shape
    return (
        weights.reshape(num_heads, 2, out_features // num_heads // 2, in_features)
        .swapaxes(1, 2)
        .reshape(out_features, in_features)
    )


def test_unpermute_undoes_the_converter_permutation() -> None:
    weights = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    np.testing.assert_array_equal(unpermute_rope_rows(_llama_cpp_permute(weights, 3), 3), weights)


def test_smollm2_hyper_parameters() -> None:
    file = GGUFFile(smollm2_gguf_path())
    hparams = file.hparams(file.architecture())
    assert (hparams.block_count, hparams.embedding_length, hparams.feed_forward_length) == (
        30,
        576,
        1536,
    )
    assert (hparams.head_count, hparams.head_count_kv, hparams.head_dim) == (9, 3, 64)
    assert hparams.rope_freq_base == 100000.0
    assert hparams.context_length == 8192
    assert hparams.vocab_size == 49152
    assert hparams.tied_embeddings  # no output.weight: logits use token_embd.weight
    assert file.tensor("blk.0.attn_k.weight").shape == (192, 576)


def test_a_file_rewritten_in_place_is_parsed_again(tiny_checkpoints, tmp_path) -> None:
    """Opening the same unchanged file twice shares one parse; replacing the file (another
    size or modification time) is read anew, not served from that parse."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_checkpoints.gguf("llama"), path)
    first, again = GGUFFile(path), GGUFFile(path)
    assert first._reader is again._reader
    assert first.architecture_name == "llama"
    shutil.copyfile(tiny_checkpoints.gguf("qwen2"), path)
    assert GGUFFile(path).architecture_name == "qwen2"
