"""Every architecture's float32 forward against transformers on the original Hugging Face weights:
from the HF directory and from its F32 GGUF, tied and untied, both config.json generations,
sharded safetensors, half-precision safetensors, and each supported rope scaling.

The reference is always transformers' own model of the HF directory (the tiny random-weight
checkpoints of ``tests/checkpoints.py``); ``tests/models/test_tiny_checkpoints.py`` shows that
transformers' GGUF loader reads the same GGUFs to the same logits, so they are real GGUFs.
"""

from __future__ import annotations

import pytest
import torch

from app.models.hparams import RopeScalingKind
from tests.checkpoints import (
    ARCHITECTURES,
    LLAMA3_ROPE_SCALING,
    load_transformers_model,
    transformers_logits,
)
from tests.models.stepping import decoder_of, open_tensors, sequence_logits

pytest.importorskip("transformers")

# "<|im_start|>user\nThe capital of France is<|im_end|>" and a few digits, as SmolLM2 ids.
PROMPT_IDS = [1, 4093, 198, 504, 3575, 282, 4649, 314, 2, 216, 33, 34, 35]
CHUNK = 5  # the first tokens go in as one prompt chunk, the rest as decode steps
TOLERANCE = 1e-4  # max |logit difference|, float32
# A prompt long enough for rope scaling to show (it changes the slow frequencies only).
LONG_IDS = [(17 + 131 * i) % 49000 + 100 for i in range(300)]


def _compare(path, reference_path, token_ids, *, chunk: int = CHUNK) -> float:
    reference = transformers_logits(load_transformers_model(reference_path), token_ids)
    ours = sequence_logits(decoder_of(path, max_model_len=len(token_ids)), token_ids, chunk=chunk)
    return (ours - reference[chunk - 1 :]).abs().max().item()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_hf_directory_logits_equal_transformers(tiny_checkpoints, architecture, tied) -> None:
    path = tiny_checkpoints.hf(architecture, tied=tied)
    assert open_tensors(path).hparams.tied_embeddings is tied
    difference = _compare(path, path, PROMPT_IDS)
    print(f"{architecture} tied={tied} HF dir: max |logit difference| {difference:.2e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_f32_gguf_logits_equal_transformers(tiny_checkpoints, architecture, tied) -> None:
    path = tiny_checkpoints.gguf(architecture, "F32", tied=tied)
    tensors = open_tensors(path)
    assert tensors.hparams.tied_embeddings is tied
    assert tensors.hparams.architecture == ("llama" if architecture == "mistral" else architecture)
    difference = _compare(path, tiny_checkpoints.hf(architecture, tied=tied), PROMPT_IDS)
    print(f"{architecture} tied={tied} F32 GGUF: max |logit difference| {difference:.2e}")
    assert difference <= TOLERANCE


def test_qwen3_head_dim_is_its_own(tiny_checkpoints) -> None:
    """Qwen3's head_dim (128 here) is not hidden / heads (16): read from config.json and from
    the GGUF's attention.key_length."""
    for path in (tiny_checkpoints.hf("qwen3"), tiny_checkpoints.gguf("qwen3")):
        hparams = open_tensors(path).hparams
        assert (hparams.head_dim, hparams.embedding_length, hparams.head_count) == (128, 64, 4)
        assert hparams.qk_norm


def test_qwen2_biases_are_loaded(tiny_checkpoints) -> None:
    """The QKV biases reach the projection (a model without them gives other logits)."""
    model = decoder_of(tiny_checkpoints.hf("qwen2"), max_model_len=16)
    bias = model.weights.layers[0].qkv.bias
    assert bias is not None and bias.shape == (model.hparams.q_width + 2 * model.hparams.kv_width,)
    assert bias.abs().max() > 0.1


def test_transformers4_config_and_shards(tiny_checkpoints) -> None:
    """config.json as transformers 4 wrote it (rope_theta, rope_scaling at the top level), the
    weights in three safetensors shards with their index."""
    path = tiny_checkpoints.hf("qwen2", shards=3, transformers4_config=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert not (path / "model.safetensors").exists()
    assert open_tensors(path).hparams.rope_freq_base == 50000.0
    assert _compare(path, path, PROMPT_IDS) <= TOLERANCE


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_safetensors(tiny_checkpoints, dtype: str) -> None:
    """bfloat16 / float16 files, widened to float32 exactly as transformers widens them."""
    path = tiny_checkpoints.hf("llama", torch_dtype=dtype)
    assert (
        open_tensors(path).checkpoint.tensor_type("model.norm.weight")
        == {
            "bfloat16": "BF16",
            "float16": "F16",
        }[dtype]
    )
    assert _compare(path, path, PROMPT_IDS) <= TOLERANCE


@pytest.mark.parametrize(
    "config",
    [
        {"rope_scaling": LLAMA3_ROPE_SCALING},
        {"rope_scaling": LLAMA3_ROPE_SCALING, "transformers4_config": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ],
    ids=["llama3", "llama3-transformers4", "linear"],
)
def test_rope_scaling(tiny_checkpoints, config) -> None:
    """Llama 3.1's scaling (the GGUF stores it as rope_freqs.weight) and linear scaling, from
    the HF directory and from the GGUF, over a prompt long enough for them to matter: the
    same weights without the scaling give logits far from the reference."""
    path = tiny_checkpoints.hf("llama", **config)
    gguf_path = tiny_checkpoints.gguf("llama", "F32", **config)
    kind = config["rope_scaling"]["rope_type"]
    expected = {"llama3": RopeScalingKind.FREQ_FACTORS, "linear": RopeScalingKind.LINEAR}[kind]
    scaling = open_tensors(gguf_path).hparams.rope_scaling
    assert scaling is not None and scaling.kind is expected
    hf_scaling = open_tensors(path).hparams.rope_scaling
    assert hf_scaling is not None and hf_scaling.kind.value == kind
    assert _compare(path, path, LONG_IDS, chunk=280) <= TOLERANCE
    assert _compare(gguf_path, path, LONG_IDS, chunk=280) <= TOLERANCE
    unscaled = tiny_checkpoints.hf("llama")  # the same seed: the same weights
    assert _compare(unscaled, path, LONG_IDS, chunk=280) > 100 * TOLERANCE


def test_mistral_sliding_window_caps_the_context(tiny_checkpoints) -> None:
    """A window the model was trained with caps the context at it (full attention over at most
    the window is exactly sliding-window attention); without one the context is the model's."""
    windowed = open_tensors(tiny_checkpoints.hf("mistral", sliding_window=256)).hparams
    assert (windowed.sliding_window, windowed.context_length) == (256, 256)
    plain = open_tensors(tiny_checkpoints.hf("mistral")).hparams
    assert (plain.sliding_window, plain.context_length) == (None, 2048)
    switched_off = open_tensors(tiny_checkpoints.hf("qwen2", sliding_window=128)).hparams
    assert (switched_off.sliding_window, switched_off.context_length) == (None, 2048)
    switched_on = tiny_checkpoints.hf("qwen2", sliding_window=128, use_sliding_window=True)
    assert open_tensors(switched_on).hparams.context_length == 128


def test_bfloat16_follows_float32(tiny_checkpoints) -> None:
    """The served dtype against the reference dtype on one tiny model of each architecture:
    close logits (bfloat16 rounds weights, activations and KV cache to 8 significant bits)."""
    for architecture in ARCHITECTURES:
        path = tiny_checkpoints.hf(architecture)
        full = sequence_logits(decoder_of(path, max_model_len=16), PROMPT_IDS, chunk=CHUNK)
        half = sequence_logits(
            decoder_of(path, dtype=torch.bfloat16, max_model_len=16), PROMPT_IDS, chunk=CHUNK
        )
        assert (half - full).abs().max().item() < 0.1, architecture
