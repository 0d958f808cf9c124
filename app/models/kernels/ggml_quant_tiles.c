/*
 * AVX2 tile kernels for the 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): eight weight rows
 * at a time, their eight outputs in the eight float32 lanes of one vector.
 *
 * Why: the one-row dot products of ggml_quant_legacy.c spend most of their instructions on
 * per-block float work and horizontal sums for each output alone. Here the per-block float work
 * is done once for eight outputs (one lane each), and for many activation rows the weight rows
 * are decoded once per tile into an interleaved copy in the thread's cache (lane j of a vector
 * holds 4 codes of weight row j), against which every activation row of the call runs: four
 * broadcast activation bytes times 32 codes per vpmaddubsw, summed in int16 as far as the
 * format's code range allows, widened once per block. The idea of interleaving rows for the
 * many-row case is llama.cpp's "repack" CPU path (ggml-cpu/repack.cpp); the code is our own.
 *
 * Two ways to the same integers. Per (weight row j, activation row i, block b) the integer dot
 * product of the codes with the activation's int8 codes is exact in int32, whichever order it
 * is summed in: from the file's rows with a horizontal-sum tree (few activation rows: no decode
 * pass, "gemv"), or from the interleaved tile (many rows, "gemm"). Then the one float sequence
 * both share, per lane:
 *
 *     scale = d_w * d_x                          (float32 product)
 *     acc   = fma((float)isum, scale, acc)
 *     macc  = fma(mo, s_x, macc)                 (formats with a minimum or an offset)
 *     out   = acc + macc                         (after the last block)
 *
 * with mo = m (Q4_1, Q5_1), -8 d (Q4_0), -16 d (Q5_0): the codes are used unsigned and the
 * offset is folded into the activation sums s_x = d_x * sum(qs). So a row's output is the same
 * bit for bit in any batch, whichever way computed it (tested).
 */
#include "ggml_quant.h"

#include <stddef.h>

#if defined(__x86_64__)
#include "ggml_quant_avx2.h"

enum { TL_Q4_0, TL_Q4_1, TL_Q5_0, TL_Q5_1, TL_Q8_0 };

#define TL_INLINE static inline __attribute__((always_inline))
#define TL_LANES 8                           /* weight rows per tile */
#define TL_GROUPS (SL_QK / 4)                /* 4-code groups per block */
#define TL_TILE_BLOCK_BYTES (SL_QK * TL_LANES) /* interleaved codes of one block, 8 rows */

static inline int tl_block_bytes(int fmt) {
    return fmt == TL_Q4_0 ? 18 : fmt == TL_Q4_1 ? 20 : fmt == TL_Q5_0 ? 22 : fmt == TL_Q5_1 ? 24 : 34;
}
static inline int tl_is5(int fmt) { return fmt == TL_Q5_0 || fmt == TL_Q5_1; }
static inline int tl_has_mo(int fmt) { return fmt != TL_Q8_0; }

/* The 32 codes of one block in weight order: unsigned 0..15 / 0..31 (the offset not
 * subtracted), or Q8_0's signed bytes. */
SL_TARGET_AVX2 TL_INLINE __m256i tl_codes(int fmt, const uint8_t *blk) {
    if (fmt == TL_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const int qs_at = fmt == TL_Q4_0 ? 2 : fmt == TL_Q4_1 ? 4 : fmt == TL_Q5_0 ? 6 : 8;
    return sl_nibble_codes_avx2(blk + qs_at, tl_is5(fmt) ? blk + (fmt == TL_Q5_0 ? 2 : 4) : NULL);
}

/* d of block b of the eight rows, and mo (see the top): both as float32 lanes. */
SL_TARGET_AVX2 TL_INLINE void tl_scales(int fmt, const uint8_t *const rows[TL_LANES], int64_t at,
                                        __m256 *d, __m256 *mo) {
    __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
#pragma GCC unroll 8
    for (int j = 0; j < TL_LANES; j++) {
        dh = _mm_insert_epi16(dh, sl_read_u16(rows[j] + at), j);
        if (fmt == TL_Q4_1 || fmt == TL_Q5_1) mh = _mm_insert_epi16(mh, sl_read_u16(rows[j] + at + 2), j);
    }
    *d = _mm256_cvtph_ps(dh);
    if (fmt == TL_Q4_1 || fmt == TL_Q5_1)
        *mo = _mm256_cvtph_ps(mh);
    else if (fmt == TL_Q4_0)
        *mo = _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f)); /* exact: a power of two */
    else if (fmt == TL_Q5_0)
        *mo = _mm256_mul_ps(*d, _mm256_set1_ps(-16.0f));
    else
        *mo = _mm256_setzero_ps();
}

/* The one float sequence of a block (see the top). */
SL_TARGET_AVX2 TL_INLINE void tl_finish_block(int fmt, __m256i isum, __m256 d, __m256 mo,
                                              const sl_block_q8_1 *x, __m256 *acc, __m256 *macc) {
    const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->d));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
    if (tl_has_mo(fmt)) *macc = _mm256_fmadd_ps(mo, _mm256_set1_ps(x->s), *macc);
}

/* Eight int32 vectors -> one vector whose lane j is the sum of v[j]'s lanes (exact). */
SL_TARGET_AVX2 TL_INLINE __m256i tl_sum8(const __m256i v[TL_LANES]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* a: [rows 0-3 of the low 128-bit halves | rows 0-3 of the high halves]; b: rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Exact integer dot product of 32 codes with 32 int8 activations, as 8 int32 partial sums. */
SL_TARGET_AVX2 TL_INLINE __m256i tl_idot32(int fmt, __m256i codes, __m256i xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (fmt == TL_Q8_0) /* |w| <= 128, |x| <= 127: the pairs stay below 2^15 */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(xq, codes)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), ones);
}

/* gemv: one activation row against eight weight rows read from the file's layout. Eight rows
 * read side by side are eight streams the hardware prefetchers follow poorly (a Q8_0 LM head ran
 * at 0.4x the one-row code), so the loop prefetches `ahead` bytes from `prefetch` (the tiles
 * after this one: the rows are contiguous), a share per block. */
SL_TARGET_AVX2 TL_INLINE void tl_gemv(int fmt, const uint8_t *const rows[TL_LANES], int64_t nb,
                                      const sl_block_q8_1 *x, float out[TL_LANES],
                                      const uint8_t *prefetch, int64_t ahead) {
    const int64_t bs = tl_block_bytes(fmt);
    const int64_t lines = (ahead + 63) / 64, per_block = (lines + nb - 1) / nb;
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t l = b * per_block; l < (b + 1) * per_block && l < lines; l++)
            _mm_prefetch((const char *)prefetch + 64 * l, _MM_HINT_T0);
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        __m256i partial[TL_LANES];
#pragma GCC unroll 8
        for (int j = 0; j < TL_LANES; j++) partial[j] = tl_idot32(fmt, tl_codes(fmt, rows[j] + b * bs), xq);
        __m256 d, mo;
        tl_scales(fmt, rows, b * bs, &d, &mo);
        tl_finish_block(fmt, tl_sum8(partial), d, mo, x + b, &acc, &macc);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, macc));
}

/* Decode eight rows into the interleaved tile: codes[b][g] is 32 bytes, 4 codes (weights
 * 4g .. 4g + 3 of block b) of each row j at bytes 4j .. 4j + 3; d[b], mo[b]: 8 floats each. */
SL_TARGET_AVX2 TL_INLINE void tl_decode(int fmt, const uint8_t *const rows[TL_LANES], int64_t nb,
                                        uint8_t *codes, float *d, float *mo,
                                        const uint8_t *prefetch, int64_t ahead) {
    const int64_t bs = tl_block_bytes(fmt);
    const int64_t lines = (ahead + 63) / 64, per_block = (lines + nb - 1) / nb;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t l = b * per_block; l < (b + 1) * per_block && l < lines; l++)
            _mm_prefetch((const char *)prefetch + 64 * l, _MM_HINT_T0);
        __m256i c[TL_LANES], t[TL_LANES], u[TL_LANES];
#pragma GCC unroll 8
        for (int j = 0; j < TL_LANES; j++) c[j] = tl_codes(fmt, rows[j] + b * bs);
        /* an 8 x 8 transpose of 4-byte groups */
#pragma GCC unroll 4
        for (int j = 0; j < TL_LANES; j += 2) {
            t[j] = _mm256_unpacklo_epi32(c[j], c[j + 1]);
            t[j + 1] = _mm256_unpackhi_epi32(c[j], c[j + 1]);
        }
#pragma GCC unroll 2
        for (int j = 0; j < TL_LANES; j += 4) {
            u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);     /* groups 0 | 4, rows j..j+3 */
            u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]); /* groups 1 | 5 */
            u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]); /* groups 2 | 6 */
            u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]); /* groups 3 | 7 */
        }
        __m256i *out = (__m256i *)(codes + b * TL_TILE_BLOCK_BYTES);
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            _mm256_storeu_si256(out + g, _mm256_permute2x128_si256(u[g], u[g + 4], 0x20));
            _mm256_storeu_si256(out + g + 4, _mm256_permute2x128_si256(u[g], u[g + 4], 0x31));
        }
        __m256 vd, vmo;
        tl_scales(fmt, rows, b * bs, &vd, &vmo);
        _mm256_storeu_ps(d + b * TL_LANES, vd);
        _mm256_storeu_ps(mo + b * TL_LANES, vmo);
    }
}

/* The integer sums of one block for R activation rows from the tile: lane j = row j's. */
SL_TARGET_AVX2 TL_INLINE void tl_tile_block(int fmt, int R, const uint8_t *codes,
                                            const sl_block_q8_1 *const x[SL_ROWS], int64_t b,
                                            __m256i isum[SL_ROWS]) {
    const __m256i ones = _mm256_set1_epi16(1);
    /* int16 sums of maddubs pairs: 4-bit codes 2 * 15 * 127 per pair, 8 groups fit in int16;
     * 5-bit 2 * 31 * 127, 4 groups; Q8_0 2 * 128 * 127, one. */
    const int run = fmt == TL_Q8_0 ? 1 : tl_is5(fmt) ? 4 : 8;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int g0 = 0; g0 < TL_GROUPS; g0 += run) {
        __m256i s16[SL_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = g0; g < g0 + run; g++) {
            const __m256i cv = _mm256_loadu_si256((const __m256i *)(codes + g * 32));
            const __m256i cu = fmt == TL_Q8_0 ? _mm256_abs_epi8(cv) : cv;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, x[r][b].qs + 4 * g, 4);
                __m256i xb = _mm256_set1_epi32(four);
                if (fmt == TL_Q8_0) xb = _mm256_sign_epi8(xb, cv);
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(cu, xb));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16[r], ones));
    }
}

/* gemm: R activation rows against a decoded tile. */
SL_TARGET_AVX2 TL_INLINE void tl_gemm(int fmt, int R, const uint8_t *codes, const float *d,
                                      const float *mo, int64_t nb,
                                      const sl_block_q8_1 *const x[SL_ROWS], float *out,
                                      int64_t out_stride) {
    __m256 acc[SL_ROWS], macc[SL_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[SL_ROWS];
        tl_tile_block(fmt, R, codes + b * TL_TILE_BLOCK_BYTES, x, b, isum);
        const __m256 vd = _mm256_loadu_ps(d + b * TL_LANES);
        const __m256 vmo = _mm256_loadu_ps(mo + b * TL_LANES);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) tl_finish_block(fmt, isum[r], vd, vmo, x[r] + b, &acc[r], &macc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * out_stride, _mm256_add_ps(acc[r], macc[r]));
}

/* The exported entry points, one per format (see ggml_quant.h, sl_tile_fns). */
#define TL_EXPORT(name, fmt)                                                                       \
    SL_TARGET_AVX2 void sl_gemv8_##name##_avx2(const uint8_t *const *rows, int64_t k, const void *x,  \
                                               float *out, const uint8_t *prefetch,                \
                                               int64_t ahead) {                                    \
        tl_gemv(fmt, rows, k / SL_QK, (const sl_block_q8_1 *)x, out, prefetch, ahead);             \
    }                                                                                              \
    SL_TARGET_AVX2 void sl_decode8_##name##_avx2(const uint8_t *const *rows, int64_t k, void *tile, \
                                                 const uint8_t *prefetch, int64_t ahead) {        \
        const int64_t nb = k / SL_QK;                                                              \
        uint8_t *codes = (uint8_t *)tile;                                                          \
        float *d = (float *)(codes + nb * TL_TILE_BLOCK_BYTES);                                    \
        tl_decode(fmt, rows, nb, codes, d, d + nb * TL_LANES, prefetch, ahead);                    \
    }                                                                                              \
    SL_TARGET_AVX2 void sl_gemm8_##name##_avx2(const void *tile, int64_t k, const void *const *x, \
                                               int n_x, float *out, int64_t out_stride) {          \
        const int64_t nb = k / SL_QK;                                                              \
        const uint8_t *codes = (const uint8_t *)tile;                                              \
        const float *d = (const float *)(codes + nb * TL_TILE_BLOCK_BYTES);                        \
        const sl_block_q8_1 *const *xr = (const sl_block_q8_1 *const *)x;                          \
        switch (n_x) {                                                                             \
        case 4: tl_gemm(fmt, 4, codes, d, d + nb * TL_LANES, nb, xr, out, out_stride); break;      \
        case 3: tl_gemm(fmt, 3, codes, d, d + nb * TL_LANES, nb, xr, out, out_stride); break;      \
        case 2: tl_gemm(fmt, 2, codes, d, d + nb * TL_LANES, nb, xr, out, out_stride); break;      \
        default: tl_gemm(fmt, 1, codes, d, d + nb * TL_LANES, nb, xr, out, out_stride); break;     \
        }                                                                                          \
    }

TL_EXPORT(q4_0, TL_Q4_0)
TL_EXPORT(q4_1, TL_Q4_1)
TL_EXPORT(q5_0, TL_Q5_0)
TL_EXPORT(q5_1, TL_Q5_1)
TL_EXPORT(q8_0, TL_Q8_0)

/* Bytes of a decoded tile of rows of k weights (32-weight formats). */
int64_t sl_tile8_bytes_q8_1(int64_t k) {
    return k / SL_QK * (TL_TILE_BLOCK_BYTES + 2 * TL_LANES * (int64_t)sizeof(float));
}

#endif
