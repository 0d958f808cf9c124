/*
 * The inner loops of sl_decode_attention for one KV head of one row, a cache block of 16
 * positions at a time, with AVX2 and FMA: the same two functions as fused_attention_tiles.c
 * (which has them with AVX-512 BF16), for the CPUs without it. Part of the fused decode
 * library (fused_decode.h says which file holds what); empty unless SL_TILED_ATTENTION is
 * SL_TILES_AVX2.
 *
 * Why: on the AVX2-only EPYC the portable loops of fused_decode_attention.c took ~46 ns of CPU
 * per (row, KV head, cached position) of SmolLM2 (head_dim 64, 3 query heads a KV head): a
 * horizontal sum per dot product, each score stored on its own, and the weighted sum's
 * accumulators in memory. That was 32% of a 64-row decode step at 256 positions.
 *
 * Scores: four keys' dot products with up to three query heads accumulate in twelve
 * registers, eight lanes each, each key widened once for the heads, ending in a transposing
 * sum per head (sum_each4). Values: the
 * accumulators of up to four query heads and 16 dimensions stay in registers across the
 * block's positions, in order of t, with fused multiply-adds.
 */
#include <stdint.h>
#include <string.h>

#include "fused_decode.h"

#if SL_TILED_ATTENTION == SL_TILES_AVX2
#include <immintrin.h>

enum { TILE = SL_TILE_POSITIONS, QUAD = 4, SCORE_HEADS = 3, VALUE_GROUP = 4, VALUE_CHUNK = 2 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Eight bfloat16 as float32: each is the high half of its float. */
ALWAYS_INLINE __m256 widen8(const bf16 *x) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline void prefetch_block(const bf16 *block, int64_t head_dim) {
    const char *lines = (const char *)block;
    for (int64_t line = 0; line < TILE * head_dim * (int64_t)sizeof(bf16); line += 64) {
        __builtin_prefetch(lines + line, 0, 1);
    }
}

/* Lane j of the result is the sum of the eight lanes of v[j] (j < 4). */
ALWAYS_INLINE __m128 sum_each4(const __m256 v[QUAD]) {
    const __m256 a0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(a0123), _mm256_extractf128_ps(a0123, 1));
}

/* The scores of `heads` query heads (q, rows query_stride apart) against keys [4, head_dim],
 * each key widened once for all of them: lane j of out[g] is head g's with key j (unscaled:
 * the caller scales). Accumulators stay in registers when heads is a constant (at most SCORE_HEADS). */
ALWAYS_INLINE void quad_scores(const float *q, int64_t query_stride, const bf16 *keys,
                               int64_t head_dim, __m128 out[SCORE_HEADS], const int heads) {
    __m256 acc[SCORE_HEADS][QUAD];
    for (int g = 0; g < heads; ++g) {
        for (int j = 0; j < QUAD; ++j) {
            acc[g][j] = _mm256_setzero_ps();
        }
    }
    for (int64_t d = 0; d < head_dim; d += 8) {
        for (int j = 0; j < QUAD; ++j) {
            const __m256 k = widen8(keys + j * head_dim + d);
            for (int g = 0; g < heads; ++g) {
                acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * query_stride + d), k, acc[g][j]);
            }
        }
    }
    for (int g = 0; g < heads; ++g) {
        out[g] = sum_each4(acc[g]);
    }
}

/* One block's scores for `heads` query heads from q, scaled, stored where attended: the
 * block's position h is score s[g * length + at + h] (at = the block's first position less the
 * row's first attended one; at + h >= 0 for every attended h). */
ALWAYS_INLINE void block_scores(const float *q, int64_t query_stride, const bf16 *keys,
                                int64_t head_dim, __m128 scale, float *s, int64_t length,
                                int64_t at, int64_t first, int64_t end, const int heads) {
    for (int64_t h = first & ~(int64_t)(QUAD - 1); h < end; h += QUAD) {
        __m128 lanes[SCORE_HEADS];
        quad_scores(q, query_stride, keys + h * head_dim, head_dim, lanes, heads);
        for (int g = 0; g < heads; ++g) {
            const __m128 scaled = _mm_mul_ps(lanes[g], scale);
            float *dst = s + g * length;
            if (h >= first && h + QUAD <= end) {
                _mm_storeu_ps(dst + at + h, scaled);
            } else {
                float part[QUAD];
                _mm_storeu_ps(part, scaled);
                for (int64_t t = h > first ? h : first; t < h + QUAD && t < end; ++t) {
                    dst[at + t] = part[t - h];
                }
            }
        }
    }
}

/*
 * scores[g * length + t] = scale * (query[g] . key[skip + t]) for t < length, g < group.
 *
 * query: [group, query_stride] float32 (the rotated heads).
 * pool:  one layer's keys, [n_kv_heads, pool_len, head_dim]; head_base = kv * pool_len.
 * table: the row's block table from the block holding the first attended position, skip
 *        (< TILE) positions into it (a sliding window's start); blocks of TILE positions.
 *        head_dim % 8 == 0.
 */
void sl_tile_scores(const float *query, int64_t query_stride, int64_t group, const bf16 *pool,
                    const int64_t *table, int64_t head_base, int64_t head_dim, int64_t skip,
                    int64_t length, float scale, float *scores) {
    const __m128 scaled = _mm_set1_ps(scale);
    const int64_t blocks = (skip + length + TILE - 1) / TILE;
    for (int64_t b = 0; b < blocks; ++b) {
        const bf16 *keys = pool + (head_base + table[b] * TILE) * head_dim;
        if (b + 1 < blocks) {
            prefetch_block(pool + (head_base + table[b + 1] * TILE) * head_dim, head_dim);
        }
        /* the block's positions [first, end) are attended; the others hold other values:
         * their lanes are computed (each lane only ever sums its own key) and never stored */
        const int64_t first = b == 0 ? skip : 0;
        const int64_t end = skip + length - b * TILE < TILE ? skip + length - b * TILE : TILE;
        const int64_t at = b * TILE - skip;
        for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {
            const float *q = query + g0 * query_stride;
            float *sg = scores + g0 * length;
            switch (group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS) {
            case 1: block_scores(q, query_stride, keys, head_dim, scaled, sg, length, at, first, end, 1); break;
            case 2: block_scores(q, query_stride, keys, head_dim, scaled, sg, length, at, first, end, 2); break;
            default: block_scores(q, query_stride, keys, head_dim, scaled, sg, length, at, first, end, 3);
            }
        }
    }
}

/* The weighted sum of the values for `heads` query heads and VALUE_CHUNK x 8 dimensions from
 * d0, accumulators in registers when heads is a constant (see sl_tile_values). */
ALWAYS_INLINE void value_chunk(const float *probs, const bf16 *pool, const int64_t *table,
                               int64_t head_base, int64_t head_dim, int64_t skip,
                               int64_t length, int64_t d0, float *out, int64_t out_stride,
                               const int heads) {
    const int64_t blocks = (skip + length + TILE - 1) / TILE;
    __m256 acc[VALUE_GROUP][VALUE_CHUNK];
    for (int g = 0; g < heads; ++g) {
        for (int c = 0; c < VALUE_CHUNK; ++c) {
            acc[g][c] = _mm256_setzero_ps();
        }
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const bf16 *values = pool + (head_base + table[b] * TILE) * head_dim + d0;
        if (d0 == 0 && b + 1 < blocks) {
            prefetch_block(pool + (head_base + table[b + 1] * TILE) * head_dim, head_dim);
        }
        const int64_t end = skip + length - b * TILE < TILE ? skip + length - b * TILE : TILE;
        for (int64_t j = b == 0 ? skip : 0; j < end; ++j) {
            __m256 v[VALUE_CHUNK];
            for (int c = 0; c < VALUE_CHUNK; ++c) {
                v[c] = widen8(values + j * head_dim + c * 8);
            }
            const int64_t t = b * TILE + j - skip;
            for (int g = 0; g < heads; ++g) {
                const __m256 p = _mm256_broadcast_ss(probs + g * length + t);
                for (int c = 0; c < VALUE_CHUNK; ++c) {
                    acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
                }
            }
        }
    }
    for (int g = 0; g < heads; ++g) {
        for (int c = 0; c < VALUE_CHUNK; ++c) {
            _mm256_storeu_ps(out + g * out_stride + d0 + c * 8, acc[g][c]);
        }
    }
}

/*
 * out[g * out_stride + d] = sum over t < length of probs[g * length + t] * value[skip + t][d],
 * in order of t, as float32 with fused multiply-adds (the AVX-512 tiles' order).
 *
 * pool, table, skip: as sl_tile_scores's keys. head_dim % 16 == 0.
 */
SL_DEFINE_TILE_VALUES(8 * VALUE_CHUNK)

#endif /* SL_TILED_ATTENTION == SL_TILES_AVX2 */
