/*
 * The inner loops of sl_decode_attention for one KV head of one row, a cache block of 16
 * positions at a time, with AVX-512 BF16: scores with vdpbf16ps and a 16-way transposing sum,
 * the weighted sum of values with the accumulators in registers. Part of the fused decode
 * library (fused_decode.h says which file holds what); empty without AVX-512 BF16, where
 * fused_attention_tiles_avx2.c has them for AVX2, or fused_decode_attention.c keeps its
 * portable loops.
 *
 * Why: the portable loops reduce each dot product horizontally, store each score on its own,
 * and keep the accumulators of the weighted sum in memory; a row then cost ~120 ns of one
 * thread per cached position per layer (SmolLM2, 3 KV heads of 3 query heads), the larger part
 * of a 64-row decode step at 700 positions and of a short prompt chunk over a long cached
 * prefix.
 */
#include <stdint.h>
#include <string.h>

#include "fused_decode.h"

#if SL_TILED_ATTENTION == SL_TILES_AVX512BF16
#include <immintrin.h>

enum { TILE = SL_TILE_POSITIONS, MAX_PAIRS = 8 /* head_dim <= 256 */, VALUE_GROUP = 4, VALUE_CHUNK = 4 };

/* Lane j of the result is the sum of the 16 lanes of v[j]: a transposing tree of 15 adds. */
static inline __m512 sum_each(const __m512 v[TILE]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; ++i) { /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) { /* per 128-bit lane: keys 4i..4i+3, that lane's share */
        const __m512d ab = _mm512_castps_pd(pairs[2 * i]);
        const __m512d cd = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
    }
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                         _mm512_shuffle_f32x4(low, high, 0xdd));
}

static inline void prefetch_block(const bf16 *block, int64_t head_dim) {
    const char *lines = (const char *)block;
    for (int64_t line = 0; line < TILE * head_dim * (int64_t)sizeof(bf16); line += 64) {
        __builtin_prefetch(lines + line, 0, 1);
    }
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* One block's 16 scores of query q (pairs x 32 bfloat16) against keys [16, head_dim]: the
 * accumulators stay in registers when pairs is a constant (see sl_tile_scores). */
ALWAYS_INLINE __m512 block_scores(const __m512bh *q, const bf16 *keys, int64_t head_dim,
                                  const int pairs) {
    __m512 acc[TILE];
    for (int j = 0; j < TILE; ++j) {
        acc[j] = _mm512_setzero_ps();
        for (int c = 0; c < pairs; ++c) {
            const __m512i k = _mm512_loadu_si512(keys + j * head_dim + c * 32);
            acc[j] = _mm512_dpbf16_ps(acc[j], q[c], (__m512bh)k);
        }
    }
    return sum_each(acc);
}

ALWAYS_INLINE void head_scores(const __m512bh *q, const bf16 *pool, const int64_t *table,
                               int64_t head_base, int64_t head_dim, int64_t skip,
                               int64_t length, __m512 scale, float *s, int prefetch,
                               const int pairs) {
    const int64_t blocks = (skip + length + TILE - 1) / TILE;
    for (int64_t b = 0; b < blocks; ++b) {
        const bf16 *keys = pool + (head_base + table[b] * TILE) * head_dim;
        if (prefetch && b + 1 < blocks) {
            prefetch_block(pool + (head_base + table[b + 1] * TILE) * head_dim, head_dim);
        }
        /* A block's positions outside the attended ones (a window's start, past the row's
         * length) hold other values: their lanes are computed (each lane only ever sums its
         * own key) and never stored. */
        const __m512 scores = _mm512_mul_ps(block_scores(q, keys, head_dim, pairs), scale);
        const int64_t end = skip + length - b * TILE < TILE ? skip + length - b * TILE : TILE;
        if (b == 0 && skip > 0) { /* lane j is s[j - skip] */
            float lanes[TILE];
            _mm512_storeu_ps(lanes, scores);
            memcpy(s, lanes + skip, (size_t)(end - skip) * sizeof(float));
        } else {
            _mm512_mask_storeu_ps(s + b * TILE - skip, (__mmask16)((1u << end) - 1u), scores);
        }
    }
}

/*
 * scores[g * length + t] = scale * (query[g] . key[skip + t]) for t < length, g < group.
 *
 * query: [group, query_stride] float32, each value exactly a bfloat16 (the rotated heads).
 * pool:  one layer's keys, [n_kv_heads, pool_len, head_dim]; head_base = kv * pool_len.
 * table: the row's block table from the block holding the first attended position, skip
 *        (< TILE) positions into it (a sliding window's start); blocks of TILE positions.
 *        head_dim % 32 == 0, <= 256.
 */
void sl_tile_scores(const float *query, int64_t query_stride, int64_t group, const bf16 *pool,
                    const int64_t *table, int64_t head_base, int64_t head_dim, int64_t skip,
                    int64_t length, float scale, float *scores) {
    const int pairs = (int)(head_dim / 32);
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < group; ++g) {
        __m512bh q[MAX_PAIRS];
        for (int c = 0; c < pairs; ++c) { /* exact: the values are bfloat16 already */
            const float *part = query + g * query_stride + c * 32;
            q[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(part + 16), _mm512_loadu_ps(part));
        }
        float *s = scores + g * length;
        const int prefetch = g == 0;
        switch (pairs) { /* constant trip counts: the accumulators stay in registers */
        case 2: head_scores(q, pool, table, head_base, head_dim, skip, length, scaled, s, prefetch, 2); break;
        case 4: head_scores(q, pool, table, head_base, head_dim, skip, length, scaled, s, prefetch, 4); break;
        default:
            head_scores(q, pool, table, head_base, head_dim, skip, length, scaled, s, prefetch, pairs);
        }
    }
}

/* The weighted sum of the values for `heads` query heads and VALUE_CHUNK x 16 dimensions from
 * d0, accumulators in registers when heads is a constant (see sl_tile_values). */
ALWAYS_INLINE void value_chunk(const float *probs, const bf16 *pool, const int64_t *table,
                               int64_t head_base, int64_t head_dim, int64_t skip,
                               int64_t length, int64_t d0, float *out, int64_t out_stride,
                               const int heads) {
    const int64_t blocks = (skip + length + TILE - 1) / TILE;
    __m512 acc[VALUE_GROUP][VALUE_CHUNK];
    for (int g = 0; g < heads; ++g) {
        for (int c = 0; c < VALUE_CHUNK; ++c) {
            acc[g][c] = _mm512_setzero_ps();
        }
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const bf16 *values = pool + (head_base + table[b] * TILE) * head_dim + d0;
        if (d0 == 0 && b + 1 < blocks) {
            prefetch_block(pool + (head_base + table[b + 1] * TILE) * head_dim, head_dim);
        }
        const int64_t end = skip + length - b * TILE < TILE ? skip + length - b * TILE : TILE;
        for (int64_t j = b == 0 ? skip : 0; j < end; ++j) {
            __m512 v[VALUE_CHUNK];
            for (int c = 0; c < VALUE_CHUNK; ++c) {
                const __m256i raw =
                    _mm256_loadu_si256((const __m256i *)(values + j * head_dim + c * 16));
                v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            }
            const int64_t t = b * TILE + j - skip;
            for (int g = 0; g < heads; ++g) {
                const __m512 p = _mm512_set1_ps(probs[g * length + t]);
                for (int c = 0; c < VALUE_CHUNK; ++c) {
                    acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
                }
            }
        }
    }
    for (int g = 0; g < heads; ++g) {
        for (int c = 0; c < VALUE_CHUNK; ++c) {
            _mm512_storeu_ps(out + g * out_stride + d0 + c * 16, acc[g][c]);
        }
    }
}

/*
 * out[g * out_stride + d] = sum over t < length of probs[g * length + t] * value[skip + t][d],
 * in order of t, as float32 (the portable loop's order and fused multiply-adds).
 *
 * pool, table, skip: as sl_tile_scores's keys. head_dim % 64 == 0, <= 256.
 */
SL_DEFINE_TILE_VALUES(16 * VALUE_CHUNK)

#endif /* SL_TILED_ATTENTION == SL_TILES_AVX512BF16 */
