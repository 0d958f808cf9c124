"""Loading the model the user brings: the default weight format (``--quantization auto``), the
served name, the context length, the memory estimate, and an architecture added as a
declaration only."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.config import ServerConfig
from app.models import architectures
from app.models.architectures import HF_NAMES, Architecture, TensorNames
from app.models.checkpoints.gguf_file import GGUFFile
from app.models.load import memory
from app.models.load.plan import LoadOptions, auto_without_blocks, load_runner, plan_load
from app.models.loading import load_model
from app.models.refusal import ModelRefused
from app.models.weights.projections import widens_to_float32
from app.models.weights.record import Quantization
from tests.models.stepping import decoder_of, sequence_logits

PROMPT_IDS = [1, 4093, 198, 504, 3575, 282, 4649, 314, 2, 216, 33, 34, 35]


def _plan(path, **options):
    return plan_load(str(path), LoadOptions(max_num_seqs=2, **options))


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_auto_computes_on_a_gguf_files_own_blocks(tiny_checkpoints, tensor_type) -> None:
    plan = _plan(tiny_checkpoints.gguf("qwen2", tensor_type), dtype="bfloat16", quantization="auto")
    assert plan.quantization is Quantization.GGUF
    assert "own" in plan.quantization_reason and tensor_type in plan.quantization_reason
    # a tiny model's dense copies are far under the limit: kept where they compute in
    # bfloat16; on an AVX2 CPU they would be float32, which the tile kernels beat
    assert plan.wide_copies == (not widens_to_float32(torch.device("cpu"), torch.bfloat16))
    assert not _plan(plan.source.path, dtype="bfloat16", wide_copies="off").wide_copies
    runner = load_runner(plan)
    assert runner.capabilities.backend == "torch-cpu-bfloat16-gguf"
    assert tensor_type in runner.capabilities.weight_kernels


def test_auto_is_dense_for_everything_else(tiny_checkpoints) -> None:
    for path in (tiny_checkpoints.gguf("llama", "F16"), tiny_checkpoints.hf("llama")):
        plan = _plan(path, dtype="bfloat16", quantization="auto")
        assert plan.quantization is Quantization.NONE, path
        assert "not 4-bit" not in plan.quantization_reason
    float32 = _plan(tiny_checkpoints.gguf("llama", "Q4_0"), dtype="float32", quantization="auto")
    assert float32.quantization is Quantization.NONE
    assert "bfloat16 only" in float32.quantization_reason


def test_without_the_block_kernels_auto_is_todays_path(tiny_checkpoints) -> None:
    """Where the kernels do not build, auto falls back as before: int4 for an all-Q4_0/Q4_1
    file, else dense (load_runner logs the one line; test_random_gguf checks it)."""
    source = _plan(tiny_checkpoints.gguf("qwen2", "Q4_1"), dtype="bfloat16").source
    quantization, reason = auto_without_blocks(source, torch.bfloat16, torch.device("cpu"))
    assert quantization is Quantization.INT4 and "own 4-bit codes" in reason
    source = _plan(tiny_checkpoints.gguf("qwen2", "Q8_0"), dtype="bfloat16").source
    quantization, reason = auto_without_blocks(source, torch.bfloat16, torch.device("cpu"))
    assert quantization is Quantization.NONE and "Q8_0" in reason


def test_explicit_formats_that_cannot_run_are_refused(tiny_checkpoints) -> None:
    path = tiny_checkpoints.gguf("llama", "Q4_0")
    with pytest.raises(ModelRefused, match="int8 needs --dtype bfloat16"):
        _plan(path, dtype="float32", quantization="int8")
    with pytest.raises(ModelRefused, match="int4 runs on the CPU only"):
        _plan(path, dtype="bfloat16", quantization="int4", device="meta")
    with pytest.raises(ModelRefused, match="--quantization gguf needs a GGUF file"):
        _plan(tiny_checkpoints.hf("llama"), dtype="bfloat16", quantization="gguf")


def test_served_names(tiny_checkpoints) -> None:
    gguf = tiny_checkpoints.gguf("mistral", "F32")
    hf = tiny_checkpoints.hf("qwen3")
    # a GGUF: its general.name (the converter writes the directory's name); a directory: its name
    assert _plan(gguf).source.name == tiny_checkpoints.hf("mistral").name
    assert _plan(hf).source.name == hf.name
    assert _plan(hf, served_model_name="my-model").source.name == "my-model"
    # the mock too (found by a helper: it kept "mock-bytes")
    assert load_model(ServerConfig(model="mock")).capabilities.name == "mock-bytes"
    renamed = load_model(ServerConfig(model="mock", served_model_name="simple"))
    assert renamed.capabilities.name == "simple"


def test_the_context_is_the_models_at_most(tiny_checkpoints) -> None:
    path = tiny_checkpoints.hf("llama")  # trained for 2048 positions
    assert _plan(path, max_model_len=8192).max_model_len == 2048
    assert _plan(path, max_model_len=100).max_model_len == 100
    runner = load_runner(_plan(path, max_model_len=8192))
    assert runner.capabilities.context_length == 2048


@pytest.mark.parametrize("widened", [False, True], ids=["bfloat16 matmuls", "float32 copies"])
def test_the_memory_estimate_counts_weights_and_a_full_kv_cache(
    widened: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either CPU kind, whichever this one is: with oneDNN bfloat16, or without (AVX2), where
    the dense projections hold float32 copies of the bfloat16 weights."""
    monkeypatch.setattr(memory, "widens_to_float32", lambda device, dtype: widened)
    plan = plan_load("smollm2", LoadOptions(max_num_seqs=16, dtype="bfloat16"))
    # 2 x 30 layers x 3 KV heads x 64 x 2 bytes per position: 45 MiB per sequence of 2048;
    # the default pool holds 16 of them, and the null block (16 positions)
    assert plan.num_kv_blocks == 16 * 2048 // 16 + 1
    assert plan.memory.kv_cache == 16 * 45 * 2**20 + 45 * 2**20 // 128
    # bfloat16 projections of 135M parameters (the tied head counted once): ~260 MiB; as
    # float32 copies, twice that
    low, high = (400, 600) if widened else (200, 320)
    assert low * 2**20 < plan.memory.weights < high * 2**20
    assert plan.memory.fits and plan.memory.where == "RAM"


def test_kv_cache_memory_sizes_the_pool_and_refuses_one_too_small() -> None:
    block = 45 * 2**20 // 128  # bfloat16 SmolLM2: 16 positions
    plan = plan_load(
        "smollm2", LoadOptions(max_num_seqs=64, dtype="bfloat16", kv_cache_memory=400 * 2**20)
    )
    assert plan.num_kv_blocks == 400 * 2**20 // block + 1
    assert plan.memory.kv_cache == plan.num_kv_blocks * block
    fraction = plan_load("smollm2", LoadOptions(max_num_seqs=4, kv_cache_memory=0.05))
    assert fraction.num_kv_blocks > 1
    with pytest.raises(ModelRefused, match="fewer than one sequence"):
        plan_load("smollm2", LoadOptions(max_num_seqs=4, kv_cache_memory=10 * 2**20))


def test_an_architecture_is_a_declaration(tiny_checkpoints, tmp_path, monkeypatch) -> None:
    """A Llama whose checkpoint names its tensors otherwise ("decoder.blocks.N...") is served
    by adding one Architecture: no forward, runner or loader code."""
    source = tiny_checkpoints.hf("llama", tied=False)
    target = tmp_path / "renamed-llama"
    shutil.copytree(source, target)
    names = TensorNames(
        token_embedding="decoder.tokens.weight",
        output="decoder.head.weight",
        output_norm="decoder.final_norm.weight",
        attn_norm="decoder.blocks.{i}.norm_1.weight",
        attn_q="decoder.blocks.{i}.attention.query.weight",
        attn_k="decoder.blocks.{i}.attention.key.weight",
        attn_v="decoder.blocks.{i}.attention.value.weight",
        attn_output="decoder.blocks.{i}.attention.dense.weight",
        attn_q_norm="decoder.blocks.{i}.attention.query_norm.weight",
        attn_k_norm="decoder.blocks.{i}.attention.key_norm.weight",
        ffn_norm="decoder.blocks.{i}.norm_2.weight",
        ffn_gate="decoder.blocks.{i}.mlp.gate.weight",
        ffn_up="decoder.blocks.{i}.mlp.up.weight",
        ffn_down="decoder.blocks.{i}.mlp.down.weight",
    )
    rename = {}
    for part in names.__dataclass_fields__:
        if getattr(HF_NAMES, part) is None:  # a part Llama does not have (Gemma's post norms)
            continue
        for layer in (0, 1):
            rename[HF_NAMES.of(part, layer)] = names.of(part, layer)
    tensors = load_file(target / "model.safetensors")
    save_file({rename[k]: v for k, v in tensors.items()}, target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = "renamed-llama"
    (target / "config.json").write_text(json.dumps(config))

    with pytest.raises(ModelRefused, match="unsupported architecture 'renamed-llama'"):
        _plan(target)
    renamed = Architecture(
        name="renamed-llama",
        hf_model_types=("renamed-llama",),
        gguf_architectures=(),
        hf_names=names,
    )
    monkeypatch.setattr(architectures, "ARCHITECTURES", (*architectures.ARCHITECTURES, renamed))
    assert _plan(target).source.architecture is renamed
    original = sequence_logits(decoder_of(source, max_model_len=16), PROMPT_IDS, chunk=5)
    served = sequence_logits(decoder_of(target, max_model_len=16), PROMPT_IDS, chunk=5)
    assert torch.equal(original, served)


def _edited_copy(source, target, **config_changes):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_metadata_of_the_wrong_type_is_a_refusal(tiny_checkpoints, tmp_path, monkeypatch) -> None:
    """(found by a helper: each crashed ``serve`` with a traceback and exit 1.) A metadata value
    of the wrong type is a one-line refusal naming the field: a ``config.json`` that is not an
    object, a size that is a string or a fraction, a GGUF's context length as a string."""
    hf = tiny_checkpoints.hf("llama")
    cases = {
        r"config.json's 'hidden_size' is 'big', not a whole number": _edited_copy(
            hf, tmp_path / "big", hidden_size="big"
        ),
        r"'max_position_embeddings' is 128.5, not a whole number": _edited_copy(
            hf, tmp_path / "fraction", max_position_embeddings=128.5
        ),
    }
    listed = tmp_path / "listed"
    shutil.copytree(hf, listed)
    (listed / "config.json").write_text("[1, 2]")
    cases[r"config.json is not a JSON object \(a list\)"] = listed
    for reason, path in cases.items():
        with pytest.raises(ModelRefused, match=reason):
            _plan(path)
    gguf_path = tiny_checkpoints.gguf("llama", "F32")
    field_or = GGUFFile.field_or

    def stringly(self, key, default=None):
        return "4096" if key == "llama.context_length" else field_or(self, key, default)

    monkeypatch.setattr(GGUFFile, "field_or", stringly)
    with pytest.raises(ModelRefused, match=r"llama.context_length is '4096', not a number"):
        _plan(gguf_path)


def test_more_refusals(tiny_checkpoints, tmp_path) -> None:
    """Reasons the command line gives as one line (tests/http/test_any_model_refusals.py runs
    the main ones through it), each naming what is wrong."""
    hf = tiny_checkpoints.hf("llama")
    supported = r"\(supported: llama, mistral, qwen2, qwen3, gemma3, phi3, qwen3moe, mixtral\)"
    cases = {
        f"unsupported architecture 'gemma2' {supported}": _edited_copy(
            hf, tmp_path / "gemma", model_type="gemma2"
        ),
        r"rope type 'yarn' is not supported "
        r"\(supported: default, linear, llama3, longrope, su\)": _edited_copy(
            hf,
            tmp_path / "yarn",
            rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0},
        ),
        r"quantized checkpoints \(gptq\) are not supported": _edited_copy(
            hf, tmp_path / "gptq", quantization_config={"quant_method": "gptq", "bits": 4}
        ),
        "activation 'gelu' is not supported": _edited_copy(
            hf, tmp_path / "gelu", hidden_act="gelu"
        ),
    }
    bin_only = tmp_path / "bin-only"
    bin_only.mkdir()
    shutil.copy(hf / "config.json", bin_only / "config.json")
    (bin_only / "pytorch_model.bin").write_bytes(b"\0" * 16)
    cases[r"no \*\.safetensors weights \(found pytorch_model\.bin"] = bin_only
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(hf, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    cases["tokenizer: .*no tokenizer.json"] = no_tokenizer
    missing_layer = tmp_path / "missing-layer"
    shutil.copytree(hf, missing_layer)
    tensors = load_file(missing_layer / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, missing_layer / "model.safetensors")
    cases["tensor model.layers.1.mlp.down_proj.weight is missing"] = missing_layer
    for reason, path in cases.items():
        with pytest.raises(ModelRefused, match=reason) as refused:
            _plan(path)
        assert str(refused.value).startswith(f"{path}: ")
    with pytest.raises(
        ModelRefused, match=r"int4 needs Q4_0/Q4_1 projections; blk\.0\.\w+\.weight is F32"
    ):
        _plan(tiny_checkpoints.gguf("llama", "F32"), dtype="bfloat16", quantization="int4")
