"""Phi-3 / Phi-4-mini against transformers' Phi3ForCausalLM on tiny random-weight checkpoints:
fused ``qkv_proj`` and ``gate_up_proj`` (GGUF ``attn_qkv``, ``ffn_up`` of twice the rows), rope
over 12 of each head's 16 dimensions (Phi-4-mini's ``partial_rotary_factor`` 0.75), and
longrope's short and long factors with its attention factor, from the HF directory and from
the GGUF as llama.cpp's converter writes it (the factors as ``rope_factors_*`` tensors).

Each feature is shown to matter: the forward with rope over the whole head, the other
longrope factors, or no attention factor is far from transformers' logits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from app.engine.request import GenerationRequest, StopCriteria
from app.engine.sync_engine import SyncEngine
from app.models.forward.decoder import DecoderModel
from app.models.hparams import RopeScalingKind
from app.models.load.plan import load_checkpoint
from app.models.weights.build import load_weights
from app.models.weights.projections import LinearKernel
from app.models.weights.record import Quantization
from tests.checkpoints import (
    PHI3_LONGROPE,
    TinyCheckpoints,
    load_transformers_model,
    transformers_logits,
)
from tests.models.stepping import CPU, GREEDY, decoder_of, open_tensors, sequence_logits

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |logit difference|, float32
LONG_IDS = [(17 + 131 * i) % 49000 + 100 for i in range(60)]
# longrope's original context is 32 positions: 60 positions served run past it (long
# factors), 30 served within it (short factors)
LONGROPE = {"rope_scaling": PHI3_LONGROPE, "original_max_position_embeddings": 32}


def _difference(model: DecoderModel, reference: torch.Tensor, ids: list[int], chunk: int) -> float:
    ours = sequence_logits(model, ids, chunk=chunk)
    return (ours - reference[chunk - 1 :]).abs().max().item()


def _decoder(path: Path, max_model_len: int, **changes) -> DecoderModel:
    """The float32 forward of ``path`` with ``changes`` made to its hyper-parameters."""
    tensors = open_tensors(path)
    weights = load_weights(tensors, dtype=torch.float32, device=CPU, kernel=LinearKernel.DENSE)
    hparams = dataclasses.replace(tensors.hparams, **changes)
    return DecoderModel(hparams, weights, max_model_len=max_model_len)


def test_fused_tensors_and_partial_rotary_from_both_formats(tiny_checkpoints) -> None:
    for path in (tiny_checkpoints.hf("phi3"), tiny_checkpoints.gguf("phi3")):
        tensors = open_tensors(path)
        assert (tensors.hparams.rope_dims, tensors.hparams.rotary_dims) == (12, 12)
        assert tensors.name("attn_k", 1) == tensors.name("attn_q", 1)
        assert tensors.name("ffn_gate", 0).endswith(("gate_up_proj.weight", "ffn_up.weight"))
        assert tensors.read("attn_v", 0).shape == (32, 64)
        assert tensors.read("ffn_up", 0).shape == (256, 64)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("source", ["hf", "gguf-f32"])
def test_logits_equal_transformers(tiny_checkpoints: TinyCheckpoints, source, tied) -> None:
    reference_path = tiny_checkpoints.hf("phi3", tied=tied)
    path = reference_path if source == "hf" else tiny_checkpoints.gguf("phi3", "F32", tied=tied)
    reference = transformers_logits(load_transformers_model(reference_path), LONG_IDS)
    for chunk in (5, 40):
        model = decoder_of(path, max_model_len=len(LONG_IDS))
        assert _difference(model, reference, LONG_IDS, chunk) <= TOLERANCE, chunk
    full_head = _decoder(reference_path, len(LONG_IDS), rope_dims=None)
    assert _difference(full_head, reference, LONG_IDS, 5) > 100 * TOLERANCE


@pytest.mark.parametrize("source", ["hf", "gguf-f32"])
def test_longrope_long_and_short_factors(tiny_checkpoints: TinyCheckpoints, source) -> None:
    """A served context past the original one takes the long factors and the attention
    factor (transformers: a forward longer than the original context), one within it the
    short factors."""
    reference_path = tiny_checkpoints.hf("phi3", **LONGROPE)
    path = reference_path if source == "hf" else tiny_checkpoints.gguf("phi3", "F32", **LONGROPE)
    scaling = open_tensors(path).hparams.rope_scaling
    assert scaling is not None and scaling.kind is RopeScalingKind.LONGROPE
    assert scaling.original_context_length == 32
    assert scaling.attention_factor == pytest.approx((1 + 6 / 5) ** 0.5)  # ln 64 / ln 32
    transformers_model = load_transformers_model(reference_path)
    long_reference = transformers_logits(transformers_model, LONG_IDS)
    model = decoder_of(path, max_model_len=64)
    assert _difference(model, long_reference, LONG_IDS, 40) <= TOLERANCE
    short_ids = LONG_IDS[:30]
    short_reference = transformers_logits(transformers_model, short_ids)
    assert _difference(decoder_of(path, max_model_len=32), short_reference, short_ids, 5) <= (
        TOLERANCE
    )
    # the other factors, or no attention factor, are far from the reference
    swapped = dataclasses.replace(
        scaling, long_factors=scaling.short_factors, short_factors=scaling.long_factors
    )
    changed = {
        "swapped factors": _decoder(reference_path, 64, rope_scaling=swapped),
        "no attention factor": _decoder(
            reference_path, 64, rope_scaling=dataclasses.replace(scaling, attention_factor=1.0)
        ),
    }
    for what, other in changed.items():
        assert _difference(other, long_reference, LONG_IDS, 40) > 100 * TOLERANCE, what


def test_legacy_su_config(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """config.json as Phi-3-mini-128k's first release wrote it: ``rope_scaling`` with
    ``"type": "su"``, ``rope_theta`` and ``partial_rotary_factor`` at the top level."""
    source = tiny_checkpoints.hf("phi3", **LONGROPE)
    path = Path(shutil.copytree(source, tmp_path / "tiny-phi3-su"))
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {
        "rope_theta": rope.pop("rope_theta"),
        "partial_rotary_factor": rope.pop("partial_rotary_factor"),
        "rope_scaling": {
            "type": "su",
            "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"],
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    assert open_tensors(path).hparams == open_tensors(source).hparams


def test_file_blocks_of_fused_matrices(tiny_checkpoints: TinyCheckpoints) -> None:
    """Q8_0 and Q4_K files on their own blocks: each part a share of the fused matrix's rows
    (bfloat16, against the same file dequantised; 2 layers: close)."""
    short_ids = LONG_IDS[:13]
    for tensor_type in ("Q8_0", "Q4_K"):
        path = tiny_checkpoints.gguf("phi3", tensor_type)
        dequantised = sequence_logits(decoder_of(path, max_model_len=16), short_ids, chunk=5)
        blocks = decoder_of(
            path, dtype=torch.bfloat16, quantization=Quantization.GGUF, max_model_len=16
        )
        assert blocks.weights.dense_projections == ()
        assert "partial rotary" in blocks.fused_decode_status
        on_blocks = sequence_logits(blocks, short_ids, chunk=5)
        assert (on_blocks - dequantised).abs().max().item() < 0.1, tensor_type


def test_served_tokens_equal_transformers(tiny_checkpoints: TinyCheckpoints) -> None:
    """Greedy tokens through the scheduler, prefix caching on, equal transformers'."""
    path = tiny_checkpoints.hf("phi3")
    prompts = [LONG_IDS[:40] + LONG_IDS[45 + i : 48 + i] for i in range(2)]
    model = load_transformers_model(path)
    expected = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(10):
            tokens.append(int(transformers_logits(model, tokens)[-1].argmax()))
        expected.append(tokens[len(prompt) :])
    runner = load_checkpoint(path, max_num_seqs=2, max_model_len=64)
    engine = SyncEngine(runner, prefix_caching=True)
    handles = [
        engine.add(
            GenerationRequest(f"r{i}", tuple(p), 10, GREEDY, stop=StopCriteria(ignore_eos=True))
        )
        for i, p in enumerate(prompts)
    ]
    engine.run_until_idle(max_steps=1000)
    assert [list(h.final.token_ids) for h in handles] == expected


def test_whole_head_rope_decodes_in_the_fused_kernels(tiny_checkpoints: TinyCheckpoints) -> None:
    """Phi-3-mini (rope over whole heads, longrope): bfloat16 decode steps go through the fused
    kernels, whose rope reads the same tables (long factors, attention factor included), and
    give the eager path's logits up to rounding order."""
    whole_head = {
        **PHI3_LONGROPE,
        "short_factor": [1.0, 1.1, 1.2, 1.3, 1.6, 2.0, 2.5, 3.0],
        "long_factor": [1.0, 1.5, 2.0, 2.5, 4.0, 6.0, 9.0, 12.0],
    }
    path = tiny_checkpoints.hf(
        "phi3",
        partial_rotary_factor=1.0,
        rope_scaling=whole_head,
        original_max_position_embeddings=32,
    )
    assert open_tensors(path).hparams.rope_dims is None
    fused = decoder_of(path, dtype=torch.bfloat16, max_model_len=64)
    if fused.fused_decode is None:
        pytest.skip(f"no fused kernels here: {fused.fused_decode_status}")
    eager = decoder_of(path, dtype=torch.bfloat16, max_model_len=64, fused_decode=False)
    reference = transformers_logits(load_transformers_model(path), LONG_IDS)
    for model in (fused, eager):
        assert _difference(model, reference, LONG_IDS, 40) < 0.1
    difference = sequence_logits(fused, LONG_IDS, chunk=40) - sequence_logits(
        eager, LONG_IDS, chunk=40
    )
    assert difference.abs().max().item() < 0.05
