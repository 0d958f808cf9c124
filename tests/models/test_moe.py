"""Mixtures of experts (Qwen3-MoE, Mixtral) against transformers' Qwen3MoeForCausalLM and
MixtralForCausalLM on tiny random-weight checkpoints (every layer 4 experts, 2 used a token),
from the HF directory (each expert's matrices) and from the GGUF as llama.cpp's converter writes
it (experts stacked in ``ffn_*_exps``, the router ``ffn_gate_inp`` in F32; Mixtral as
``general.architecture = llama``), served through the scheduler too.

Routing is shown to matter: without the renormalisation, or with one expert a token or all of
them, the logits are far from transformers'; and a step runs only the experts its tokens chose,
each once over the rows that chose it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from app.engine.request import GenerationRequest, StopCriteria
from app.engine.sync_engine import SyncEngine
from app.models.forward.decoder import DecoderModel
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KVCache
from app.models.load.plan import load_checkpoint
from app.models.weights.build import load_weights
from app.models.weights.projections import LinearKernel, Projection
from app.models.weights.record import Quantization
from tests.checkpoints import TinyCheckpoints, load_transformers_model, transformers_logits
from tests.models.stepping import CPU, GREEDY, decoder_of, open_tensors, sequence_logits

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |logit difference|, float32
IDS = [(17 + 131 * i) % 49000 + 100 for i in range(40)]
MOE = ("qwen3moe", "mixtral")


def _difference(model: DecoderModel, reference: torch.Tensor, chunk: int) -> float:
    return (sequence_logits(model, IDS, chunk=chunk) - reference[chunk - 1 :]).abs().max().item()


@pytest.mark.parametrize("architecture", MOE)
def test_experts_from_both_formats(tiny_checkpoints: TinyCheckpoints, architecture) -> None:
    ffn = 64 if architecture == "qwen3moe" else 256
    for path in (tiny_checkpoints.hf(architecture), tiny_checkpoints.gguf(architecture)):
        hp = open_tensors(path).hparams
        assert hp.experts is not None
        assert (hp.experts.count, hp.experts.used, hp.experts.feed_forward_length) == (4, 2, ffn)
        assert hp.experts.normalize
    gguf_hp = open_tensors(tiny_checkpoints.gguf(architecture)).hparams
    assert gguf_hp.architecture == ("llama" if architecture == "mixtral" else "qwen3moe")


@pytest.mark.parametrize("source", ["hf", "gguf-f32"])
@pytest.mark.parametrize("architecture", MOE)
def test_logits_equal_transformers(tiny_checkpoints: TinyCheckpoints, architecture, source) -> None:
    reference_path = tiny_checkpoints.hf(architecture)
    path = reference_path if source == "hf" else tiny_checkpoints.gguf(architecture, "F32")
    reference = transformers_logits(load_transformers_model(reference_path), IDS)
    for chunk in (5, 30):
        difference = _difference(decoder_of(path, max_model_len=48), reference, chunk)
        assert difference <= TOLERANCE, chunk


def test_routing_shows_in_the_reference(tiny_checkpoints: TinyCheckpoints) -> None:
    """Without renormalising the chosen experts' weights, with one expert a token, or with all
    four, the forward is far from transformers'; a config without norm_topk_prob is read as
    such and matches transformers too."""
    path = tiny_checkpoints.hf("qwen3moe")
    reference = transformers_logits(load_transformers_model(path), IDS)
    tensors = open_tensors(path)
    weights = load_weights(tensors, dtype=torch.float32, device=CPU, kernel=LinearKernel.DENSE)
    experts = tensors.hparams.experts
    assert experts is not None
    for changed in (
        dataclasses.replace(experts, normalize=False),
        dataclasses.replace(experts, used=1),
        dataclasses.replace(experts, used=4),
    ):
        hparams = dataclasses.replace(tensors.hparams, experts=changed)
        model = DecoderModel(hparams, weights, max_model_len=48)
        assert _difference(model, reference, 5) > 100 * TOLERANCE, changed
    plain = tiny_checkpoints.hf("qwen3moe", norm_topk_prob=False)
    plain_experts = open_tensors(plain).hparams.experts
    assert plain_experts is not None and not plain_experts.normalize
    plain_reference = transformers_logits(load_transformers_model(plain), IDS)
    assert _difference(decoder_of(plain, max_model_len=48), plain_reference, 5) <= TOLERANCE


@dataclass
class _Counted:
    """A projection that records the rows of every call."""

    inner: Projection
    calls: list[int]

    @property
    def exact_rows(self) -> int:
        return self.inner.exact_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.inner(x)


def test_a_step_runs_only_the_chosen_experts(tiny_checkpoints: TinyCheckpoints) -> None:
    """One decode row: at most two experts run in a layer, each over that one row; a prompt
    chunk of 12 tokens: each chosen expert once, over the rows that chose it (24 rows in all,
    two a token)."""
    model = decoder_of(tiny_checkpoints.hf("qwen3moe"), max_model_len=48)
    calls: list[int] = []
    layer = model.weights.layers[0]
    assert layer.experts is not None
    counted = tuple(_Counted(p, calls) for p in layer.experts.gate_up)
    layers = list(model.weights.layers)
    layers[0] = dataclasses.replace(
        layer, experts=dataclasses.replace(layer.experts, gate_up=counted)
    )
    model.weights = dataclasses.replace(model.weights, layers=tuple(layers))
    cache = KVCache(model.hparams, max_num_seqs=1, max_model_len=48, dtype=model.dtype, device=CPU)
    with torch.inference_mode():
        model.forward(ForwardPlan.build([RowSpec(0, IDS[:12], 0, True)], cache=cache), cache)
        assert sum(calls) == 24 and len(calls) <= 4
        calls.clear()
        model.forward(ForwardPlan.build([RowSpec(0, IDS[12:13], 12, True)], cache=cache), cache)
        assert calls == [1, 1]


@pytest.mark.parametrize("architecture", MOE)
def test_file_blocks_and_served_tokens(tiny_checkpoints: TinyCheckpoints, architecture) -> None:
    """A Q8_0 file's experts on their own blocks (each expert a share of the stack's rows),
    close to the same file dequantised; greedy tokens through the scheduler equal
    transformers'."""
    q8 = tiny_checkpoints.gguf(architecture, "Q8_0")
    dequantised = sequence_logits(decoder_of(q8, max_model_len=16), IDS[:13], chunk=5)
    blocks = decoder_of(q8, dtype=torch.bfloat16, quantization=Quantization.GGUF, max_model_len=16)
    assert blocks.weights.dense_projections == ()
    assert "mixture of experts" in blocks.fused_decode_status
    assert (sequence_logits(blocks, IDS[:13], chunk=5) - dequantised).abs().max().item() < 0.2
    path = tiny_checkpoints.hf(architecture)
    model = load_transformers_model(path)
    tokens = list(IDS[:20])
    for _ in range(8):
        tokens.append(int(transformers_logits(model, tokens)[-1].argmax()))
    engine = SyncEngine(load_checkpoint(path, max_num_seqs=1, max_model_len=32))
    handle = engine.add(
        GenerationRequest("r", tuple(IDS[:20]), 8, GREEDY, stop=StopCriteria(ignore_eos=True))
    )
    engine.run_until_idle(max_steps=100)
    assert handle.final is not None and list(handle.final.token_ids) == tokens[20:]
