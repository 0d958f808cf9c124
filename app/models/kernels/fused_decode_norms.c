/*
 * Row-wise fused kernels: RMSNorm (with the residual add before it), silu(gate) * up and
 * gelu_tanh(gate) * up.
 * Part of the fused decode library (fused_decode.h says which file holds what).
 */
#include <math.h>

#include "fused_decode.h"

/*
 * RMSNorm of rows, optionally after a residual add.
 *
 * x:        [rows, dim] bfloat16, row stride x_stride (elements).
 * residual: NULL, or [rows, dim] bfloat16 (row stride dim): then x <- bf16(x + residual)
 *           first, written back into x (x is the new hidden state).
 * weight:   NULL (folded into the next projection), or [dim] bfloat16.
 * out:      [rows, dim] bfloat16, contiguous.
 *
 * inv = bf16(1 / sqrt(sum(x^2) / dim + eps)) in float32; out = bf16(x * inv), then
 * bf16(out * weight) when a weight is given: the rounding of DecoderModel._normed.
 */
void sl_rms_norm(bf16 *x, int64_t x_stride, const bf16 *residual, const bf16 *weight,
                 bf16 *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        bf16 *row = x + r * x_stride;
        bf16 *dst = out + r * dim;
        if (residual != NULL) {
            const bf16 *add = residual + r * dim;
            for (int64_t i = 0; i < dim; ++i) {
                row[i] = float_to_bf16(bf16_to_float(row[i]) + bf16_to_float(add[i]));
            }
        }
        float partial[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES) {
            for (int lane = 0; lane < LANES; ++lane) {
                float v = bf16_to_float(row[i + lane]);
                partial[lane] += v * v;
            }
        }
        float sum = sum_lanes(partial);
        for (; i < dim; ++i) {
            float v = bf16_to_float(row[i]);
            sum += v * v;
        }
        float inv = bf16_to_float(float_to_bf16(1.0f / sqrtf(sum / (float)dim + eps)));
        if (weight == NULL) {
            for (i = 0; i < dim; ++i) {
                dst[i] = float_to_bf16(bf16_to_float(row[i]) * inv);
            }
        } else {
            for (i = 0; i < dim; ++i) {
                float normed = bf16_to_float(float_to_bf16(bf16_to_float(row[i]) * inv));
                dst[i] = float_to_bf16(normed * bf16_to_float(weight[i]));
            }
        }
    }
}

/* GELU in its tanh approximation (Gemma's MLP; torch's F.gelu(approximate="tanh"),
 * transformers' "gelu_pytorch_tanh"): g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))),
 * with tanh(y) computed as 1 - 2 / (exp(2y) + 1). */
static inline float gelu_tanh(float g) {
    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + (1.0f - 2.0f / (exp_approx(2.0f * inner) + 1.0f)));
}

/* Both gated activations write out = bf16(bf16(activation(gate)) * up) for gate_up
 * [rows, 2 * ffn] bfloat16 (gate first, as the fused gate/up projection writes it); out is
 * [rows, ffn] bfloat16, contiguous. */

/*
 * silu(gate) * up (Llama's MLP), silu(g) = g / (1 + exp(-g)).
 *
 * exp(-g) goes through a buffer of CHUNK values before the division. Written as one loop, GCC
 * -O3's partial redundancy elimination gave the clamp's lanes their own constant, so every
 * vector also divided g by 1 + exp(88) = 1.7e38: a denormal for |g| < 2, a microcode assist
 * per vector, and 14x the time of this form (16 rows x 1536 on the Xeon: 285 against 20 us).
 * The values are the one loop's, bit for bit (all 65,536 bfloat16 gates compared).
 */
void sl_silu_mul(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t ffn) {
    enum { CHUNK = 256 };
    float exp_minus[CHUNK];
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *gate = gate_up + r * 2 * ffn;
        const bf16 *up = gate + ffn;
        bf16 *dst = out + r * ffn;
        for (int64_t i0 = 0; i0 < ffn; i0 += CHUNK) {
            const int64_t n = ffn - i0 < CHUNK ? ffn - i0 : CHUNK;
            for (int64_t i = 0; i < n; ++i) exp_minus[i] = exp_approx(-bf16_to_float(gate[i0 + i]));
            for (int64_t i = 0; i < n; ++i) {
                const float g = bf16_to_float(gate[i0 + i]);
                const float activated = bf16_to_float(float_to_bf16(g / (1.0f + exp_minus[i])));
                dst[i0 + i] = float_to_bf16(activated * bf16_to_float(up[i0 + i]));
            }
        }
    }
}

/* gelu_tanh(gate) * up (Gemma's MLP). */
void sl_gelu_tanh_mul(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t ffn) {
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *gate = gate_up + r * 2 * ffn;
        const bf16 *up = gate + ffn;
        bf16 *dst = out + r * ffn;
        for (int64_t i = 0; i < ffn; ++i) {
            const float activated = bf16_to_float(float_to_bf16(gelu_tanh(bf16_to_float(gate[i]))));
            dst[i] = float_to_bf16(activated * bf16_to_float(up[i]));
        }
    }
}

/* The first index of row's maximum over n values (bfloat16 when is_bf16, else float32), as
 * torch's argmax picks it: NaN counts as the largest value (its first index wins), equal values
 * (+0 and -0 too) the first. LANES partial maxima with the index of each (a strict > keeps a
 * lane's first), so the loop vectorises; then the smallest index among the lanes holding the
 * maximum. A row with a NaN is read again for its first NaN. 0 < n < 2^31. */
static int64_t argmax_row(const void *row, int is_bf16, int64_t n) {
    const bf16 *half = (const bf16 *)row;
    const float *full = (const float *)row;
    float best_lanes[LANES];
    int32_t index_lanes[LANES];
    int32_t nan_lanes[LANES];
    for (int lane = 0; lane < LANES; ++lane)
        best_lanes[lane] = -INFINITY, index_lanes[lane] = INT32_MAX, nan_lanes[lane] = 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int lane = 0; lane < LANES; ++lane) {
            const float v = is_bf16 ? bf16_to_float(half[i + lane]) : full[i + lane];
            const int greater = v > best_lanes[lane];
            best_lanes[lane] = greater ? v : best_lanes[lane];
            index_lanes[lane] = greater ? (int32_t)(i + lane) : index_lanes[lane];
            nan_lanes[lane] |= v != v;
        }
    }
    float best = -INFINITY;
    int64_t best_index = n > 0 ? 0 : -1, nan = 0;
    for (int lane = 0; lane < LANES; ++lane) nan |= nan_lanes[lane];
    for (; i < n; ++i) { /* the tail: a lane of its own */
        const float v = is_bf16 ? bf16_to_float(half[i]) : full[i];
        nan |= v != v;
        if (v > best) best = v, best_index = i;
    }
    if (nan) {
        for (i = 0; i < n; ++i) {
            const float v = is_bf16 ? bf16_to_float(half[i]) : full[i];
            if (v != v) return i;
        }
    }
    for (int lane = 0; lane < LANES; ++lane) {
        if (index_lanes[lane] == INT32_MAX) continue; /* never above -inf */
        if (best_lanes[lane] > best || (best_lanes[lane] == best && index_lanes[lane] < best_index))
            best = best_lanes[lane], best_index = index_lanes[lane];
    }
    return best_index; /* a row of -inf only: 0, as torch */
}

/*
 * out[r] = argmax of row r (torch.argmax(dim=-1), see argmax_row) for `rows` rows of `n`
 * logits each, row stride `stride` elements; bfloat16 when is_bf16, else float32. The rows are
 * shared among `threads` (from 2 rows). The greedy sampler's argmax: torch's CPU argmax is a
 * scalar loop and its bfloat16 amax widens each value in AVX2 code (64 rows of Gemma 3's
 * 262,144 bfloat16 logits on the AMX Xeon's two cores: 1.2 ms here, 2.6 ms through torch's
 * amax, app.models.sampling.sampler.argmax_rows).
 */
void sl_argmax_rows(const void *logits, int is_bf16, int64_t rows, int64_t n, int64_t stride,
                    int64_t *out, int64_t threads) {
    const int64_t bytes = is_bf16 ? 2 : 4;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(static) if (rows >= 2 && threads > 1)
#endif
    for (int64_t r = 0; r < rows; ++r)
        out[r] = argmax_row((const uint8_t *)logits + r * stride * bytes, is_bf16, n);
    (void)threads;
}
