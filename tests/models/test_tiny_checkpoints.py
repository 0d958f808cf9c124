"""The test checkpoints are what they claim: transformers loads our GGUFs to the HF logits, the
layout is the converter's, the quantisers decode with gguf's own decoder."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.checkpoints import (
    ARCHITECTURES,
    LLAMA3_ROPE_SCALING,
    TENSOR_TYPES,
    TinyCheckpoints,
    load_transformers_model,
    transformers_logits,
)
from tests.gguf_convert import (
    _add_hyperparameters,
    _encode,
    _gguf_tensors,
    _hf_tensors,
    _load_hparams,
    llama3_rope_factors,
    permute_rope_rows,
    pre_tokenizer_name,
)
from tests.kquants import quantize_q4_k, quantize_q6_k

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")

# "<|im_start|>user\nThe capital of France is<|im_end|>" and a few digits, as SmolLM2 ids.
PROMPT_IDS = [1, 4093, 198, 504, 3575, 282, 4649, 314, 2, 216, 33, 34, 35]

Q = gguf.GGMLQuantizationType


@pytest.fixture
def gguf_read_once(monkeypatch: pytest.MonkeyPatch) -> dict[str, gguf.GGUFReader]:
    """Each GGUF file parsed once in the test: transformers' loader opens a file twice (config,
    then weights) and gguf-py spends ~7 s on SmolLM2's 49152 tokens and merges each time."""
    readers: dict[str, gguf.GGUFReader] = {}
    original = gguf.GGUFReader

    def reader(path, mode="r"):
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    return readers


def _expected_tensor_names(architecture: str, *, tied: bool) -> set[str]:
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    per_layer += ["ffn_gate", "ffn_up", "ffn_down"]
    if architecture == "qwen2":
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if architecture == "qwen3":
        per_layer += ["attn_q_norm", "attn_k_norm"]
    names = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not tied else set())
    for block in range(2):
        for part in per_layer:
            names.add(f"blk.{block}.{part}" + ("" if part.endswith(".bias") else ".weight"))
    return names


def _check_layout(reader: gguf.GGUFReader, architecture: str, hf_state: dict) -> None:
    fields = {key: field.contents() for key, field in reader.fields.items()}
    arch = "llama" if architecture == "mistral" else architecture
    assert fields["general.architecture"] == arch
    assert architecture in fields["general.name"]
    assert fields[f"{arch}.block_count"] == 2 and fields[f"{arch}.embedding_length"] == 64
    assert fields[f"{arch}.attention.head_count_kv"] == 2
    assert fields[f"{arch}.rope.freq_base"] == 50000.0
    assert (f"{arch}.vocab_size" in fields) == (arch == "llama")
    assert (f"{arch}.rope.dimension_count" in fields) == (arch == "llama")
    key_length = {"llama": 16, "mistral": 16, "qwen2": None, "qwen3": 128}[architecture]
    assert fields.get(f"{arch}.attention.key_length") == key_length
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "smollm"
    assert fields["tokenizer.ggml.bos_token_id"] == 1 and fields["tokenizer.ggml.eos_token_id"] == 2
    assert len(fields["tokenizer.ggml.tokens"]) == 49152
    assert fields["tokenizer.ggml.token_type"][:3] == [3, 3, 3]  # the specials are CONTROL
    assert "<|im_start|>" in fields["tokenizer.chat_template"]
    assert fields.get("tokenizer.ggml.add_bos_token") is (False if arch == "llama" else None)

    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert set(tensors) == _expected_tensor_names(architecture, tied=True)
    assert all(t.tensor_type == Q.F32 for t in tensors.values())
    q_rows = np.asarray(tensors["blk.0.attn_q.weight"].data)
    k_rows = np.asarray(tensors["blk.0.attn_k.weight"].data)
    hf_q = hf_state["model.layers.0.self_attn.q_proj.weight"].numpy()
    hf_k = hf_state["model.layers.0.self_attn.k_proj.weight"].numpy()
    if arch == "llama":  # rows permuted for llama.cpp's adjacent-pair rope
        np.testing.assert_array_equal(q_rows, permute_rope_rows(hf_q, 4))
        np.testing.assert_array_equal(k_rows, permute_rope_rows(hf_k, 2))
        assert not np.array_equal(q_rows, hf_q)
    else:
        np.testing.assert_array_equal(q_rows, hf_q)
        np.testing.assert_array_equal(k_rows, hf_k)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_transformers_gguf_loader_reads_our_f32_file_to_the_hf_logits(
    tiny_checkpoints: TinyCheckpoints,
    gguf_read_once: dict[str, gguf.GGUFReader],
    architecture: str,
) -> None:
    hf_model = load_transformers_model(tiny_checkpoints.hf(architecture))
    path = tiny_checkpoints.gguf(architecture)
    gguf_model = load_transformers_model(path)
    reference = transformers_logits(hf_model, PROMPT_IDS)
    difference = (transformers_logits(gguf_model, PROMPT_IDS) - reference).abs().max().item()
    assert difference <= 1e-4
    assert reference.std().item() > 0.2  # the weights give logits worth comparing
    _check_layout(gguf_read_once[str(path.resolve())], architecture, hf_model.state_dict())


def test_an_untied_checkpoint_gets_an_output_tensor(tiny_checkpoints: TinyCheckpoints) -> None:
    from safetensors import safe_open

    directory = tiny_checkpoints.hf("qwen2", tied=False)
    with safe_open(directory / "model.safetensors", framework="pt") as part:
        assert "lm_head.weight" in part.keys()
    hparams = _load_hparams(directory)
    written = {
        name: qtype for name, _, qtype in _gguf_tensors(directory, hparams, "qwen2", "Q8_0", "Q8_0")
    }
    assert set(written) == _expected_tensor_names("qwen2", tied=False)
    assert written["output.weight"] == written["blk.0.ffn_up.weight"] == Q.Q8_0
    assert written["blk.0.attn_q.bias"] == written["output_norm.weight"] == Q.F32


def test_the_tokenizer_is_smollm2s_own(tiny_checkpoints: TinyCheckpoints) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    directory = tiny_checkpoints.hf("llama")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.encode("² ³", add_special_tokens=False).ids == [19133, 216, 39050]  # llama.cpp
    # convert_hf_to_gguf.py's hash of the ids of its check text names SmolLM's tokenizer:
    fast = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    assert pre_tokenizer_name(fast) == "smollm"
    assert "<|im_start|>" in (directory / "chat_template.jinja").read_text()
    generation = json.loads((directory / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    assert (settings["bos_token"], settings["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_sharded_transformers4_checkpoint_holds_the_same_model(
    tiny_checkpoints: TinyCheckpoints,
) -> None:
    plain = tiny_checkpoints.hf("llama", rope_scaling=LLAMA3_ROPE_SCALING)
    old = tiny_checkpoints.hf(
        "llama", rope_scaling=LLAMA3_ROPE_SCALING, shards=3, transformers4_config=True
    )
    config = json.loads((old / "config.json").read_text())
    assert "rope_parameters" not in config and config["rope_theta"] == 50000.0
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["torch_dtype"] == "float32"
    index = json.loads((old / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 and not (old / "model.safetensors").exists()
    ours = dict(_hf_tensors(old))
    assert ours.keys() == dict(_hf_tensors(plain)).keys()
    for name, array in _hf_tensors(plain):
        np.testing.assert_array_equal(ours[name], array)
    assert _load_hparams(old)["rope_parameters"] == _load_hparams(plain)["rope_parameters"]
    reference = transformers_logits(load_transformers_model(plain), PROMPT_IDS)
    assert (
        transformers_logits(load_transformers_model(old), PROMPT_IDS) - reference
    ).abs().max() == 0


def test_llama3_rope_factors_are_what_transformers_scales_by(
    tiny_checkpoints: TinyCheckpoints,
) -> None:
    import torch

    directory = tiny_checkpoints.hf("llama", rope_scaling=LLAMA3_ROPE_SCALING)
    hparams = _load_hparams(directory)
    model = load_transformers_model(directory)
    inv_freq = model.model.rotary_emb.inv_freq.double()
    unscaled = 1.0 / 50000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    factors = llama3_rope_factors(hparams)
    np.testing.assert_allclose(factors, (unscaled / inv_freq).numpy(), rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends of the blend are present

    names = [name for name, _, _ in _gguf_tensors(directory, hparams, "llama", "F32", "F32")]
    assert names[0] == "rope_freqs.weight"
    writer = gguf.GGUFWriter(None, "llama")
    _add_hyperparameters(writer, hparams, "llama", "F32")
    keys = {key for kv in writer.kv_data for key in kv}
    assert not any(".rope.scaling." in key for key in keys)  # the converter writes none for llama3


def test_linear_rope_scaling_is_written_as_the_converter_does(
    tiny_checkpoints: TinyCheckpoints,
) -> None:
    linear = {"rope_type": "linear", "factor": 2.0}
    directory = tiny_checkpoints.hf("mistral", rope_scaling=linear, transformers4_config=True)
    writer = gguf.GGUFWriter(None, "llama")
    _add_hyperparameters(writer, _load_hparams(directory), "llama", "Q8_0")
    values = {key: kv.value for entries in writer.kv_data for key, kv in entries.items()}
    assert values["llama.rope.scaling.type"] == "linear"
    assert values["llama.rope.scaling.factor"] == 2.0
    assert values["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0


def test_half_precision_checkpoint(tiny_checkpoints: TinyCheckpoints) -> None:
    from safetensors import safe_open

    directory = tiny_checkpoints.hf("qwen3", torch_dtype="bfloat16")
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(directory / "model.safetensors", framework="pt") as part:
        assert {str(part.get_slice(name).get_dtype()) for name in part.keys()} == {"BF16"}


def _relative_error(weights: np.ndarray, data: np.ndarray, qtype: gguf.GGMLQuantizationType):
    decoded = gguf.quants.dequantize(data, qtype).reshape(weights.shape)
    return np.abs(decoded - weights).mean() / np.abs(weights).mean()


@pytest.mark.parametrize(
    ("quantize", "qtype", "bound"), [(quantize_q4_k, Q.Q4_K, 0.12), (quantize_q6_k, Q.Q6_K, 0.03)]
)
def test_k_quants_decode_with_ggufs_decoder(quantize, qtype, bound: float) -> None:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((16, 512)) * 0.1).astype(np.float32)
    weights[1] = 0.0
    weights[2, :256] = np.abs(weights[2, :256])  # a block with no negative weight
    weights[3] = np.linspace(-1.0, 3.0, 512, dtype=np.float32)
    data = quantize(weights)
    assert data.shape == (16, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    decoded = gguf.quants.dequantize(data, qtype)
    np.testing.assert_array_equal(decoded[1], 0.0)
    assert _relative_error(weights, data, qtype) < bound
    step = {Q.Q4_K: 4.0 / 15, Q.Q6_K: 3.0 / 31}[qtype]  # the widest block's quantisation step
    assert np.abs(decoded[3] - weights[3]).max() <= step


# Mean relative error bounds per type (4-bit ~0.1, 5-bit ~0.05, 8-bit ~0.006, 16-bit ~1e-3).
ENCODE_BOUNDS = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q4_0": 0.15}
ENCODE_BOUNDS |= {"Q4_1": 0.12, "Q5_0": 0.07, "Q5_1": 0.06, "Q4_K": 0.12, "Q6_K": 0.03}


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_every_tensor_type_encodes_a_projection(tensor_type: str) -> None:
    rng = np.random.default_rng(1)
    for in_features in (64, 256):  # hidden-size rows and intermediate-size rows
        weights = (rng.standard_normal((128, in_features)) * 0.1).astype(np.float32)
        data, qtype = _encode(weights, tensor_type)
        falls_back = tensor_type in ("Q4_K", "Q6_K") and in_features % 256
        expected = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[tensor_type] if falls_back else tensor_type
        assert qtype == Q[expected]
        assert _relative_error(weights, data, qtype) <= ENCODE_BOUNDS[expected]
