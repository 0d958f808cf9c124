"""The fused CPU decode kernels (app/models/fused_decode_*.c) compute what the eager torch ops
do, the model takes them only for the steps they are meant for, and a machine that cannot
build them still serves."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from app.models.forward import forward_plan
from app.models.forward.decoder import DecoderModel, apply_rope
from app.models.forward.forward_plan import FUSED_PREFILL_MAX_TOKENS, ForwardPlan, RowSpec
from app.models.forward.fused_step import greedy_argmax
from app.models.forward.kv_cache import KV_BLOCK_SIZE, KVCache
from app.models.kernels import fused_decode
from app.models.kernels.fused_decode import FusedDecodeKernels, load_fused_decode
from app.models.load.plan import load_checkpoint
from app.models.runner import ModelRunner
from tests.checkpoints import ARCHITECTURES
from tests.models.stepping import decoder_of

BF16 = torch.bfloat16
CPU = torch.device("cpu")
HAS_COMPILER = any(shutil.which(name) for name in ("cc", "gcc", "clang"))


@pytest.fixture(scope="module")
def kernels() -> FusedDecodeKernels:
    if not HAS_COMPILER:
        pytest.skip("no C compiler: the model uses its eager path (tested below)")
    loaded, how = load_fused_decode()
    assert loaded is not None, how  # a compiler is here: the build must work
    return loaded


@pytest.fixture
def fresh_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``load_fused_decode`` with an empty build cache, forgotten again afterwards."""
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    load_fused_decode.cache_clear()
    yield tmp_path
    load_fused_decode.cache_clear()


def _random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(BF16)


def _share_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


# --------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("with_weight", [False, True])
def test_rms_norm_matches_the_eager_norm(kernels: FusedDecodeKernels, with_weight: bool) -> None:
    wide = _random(5, 700, seed=1, scale=3.0)
    x = wide[:, :576]  # a row stride wider than the row, as a slice of a projection has
    weight = _random(576, seed=2) if with_weight else None
    expected_inv = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(BF16)
    expected = x * expected_inv
    if weight is not None:
        expected = expected * weight
    got = kernels.rms_norm(x, weight, 1e-5)
    assert got.shape == (5, 576) and got.is_contiguous()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    assert _share_equal(got, expected) > 0.99


def test_rms_norm_adds_the_residual_into_x_first(kernels: FusedDecodeKernels) -> None:
    x, residual = _random(3, 576, seed=3), _random(3, 576, seed=4)
    summed = x + residual
    got = kernels.rms_norm(x, None, 1e-6, residual=residual)
    assert torch.equal(x, summed)  # x now holds the new hidden state
    expected = summed * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(BF16)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("residual", [False, True])
def test_the_row_kernels_on_threads_give_the_one_threads_bits(
    kernels: FusedDecodeKernels, residual: bool
) -> None:
    """From 4 rows the norm and the activations share their rows among threads; each row is
    computed alone, so 2 threads give 1 thread's bits (a strided x included)."""
    weight = _random(576, seed=12)
    results = []
    for threads in (1, 2):
        wide = _random(9, 700, seed=10, scale=3.0)
        x = wide[:, :576]
        add = _random(9, 576, seed=11) if residual else None
        normed = kernels.rms_norm(x, weight, 1e-5, residual=add, threads=threads)
        gate_up = _random(9, 2 * 640, seed=13, scale=4.0)
        results.append(
            (
                normed,
                x.clone(),
                kernels.gelu_tanh_mul(gate_up, threads=threads),
                kernels.silu_mul(gate_up, threads=threads),
            )
        )
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)
    assert not torch.equal(results[0][2], results[0][3])  # the two activations differ


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_is_torchs_argmax(kernels: FusedDecodeKernels, dtype: torch.dtype) -> None:
    """Random rows of several widths (a tail past the 16 lanes too), rows of a wider tensor,
    and the edge cases: ties (the first index), +0 / -0, a row of -inf, NaN (the first one
    wins, as torch counts NaN the largest), +inf."""
    generator = torch.Generator().manual_seed(21)
    for vocab in (1, 17, 1000, 49152 + 5):
        x = torch.randn(7, vocab, generator=generator).to(dtype)
        assert torch.equal(kernels.argmax_rows(x, threads=2), x.argmax(dim=-1))
    wide = torch.randn(5, 300, generator=generator).to(dtype)
    assert torch.equal(kernels.argmax_rows(wide[:, :250]), wide[:, :250].argmax(dim=-1))
    edges = torch.zeros(6, 100, dtype=dtype)
    edges[0, [40, 90, 7]] = torch.tensor([3.0, 3.0, 2.0], dtype=dtype)
    edges[1] = -0.0
    edges[1, 50] = 0.0
    edges[2] = float("-inf")
    edges[3, [30, 60, 5]] = torch.tensor([float("nan"), float("nan"), float("inf")], dtype=dtype)
    edges[4, 99] = float("inf")
    edges[5, 33] = 1.0  # the maximum in one lane, the lanes' first indices tie below it
    got = kernels.argmax_rows(edges, threads=2)
    assert torch.equal(got, edges.argmax(dim=-1))
    assert got.tolist() == [40, 0, 0, 30, 99, 33]
    with pytest.raises(ValueError, match="unit column stride"):
        kernels.argmax_rows(torch.ones(4, 8).t())


def test_the_samplers_argmax_takes_the_kernel_where_it_fits(kernels: FusedDecodeKernels) -> None:
    """The runner's greedy argmax: the kernel for bfloat16 / float32 rows, torch for others;
    none without the kernels (the sampler's own)."""
    assert greedy_argmax(None) is None
    argmax = greedy_argmax(kernels)
    assert argmax is not None
    x = torch.randn(3, 4099, generator=torch.Generator().manual_seed(5))
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.float64):
        assert torch.equal(argmax(x.to(dtype)), x.to(dtype).argmax(dim=-1))
    assert torch.equal(argmax(x.t().contiguous().t()), x.argmax(dim=-1))  # strided columns


def test_a_wrong_dtype_or_layout_is_refused(kernels: FusedDecodeKernels) -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.rms_norm(torch.ones(2, 576), None, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.silu_mul(_random(8, 4, seed=0).t())


def test_silu_mul_matches_the_eager_ops(kernels: FusedDecodeKernels) -> None:
    gate_up = _random(4, 2 * 1536, seed=5, scale=4.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 200.0, -200.0])
    expected = F.silu(gate_up[:, :1536]).mul_(gate_up[:, 1536:])
    got = kernels.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-30)
    assert _share_equal(got, expected) > 0.99


def _round_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32: fused_decode.h's rounding."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32)


def _exp_approx(x: np.ndarray) -> np.ndarray:
    """fused_decode.h's exp_approx, operation for operation in float32 (no fused multiply-adds:
    the library is built with -std=c11, which does not contract)."""
    f = np.float32
    x = np.where(x < f(-87.0), f(-87.0), np.where(x > f(88.0), f(88.0), x)).astype(f)
    n = (x * f(1.44269504) + f(12582912.0)) - f(12582912.0)
    r = (x - n * f(0.693359375)) - n * f(-2.12194440e-4)
    poly = f(1.0) / f(720.0)
    for coefficient in (f(1.0) / f(120.0), f(1.0) / f(24.0), f(1.0) / f(6.0), f(0.5), 1.0, 1.0):
        poly = poly * r + f(coefficient)
    scale = ((n.astype(np.int32) + 127).astype(np.uint32) << 23).view(f)
    return poly * scale


def test_silu_mul_is_its_formula_for_every_bfloat16_gate(kernels: FusedDecodeKernels) -> None:
    """Every one of the 65,536 bfloat16 gate values, against the C formula emulated in numpy:
    the same bits. The kernel computes exp(-gate) into a buffer before dividing (one loop made
    GCC divide by 1 + exp(88) in every lane: a denormal for ordinary gates, 8-14x the time);
    this pins that the split changed no value, infinities and NaNs included."""
    ffn = 65536
    gates = torch.arange(ffn, dtype=torch.int32).to(torch.int16).view(BF16)
    ups = _random(ffn, seed=11, scale=3.0)
    got = kernels.silu_mul(torch.cat([gates, ups])[None])[0].float().numpy()
    g = gates.float().numpy()
    with np.errstate(all="ignore"):
        activated = _round_bf16(g / (np.float32(1.0) + _exp_approx(-g)))
        expected = _round_bf16(activated * ups.float().numpy())
    nan = np.isnan(g) | np.isnan(expected)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def _scattered_tables(num_slots: int, cache_len: int, seed: int) -> torch.Tensor:
    """``[num_slots, cache_len / KV_BLOCK_SIZE]`` block tables over a shuffled pool (block 0,
    the null block, in none of them)."""
    per_slot = cache_len // KV_BLOCK_SIZE
    order = torch.randperm(num_slots * per_slot, generator=torch.Generator().manual_seed(seed))
    return (order + 1).view(num_slots, per_slot)


def _to_pool(per_slot: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[slots, heads, L, D]`` -> the paged layout ``[heads, blocks * KV_BLOCK_SIZE, D]``."""
    slots, heads, length, head_dim = per_slot.shape
    pool = torch.zeros(heads, (1 + tables.numel()) * KV_BLOCK_SIZE, head_dim, dtype=per_slot.dtype)
    for slot in range(slots):
        for index, block in enumerate(tables[slot].tolist()):
            span = slice(index * KV_BLOCK_SIZE, (index + 1) * KV_BLOCK_SIZE)
            pool[:, block * KV_BLOCK_SIZE : (block + 1) * KV_BLOCK_SIZE] = per_slot[slot, :, span]
    return pool


def _from_pool(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_to_pool``."""
    positions = (tables[:, :, None] * KV_BLOCK_SIZE + torch.arange(KV_BLOCK_SIZE)).flatten(1)
    return torch.stack([pool[:, row] for row in positions])


@pytest.mark.parametrize(
    ("threads", "positions"),
    [
        (1, [0, 17, 40, 2]),
        (2, [0, 17, 40, 2]),  # under SPLIT_MIN_POSITIONS: one thread
        (2, [0, 170, 250, 2]),
        (3, [0, 170, 250, 2]),
        (2, [250, 251, 252, 253]),  # rows of about one length: split at their middles
        (3, [252]),  # one long row: its KV heads shared by the threads
    ],
)
def test_decode_attention_writes_the_cache_and_attends_like_sdpa(
    kernels: FusedDecodeKernels, threads: int, positions: list[int]
) -> None:
    """Each row the same whatever the thread count: the threads split the (row, KV head)
    pairs, never one head's attention."""
    n_heads, n_kv, head_dim, cache_len = 9, 3, 64, 256
    count = len(positions)
    slots = torch.tensor([3, 0, 5, 1][:count])  # not in slot order
    positions = torch.tensor(positions)
    tables = _scattered_tables(6, cache_len, seed=9)
    keys_before = _random(6, n_kv, cache_len, head_dim, seed=6)
    values_before = _random(6, n_kv, cache_len, head_dim, seed=7)
    qkv = _random(count, (n_heads + 2 * n_kv) * head_dim, seed=8, scale=2.0)
    angles = torch.arange(cache_len, dtype=torch.float64)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, head_dim // 2, dtype=torch.float64) / (head_dim // 2))
    )
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(BF16)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(BF16)
    scores = torch.empty((threads, n_heads // n_kv * cache_len), dtype=torch.float32)

    def attend(keys: torch.Tensor, values: torch.Tensor, threads: int) -> torch.Tensor:
        return kernels.decode_attention(
            qkv, cos, sin, positions, tables[slots].contiguous(), keys, values, scores[:threads],
            n_heads=n_heads, n_kv_heads=n_kv, threads=threads,
        )  # fmt: skip

    pooled_keys, pooled_values = _to_pool(keys_before, tables), _to_pool(values_before, tables)
    got = attend(pooled_keys, pooled_values, threads)
    alone = attend(_to_pool(keys_before, tables), _to_pool(values_before, tables), 1)
    assert torch.equal(got, alone)
    assert not pooled_keys[:, :KV_BLOCK_SIZE].any()  # the null block is never written
    keys, values = _from_pool(pooled_keys, tables), _from_pool(pooled_values, tables)

    heads = qkv.view(count, -1, head_dim)
    rotated = apply_rope(
        heads[:, : n_heads + n_kv], cos[positions][:, None], sin[positions][:, None]
    )
    expected_keys, expected_values = keys_before.clone(), values_before.clone()
    for row, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        expected_keys[slot, :, position] = rotated[row, n_heads:]
        expected_values[slot, :, position] = heads[row, n_heads + n_kv :]
    # The rope rounds as the eager path does, and nothing else in the cache moved.
    assert torch.equal(keys, expected_keys)
    assert torch.equal(values, expected_values)
    for row, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        q = rotated[row, :n_heads].float()[None, :, None, :]  # [1, heads, 1, D]
        k = expected_keys[slot, :, : position + 1].float()[None]
        v = expected_values[slot, :, : position + 1].float()[None]
        reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).reshape(-1)
        torch.testing.assert_close(got[row].float(), reference, rtol=2**-7, atol=2e-3)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_a_windowed_row_attends_to_its_window_only(
    kernels: FusedDecodeKernels, window: int, head_dim: int
) -> None:
    """Gemma 3's local layers: with ``window``, a row at position p attends to positions
    p - window + 1 .. p (windows inside one block, across block edges, longer than the row),
    with the model's own score factor. A head of 64 takes the tiles where the CPU has them
    (AVX-512 BF16 or AVX2), from a window's first position inside a block; 32, the portable
    loops."""
    _attend_windowed(kernels, 4, 1, head_dim, window)


@pytest.fixture(scope="module")
def avx2_kernels() -> Iterator[FusedDecodeKernels]:
    """The library built as ``SLOTSERVE_GGML_ISA=avx2`` builds it (the AVX2 tiles), on a CPU
    with AVX2 and FMA."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not HAS_COMPILER or not {"avx2", "fma"} <= set(flags.split()):
        pytest.skip("no C compiler, or no AVX2 and FMA here")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLOTSERVE_GGML_ISA", "avx2")
        load_fused_decode.cache_clear()
        loaded, how = load_fused_decode()
    load_fused_decode.cache_clear()
    assert loaded is not None, how
    yield loaded


@pytest.mark.parametrize("window", [0, 5, 17, 40])
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "head_dim"),
    [(1, 1, 64), (2, 1, 64), (9, 3, 64), (4, 1, 256), (5, 1, 128), (8, 2, 64), (16, 1, 64)],
)
def test_the_avx2_tiles_attend_like_sdpa(
    avx2_kernels: FusedDecodeKernels, n_heads: int, n_kv: int, head_dim: int, window: int
) -> None:
    """The AVX2 tiles (every head count of their switches, heads of 64 to 256, windows whose
    first position falls inside a block, rows ending mid-block) on any CPU with AVX2."""
    _attend_windowed(avx2_kernels, n_heads, n_kv, head_dim, window)


def _attend_windowed(
    kernels: FusedDecodeKernels, n_heads: int, n_kv: int, head_dim: int, window: int
) -> None:
    """Three rows at positions 3, 20 and 47 of scattered tables, against SDPA over their
    window (``window`` 0: every position)."""
    cache_len = 64
    slots = torch.tensor([2, 0, 1])
    positions = torch.tensor([3, 20, 47])
    tables = _scattered_tables(3, cache_len, seed=4)
    keys_before = _random(3, n_kv, cache_len, head_dim, seed=1)
    values_before = _random(3, n_kv, cache_len, head_dim, seed=2)
    qkv = _random(3, (n_heads + 2 * n_kv) * head_dim, seed=3, scale=2.0)
    cos = torch.ones(cache_len, head_dim, dtype=BF16)  # no rotation: the reference stays plain
    sin = torch.zeros(cache_len, head_dim, dtype=BF16)
    scores = torch.empty((1, n_heads // n_kv * cache_len), dtype=torch.float32)
    pooled_keys, pooled_values = _to_pool(keys_before, tables), _to_pool(values_before, tables)
    got = kernels.decode_attention(
        qkv, cos, sin, positions, tables[slots].contiguous(), pooled_keys, pooled_values, scores,
        n_heads=n_heads, n_kv_heads=n_kv, window=window, scale=0.125,
    )  # fmt: skip
    keys, values = _from_pool(pooled_keys, tables), _from_pool(pooled_values, tables)
    heads = qkv.view(3, -1, head_dim)
    for row, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        first = max(0, position + 1 - window) if window else 0
        q = heads[row, :n_heads].float()[None, :, None, :]
        k = keys[slot, :, first : position + 1].float()[None]
        v = values[slot, :, first : position + 1].float()[None]
        reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.125)
        torch.testing.assert_close(got[row].float(), reference.reshape(-1), rtol=2**-7, atol=2e-3)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_of_one_sequence_see_each_other_causally(
    kernels: FusedDecodeKernels, threads: int
) -> None:
    """A prompt chunk given as one row per token, in one call (its rows sharing one block
    table, split among the threads) computes bit for bit what one call per token, in order,
    computes: every row's key and value are written before any row attends. Positions 30-52
    cross two block boundaries; the 30 before them are a cached prefix."""
    n_heads, n_kv, head_dim, cache_len, first, count = 9, 3, 64, 64, 30, 23
    table = _scattered_tables(1, cache_len, seed=21)
    keys = _to_pool(_random(1, n_kv, cache_len, head_dim, seed=22), table)
    values = _to_pool(_random(1, n_kv, cache_len, head_dim, seed=23), table)
    qkv = _random(count, (n_heads + 2 * n_kv) * head_dim, seed=24, scale=2.0)
    positions = torch.arange(first, first + count)
    tables = table.expand(count, -1).contiguous()
    angles = torch.arange(cache_len, dtype=torch.float64)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, head_dim // 2, dtype=torch.float64) / (head_dim // 2))
    )
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(BF16)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(BF16)
    scores = torch.empty((threads, n_heads // n_kv * cache_len), dtype=torch.float32)

    def attend(rows: slice, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return kernels.decode_attention(
            qkv[rows], cos, sin, positions[rows], tables[rows], keys, values, scores,
            n_heads=n_heads, n_kv_heads=n_kv, threads=threads,
        )  # fmt: skip

    one_by_one_keys, one_by_one_values = keys.clone(), values.clone()
    expected = torch.cat(
        [attend(slice(i, i + 1), one_by_one_keys, one_by_one_values) for i in range(count)]
    )
    got = attend(slice(0, count), keys, values)
    assert torch.equal(got, expected)
    assert torch.equal(keys, one_by_one_keys) and torch.equal(values, one_by_one_values)


def test_decode_attention_norms_query_and_key_heads_first(kernels: FusedDecodeKernels) -> None:
    """Qwen3's per-head q/k RMSNorm inside the kernel: the keys it writes and the attention it
    computes are the eager path's (norm, then rope) up to the order of a float32 sum."""
    n_heads, n_kv, head_dim, cache_len, eps = 8, 2, 128, 32, 1e-6
    slots, positions = torch.tensor([1, 0]), torch.tensor([5, 20])
    tables = _scattered_tables(2, cache_len, seed=16)
    row_tables = tables[slots].contiguous()
    before = _random(2, n_kv, cache_len, head_dim, seed=11)
    values = _random(2, n_kv, cache_len, head_dim, seed=12)
    pooled_keys, pooled_values = _to_pool(before, tables), _to_pool(values, tables)
    qkv = _random(2, (n_heads + 2 * n_kv) * head_dim, seed=13, scale=3.0)
    q_norm, k_norm = (
        1 + 0.3 * _random(head_dim, seed=14).float(),
        1 + 0.3 * _random(head_dim, seed=15).float(),
    )
    qk_norm = torch.cat([q_norm.expand(n_heads, -1), k_norm.expand(n_kv, -1)]).to(BF16)
    angles = torch.arange(cache_len, dtype=torch.float64)[:, None] * (
        1.0 / 1e6 ** (torch.arange(0, head_dim // 2, dtype=torch.float64) / (head_dim // 2))
    )
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(BF16)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(BF16)
    scores = torch.empty((1, n_heads // n_kv * cache_len), dtype=torch.float32)
    got = kernels.decode_attention(
        qkv, cos, sin, positions, row_tables, pooled_keys, pooled_values, scores,
        n_heads=n_heads, n_kv_heads=n_kv, qk_norm=qk_norm, eps=eps,
    )  # fmt: skip
    keys, values = _from_pool(pooled_keys, tables), _from_pool(pooled_values, tables)

    heads = qkv.view(2, -1, head_dim)[:, : n_heads + n_kv]
    inv = torch.rsqrt(heads.float().pow(2).mean(-1, keepdim=True) + eps).to(BF16)
    normed = (heads * inv).mul_(qk_norm)
    rotated = apply_rope(normed, cos[positions][:, None], sin[positions][:, None])
    for row, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        written = keys[slot, :, position]
        torch.testing.assert_close(
            written.float(), rotated[row, n_heads:].float(), rtol=2**-7, atol=1e-2
        )
        assert _share_equal(written, rotated[row, n_heads:]) > 0.95
        others = torch.ones(cache_len, dtype=torch.bool)
        others[position] = False
        assert torch.equal(keys[slot][:, others], before[slot][:, others])
        q = rotated[row, :n_heads].float()[None, :, None, :]
        k = keys[slot, :, : position + 1].float()[None]
        v = values[slot, :, : position + 1].float()[None]
        reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).reshape(-1)
        torch.testing.assert_close(got[row].float(), reference, rtol=2**-6, atol=5e-3)
    with pytest.raises(ValueError, match="qk_norm"):
        kernels.decode_attention(
            qkv, cos, sin, positions, row_tables, pooled_keys, pooled_values, scores,
            n_heads=n_heads, n_kv_heads=n_kv, qk_norm=qk_norm[:4], eps=eps,
        )  # fmt: skip


# --------------------------------------------------------------------------- in the model


class _CountingKernels:
    """Wraps the kernels and counts the fused steps (one ``decode_attention`` per layer)."""

    def __init__(self, inner: FusedDecodeKernels) -> None:
        self.inner = inner
        self.attention_calls = 0

    def rms_norm(self, *args, **kwargs):
        return self.inner.rms_norm(*args, **kwargs)

    def silu_mul(self, *args, **kwargs):
        return self.inner.silu_mul(*args, **kwargs)

    def gelu_tanh_mul(self, *args, **kwargs):
        return self.inner.gelu_tanh_mul(*args, **kwargs)

    def decode_attention(self, *args, **kwargs):
        self.attention_calls += 1
        return self.inner.decode_attention(*args, **kwargs)

    def decode_layers(self, layout, *args, **kwargs):
        """Every layer's attention, in one C call (GGUF-block projections)."""
        self.attention_calls += layout.decoder.n_layers
        return self.inner.decode_layers(layout, *args, **kwargs)


def _prefill(
    model: DecoderModel, cache: KVCache, prompts: list[list[int]], *, slot: int = 0
) -> None:
    """Prompt ``i`` into slot ``slot + i``, from position 0."""
    with torch.inference_mode():
        for index, prompt in enumerate(prompts):
            plan = ForwardPlan.build([RowSpec(slot + index, prompt, 0, False)], cache=cache)
            model.forward(plan, cache)


def test_fused_steps_follow_the_float32_model_as_the_eager_ones_do(
    kernels: FusedDecodeKernels, bf16_runner: ModelRunner, runner: ModelRunner
) -> None:
    """Teacher-forced on float32's greedy tokens: the fused bfloat16 decode step agrees with
    float32 as often as the eager one (98.7% against 98.8% at 32 rows in the benchmark's
    check), and its logits stay as close to the eager step's as bfloat16 allows."""
    model, reference = bf16_runner.model, runner.model
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
    prompts = [bf16_runner.tokenizer.encode(text) for text in texts]
    cache = KVCache(model.hparams, max_num_seqs=3, max_model_len=128, dtype=BF16, device=CPU)
    reference_cache = KVCache(
        reference.hparams, max_num_seqs=3, max_model_len=128, dtype=torch.float32, device=CPU
    )
    _prefill(model, cache, prompts)
    _prefill(reference, reference_cache, prompts)
    counting = _CountingKernels(kernels)
    tokens, lengths = [13, 13, 13], [len(p) for p in prompts]
    agree = {"fused": 0, "eager": 0}
    try:
        with torch.inference_mode():
            for _ in range(12):
                rows = [RowSpec(slot, [tokens[slot]], lengths[slot], True) for slot in range(3)]
                expected = reference.forward(
                    ForwardPlan.build(rows, cache=reference_cache), reference_cache
                )
                plan = ForwardPlan.build(rows, cache=cache)
                model.fused_decode = None
                eager = model.forward(plan, cache)
                model.fused_decode = counting
                fused = model.forward(plan, cache)  # rewrites the same positions
                torch.testing.assert_close(fused.float(), eager.float(), rtol=0.05, atol=1.5)
                agree["fused"] += int((fused.argmax(-1) == expected.argmax(-1)).sum())
                agree["eager"] += int((eager.argmax(-1) == expected.argmax(-1)).sum())
                tokens = expected.argmax(-1).tolist()
                lengths = [length + 1 for length in lengths]
    finally:
        model.fused_decode = kernels
    assert counting.attention_calls == 12 * model.hparams.block_count
    assert agree["fused"] >= 33 and agree["fused"] >= agree["eager"] - 1, agree


def test_short_prompt_chunks_in_the_kernels_follow_float32_as_the_eager_path_does(
    kernels: FusedDecodeKernels, bf16_runner: ModelRunner, runner: ModelRunner
) -> None:
    """Steps of two decode rows, a whole short prompt and the uncached tail of a longer one
    (after a 16-token prefix), on the same tokens for all three: fused, the logits stay as
    close to the eager step's as bfloat16 allows, and predict float32's next token about as
    often as the eager step does."""
    model, reference = bf16_runner.model, runner.model
    texts = [
        "The capital of France is Paris, and the capital of Italy is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Water boils at a temperature of one hundred degrees Celsius at sea level, and",
        "A long time ago, in a small village by the sea, there lived an old fisherman who "
        "went out every morning before dawn. One day he caught",
    ]
    prompts = [bf16_runner.tokenizer.encode(text) for text in texts]
    assert min(len(p) for p in prompts[:2]) > 8 and len(prompts[3]) >= 29
    counting = _CountingKernels(kernels)
    agree = {"fused": 0, "eager": 0}

    def step(m: DecoderModel, dtype: torch.dtype, k: int) -> torch.Tensor:
        cache = KVCache(m.hparams, max_num_seqs=4, max_model_len=64, dtype=dtype, device=CPU)
        heads = [prompts[0][: -1 - k], prompts[1][: -1 - k]]
        _prefill(m, cache, heads)
        _prefill(m, cache, [prompts[3][:16]], slot=3)
        rows = [
            RowSpec(0, [prompts[0][-1 - k]], len(heads[0]), True),
            RowSpec(1, [prompts[1][-1 - k]], len(heads[1]), True),
            RowSpec(2, prompts[2][: 8 + k], 0, True),
            RowSpec(3, prompts[3][16 : 24 + k], 16, True),
        ]
        with torch.inference_mode():
            return m.forward(ForwardPlan.build(rows, cache=cache), cache)

    try:
        for k in range(6):
            expected = step(reference, torch.float32, k).argmax(-1)
            model.fused_decode = None
            eager = step(model, BF16, k)
            model.fused_decode = counting
            before = counting.attention_calls
            fused = step(model, BF16, k)
            # the three prefills (short chunks too) and the step
            assert counting.attention_calls == before + 4 * model.hparams.block_count
            torch.testing.assert_close(fused.float(), eager.float(), rtol=0.05, atol=1.5)
            agree["fused"] += int((fused.argmax(-1) == expected).sum())
            agree["eager"] += int((eager.argmax(-1) == expected).sum())
    finally:
        model.fused_decode = kernels
    assert agree["fused"] >= agree["eager"] - 1 and agree["fused"] >= 20, agree


def test_seeded_rows_and_long_prompt_chunks_stay_eager(
    kernels: FusedDecodeKernels, bf16_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded rows (batch invariance needs the eager path's exact rounding) and steps with a
    prompt chunk of more than FUSED_PREFILL_MAX_TOKENS tokens or chunks that attend to more
    than FUSED_PREFILL_KEY_BUDGET keys stay eager; decode rows and short chunks take the
    kernels, however many short chunks (a wave of short prompts)."""
    model = bf16_runner.model
    cache = KVCache(model.hparams, max_num_seqs=3, max_model_len=128, dtype=BF16, device=CPU)
    long_cache = KVCache(model.hparams, max_num_seqs=3, max_model_len=256, dtype=BF16, device=CPU)
    _prefill(model, cache, [[1, 2, 3, 4], [5, 6, 7, 8, 9]])
    counting = _CountingKernels(kernels)
    model.fused_decode = counting

    def fused(rows: list[RowSpec], on: KVCache = cache) -> bool:
        before = counting.attention_calls
        with torch.inference_mode():
            model.forward(ForwardPlan.build(rows, cache=on), on)
        return counting.attention_calls > before

    try:
        # 8 tokens at positions 200-207 attend to 201 + ... + 208 = 1,636 keys
        long_tail = [RowSpec(2, list(range(1, 9)), 200, True)]
        _prefill(model, long_cache, [[5] * 200], slot=2)
        monkeypatch.setattr(forward_plan, "FUSED_PREFILL_KEY_BUDGET", 1635)
        assert not fused(long_tail, long_cache)
        monkeypatch.setattr(forward_plan, "FUSED_PREFILL_KEY_BUDGET", 1636)
        assert fused(long_tail, long_cache)
        assert fused([RowSpec(0, [10], 4, True), RowSpec(1, [11], 5, True)])
        assert not fused([RowSpec(0, [10], 4, True), RowSpec(1, [11], 5, True, True)])
        assert fused([RowSpec(0, [10], 4, True), RowSpec(2, [1, 2, 3], 0, True)])
        most = FUSED_PREFILL_MAX_TOKENS
        assert fused([RowSpec(2, list(range(1, most + 1)), 0, True)])
        assert not fused([RowSpec(2, list(range(1, most + 2)), 0, True)])
        two_chunks = [RowSpec(2, list(range(1, most + 1)), 0, True)]
        two_chunks.append(RowSpec(0, list(range(1, most + 1)), 4, True))
        # 2 x FUSED_PREFILL_MAX_TOKENS tokens attending to 1,176 + 1,368 = 2,544 keys
        monkeypatch.setattr(forward_plan, "FUSED_PREFILL_KEY_BUDGET", 2543)
        assert not fused(two_chunks)
        monkeypatch.setattr(forward_plan, "FUSED_PREFILL_KEY_BUDGET", 2544)
        assert fused(two_chunks)
        assert not fused([RowSpec(2, [1, 2, 3], 0, True, True)])
        assert fused([RowSpec(1, [11], 5, True)])
        with torch.inference_mode():  # a fused step whose rows want no logits
            plan = ForwardPlan.build([RowSpec(0, [12], 5, False)], cache=cache)
            assert model.forward(plan, cache).shape == (0, model.hparams.vocab_size)
    finally:
        model.fused_decode = kernels


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "gemma3"])
def test_every_architecture_takes_the_fused_kernels(
    kernels: FusedDecodeKernels, tiny_checkpoints, architecture: str
) -> None:
    """Qwen2's biases (in the QKV projection), Qwen3's q/k norm (in the attention kernel) and
    Gemma 3's block (its post norms, GELU, windowed layers, scales) included: fused bfloat16
    decode steps on dense weights follow the eager bfloat16 ones and float32."""
    path = tiny_checkpoints.hf(architecture)
    model = decoder_of(path, dtype=BF16, max_model_len=64)
    reference = decoder_of(path, dtype=torch.float32, max_model_len=64, fused_decode=False)
    assert model.fused_decode is not None, model.fused_decode_status
    prompts = [[1, 4093, 198, 504, 3575], [33, 34, 35], [216, 4649, 314, 2, 9, 10, 11]]
    cache = KVCache(model.hparams, max_num_seqs=3, max_model_len=64, dtype=BF16, device=CPU)
    reference_cache = KVCache(
        model.hparams, max_num_seqs=3, max_model_len=64, dtype=torch.float32, device=CPU
    )
    _prefill(model, cache, prompts)
    _prefill(reference, reference_cache, prompts)
    counting = _CountingKernels(kernels)
    tokens, lengths = [13, 14, 15], [len(p) for p in prompts]
    agree = {"fused": 0, "eager": 0}
    with torch.inference_mode():
        for _ in range(8):
            rows = [RowSpec(slot, [tokens[slot]], lengths[slot], True) for slot in range(3)]
            expected = reference.forward(
                ForwardPlan.build(rows, cache=reference_cache), reference_cache
            )
            plan = ForwardPlan.build(rows, cache=cache)
            model.fused_decode = None
            eager = model.forward(plan, cache)
            model.fused_decode = counting
            fused = model.forward(plan, cache)  # rewrites the same positions
            # Gemma 3's random norms (~2x a layer) amplify bfloat16's rounding: its eager
            # bfloat16 logits are themselves 0.15-0.6 from float32's (the others' ~0.03), so
            # the tolerances grow with the eager path's own error.
            eager_error = (eager.float() - expected).abs().max().item()
            atol = max(0.05, eager_error)
            torch.testing.assert_close(fused.float(), eager.float(), rtol=0.05, atol=atol)
            torch.testing.assert_close(
                fused.float(), expected, rtol=0.05, atol=max(0.08, 1.5 * atol)
            )
            agree["fused"] += int((fused.argmax(-1) == expected.argmax(-1)).sum())
            agree["eager"] += int((eager.argmax(-1) == expected.argmax(-1)).sum())
            tokens = expected.argmax(-1).tolist()
            lengths = [length + 1 for length in lengths]
    assert counting.attention_calls == 8 * model.hparams.block_count
    assert agree["fused"] >= agree["eager"] - 2, agree


# --------------------------------------------------------------------------- the build


def test_the_build_is_cached_on_disk(fresh_loader: Path) -> None:
    if not HAS_COMPILER:
        pytest.skip("no C compiler")
    first, _ = load_fused_decode()
    assert first is not None and first.path.parent == fresh_loader
    built = first.path.stat().st_mtime_ns
    load_fused_decode.cache_clear()
    second, _ = load_fused_decode()
    assert second is not None and second.path == first.path
    assert second.path.stat().st_mtime_ns == built
    assert not list(fresh_loader.glob("*.partial"))


@pytest.mark.parametrize("changed", fused_decode.SOURCES)
def test_a_change_to_any_source_file_rebuilds(
    changed: str,
    fresh_loader: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cache key hashes every file of the library, the header as well as the .c files."""
    if not HAS_COMPILER:
        pytest.skip("no C compiler")
    sources = tmp_path_factory.mktemp("sources")
    for name in fused_decode.SOURCES:
        shutil.copy(fused_decode.SOURCE_DIR / name, sources / name)
    monkeypatch.setattr(fused_decode, "SOURCE_DIR", sources)
    first, how = load_fused_decode()
    assert first is not None, how
    with (sources / changed).open("a") as source:
        source.write("\n/* edited */\n")
    load_fused_decode.cache_clear()
    second, how = load_fused_decode()
    assert second is not None, how
    assert second.path != first.path, f"an edit of {changed} did not change the cache key"
    assert sorted(fresh_loader.glob("*.so")) == sorted([first.path, second.path])


def test_slotserve_ggml_isa_narrows_the_build(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SLOTSERVE_GGML_ISA=avx2`` builds the library without AVX-512 (another cached file),
    so the whole model runs as the AVX2-only CPU would; its kernels still compute the norm."""
    if not HAS_COMPILER:
        pytest.skip("no C compiler")
    monkeypatch.delenv("SLOTSERVE_GGML_ISA", raising=False)
    native, how = load_fused_decode()
    assert native is not None, how
    monkeypatch.setenv("SLOTSERVE_GGML_ISA", "avx2")
    assert fused_decode.build_flags() == (*fused_decode.CFLAGS, "-mno-avx512f")
    load_fused_decode.cache_clear()
    narrowed, how = load_fused_decode()
    assert narrowed is not None, how
    assert narrowed.path != native.path
    x = _random(4, 576, seed=5, scale=2.0)
    expected = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(BF16)
    got = narrowed.rms_norm(x, None, 1e-5)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)


def _greedy(runner: ModelRunner, text: str, count: int) -> bytes:
    prompt = runner.tokenizer.encode(text)
    plan = ForwardPlan.build([RowSpec(0, prompt, 0, True)], cache=runner.cache)
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(count):
            generated.append(int(runner.model.forward(plan, runner.cache)[0].argmax()))
            row = RowSpec(0, [generated[-1]], len(prompt) + len(generated) - 1, True)
            plan = ForwardPlan.build([row], cache=runner.cache)
    return runner.tokenizer.decode_bytes(generated)


def test_a_failed_build_leaves_the_model_on_its_eager_path(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    kernels, how = load_fused_decode()
    assert kernels is None and "build failed" in how
    runner = load_checkpoint("smollm2", max_num_seqs=1, max_model_len=64, dtype="bfloat16")
    assert runner.model.fused_decode is None
    assert "build failed" in runner.model.fused_decode_status
    assert _greedy(runner, "The capital of France is", 3).startswith(b" Paris")


def test_fused_decode_false_keeps_the_eager_path() -> None:
    runner = load_checkpoint(
        "smollm2", max_num_seqs=1, max_model_len=64, dtype="bfloat16", fused_decode=False
    )
    assert runner.model.fused_decode is None
    assert "--fused-decode false" in runner.model.fused_decode_status
    assert _greedy(runner, "The capital of France is", 3).startswith(b" Paris")
