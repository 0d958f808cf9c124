"""``sl_decode_layers`` (app/models/kernels/fused_decode_layers.c): the fused step's layer loop
in one C call computes bit for bit what the Python loop over the same kernels computes, for
every Llama-style block (Qwen2's QKV bias, Qwen3's q/k norm) and Gemma 3's, decode rows of
several slots and the single-token rows of a short prompt chunk; and the model takes it only
where every projection is on GGUF blocks."""

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
PROMPTS = [[1, 17, 29, 33, 41], [1, 5, 9], [1, *range(40, 59)]]  # the last one passes the
# tiny Gemma 3's window of 21 during the steps
CHUNK = [1, 8, 6, 7]


def _steps(model: DecoderModel, *, in_c: bool = True) -> list[torch.Tensor]:
    """Every step's logits with the layer loop in C (``in_c``) or in Python (the same tokens
    fed in both; a float32 model: its eager path)."""
    model.decode_layers = in_c
    cache = KVCache(model.hparams, max_num_seqs=4, max_model_len=64, dtype=model.dtype, device=CPU)
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
            logits = model.forward(plan, cache)
            outputs.append(logits)
            tokens = [3 + (7 * step + 5 * slot) % 50 for slot in range(3)]  # teacher-forced
            lengths = [length + 1 for length in lengths]
    model.decode_layers = True
    return outputs


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "gemma3"])
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


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_K"])
def test_gemma3_blocks_in_c_follow_float32_as_the_eager_path_does(
    tiny_checkpoints, tensor_type: str
) -> None:
    """Gemma 3's block (norms after attention and MLP, GELU, windowed local layers with their
    own rope, the scaled embedding, its attention scale) in the C layer loop: as close to the
    same file in float32 as the eager bfloat16 path on the same blocks, past the window (slot
    2 reaches position 24; the window is 21 on five of six layers). Measured max |logit
    difference| from the float32 decode of the file (no 8-bit activations): Q8_0 0.88 in C, 0.78
    eager, and the same error per row past the window. (Greedy agreement on a random tiny
    model is mostly near-ties: 14 against 17 of 19 rows here, so it is not asserted.)"""
    path = tiny_checkpoints.gguf("gemma3", tensor_type)
    model = decoder_of(path, dtype=BF16, quantization=Quantization.GGUF, max_model_len=64)
    assert model.fused_decode is not None, model.fused_decode_status
    in_c = _steps(model, in_c=True)
    assert model._layout is not None and model._layout[1][0] is not None  # it ran in C
    kernels, model.fused_decode = model.fused_decode, None
    eager = _steps(model)  # without the fused kernels: the eager path
    model.fused_decode = kernels
    float32 = _steps(decoder_of(path, max_model_len=64))
    worst = {"c": 0.0, "eager": 0.0}
    total = {"c": 0.0, "eager": 0.0}
    for c_logits, eager_logits, reference in zip(in_c, eager, float32, strict=True):
        for name, logits in (("c", c_logits), ("eager", eager_logits)):
            error = (logits.float() - reference).abs()
            worst[name] = max(worst[name], error.max().item())
            total[name] += error.mean().item()
    assert worst["c"] <= 1.3 * worst["eager"], worst
    assert total["c"] <= 1.2 * total["eager"], total
