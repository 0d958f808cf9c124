"""Q4_1 codes read from the SmolLM2 GGUF (Q4_0 ones from a tiny GGUF), and the int4 projection
built on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.models.checkpoints.model_tensors import ModelTensors
from app.models.checkpoints.q4_codes import Q4Codes
from app.models.load.plan import LoadOptions, plan_load
from app.models.load.smollm2 import smollm2_gguf_path
from app.models.refusal import ModelRefused
from app.models.weights.int4 import (
    INT4_MAX_ROWS,
    Int4Linear,
    int4_dequantize,
    int4_kernel_status,
    q4_1_scale_and_zero,
)
from app.models.weights.projections import LinearKernel, select_linear_kernel
from tests.models.stepping import open_tensors

KERNEL_AVAILABLE, KERNEL_REASON = int4_kernel_status()
needs_kernel = pytest.mark.skipif(not KERNEL_AVAILABLE, reason=KERNEL_REASON)


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Frobenius norm of the difference over the reference's."""
    return float((value.double() - reference.double()).norm() / reference.double().norm())


@pytest.fixture(scope="module")
def smollm2() -> ModelTensors:
    return open_tensors(smollm2_gguf_path())


@pytest.mark.parametrize("part, layer", [("attn_q", 0), ("attn_k", 0), ("ffn_down", 7)])
def test_q4_1_codes_match_gguf_dequantize(smollm2: ModelTensors, part: str, layer: int) -> None:
    """codes * d + m is, bit for bit, what gguf's dequantize gives (Q/K rows un-permuted)."""
    assert smollm2.tensor_type(part, layer) == "Q4_1"
    q4 = smollm2.q4_codes(part, layer)
    assert q4 is not None
    reference = smollm2.read(part, layer)
    assert q4.codes.dtype == np.uint8 and q4.codes.shape == reference.shape
    assert q4.d.shape == q4.m.shape == (reference.shape[0], reference.shape[1] // 32)
    assert q4.d.dtype == q4.m.dtype == np.float32
    assert int(q4.codes.max()) <= 15
    np.testing.assert_array_equal(q4.dequantize(), reference)


def test_q4_0_codes_match_gguf_dequantize(tiny_checkpoints) -> None:
    """Q4_0's d * (q - 8) comes back as Q4_1 codes with m = -8d, bit for bit."""
    tensors = open_tensors(tiny_checkpoints.gguf("llama", "Q4_0"))
    for part in ("attn_q", "attn_k", "ffn_up"):
        assert tensors.tensor_type(part, 1) == "Q4_0"
        q4 = tensors.q4_codes(part, 1)
        assert q4 is not None and int(q4.codes.max()) <= 15
        np.testing.assert_array_equal(q4.dequantize(), tensors.read(part, 1))


def test_int4_refuses_a_file_whose_projections_are_not_4_bit(tiny_checkpoints) -> None:
    path = tiny_checkpoints.gguf("llama", "Q8_0")
    assert open_tensors(path).q4_codes("attn_q", 0) is None
    options = LoadOptions(max_num_seqs=1, dtype="bfloat16", quantization="int4")
    with pytest.raises(ModelRefused, match=r"int4 needs Q4_0/Q4_1 projections; blk\.0\..* is Q8_0"):
        plan_load(str(path), options)


def test_scale_and_zero_approximate_q4_1() -> None:
    """bfloat16 (scale, zero) keep the weights within bfloat16 rounding of d and m + 8d."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(32, 64), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, size=(32, 2)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0, 0.2, size=(32, 2)).astype(np.float16).astype(np.float32)
    scale, zero = q4_1_scale_and_zero(codes, d, m)
    assert scale.dtype == zero.dtype == torch.bfloat16
    exact = torch.from_numpy(d.repeat(32, axis=1) * codes + m.repeat(32, axis=1))
    approx = int4_dequantize(torch.from_numpy(codes), scale, zero)
    bound = 2.0**-8 * (8 * d + np.abs(m + 8 * d)).repeat(32, axis=1)
    assert bool(((approx - exact).abs() <= torch.from_numpy(bound)).all())


@pytest.fixture(scope="module")
def qkv(smollm2: ModelTensors) -> tuple[Int4Linear, torch.Tensor, torch.Tensor]:
    """Layer 3's fused QKV as Int4Linear (dense wide path), the weights the int4 kernel uses and
    the exact Q4_1 weights, both float32 ``[960, 576]``."""
    if not KERNEL_AVAILABLE:
        pytest.skip(KERNEL_REASON)
    parts = [smollm2.q4_codes(f"attn_{p}", 3) for p in "qkv"]
    linear = Int4Linear.from_codes(parts)
    codes = np.concatenate([p.codes for p in parts])
    scale, zero = q4_1_scale_and_zero(
        codes, np.concatenate([p.d for p in parts]), np.concatenate([p.m for p in parts])
    )
    exact = torch.from_numpy(np.concatenate([p.dequantize() for p in parts]))
    return linear, int4_dequantize(torch.from_numpy(codes), scale, zero), exact


@needs_kernel
def test_int4_kernel_computes_the_dequantised_weights(qkv) -> None:
    """One-hot rows read the kernel's weights back: (q - 8) * scale + zero, rounded to bf16."""
    linear, weight, _ = qkv
    assert (linear.out_features, linear.in_features) == (960, 576)
    eye = torch.eye(576, dtype=torch.bfloat16)
    read_back = torch.cat([linear.int4(eye[i : i + 4]) for i in range(0, 576, 4)])
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        torch.testing.assert_close(read_back, weight.t().to(torch.bfloat16), rtol=0, atol=0)
    else:  # the AVX2 kernel dequantises with two roundings: the last bfloat16 bit may differ
        torch.testing.assert_close(read_back, weight.t().to(torch.bfloat16))


@needs_kernel
def test_int4_matches_the_float32_matmul(qkv) -> None:
    linear, weight, _ = qkv
    x = torch.randn(INT4_MAX_ROWS, 576, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    reference = x.double() @ weight.double().t()
    assert _relative(linear(x), reference) < 4e-3  # bfloat16 output rounding alone: ~1.7e-3


@needs_kernel
def test_int4_rows_are_batch_invariant(qkv) -> None:
    """A row's result is bit-identical whatever the other rows of the call, up to the limit."""
    linear, _, _ = qkv
    x = torch.randn(INT4_MAX_ROWS, 576, generator=torch.Generator().manual_seed(2))
    x = x.to(torch.bfloat16)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(INT4_MAX_ROWS)])
    for rows in range(2, INT4_MAX_ROWS + 1):
        assert torch.equal(linear(x[:rows]), alone[:rows])


@needs_kernel
def test_add_to_leaves_the_residual_alone(qkv) -> None:
    linear, _, _ = qkv
    generator = torch.Generator().manual_seed(3)
    for rows in (1, INT4_MAX_ROWS + 3):
        x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
        residual = torch.randn(rows, 960, generator=generator).to(torch.bfloat16)
        before = residual.clone()
        out = linear.add_to(residual, x)
        assert torch.equal(residual, before)
        assert _relative(out, residual + linear(x)) < 4e-3


@needs_kernel
def test_wide_path_agrees_with_the_int4_kernel(qkv) -> None:
    """Above INT4_MAX_ROWS the exact Q4_1 weights rounded to bfloat16 compute each row."""
    linear, weight, exact = qkv
    assert torch.equal(linear.wide.weight, exact.to(torch.bfloat16))
    rows = INT4_MAX_ROWS + 5
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    wide = linear(x)
    assert torch.equal(wide, linear.wide(x))
    by_int4 = torch.cat([linear.int4(x[i : i + 1]) for i in range(rows)])
    assert _relative(wide, x.double() @ exact.double().t()) < 3e-3
    assert _relative(by_int4, x.double() @ weight.double().t()) < 3e-3
    assert _relative(by_int4, x.double() @ exact.double().t()) < 4e-3
    assert _relative(wide, by_int4) < 4e-3  # a few elements differ by a bfloat16 ulp or two


@needs_kernel
def test_onednn_wide_path(smollm2: ModelTensors) -> None:
    kernel, reason = select_linear_kernel(torch.device("cpu"), torch.bfloat16)
    if kernel is not LinearKernel.ONEDNN:
        pytest.skip(reason)
    codes = smollm2.q4_codes("ffn_down", 1)
    dense = Int4Linear.from_codes(codes)
    packed = Int4Linear.from_codes(codes, kernel=kernel)
    x = torch.randn(INT4_MAX_ROWS + 1, 1536, generator=torch.Generator().manual_seed(5))
    x = x.to(torch.bfloat16)
    assert _relative(packed(x), dense(x)) < 4e-3
    assert torch.equal(packed(x[:1]), dense(x[:1]))  # the same int4 kernel


def test_from_codes_checks_shapes() -> None:
    codes = np.zeros((24, 64), dtype=np.uint8)  # 24 output rows: not a multiple of 16
    d = np.ones((24, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="% 16"):
        Int4Linear.from_codes(Q4Codes(codes, d, d))
    with pytest.raises(ValueError, match="groups of 32"):
        Int4Linear.from_codes(Q4Codes(np.zeros((16, 48), dtype=np.uint8), d[:16], d[:16]))
