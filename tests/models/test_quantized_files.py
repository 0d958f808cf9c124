"""GGUF tensor types: every supported type decodes exactly (our float32 logits equal transformers'
GGUF loader on the same file), and each type's distance from the original weights stays within
its documented tolerance; the int4 path on Q4_0/Q4_1 files follows its float32 decode.

Tolerances (max |logit difference| from transformers on the original float32 HF weights, on
these tiny random models whose logits span about +-2; measured 2026-12-01 on the four
architectures, the bound is about 1.5x the worst): F16 0.004, BF16 0.03, Q8_0 0.1, Q6_K 0.12,
Q5_0/Q5_1 0.7, Q4_K 0.7, Q4_0/Q4_1 1.2. Random N(0, 0.1) weights without outliers are close
to the worst case for 4-5 bit blocks; the model-level quality of the default is checked on
SmolLM2 instead (docs/MODEL_PERF.md, "The default").
"""

from __future__ import annotations

import pytest
import torch

from app.models.kernels.ggml_quant import load_ggml_quant
from app.models.weights.ggml import GGMLLinear
from app.models.weights.int4 import int4_kernel_status
from app.models.weights.record import Quantization
from tests.checkpoints import ARCHITECTURES, load_transformers_model, transformers_logits
from tests.models.stepping import decoder_of, open_tensors, sequence_logits

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")

PROMPT_IDS = [1, 4093, 198, 504, 3575, 282, 4649, 314, 2, 216, 33, 34, 35]
CHUNK = 5
FROM_ORIGINAL = {
    "F16": 0.004,
    "BF16": 0.03,
    "Q8_0": 0.1,
    "Q6_K": 0.12,
    "Q5_0": 0.7,
    "Q5_1": 0.7,
    "Q4_K": 0.7,
    "Q4_0": 1.2,
    "Q4_1": 1.2,
}
# The four, on every architecture; the rest on one architecture each.
EVERY_ARCHITECTURE = ("F16", "Q8_0", "Q4_0", "Q4_K")
ONE_ARCHITECTURE = {"BF16": "mistral", "Q4_1": "qwen2", "Q5_0": "qwen3", "Q5_1": "llama"}
ONE_ARCHITECTURE |= {"Q6_K": "qwen2"}
CASES = [(t, a) for t in EVERY_ARCHITECTURE for a in ARCHITECTURES] + [
    (t, a) for t, a in ONE_ARCHITECTURE.items()
]


def _ours(path, **options) -> torch.Tensor:
    model = decoder_of(path, max_model_len=len(PROMPT_IDS), **options)
    return sequence_logits(model, PROMPT_IDS, chunk=CHUNK)


@pytest.mark.parametrize("tensor_type, architecture", CASES)
def test_quantized_gguf_follows_the_original_weights(
    tiny_checkpoints, tensor_type: str, architecture: str
) -> None:
    path = tiny_checkpoints.gguf(architecture, tensor_type)
    # K-quants need rows of 256: the 64-column matrices fall back (Q4_K to Q5_0, Q6_K to Q8_0)
    # as llama-quantize does, ffn_down (256 columns) keeps the type.
    assert tensor_type in set(open_tensors(path).projection_types().values())
    original = transformers_logits(
        load_transformers_model(tiny_checkpoints.hf(architecture)), PROMPT_IDS
    )
    difference = (_ours(path) - original[CHUNK - 1 :]).abs().max().item()
    print(
        f"{architecture} {tensor_type}: max |logit difference| from the original {difference:.3f}"
    )
    assert difference <= FROM_ORIGINAL[tensor_type]


@pytest.mark.parametrize(
    "tensor_type, architecture",
    [("Q4_0", "llama"), ("Q4_K", "qwen2")],
)
def test_quantized_gguf_decodes_as_transformers_does(
    tiny_checkpoints, tensor_type: str, architecture: str
) -> None:
    """Exact decoding: transformers' GGUF loader dequantises the same file (with gguf-py, as we
    do); the two float32 forwards then agree to float32 rounding. (Measured for every type and
    architecture once, 2026-12-01: within 2e-6. Two here, a classic block type and a K-quant,
    since transformers' loader parses the vocabulary twice, ~10 s a file.)"""
    path = tiny_checkpoints.gguf(architecture, tensor_type)
    reference = transformers_logits(load_transformers_model(path), PROMPT_IDS)
    difference = (_ours(path) - reference[CHUNK - 1 :]).abs().max().item()
    assert difference <= 1e-4


@pytest.mark.skipif(not int4_kernel_status()[0], reason=int4_kernel_status()[1])
@pytest.mark.parametrize(
    "tensor_type, architecture", [("Q4_0", "llama"), ("Q4_1", "qwen3"), ("Q4_0", "qwen2")]
)
def test_int4_path_follows_the_files_float32_decode(
    tiny_checkpoints, tensor_type: str, architecture: str
) -> None:
    """The file's own 4-bit codes in the int4 kernel (bfloat16 activations; at most 4 rows a
    call, so every step here takes the kernel) against the same file decoded to float32."""
    path = tiny_checkpoints.gguf(architecture, tensor_type)
    int4 = _ours(path, dtype=torch.bfloat16, quantization=Quantization.INT4)
    float32 = _ours(path)
    assert (int4 - float32).abs().max().item() < 0.1
    agreement = (int4.argmax(-1) == float32.argmax(-1)).float().mean().item()
    assert agreement >= 0.75


GGUF_CASES = [
    ("Q4_0", "llama"),
    ("Q4_1", "qwen3"),
    ("Q5_0", "mistral"),
    ("Q5_1", "llama"),
    ("Q8_0", "qwen2"),
    ("Q4_K", "llama"),
    ("Q6_K", "qwen2"),
]


@pytest.mark.skipif(load_ggml_quant()[0] is None, reason=load_ggml_quant()[1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("tensor_type, architecture", GGUF_CASES)
def test_gguf_blocks_follow_the_files_float32_decode(
    tiny_checkpoints, tensor_type: str, architecture: str, dtype: torch.dtype
) -> None:
    """The file's own blocks in the GGUF-block kernels (8-bit activations; K-quant tensors
    beside their fallbacks, Q5_0 / Q8_0, in one model) against the same file decoded to
    float32: the activation quantisation's error, and the greedy tokens mostly agree. No dense
    copy of a quantised matrix is kept: every projection and the head are on the blocks."""
    path = tiny_checkpoints.gguf(architecture, tensor_type)
    model = decoder_of(path, dtype=dtype, quantization=Quantization.GGUF, max_model_len=64)
    weights = model.weights
    assert weights.dense_projections == ()
    assert all(isinstance(p, GGMLLinear) for layer in weights.layers for p in _projections(layer))
    assert isinstance(weights.lm_head, GGMLLinear)
    blocks = sequence_logits(model, PROMPT_IDS, chunk=CHUNK)
    float32 = _ours(path)
    assert (blocks - float32).abs().max().item() < 0.15
    agreement = (blocks.argmax(-1) == float32.argmax(-1)).float().mean().item()
    assert agreement >= 0.75


def _projections(layer):
    return (layer.qkv, layer.attn_output, layer.gate_up, layer.down)
