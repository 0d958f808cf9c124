/*
 * sl_sample_rows: the sampler's draw for rows that sample from the whole vocabulary (a
 * temperature, no top-k, no top-p: API.md's defaults), by inverse CDF in token-id order, as
 * app/models/sampling/sampler.py defines it, without the float32 copies torch makes of every
 * row (the scaled logits, the softmax, its cumulative sum): one pass for the maximum, one for
 * the exponentials summed a block at a time, then a walk over the block sums and one block.
 * Gemma 3's 262,144-token rows are 1 MiB each in float32: at 64 rows the torch pipeline wrote
 * and read back ~200 MB a step (docs/MODEL_PERF.md).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "fused_decode.h"

/* Columns per block of the sums the walk skips over. */
#define SAMPLE_BLOCK 1024

/* exp(x) for x = s - max <= 0 of a row, 0 below -87 (a token masked to -inf, or one whose
 * weight is under float32's smallest normal times the best's: the clamp of exp_approx would
 * give it 1.6e-38 instead, so a masked token could be drawn). */
static inline float row_weight(float x) {
    const float e = exp_approx(x);
    return x < -87.0f ? 0.0f : e;
}

/* The largest logit of a row (NaN if any is NaN), in LANES partial maxima (vectorised). */
#define ROW_MAX(type, load)                                                                       \
    static float row_max_##type(const type *row, int64_t n) {                                     \
        float lanes[LANES];                                                                       \
        int nan_lanes[LANES];                                                                     \
        for (int lane = 0; lane < LANES; ++lane) lanes[lane] = -INFINITY, nan_lanes[lane] = 0;   \
        int64_t i = 0;                                                                            \
        for (; i + LANES <= n; i += LANES) {                                                      \
            for (int lane = 0; lane < LANES; ++lane) {                                            \
                const float v = load(row[i + lane]);                                              \
                lanes[lane] = v > lanes[lane] ? v : lanes[lane];                                  \
                nan_lanes[lane] |= v != v;                                                        \
            }                                                                                     \
        }                                                                                         \
        float best = -INFINITY;                                                                   \
        int nan = 0;                                                                              \
        for (; i < n; ++i) {                                                                      \
            const float v = load(row[i]);                                                         \
            nan |= v != v;                                                                        \
            best = v > best ? v : best;                                                           \
        }                                                                                         \
        for (int lane = 0; lane < LANES; ++lane) {                                                \
            nan |= nan_lanes[lane];                                                               \
            best = lanes[lane] > best ? lanes[lane] : best;                                       \
        }                                                                                         \
        return nan ? NAN : best;                                                                  \
    }

/* The weights of columns [from, to) of a row summed in float32 lanes: exp(s - top) with
 * s = logit / temperature, 0 under `floor` (min_p's cut, relative to the best's weight 1). */
#define BLOCK_WEIGHT(type, load)                                                                  \
    static float block_weight_##type(const type *row, int64_t from, int64_t to,                  \
                                     float temperature, float top, float floor) {                 \
        float lanes[LANES] = {0};                                                                 \
        int64_t i = from;                                                                         \
        for (; i + LANES <= to; i += LANES) {                                                     \
            for (int lane = 0; lane < LANES; ++lane) {                                            \
                const float e = row_weight(load(row[i + lane]) / temperature - top);              \
                lanes[lane] += e < floor ? 0.0f : e;                                              \
            }                                                                                     \
        }                                                                                         \
        float sum = sum_lanes(lanes);                                                             \
        for (; i < to; ++i) {                                                                     \
            const float e = row_weight(load(row[i]) / temperature - top);                         \
            sum += e < floor ? 0.0f : e;                                                          \
        }                                                                                         \
        return sum;                                                                               \
    }

#define AS_FLOAT(v) (v)
ROW_MAX(float, AS_FLOAT)
ROW_MAX(bf16, bf16_to_float)
BLOCK_WEIGHT(float, AS_FLOAT)
BLOCK_WEIGHT(bf16, bf16_to_float)

static inline float logit_at(const void *row, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_float(((const bf16 *)row)[i]) : ((const float *)row)[i];
}

/* One row's draw, or -1 when its largest logit is not finite (NaN, +inf, or every logit
 * -inf): the caller's torch path decides such a row. `sums`: n / SAMPLE_BLOCK + 1 doubles. */
static int64_t sample_row(const void *row, int is_bf16, int64_t n, float temperature, float min_p,
                          float uniform, double *sums) {
    const float best = is_bf16 ? row_max_bf16((const bf16 *)row, n) : row_max_float((const float *)row, n);
    if (!isfinite(best)) return -1;
    const float top = best / temperature; /* the largest scaled logit (division is monotone) */
    const int64_t blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t to = (b + 1) * SAMPLE_BLOCK < n ? (b + 1) * SAMPLE_BLOCK : n;
        sums[b] = is_bf16 ? block_weight_bf16((const bf16 *)row, b * SAMPLE_BLOCK, to, temperature, top, min_p)
                          : block_weight_float((const float *)row, b * SAMPLE_BLOCK, to, temperature, top, min_p);
        total += sums[b];
    }
    /* the first column whose cumulative weight exceeds u times the total */
    const double target = (double)uniform * total;
    double below = 0.0;
    int64_t b = 0;
    while (b + 1 < blocks && below + sums[b] <= target) below += sums[b++];
    const int64_t to = (b + 1) * SAMPLE_BLOCK < n ? (b + 1) * SAMPLE_BLOCK : n;
    int64_t last = -1;
    for (int64_t i = b * SAMPLE_BLOCK; i < to; ++i) {
        const float e = row_weight(logit_at(row, is_bf16, i) / temperature - top);
        if (e < min_p || e == 0.0f) continue;
        below += e;
        last = i;
        if (below > target) return i;
    }
    /* rounding left the target past this block's end: its last column with weight, or the
     * row's last one before it */
    if (last >= 0) return last;
    for (int64_t i = b * SAMPLE_BLOCK - 1; i >= 0; --i) {
        const float e = row_weight(logit_at(row, is_bf16, i) / temperature - top);
        if (!(e < min_p) && e > 0.0f) return i;
    }
    return -1;
}

/*
 * out[r] = the token drawn for row r of `rows` rows of `n` logits (row stride `stride`
 * elements; bfloat16 when is_bf16, else float32): the first column whose cumulative weight
 * exp(logit / temperature[r] - max) (0 where it is under min_p[r] times the best's) exceeds
 * uniform[r] times the row's total, as Sampler._sample_random's unfiltered rows (a
 * distribution, not the same bits: the sums are in another order). temperature[r] > 0,
 * uniform[r] in [0, 1). The rows are shared among `threads`. Returns 0; 1 when some row's
 * largest logit is not finite (its out[r] is -1: the caller's torch path must take it);
 * -2 without memory.
 */
int sl_sample_rows(const void *logits, int is_bf16, int64_t rows, int64_t n, int64_t stride,
                   const float *temperature, const float *min_p, const float *uniform,
                   int64_t *out, int64_t threads) {
    const int64_t bytes = is_bf16 ? 2 : 4;
    const int64_t blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK + 1;
    double *sums = (double *)malloc((size_t)(rows * blocks) * sizeof(double));
    if (sums == NULL) return -2;
    int undecided = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(static) reduction(| : undecided) if (rows >= 2 && threads > 1)
#endif
    for (int64_t r = 0; r < rows; ++r) {
        out[r] = sample_row((const uint8_t *)logits + r * stride * bytes, is_bf16, n,
                            temperature[r], min_p[r], uniform[r], sums + r * blocks);
        undecided |= out[r] < 0;
    }
    (void)threads;
    free(sums);
    return undecided;
}
