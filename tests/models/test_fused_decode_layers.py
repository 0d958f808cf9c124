"""``sl_decode_layers`` (app/models/kernels/fused_decode_layers.c): the fused step's layer loop
in one C call computes bit for bit what the Python loop over the same kernels computes, for
every Llama-style block (Qwen2's QKV bias, Qwen3's q/k norm), decode rows of several slots and
the single-token rows of a short prompt chunk; and the model takes it only where every
projection is on GGUF blocks."""

from __future__ import annotations

import pytest
import torch

from app.models.forward.decoder import DecoderModel
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import KVCache
from app.models.kernels.fused_decode import load_fused_decode
from app.models.kernels.ggml_quant import load_ggml_quant
from app.models.weights.record import Quantization
from tests.checkpoints import ARCHITECTURES
from tests.models.stepping import decoder_of

BF16 = torch.bfloat16
CPU = torch.device("cpu")

pytestmark = [
    pytest.mark.skipif(load_fused_decode()[0] is None, reason=load_fused_decode()[1]),
    pytest.mark.skipif(load_ggml_quant()[0] is None, reason=load_ggml_quant()[1]),
]

# Three slots' prompts (prefilled eagerly), then steps of: decode rows of all three; decode
# rows beside a short prompt chunk of a fourth slot (single-token rows of one sequence).
PROMPTS = [[1, 17, 29, 33, 41], [1, 5, 9], [1, 60, 61, 62, 63, 64, 65]]
CHUNK = [1, 8, 6, 7]


def _steps(model: DecoderModel, *, in_c: bool) -> list[torch.Tensor]:
    """Every step's logits with the layer loop in C (``in_c``) or in Python."""
    model.decode_layers = in_c
    cache = KVCache(model.hparams, max_num_seqs=4, max_model_len=64, dtype=BF16, device=CPU)
    outputs = []
    with torch.inference_mode():
        for slot, prompt in enumerate(PROMPTS):
            model.forward(ForwardPlan.build([RowSpec(slot, prompt, 0, False)], cache=cache), cache)
        tokens, lengths = [3, 4, 5], [len(p) for p in PROMPTS]
        for step in range(6):
            rows = [RowSpec(slot, [tokens[slot]], lengths[slot], True) for slot in range(3)]
            if step == 2:
                rows.append(RowSpec(3, CHUNK, 0, True))
            plan = ForwardPlan.build(rows, cache=cache)
            assert plan.token_rows is not None  # the fused step
            logits = model.forward(plan, cache)
            outputs.append(logits)
            tokens = logits[:3].argmax(-1).tolist()
            lengths = [length + 1 for length in lengths]
    model.decode_layers = True
    return outputs


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q8_0"])
def test_the_c_layer_loop_equals_the_python_one(
    tiny_checkpoints, architecture: str, tensor_type: str
) -> None:
    path = tiny_checkpoints.gguf(architecture, tensor_type)
    model = decoder_of(path, dtype=BF16, quantization=Quantization.GGUF, max_model_len=64)
    assert model.fused_decode is not None, model.fused_decode_status
    in_c = _steps(model, in_c=True)
    assert model._layout is not None and model._layout[1][0] is not None  # it ran in C
    in_python = _steps(model, in_c=False)
    for c_logits, python_logits in zip(in_c, in_python, strict=True):
        assert torch.equal(c_logits, python_logits)


def test_dense_projections_keep_the_python_loop(tiny_checkpoints) -> None:
    """A bfloat16 file's projections are dense: no C layout, the same logits as before."""
    model = decoder_of(tiny_checkpoints.gguf("llama", "F32"), dtype=BF16, max_model_len=64)
    cache = KVCache(model.hparams, max_num_seqs=1, max_model_len=64, dtype=BF16, device=CPU)
    assert model._decoder_layout(cache, 1) is None
