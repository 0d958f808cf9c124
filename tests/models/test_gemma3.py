"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on a tiny random-weight checkpoint: six
layers (five local with a window of 21 positions, one global), from the HF directory and from
its GGUF as llama.cpp's converter writes it (norms stored as ``1 + w``, no window pattern, no
local rope base), over prompts longer than the window; served greedily through the scheduler
with prefix caching on and off and under preemption.

Every Gemma feature is shown to matter on these weights: the forward with one feature dropped
(the window, the local rope base, the embedding scale, the ``+1`` of the norms, the post norms,
the GELU, the attention scale) moves the logits far beyond the tolerance, so each comparison
can fail.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from app.engine.request import GenerationRequest, StopCriteria
from app.engine.sync_engine import SyncEngine
from app.models.architectures.gemma3 import GEMMA3
from app.models.checkpoints.hf_directory import HFDirectory
from app.models.checkpoints.local_layers import (
    gguf_attention_scale,
    gguf_local_attention,
    periodic_layers,
)
from app.models.checkpoints.model_tensors import ModelTensors
from app.models.forward.decoder import DecoderModel
from app.models.forward.kv_cache import kv_block_bytes
from app.models.hparams import Activation, HParams
from app.models.load.plan import load_checkpoint
from app.models.refusal import ModelRefused
from app.models.weights.build import load_weights
from app.models.weights.projections import LinearKernel
from app.models.weights.record import Quantization
from tests.checkpoints import (
    GEMMA3_WINDOW,
    TinyCheckpoints,
    load_transformers_model,
    transformers_logits,
)
from tests.models.stepping import CPU, GREEDY, decoder_of, open_tensors, sequence_logits

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |logit difference|, float32
# 60 positions: nearly three windows; token ids well inside SmolLM2's vocabulary.
LONG_IDS = [(17 + 131 * i) % 49000 + 100 for i in range(60)]
# "<|im_start|>user\nThe capital of France is<|im_end|>" and a few digits, as SmolLM2 ids.
SHORT_IDS = [1, 4093, 198, 504, 3575, 282, 4649, 314, 2, 216, 33, 34, 35]
LOCAL = (True, True, True, True, True, False)  # transformers' default pattern over six layers


def _reference(path: Path, token_ids: list[int] = LONG_IDS) -> torch.Tensor:
    return transformers_logits(load_transformers_model(path), token_ids)


def _difference(model: DecoderModel, reference: torch.Tensor, *, chunk: int) -> float:
    ours = sequence_logits(model, LONG_IDS, chunk=chunk)
    return (ours - reference[chunk - 1 :]).abs().max().item()


def _decoder(hparams: HParams, tensors: ModelTensors) -> DecoderModel:
    weights = load_weights(tensors, dtype=torch.float32, device=CPU, kernel=LinearKernel.DENSE)
    return DecoderModel(hparams, weights, max_model_len=len(LONG_IDS))


def test_hyperparameters_from_both_formats(tiny_checkpoints: TinyCheckpoints) -> None:
    """config.json's layer_types and per-layer-type rope, and the GGUF's keys with llama.cpp's
    defaults for what the converter does not write, give the same model; the window caps no
    context."""
    for path in (tiny_checkpoints.hf("gemma3"), tiny_checkpoints.gguf("gemma3")):
        hp = open_tensors(path).hparams
        local = hp.local_attention
        assert local is not None
        assert (local.window, local.layers, local.rope_freq_base) == (GEMMA3_WINDOW, LOCAL, 1e4)
        assert (hp.rope_freq_base, hp.context_length, hp.sliding_window) == (50000.0, 2048, None)
        assert hp.embedding_scale == 8.0
        # config.json: query_pre_attn_scalar ** -0.5; a GGUF: None, the default 1 / sqrt(head_dim)
        assert hp.attention_scale == (0.25 if path.is_dir() else None)
        assert hp.ffn_activation is Activation.GELU_TANH
        assert hp.post_norms and hp.qk_norm and hp.tied_embeddings


def test_embedding_scale_rounds_as_its_formats_reference(tiny_checkpoints: TinyCheckpoints) -> None:
    """An HF checkpoint's scale is rounded to the model dtype first (transformers); a GGUF's
    product is float32, rounded once (llama.cpp). With bfloat16 and sqrt(640) (Gemma 3 270M:
    25.30, rounded 25.25) the two differ."""
    embedded = torch.linspace(-3, 3, 640).to(torch.bfloat16)[None, :]
    scale = math.sqrt(640)
    results = {}
    for path in (tiny_checkpoints.hf("gemma3"), tiny_checkpoints.gguf("gemma3")):
        tensors = open_tensors(path)
        hp = dataclasses.replace(tensors.hparams, embedding_scale=scale)
        assert hp.embedding_scale_rounded is path.is_dir()
        weights = load_weights(tensors, dtype=torch.bfloat16, device=CPU, kernel=LinearKernel.DENSE)
        model = DecoderModel(hp, weights, max_model_len=8, fused_decode=False)
        results[path.is_dir()] = model._scaled(embedded)
    assert torch.equal(results[True], embedded * torch.tensor(scale, dtype=torch.bfloat16))
    assert torch.equal(results[False], (embedded.float() * scale).to(torch.bfloat16))
    assert not torch.equal(results[True], results[False])


@pytest.mark.parametrize("chunk", [5, 40], ids=["decode-past-window", "prefill-past-window"])
@pytest.mark.parametrize("source", ["hf", "gguf-f32"])
def test_logits_equal_transformers(tiny_checkpoints: TinyCheckpoints, source: str, chunk) -> None:
    """60 positions: a first chunk of 5 then decode steps, or a chunk of 40 (longer than the
    window) then decode steps."""
    reference_path = tiny_checkpoints.hf("gemma3")
    path = reference_path if source == "hf" else tiny_checkpoints.gguf("gemma3", "F32")
    model = decoder_of(path, max_model_len=len(LONG_IDS))
    difference = _difference(model, _reference(reference_path), chunk=chunk)
    print(f"gemma3 {source} chunk {chunk}: max |logit difference| {difference:.2e}")
    assert difference <= TOLERANCE


def test_every_feature_shows_in_the_reference(tiny_checkpoints: TinyCheckpoints) -> None:
    """The forward without each Gemma feature is far from transformers' logits."""
    path = tiny_checkpoints.hf("gemma3")
    reference = _reference(path)
    tensors = open_tensors(path)
    hp = tensors.hparams
    assert hp.local_attention is not None
    dropped = {
        "window": dataclasses.replace(hp, local_attention=None),
        "local rope base": dataclasses.replace(
            hp,
            local_attention=dataclasses.replace(hp.local_attention, rope_freq_base=50000.0),
        ),
        "embedding scale": dataclasses.replace(hp, embedding_scale=None),
        "gelu": dataclasses.replace(hp, ffn_activation=Activation.SILU),
    }
    for feature, changed in dropped.items():
        difference = _difference(_decoder(changed, tensors), reference, chunk=40)
        assert difference > 100 * TOLERANCE, feature
    checkpoint = HFDirectory(path)
    unshifted = ModelTensors(checkpoint, dataclasses.replace(GEMMA3, hf_norm_shift=0.0), hp)
    assert _difference(_decoder(hp, unshifted), reference, chunk=40) > 100 * TOLERANCE
    model = _decoder(hp, tensors)
    layers = tuple(
        dataclasses.replace(layer, attn_post_norm=None, ffn_post_norm=None)
        for layer in model.weights.layers
    )
    model.weights = dataclasses.replace(model.weights, layers=layers)
    assert _difference(model, reference, chunk=40) > 100 * TOLERANCE


def test_attention_scale_is_query_pre_attn_scalar(tiny_checkpoints: TinyCheckpoints) -> None:
    """A query_pre_attn_scalar other than head_dim (the 27B's case): read from config.json,
    equal to transformers, and far from ``1 / sqrt(head_dim)``."""
    path = tiny_checkpoints.hf("gemma3", query_pre_attn_scalar=64)
    hp = open_tensors(path).hparams
    assert hp.attention_scale == 0.125
    reference = _reference(path)
    assert _difference(decoder_of(path, max_model_len=60), reference, chunk=40) <= TOLERANCE
    default = _decoder(dataclasses.replace(hp, attention_scale=None), open_tensors(path))
    assert _difference(default, reference, chunk=40) > 100 * TOLERANCE


def test_transformers4_config(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """config.json as Google's Gemma 3 files carry it (transformers 4): rope_theta,
    rope_local_base_freq and sliding_window_pattern at the top level, no layer_types."""
    source = tiny_checkpoints.hf("gemma3")
    path = Path(shutil.copytree(source, tmp_path / "tiny-gemma3-transformers4"))
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config.pop("_sliding_window_pattern", None)
    config |= {
        "rope_theta": rope["full_attention"]["rope_theta"],
        "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
        "rope_scaling": None,
        "sliding_window_pattern": 6,
    }
    (path / "config.json").write_text(json.dumps(config))
    assert open_tensors(path).hparams == open_tensors(source).hparams
    model = decoder_of(path, max_model_len=60)
    assert _difference(model, _reference(source), chunk=40) <= TOLERANCE


def test_gguf_window_keys_and_llama_cpp_defaults() -> None:
    """``sliding_window_pattern`` as a period or as per-layer flags, ``rope.freq_base_swa``,
    no window (every layer global); llama.cpp's attention scale, the 27B's included."""

    def reader(keys: dict):
        return lambda key, default: keys.get(key, default)

    def local(keys: dict, layers: int = 12):
        return gguf_local_attention(reader(keys), "gemma3", GEMMA3, layers)

    window = {"gemma3.attention.sliding_window": 512}
    defaults = local(window)
    assert defaults is not None and defaults.rope_freq_base == 10000.0
    assert defaults.layers == (True,) * 5 + (False,) + (True,) * 5 + (False,)
    flags = [True, False] * 6
    assert local(window | {"gemma3.attention.sliding_window_pattern": flags}).layers == tuple(flags)
    keys = window | {"gemma3.attention.sliding_window_pattern": 3, "gemma3.rope.freq_base_swa": 5e4}
    every_third = local(keys)
    assert every_third is not None and every_third.layers == periodic_layers(3, 12)
    assert every_third.rope_freq_base == 5e4
    assert local({}) is None
    assert periodic_layers(0, 3) == (True, True, True)
    scale = gguf_attention_scale(GEMMA3, block_count=18, hidden=640, heads=4, head_dim=256)
    assert scale is None  # 1 / sqrt(head_dim), the forward's default
    big = gguf_attention_scale(GEMMA3, block_count=62, hidden=5376, heads=32, head_dim=128)
    assert big == pytest.approx(168**-0.5)


def _transformers_greedy(path: Path, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy continuation (argmax over the full sequence each step; EOS does
    not stop it)."""
    model = load_transformers_model(path)
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(transformers_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def _serve(runner, prompts: list[list[int]], *, caching: bool, sampling) -> list[list[int]]:
    engine = SyncEngine(runner, prefix_caching=caching)
    handles = [
        engine.add(
            GenerationRequest(
                request_id=f"r{index}",
                prompt_token_ids=tuple(prompt),
                max_tokens=12,
                sampling=sampling,
                stop=StopCriteria(ignore_eos=True),
            )
        )
        for index, prompt in enumerate(prompts)
    ]
    engine.run_until_idle(max_steps=10_000)
    blocks = engine.scheduler.kv_blocks
    assert blocks is not None and blocks.num_used_blocks == 0
    outputs = []
    for handle in handles:
        assert handle.final is not None and handle.final.error is None
        outputs.append(list(handle.final.token_ids))
    return outputs


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded-greedy"])
def test_served_tokens_equal_transformers_with_prefix_caching_and_preemption(
    tiny_checkpoints: TinyCheckpoints, seeded: bool
) -> None:
    """Prompts of 45-47 tokens sharing 40 (two whole cached blocks, longer than the window),
    12 greedy tokens each: transformers' tokens with prefix caching off and on, and with a
    pool so small that decode preempts (seeded: the batch-invariant path)."""
    path = tiny_checkpoints.hf("gemma3")
    shared = LONG_IDS[:40]
    prompts = [shared + LONG_IDS[45 + i : 50 + 2 * i] for i in range(3)]
    expected = [_transformers_greedy(path, prompt, 12) for prompt in prompts]
    sampling = dataclasses.replace(GREEDY, seed=3, batch_invariant=True) if seeded else GREEDY
    roomy = load_checkpoint(path, max_num_seqs=3, max_model_len=64)
    assert _serve(roomy, prompts, caching=False, sampling=sampling) == expected
    assert _serve(roomy, prompts, caching=True, sampling=sampling) == expected
    block = kv_block_bytes(roomy.model.hparams, dtype=roomy.model.dtype)
    tiny = load_checkpoint(path, max_num_seqs=3, max_model_len=64, kv_cache_memory=8 * block)
    assert _serve(tiny, prompts, caching=True, sampling=sampling) == expected
    # the warm-up's chunk step covers a local and the first global layer; the tokens after
    # a warm-up are transformers' still
    assert roomy._warm_up_layers() == LOCAL.index(False) + 1
    roomy.warm_up(roomy.capabilities.default_max_num_batched_tokens)
    assert _serve(roomy, prompts, caching=True, sampling=sampling) == expected


def test_bfloat16_and_file_blocks_follow_float32(tiny_checkpoints: TinyCheckpoints) -> None:
    """bfloat16 on dense weights (the fused step's layer loop in Python over the fused kernels,
    the prompt on the torch path) and a Q8_0 / Q4_K GGUF on its own blocks, both close to
    float32 over a short prompt. Measured max |logit difference|: bfloat16 0.25
    (transformers' own bfloat16 against its float32: 0.32), Q8_0 blocks 0.59, Q4_K 0.48
    against the same file dequantised; six random layers whose norms multiply by ~2 amplify
    rounding, so a long prompt drifts further in either implementation."""
    path = tiny_checkpoints.hf("gemma3")
    full = sequence_logits(decoder_of(path, max_model_len=16), SHORT_IDS, chunk=5)
    half_model = decoder_of(path, dtype=torch.bfloat16, max_model_len=16)
    assert half_model.fused_decode is not None, half_model.fused_decode_status
    half = sequence_logits(half_model, SHORT_IDS, chunk=5)
    assert (half - full).abs().max().item() < 0.5
    for tensor_type in ("Q8_0", "Q4_K"):
        gguf_path = tiny_checkpoints.gguf("gemma3", tensor_type)
        dequantised = sequence_logits(decoder_of(gguf_path, max_model_len=16), SHORT_IDS, chunk=5)
        blocks = decoder_of(
            gguf_path, dtype=torch.bfloat16, quantization=Quantization.GGUF, max_model_len=16
        )
        assert blocks.weights.dense_projections == ()
        on_blocks = sequence_logits(blocks, SHORT_IDS, chunk=5)
        assert (on_blocks - dequantised).abs().max().item() < 1.0, tensor_type


def test_linear_rope_scaling_on_global_layers_only(tiny_checkpoints: TinyCheckpoints) -> None:
    """Gemma 3 4B-27B scale the rope of their global layers (linear, factor 8): read from
    config.json and from the GGUF's rope.scaling keys, applied to the global layer only (the
    local layers' tables take none); the same weights unscaled are far from transformers."""
    scaling = {"rope_type": "linear", "factor": 8.0}
    path = tiny_checkpoints.hf("gemma3", rope_scaling=scaling)
    gguf_path = tiny_checkpoints.gguf("gemma3", "F32", rope_scaling=scaling)
    reference = _reference(path)
    for source in (path, gguf_path):
        hp = open_tensors(source).hparams
        assert hp.rope_scaling is not None and hp.rope_scaling.factor == 8.0
        assert _difference(decoder_of(source, max_model_len=60), reference, chunk=40) <= TOLERANCE
    tensors = open_tensors(path)
    unscaled = _decoder(dataclasses.replace(tensors.hparams, rope_scaling=None), tensors)
    assert _difference(unscaled, reference, chunk=40) > 100 * TOLERANCE


def test_multimodal_directory_is_refused_by_name(tiny_checkpoints, tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration directory (model_type gemma3) is refused with what
    is served instead, not as an unknown architecture named like a supported one."""
    path = Path(shutil.copytree(tiny_checkpoints.hf("gemma3"), tmp_path / "multimodal"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "gemma3"}))
    with pytest.raises(ModelRefused, match="'gemma3' is a multimodal checkpoint .*'gemma3_text'"):
        load_checkpoint(path, max_num_seqs=1, max_model_len=16)
