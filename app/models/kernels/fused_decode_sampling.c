/*
 * sl_sample_rows: the sampler's draws (app/models/sampling/sampler.py's steps 3-5: temperature,
 * top-k, top-p, min-p and the inverse-CDF draw) without the float32 copies torch makes of every
 * row (the scaled logits, the softmax, its cumulative sum) and without its sorts. An unfiltered
 * row: one pass for the maximum, one for the exponentials summed a block at a time, then a walk
 * over the block sums and one block. A filtered row: the weights into the thread's scratch, their
 * sums above six floors (vector compares), two histograms of the float bits of the weights above
 * the highest floor that holds the cut, a sort of the cut's sub-band alone. Gemma 3's
 * 262,144-token rows are 1 MiB each in float32: at 64 rows the torch pipeline wrote and read
 * back ~200 MB a step (docs/MODEL_PERF.md).
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

/* The largest logit of a row (NaN if any is NaN), in LANES partial maxima (the portable
 * loop; GCC keeps it scalar: the NaN test per lane defeats its vectoriser). */
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

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* The rows' maxima with AVX-512 (the library is built for this machine, -march=native): the
 * same value as the portable loop (a maximum does not depend on the order; a NaN anywhere
 * gives NaN). The portable loop took 9.8% of a sampled 64-row Gemma 3 step on Zen 5 (perf:
 * 16.8 M float32 logits, ~0.5 ns each). */
static inline float row_max_tail(__m512 m, __mmask16 nan, const float *tail, int64_t count) {
    const __mmask16 keep = (__mmask16)((1u << count) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), keep, tail);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(m, v));
}

static float row_max_float(const float *row, int64_t n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 a = _mm512_loadu_ps(row + i), b = _mm512_loadu_ps(row + i + 16);
        m0 = _mm512_max_ps(m0, a);
        m1 = _mm512_max_ps(m1, b);
        nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); /* a NaN in either */
    }
    __m512 m = _mm512_max_ps(m0, m1);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        m = _mm512_max_ps(m, v);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    return row_max_tail(m, nan, row + i, n - i);
}

static inline __m512 bf16x16_to_float(const bf16 *p, __mmask16 keep) {
    const __m256i raw = _mm256_maskz_loadu_epi16(keep, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static float row_max_bf16(const bf16 *row, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = bf16x16_to_float(row + i, 0xFFFF);
        m = _mm512_max_ps(m, v);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (i == n) return nan ? NAN : _mm512_reduce_max_ps(m);
    const __mmask16 keep = (__mmask16)((1u << (n - i)) - 1u);
    const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, bf16x16_to_float(row + i, keep));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(m, v));
}
#elif defined(__AVX2__)
/* The same with AVX2, eight values at a time. */
static inline float max_of_lanes8(__m256 m) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

#define ROW_MAX_AVX2(type, load8, load)                                                           \
    static float row_max_##type(const type *row, int64_t n) {                                     \
        __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();                    \
        int64_t i = 0;                                                                            \
        for (; i + 8 <= n; i += 8) {                                                              \
            const __m256 v = load8(row + i);                                                      \
            m = _mm256_max_ps(m, v);                                                              \
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));               \
        }                                                                                         \
        int nan = _mm256_movemask_ps(unordered);                                                  \
        float best = max_of_lanes8(m);                                                            \
        for (; i < n; ++i) {                                                                      \
            const float v = load(row[i]);                                                         \
            nan |= v != v;                                                                        \
            best = v > best ? v : best;                                                           \
        }                                                                                         \
        return nan ? NAN : best;                                                                  \
    }
#define LOAD8_FLOAT(p) _mm256_loadu_ps(p)
#define LOAD8_BF16(p)                                                                             \
    _mm256_castsi256_ps(                                                                          \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define AS_FLOAT(v) (v)
ROW_MAX_AVX2(float, LOAD8_FLOAT, AS_FLOAT)
ROW_MAX_AVX2(bf16, LOAD8_BF16, bf16_to_float)
#undef AS_FLOAT
#else
#define AS_FLOAT(v) (v)
ROW_MAX(float, AS_FLOAT)
ROW_MAX(bf16, bf16_to_float)
#undef AS_FLOAT
#endif

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

/* ------------------------------------------------------------------ filtered rows */

/* weights[i] = exp(logit / temperature - top) of a row (0 below -87: row_weight), vectorised. */
#define ROW_WEIGHTS(type, load)                                                                   \
    static void row_weights_##type(const type *row, int64_t n, float temperature, float top,    \
                                   float *weights) {                                              \
        for (int64_t i = 0; i < n; ++i) weights[i] = row_weight(load(row[i]) / temperature - top); \
    }
ROW_WEIGHTS(float, AS_FLOAT)
ROW_WEIGHTS(bf16, bf16_to_float)

/* A token's weight and column, sorted by weight descending (ties: the lower column first). */
typedef struct {
    float weight;
    int32_t column;
} weighted_token;

static int by_weight_descending(const void *a, const void *b) {
    const weighted_token *x = (const weighted_token *)a, *y = (const weighted_token *)b;
    if (x->weight != y->weight) return x->weight < y->weight ? 1 : -1;
    return (x->column > y->column) - (x->column < y->column);
}

/* The histogram key of a weight in (0, 1]: its float bits from `shift` up, masked to 8 bits
 * (shift 23: the exponent, 127 for 1.0; shift 15: the top 8 bits of the mantissa). */
static inline int weight_key(float weight, int shift) {
    uint32_t bits;
    memcpy(&bits, &weight, sizeof bits);
    return (int)((bits >> shift) & 0xFF);
}

/* The floors tried for the histograms, highest first: 2^-4, 2^-8, .., 2^-24 of the best
 * token's weight 1 (powers of two, so whole exponent bands). The histograms count the weights
 * one by one from the highest floor whose weights already hold the cut (a nucleus's mass, or
 * top_k of them); the rest are only summed. Below 2^-24 lie under 0.016 of a total of at
 * least 1 in 262,144 tokens, so a nucleus of top_p <= 0.98 always finds a floor; a cut below
 * every floor (a top_k past the tokens above 2^-24, a top_p near 1) counts every weight. On
 * Gemma 3's logits the one-by-one pass over all 262,144 weights took most of a nucleus row's
 * draw (~0.6 ms a row). */
enum { FLOORS = 6 };

static inline float floor_value(int f) {
    static const float floors[FLOORS] = {0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f};
    return floors[f];
}

/* Every weight's total, summed in float32 lanes a block of SAMPLE_BLOCK at a time, the blocks
 * in double (as sample_row sums them); and the mass and count of the weights at least each
 * floor (a compare and a masked add per floor and vector; GCC kept the portable loop
 * scalar). */
static double weigh_floors(const float *weights, int64_t n, double floor_mass[FLOORS],
                           int64_t floor_count[FLOORS]) {
    double total = 0.0;
    for (int64_t from = 0; from < n; from += SAMPLE_BLOCK) {
        const int64_t to = from + SAMPLE_BLOCK < n ? from + SAMPLE_BLOCK : n;
        float lanes[LANES] = {0}, mass[FLOORS][LANES] = {{0}};
        int32_t count[FLOORS][LANES] = {{0}};
        int64_t i = from;
#if defined(__AVX512F__)
        __m512 sum = _mm512_setzero_ps(), at_floor[FLOORS];
        for (int f = 0; f < FLOORS; ++f) at_floor[f] = _mm512_setzero_ps();
        for (; i + 16 <= to; i += 16) {
            const __m512 e = _mm512_loadu_ps(weights + i);
            sum = _mm512_add_ps(sum, e);
            for (int f = 0; f < FLOORS; ++f) {
                const __mmask16 at = _mm512_cmp_ps_mask(e, _mm512_set1_ps(floor_value(f)), _CMP_GE_OQ);
                at_floor[f] = _mm512_mask_add_ps(at_floor[f], at, at_floor[f], e);
                count[f][0] += __builtin_popcount((unsigned)at);
            }
        }
        _mm512_storeu_ps(lanes, sum);
        for (int f = 0; f < FLOORS; ++f) _mm512_storeu_ps(mass[f], at_floor[f]);
#elif defined(__AVX2__)
        __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, at_floor[FLOORS][2];
        for (int f = 0; f < FLOORS; ++f) at_floor[f][0] = at_floor[f][1] = _mm256_setzero_ps();
        for (; i + 16 <= to; i += 16) {
            for (int half = 0; half < 2; ++half) {
                const __m256 e = _mm256_loadu_ps(weights + i + 8 * half);
                sum[half] = _mm256_add_ps(sum[half], e);
                for (int f = 0; f < FLOORS; ++f) {
                    const __m256 at = _mm256_cmp_ps(e, _mm256_set1_ps(floor_value(f)), _CMP_GE_OQ);
                    at_floor[f][half] = _mm256_add_ps(at_floor[f][half], _mm256_and_ps(at, e));
                    count[f][half] += __builtin_popcount((unsigned)_mm256_movemask_ps(at));
                }
            }
        }
        _mm256_storeu_ps(lanes, sum[0]);
        _mm256_storeu_ps(lanes + 8, sum[1]);
        for (int f = 0; f < FLOORS; ++f) {
            _mm256_storeu_ps(mass[f], at_floor[f][0]);
            _mm256_storeu_ps(mass[f] + 8, at_floor[f][1]);
        }
#else
        for (; i + LANES <= to; i += LANES) {
            for (int lane = 0; lane < LANES; ++lane) lanes[lane] += weights[i + lane];
            for (int f = 0; f < FLOORS; ++f) {
                const float at_least = floor_value(f);
                for (int lane = 0; lane < LANES; ++lane) {
                    const float e = weights[i + lane];
                    mass[f][lane] += e >= at_least ? e : 0.0f;
                    count[f][lane] += e >= at_least;
                }
            }
        }
#endif
        float block = sum_lanes(lanes);
        for (; i < to; ++i) {
            block += weights[i];
            for (int f = 0; f < FLOORS; ++f)
                if (weights[i] >= floor_value(f)) mass[f][0] += weights[i], count[f][0] += 1;
        }
        total += block;
        for (int f = 0; f < FLOORS; ++f) {
            floor_mass[f] += sum_lanes(mass[f]);
            for (int lane = 0; lane < LANES; ++lane) floor_count[f] += count[f][lane];
        }
    }
    return total;
}

/* The smallest float whose histogram keys are (band, sub): exponent bits `band`, the
 * mantissa's top 8 bits `sub`. Positive floats order as their bits, so a weight's keys are at
 * least (band, sub) exactly when the weight is at least this. */
static inline float band_value(int band, int sub) {
    const uint32_t bits = ((uint32_t)band << 23) | ((uint32_t)sub << 15);
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Whether any of the LANES weights at w is at least `floor` (no NaN among them). */
static inline int any_at_least(const float *w, float floor) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(w), _mm512_set1_ps(floor), _CMP_GE_OQ) != 0;
#elif defined(__AVX2__)
    const __m256 f = _mm256_set1_ps(floor);
    const __m256 low = _mm256_cmp_ps(_mm256_loadu_ps(w), f, _CMP_GE_OQ);
    const __m256 high = _mm256_cmp_ps(_mm256_loadu_ps(w + 8), f, _CMP_GE_OQ);
    return _mm256_movemask_ps(_mm256_or_ps(low, high)) != 0;
#else
    int any = 0;
    for (int lane = 0; lane < LANES; ++lane) any |= w[lane] >= floor;
    return any;
#endif
}

/* The exponent histogram (mass and count per band; band 0: no weight, never kept) of the
 * weights at least `floor` (0: every weight), skipping LANES at a time where none is. */
static void count_bands(const float *weights, int64_t n, float floor, double mass[256],
                        int64_t count[256]) {
    for (int64_t i = 0; i < n; i += LANES) {
        if (i + LANES <= n && !any_at_least(weights + i, floor)) continue;
        for (int64_t j = i; j < n && j < i + LANES; ++j) {
            const float e = weights[j];
            if (!(e >= floor)) continue;
            const int key = e > 0.0f ? weight_key(e, 23) : 0;
            mass[key] += e;
            count[key] += 1;
        }
    }
}

/* From the top bucket down, the one holding the cut: where the count reaches k or the mass
 * reaches `nucleus`, counting the buckets above it into *taken and *above (0 if none does). */
static int find_cut(const double mass[256], const int64_t count[256], int64_t k, double nucleus,
                    int64_t *taken, double *above) {
    int bucket = 255;
    for (; bucket > 0; --bucket) {
        if (*taken + count[bucket] >= k || *above + mass[bucket] >= nucleus) break;
        *taken += count[bucket], *above += mass[bucket];
    }
    return bucket;
}

/* One filtered row's draw (sl_sample_rows), with the thread's scratch: weights
 * (n floats), kept (n int32), boundary (n weighted_token). -1 when its largest logit is not
 * finite. */
static int64_t sample_filtered_row(const void *row, int is_bf16, int64_t n, float temperature,
                                   int64_t top_k, float top_p, float min_p, float uniform,
                                   float *weights, int32_t *kept, weighted_token *boundary) {
    const float best = is_bf16 ? row_max_bf16((const bf16 *)row, n) : row_max_float((const float *)row, n);
    if (!isfinite(best)) return -1;
    const float top = best / temperature;
    if (is_bf16)
        row_weights_bf16((const bf16 *)row, n, temperature, top, weights);
    else
        row_weights_float((const float *)row, n, temperature, top, weights);
    const int64_t k = top_k > 0 && top_k < n ? top_k : n;
    /* The exponent band holding the cut: every band above it is kept whole. Counted from the
     * highest floor that holds the cut (FLOORS); from none (0) if the rounding of the
     * floors' sums misled that choice and the walk ran past the floor. */
    double floor_mass[FLOORS] = {0};
    int64_t floor_count[FLOORS] = {0};
    const double total = weigh_floors(weights, n, floor_mass, floor_count);
    const double nucleus = top_p < 1.0f ? (double)top_p * total : INFINITY;
    float floor = 0.0f;
    for (int f = 0; f < FLOORS && floor == 0.0f; ++f)
        if (floor_count[f] >= k || floor_mass[f] >= nucleus) floor = floor_value(f);
    double mass[256] = {0};
    int64_t count[256] = {0};
    count_bands(weights, n, floor, mass, count);
    double above = 0.0;
    int64_t taken = 0;
    int band = find_cut(mass, count, k, nucleus, &taken, &above);
    if (floor > 0.0f && band < weight_key(floor, 23)) {
        memset(mass, 0, sizeof mass);
        memset(count, 0, sizeof count);
        count_bands(weights, n, 0.0f, mass, count);
        above = 0.0, taken = 0;
        band = find_cut(mass, count, k, nucleus, &taken, &above);
    }
    /* within the band, the top 8 bits of the mantissa: the sub-band holding the cut */
    double sub_mass[256] = {0};
    int64_t sub_count[256] = {0};
    const float band_floor = band_value(band, 0);
    for (int64_t i = 0; i < n; i += LANES) {
        if (i + LANES <= n && !any_at_least(weights + i, band_floor)) continue;
        for (int64_t j = i; j < n && j < i + LANES; ++j)
            if (weights[j] > 0.0f && weight_key(weights[j], 23) == band) {
                const int key = weight_key(weights[j], 15);
                sub_mass[key] += weights[j];
                sub_count[key] += 1;
            }
    }
    const int sub = find_cut(sub_mass, sub_count, k, nucleus, &taken, &above);
    /* kept: every token above the cut's sub-band (in column order), then that sub-band's in
     * descending order while the rank is under k and the mass before it under top_p's */
    int64_t n_kept = 0, n_boundary = 0;
    double kept_mass = 0.0;
    const float cut_floor = band_value(band, sub);
    for (int64_t i = 0; i < n; i += LANES) {
        if (i + LANES <= n && !any_at_least(weights + i, cut_floor)) continue;
        for (int64_t j = i; j < n && j < i + LANES; ++j) {
            const float e = weights[j];
            if (!(e > 0.0f)) continue;
            const int key = weight_key(e, 23);
            if (key > band || (key == band && weight_key(e, 15) > sub)) {
                kept[n_kept++] = (int32_t)j;
                kept_mass += e;
            } else if (key == band && weight_key(e, 15) == sub) {
                boundary[n_boundary++] = (weighted_token){e, (int32_t)j};
            }
        }
    }
    qsort(boundary, (size_t)n_boundary, sizeof *boundary, by_weight_descending);
    for (int64_t j = 0; j < n_boundary; ++j) {
        if (n_kept > 0 && (n_kept >= k || !(kept_mass < nucleus))) break;
        kept[n_kept++] = boundary[j].column;
        kept_mass += boundary[j].weight;
    }
    /* min_p, relative to the best token's weight 1 (which is always kept) */
    double draw_mass = 0.0;
    int64_t n_draw = 0;
    for (int64_t j = 0; j < n_kept; ++j)
        if (!(weights[kept[j]] < min_p) || weights[kept[j]] == 1.0f) {
            kept[n_draw++] = kept[j];
            draw_mass += weights[kept[j]];
        }
    const double target = (double)uniform * draw_mass;
    double below = 0.0;
    for (int64_t j = 0; j < n_draw; ++j) {
        below += weights[kept[j]];
        if (below > target) return kept[j];
    }
    return n_draw > 0 ? kept[n_draw - 1] : -1;
}

/*
 * out[r] = the token drawn for row r of `rows` rows of `n` logits (row stride `stride`
 * elements; bfloat16 when is_bf16, else float32), as Sampler._sample_random draws it (the same
 * distribution, not the same draw for a given uniform: the sums run in another order, and a
 * filtered row's kept tokens are walked in another order), temperature[r] > 0, uniform[r] in
 * [0, 1):
 *   - top_k[r] == 0 and top_p[r] >= 1 (unfiltered): the first column whose cumulative weight
 *     exp(logit / temperature[r] - max) (0 where it is under min_p[r] times the best's)
 *     exceeds uniform[r] times the row's total (sample_row);
 *   - else (filtered): the tokens by weight descending, the first top_k[r] of them (0: all)
 *     whose mass before each is under top_p[r] of the total (the best is always kept), less
 *     those under min_p[r] times the best's weight; the first of them whose cumulative weight
 *     exceeds uniform[r] times the kept mass (sample_filtered_row). Where torch sorts the
 *     vocabulary (or its best 256 and, when they hold under top_p of the mass, all of it),
 *     two 256-bucket histograms of the weights' float bits (the exponent, then the
 *     mantissa's top 8 bits within the cut's exponent band) find the cut, and only the cut's
 *     sub-band is sorted.
 * The rows are shared among `threads`. Returns 0; 1 when some row's largest logit is not
 * finite (its out[r] is -1: the caller's torch path must take it); -2 without memory.
 */
int sl_sample_rows(const void *logits, int is_bf16, int64_t rows, int64_t n, int64_t stride,
                   const float *temperature, const int64_t *top_k, const float *top_p,
                   const float *min_p, const float *uniform, int64_t *out, int64_t threads) {
    const int64_t bytes = is_bf16 ? 2 : 4;
    const int64_t blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK + 1;
    int filtered = 0;
    for (int64_t r = 0; r < rows; ++r) filtered |= top_k[r] > 0 || top_p[r] < 1.0f;
    int undecided = 0, no_memory = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads((int)threads) reduction(| : undecided, no_memory) if (rows >= 2 && threads > 1)
#endif
    {
        double *sums = (double *)malloc((size_t)blocks * sizeof(double));
        float *weights = filtered ? (float *)malloc((size_t)n * sizeof(float)) : NULL;
        int32_t *kept = filtered ? (int32_t *)malloc((size_t)n * sizeof(int32_t)) : NULL;
        weighted_token *boundary =
            filtered ? (weighted_token *)malloc((size_t)n * sizeof(weighted_token)) : NULL;
        no_memory = sums == NULL || (filtered && (weights == NULL || kept == NULL || boundary == NULL));
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < rows; ++r) {
            const void *row = (const uint8_t *)logits + r * stride * bytes;
            if (no_memory)
                out[r] = -1;
            else if (top_k[r] > 0 || top_p[r] < 1.0f)
                out[r] = sample_filtered_row(row, is_bf16, n, temperature[r], top_k[r], top_p[r],
                                             min_p[r], uniform[r], weights, kept, boundary);
            else
                out[r] = sample_row(row, is_bf16, n, temperature[r], min_p[r], uniform[r], sums);
            undecided |= out[r] < 0;
        }
        free(sums);
        free(weights);
        free(kept);
        free(boundary);
    }
    (void)threads;
    return no_memory ? -2 : undecided;
}
