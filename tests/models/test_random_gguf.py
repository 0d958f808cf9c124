"""A K-quant file of a real model's layout (scripts/make_random_gguf.py, tiny): served on its
own blocks, its resident weights are the file's bytes, and its logits follow the same file
decoded to float32 up to the 8-bit activation rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from make_random_gguf import write_random_gguf

from app.models.kernels.ggml_quant import load_ggml_quant
from app.models.load.plan import LoadOptions, load_checkpoint, plan_load
from app.models.refusal import ModelRefused
from app.models.weights.ggml import (
    GGML_MAX_ROWS,
    GGML_MAX_ROWS_NO_AMX,
    GGMLEmbedding,
    GGMLLinear,
    blocks_max_rows,
)
from app.models.weights.record import Quantization
from tests.models.stepping import decoder_of, load_on_blocks, open_tensors, sequence_logits

pytestmark = pytest.mark.skipif(load_ggml_quant()[0] is None, reason=load_ggml_quant()[1])

PROMPT_IDS = [1, 4093, 198, 504, 3575, 282, 4649, 314, 2, 216, 33, 34, 35]
SHAPE = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 512}


@pytest.fixture(scope="module", params=["Q4_K,Q6_K,Q6_K", "Q5_K,Q5_K,Q8_0"])
def random_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("random") / "model.gguf"
    return write_random_gguf(out, types=request.param, **SHAPE)


def test_the_blocks_are_the_weights_in_memory(random_file: Path) -> None:
    runner = load_on_blocks(random_file, wide_copies="off")
    weights = runner.model.weights
    assert weights.quantization is Quantization.GGUF
    assert isinstance(weights.embedding, GGMLEmbedding)
    projections = [p for layer in weights.layers for p in (layer.qkv, layer.gate_up)]
    projections += [p for layer in weights.layers for p in (layer.attn_output, layer.down)]
    assert all(isinstance(p, GGMLLinear) for p in (*projections, weights.lm_head))
    held = sum(p.nbytes for p in projections) + weights.lm_head.nbytes
    source = runner.model.hparams
    assert source.vocab_size == 49152
    stored = sum(t.n_bytes for t in _file_tensors(random_file) if t.name.endswith("weight"))
    norms = 4 * (SHAPE["hidden"] * (2 * SHAPE["layers"] + 1))  # F32 norms, kept apart
    assert held == stored - norms  # each quantised byte once: the tied embedding is the head
    assert "Q4_K" in runner.capabilities.weight_kernels or "Q5_K" in (
        runner.capabilities.weight_kernels
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_logits_follow_the_files_float32_decode(random_file: Path, dtype: torch.dtype) -> None:
    blocks = decoder_of(random_file, dtype=dtype, quantization=Quantization.GGUF, max_model_len=32)
    dense = decoder_of(random_file, max_model_len=32)
    ours = sequence_logits(blocks, PROMPT_IDS, chunk=5)
    reference = sequence_logits(dense, PROMPT_IDS, chunk=5)
    spread = reference.abs().max().item()
    assert (ours - reference).abs().max().item() <= 0.05 * spread
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= 0.75


def _file_tensors(path: Path):
    import gguf

    return gguf.GGUFReader(path).tensors


def test_wide_copies_serve_steps_of_more_rows_than_the_blocks_take(random_file: Path) -> None:
    runner = load_on_blocks(random_file, wide_copies="on")
    qkv = runner.model.weights.layers[0].qkv
    assert isinstance(qkv, GGMLLinear) and qkv.wide is not None
    most = blocks_max_rows()  # 4 with AMX, 127 without
    assert qkv.blocks_max_rows == qkv.exact_rows == most
    assert runner.model.weights.lm_head.blocks_max_rows == most
    x = torch.randn(most + 4, SHAPE["hidden"], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    blocks = qkv.kernels.matmul(qkv.prepared, x)
    wide = qkv(x)  # one call over the blocks' limit: the dense copy
    assert (wide.float() - blocks.float()).abs().max() <= 0.05 * blocks.float().abs().max()
    assert torch.equal(qkv(x[:most]), blocks[:most])  # up to the limit: the blocks


def test_wide_copies_are_the_files_weights_rounded_to_bfloat16(random_file: Path) -> None:
    """The copies are decoded from the blocks by the kernels (no float32 matrix in between):
    row for row the file's float32 decode rounded once, Q/K rows in Hugging Face's order."""
    runner = load_on_blocks(random_file, wide_copies="on")
    layer = runner.model.weights.layers[1]
    tensors = open_tensors(random_file)
    for linear, parts in ((layer.qkv, ("attn_q", "attn_k", "attn_v")), (layer.down, ("ffn_down",))):
        expected = np.concatenate([tensors.read(part, 1) for part in parts])
        expected = torch.from_numpy(expected).to(torch.bfloat16)
        identity = torch.eye(linear.in_features, dtype=torch.bfloat16)  # wide: over the limit
        assert identity.shape[0] > linear.blocks_max_rows
        assert torch.equal(linear(identity).T.contiguous(), expected)


@pytest.mark.parametrize(("amx", "most"), [(True, GGML_MAX_ROWS), (False, GGML_MAX_ROWS_NO_AMX)])
def test_blocks_take_wide_calls_on_a_cpu_without_amx(
    monkeypatch: pytest.MonkeyPatch, amx: bool, most: int
) -> None:
    """Without AMX, oneDNN's bfloat16 GEMM over the copies loses to the block kernels up to
    ~128 rows (measured on the AVX-512 EPYC), so the copies serve prompt chunks only."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert blocks_max_rows() == most


def test_a_failed_kernel_build_falls_back_with_one_line(
    random_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    load_ggml_quant.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="app.models.load.plan"):
            runner = load_checkpoint(
                random_file, max_num_seqs=1, max_model_len=32, dtype="bfloat16", quantization="auto"
            )
    finally:
        load_ggml_quant.cache_clear()
    assert runner.model.weights.quantization is Quantization.NONE
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "build failed" in warnings[0]


def test_gguf_asked_for_without_its_kernels_is_refused_before_serving(
    random_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit ``--quantization gguf`` whose kernels cannot load is a refusal of the plan
    (one line from the command line, before the port opens), not a failure of the lifespan."""
    monkeypatch.setenv("SLOTSERVE_GGML_ISA", "bogus")
    load_ggml_quant.cache_clear()
    try:
        with pytest.raises(ModelRefused, match="SLOTSERVE_GGML_ISA='bogus'"):
            plan_load(str(random_file), LoadOptions(max_num_seqs=1, quantization="gguf"))
    finally:
        load_ggml_quant.cache_clear()
