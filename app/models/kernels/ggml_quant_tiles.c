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
 * is summed in: from the file's rows with a horizontal-sum tree (one activation row: no decode
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
 *
 * Two instruction sets, one body (ggml_quant_tiles_body.h, included once for each): AVX2, whose
 * vpmaddubsw gives int16 pairs that are summed in int16 and widened by vpmaddwd, and AVX-512
 * VNNI (256-bit vectors, AVX512VL), whose vpdpbusd multiplies and accumulates four byte
 * products straight into int32. Both sums are exact, so the two give the same integers and,
 * through the same float sequence, the same outputs bit for bit: a CPU with VNNI gets the
 * tiles' layout with one instruction where AVX2 takes three.
 */
#include "ggml_quant.h"

#include <stddef.h>

#if defined(__x86_64__)
#include <string.h>

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

/* d and mo (see the top) as float32 lanes from eight rows' fp16 d (dh) and m (mh: Q4_1, Q5_1). */
SL_TARGET_AVX2 TL_INLINE void tl_scales_of(int fmt, __m128i dh, __m128i mh, __m256 *d, __m256 *mo) {
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

/* d and mo of block b of the eight file rows (at = its byte offset in each row). */
SL_TARGET_AVX2 TL_INLINE void tl_scales(int fmt, const uint8_t *const rows[TL_LANES], int64_t at,
                                        __m256 *d, __m256 *mo) {
    __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
#pragma GCC unroll 8
    for (int j = 0; j < TL_LANES; j++) {
        dh = _mm_insert_epi16(dh, sl_read_u16(rows[j] + at), j);
        if (fmt == TL_Q4_1 || fmt == TL_Q5_1) mh = _mm_insert_epi16(mh, sl_read_u16(rows[j] + at + 2), j);
    }
    tl_scales_of(fmt, dh, mh, d, mo);
}

/* The one float sequence of a block (see the top). */
SL_TARGET_AVX2 TL_INLINE void tl_finish_block(int fmt, __m256i isum, __m256 d, __m256 mo,
                                              const sl_block_q8_1 *x, __m256 *acc, __m256 *macc) {
    const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->d));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
    if (tl_has_mo(fmt)) *macc = _mm256_fmadd_ps(mo, _mm256_set1_ps(x->s), *macc);
}

/* Eight int32 vectors -> one vector whose lane j is the sum of v[j]'s lanes (exact). */
#define tl_sum8 sl_sum8_epi32

/* Decode eight rows into the interleaved tile: codes[b][g] is 32 bytes, 4 codes (weights
 * 4g .. 4g + 3 of block b) of each row j at bytes 4j .. 4j + 3; d[b], mo[b]: 8 floats each. */
SL_TARGET_AVX2 TL_INLINE void tl_decode(int fmt, const uint8_t *const rows[TL_LANES], int64_t nb,
                                        uint8_t *codes, float *d, float *mo,
                                        const uint8_t *prefetch, int64_t ahead) {
    const int64_t bs = tl_block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        __m256i c[TL_LANES];
#pragma GCC unroll 8
        for (int j = 0; j < TL_LANES; j++) c[j] = tl_codes(fmt, rows[j] + b * bs);
        sl_transpose8_store_avx2(c, codes + b * TL_TILE_BLOCK_BYTES);
        __m256 vd, vmo;
        tl_scales(fmt, rows, b * bs, &vd, &vmo);
        _mm256_storeu_ps(d + b * TL_LANES, vd);
        _mm256_storeu_ps(mo + b * TL_LANES, vmo);
    }
}

/* Group g (4 codes of each of the 8 rows) of a decoded tile block, unsigned for the byte
 * products: Q8_0's magnitudes (its signs go to the activations); *cv: the codes as stored. */
SL_TARGET_AVX2 TL_INLINE __m256i tl_group_codes(int fmt, const uint8_t *codes, int g, __m256i *cv) {
    *cv = _mm256_loadu_si256((const __m256i *)(codes + g * 32));
    return fmt == TL_Q8_0 ? _mm256_abs_epi8(*cv) : *cv;
}

/* Activation bytes 4g .. 4g + 3 of block x broadcast to the 8 lanes (Q8_0: with the signs of
 * the codes cv, so that |w| * (sign(w) x) = w x). */
/* Four activation bytes at p broadcast to the 8 lanes. */
SL_TARGET_AVX2 TL_INLINE __m256i tl_bcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}

SL_TARGET_AVX2 TL_INLINE __m256i tl_group_x(int fmt, const sl_block_q8_1 *x, int g, __m256i cv) {
    const __m256i xb = tl_bcast4(x->qs + 4 * g);
    return fmt == TL_Q8_0 ? _mm256_sign_epi8(xb, cv) : xb;
}

/* The x8 layout (ggml_quant.h): the SL_TYPE of a tile format, for its fields. */
static inline sl_x8_fields tl_x8(int fmt) {
    static const int qtypes[] = {SL_TYPE_Q4_0, SL_TYPE_Q4_1, SL_TYPE_Q5_0, SL_TYPE_Q5_1, SL_TYPE_Q8_0};
    return sl_x8_fields_of(qtypes[fmt]);
}

/* d and mo of an x8 block's eight rows, as tl_scales computes them from the file's rows. */
SL_TARGET_AVX2 TL_INLINE void tl_x8_scales(int fmt, const uint8_t *blk, __m256 *d, __m256 *mo) {
    const int has_m = fmt == TL_Q4_1 || fmt == TL_Q5_1;
    tl_scales_of(fmt, _mm_loadu_si128((const __m128i *)blk),
                 has_m ? _mm_loadu_si128((const __m128i *)(blk + 16)) : _mm_setzero_si128(), d, mo);
}

/* 0x10 in each byte of the x8 qh chunk (ggml_quant.h: byte 4j + t holds, at bit v, the fifth
 * bit of code byte 4j + t of tile group v) whose bit v is set: one shift and one mask, the
 * shift within 16-bit lanes never carrying another byte's bit into bit 4 (v <= 7). */
SL_TARGET_AVX2 TL_INLINE __m256i tl_x8_high(__m256i qh, int v) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    if (v < 4) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - v), bit4);
    if (v == 4) return _mm256_and_si256(qh, bit4);
    return _mm256_and_si256(_mm256_srli_epi16(qh, v - 4), bit4);
}

/* Chunk c of an x8 block of a 4- or 5-bit format as two tile groups: *lo = group c (weights
 * 4c .. 4c + 3 of each row), *hi = group 4 + c (weights 16 + 4c ..), unsigned codes. */
SL_TARGET_AVX2 TL_INLINE void tl_x8_codes(int fmt, const uint8_t *blk, int c, __m256i *lo, __m256i *hi) {
    const sl_x8_fields f = tl_x8(fmt);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + f.x8_codes + 32 * c));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (tl_is5(fmt)) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + f.x8_side_at));
        *lo = _mm256_or_si256(*lo, tl_x8_high(qh, c));
        *hi = _mm256_or_si256(*hi, tl_x8_high(qh, 4 + c));
    }
}

/* An x8 block's codes and scales into a tile block: codes at `codes` (group g at g * stride),
 * d and mo (8 floats each). */
SL_TARGET_AVX2 TL_INLINE void tl_x8_decode_block(int fmt, const uint8_t *blk, uint8_t *codes,
                                                 int64_t stride, float *d, float *mo) {
    if (fmt == TL_Q8_0) {
#pragma GCC unroll 8
        for (int g = 0; g < TL_GROUPS; g++)
            _mm256_storeu_si256((__m256i *)(codes + g * stride),
                                _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * g)));
    } else {
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            tl_x8_codes(fmt, blk, c, &lo, &hi);
            _mm256_storeu_si256((__m256i *)(codes + c * stride), lo);
            _mm256_storeu_si256((__m256i *)(codes + (4 + c) * stride), hi);
        }
    }
    __m256 vd, vmo;
    tl_x8_scales(fmt, blk, &vd, &vmo);
    _mm256_storeu_ps(d, vd);
    _mm256_storeu_ps(mo, vmo);
}

/* The x8 decodes: sl_decode8's tile from one group, sl_amx_decode16's from two. */
#define TL_EXPORT_X8_DECODE(name, fmt)                                                             \
    SL_TARGET_AVX2 void sl_decode8x_##name(const uint8_t *group, int64_t k, void *tile,             \
                                           const uint8_t *prefetch, int64_t ahead) {              \
        const int64_t nb = k / SL_QK, gbs = 8 * tl_block_bytes(fmt);                               \
        uint8_t *codes = (uint8_t *)tile;                                                          \
        float *d = (float *)(codes + nb * TL_TILE_BLOCK_BYTES), *mo = d + nb * TL_LANES;           \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            sl_prefetch_share(prefetch, ahead, nb, b);                                             \
            tl_x8_decode_block(fmt, group + b * gbs, codes + b * TL_TILE_BLOCK_BYTES, 32,          \
                               d + b * TL_LANES, mo + b * TL_LANES);                               \
        }                                                                                          \
    }                                                                                              \
    SL_TARGET_AVX2 void sl_amx_decode16x_##name(const uint8_t *group, int64_t k, void *tile,        \
                                                const uint8_t *prefetch, int64_t ahead) {         \
        const int64_t nb = k / SL_QK, gbs = 8 * tl_block_bytes(fmt);                               \
        uint8_t *codes = (uint8_t *)tile;                                                          \
        float *d = (float *)(codes + nb * 512), *mo = d + nb * 16;                                 \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            sl_prefetch_share(prefetch, ahead, nb, b);                                             \
            for (int h = 0; h < 2; h++)                                                            \
                tl_x8_decode_block(fmt, group + h * nb * gbs + b * gbs, codes + b * 512 + h * 32,  \
                                   64, d + b * 16 + 8 * h, mo + b * 16 + 8 * h);                   \
        }                                                                                          \
    }                                                                                              \
    SL_TARGET_AVX2 void sl_amx_decode16x_blocks_##name(const uint8_t *group, int64_t k,            \
                                                       void *tile, int64_t b0, int64_t b1) {       \
        const int64_t nb = k / SL_QK, gbs = 8 * tl_block_bytes(fmt);                               \
        uint8_t *codes = (uint8_t *)tile;                                                          \
        float *d = (float *)(codes + nb * 512), *mo = d + nb * 16;                                 \
        for (int64_t b = b0; b < b1; b++)                                                          \
            for (int h = 0; h < 2; h++)                                                            \
                tl_x8_decode_block(fmt, group + h * nb * gbs + b * gbs, codes + b * 512 + h * 32,  \
                                   64, d + b * 16 + 8 * h, mo + b * 16 + 8 * h);                   \
    }
TL_EXPORT_X8_DECODE(q4_0, TL_Q4_0)
TL_EXPORT_X8_DECODE(q4_1, TL_Q4_1)
TL_EXPORT_X8_DECODE(q5_0, TL_Q5_0)
TL_EXPORT_X8_DECODE(q5_1, TL_Q5_1)
TL_EXPORT_X8_DECODE(q8_0, TL_Q8_0)

/* The tile decode (the same layout for both instruction sets' gemm). */
#define TL_EXPORT_DECODE(name, fmt)                                                                \
    SL_TARGET_AVX2 void sl_decode8_##name##_avx2(const uint8_t *const *rows, int64_t k, void *tile, \
                                                 const uint8_t *prefetch, int64_t ahead) {        \
        const int64_t nb = k / SL_QK;                                                              \
        uint8_t *codes = (uint8_t *)tile;                                                          \
        float *d = (float *)(codes + nb * TL_TILE_BLOCK_BYTES);                                    \
        tl_decode(fmt, rows, nb, codes, d, d + nb * TL_LANES, prefetch, ahead);                    \
    }
TL_EXPORT_DECODE(q4_0, TL_Q4_0)
TL_EXPORT_DECODE(q4_1, TL_Q4_1)
TL_EXPORT_DECODE(q5_0, TL_Q5_0)
TL_EXPORT_DECODE(q5_1, TL_Q5_1)
TL_EXPORT_DECODE(q8_0, TL_Q8_0)

/* Sixteen rows decoded straight into ggml_quant_amx.c's tile: per block, tile row g (64
 * bytes) holds group g of rows 0-7 then of rows 8-15; d and mo as 16 float32 lanes. */
#define TL_EXPORT_AMX_DECODE(name, fmt)                                                            \
    SL_TARGET_AVX2 void sl_amx_decode16_##name(const uint8_t *const *rows, int64_t k, void *tile,   \
                                               const uint8_t *prefetch, int64_t ahead) {          \
        const int64_t nb = k / SL_QK, bs = tl_block_bytes(fmt);                                    \
        uint8_t *codes = (uint8_t *)tile;                                                          \
        float *d = (float *)(codes + nb * 512), *mo = d + nb * 16;                                 \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            sl_prefetch_share(prefetch, ahead, nb, b);                                             \
            for (int h = 0; h < 2; h++) {                                                          \
                __m256i c[TL_LANES];                                                               \
                for (int j = 0; j < TL_LANES; j++) c[j] = tl_codes(fmt, rows[8 * h + j] + b * bs); \
                sl_transpose8_store_strided_avx2(c, codes + b * 512 + h * 32, 64);                 \
                __m256 vd, vmo;                                                                    \
                tl_scales(fmt, rows + 8 * h, b * bs, &vd, &vmo);                                   \
                _mm256_storeu_ps(d + b * 16 + 8 * h, vd);                                          \
                _mm256_storeu_ps(mo + b * 16 + 8 * h, vmo);                                        \
            }                                                                                      \
        }                                                                                          \
    }
TL_EXPORT_AMX_DECODE(q4_0, TL_Q4_0)
TL_EXPORT_AMX_DECODE(q4_1, TL_Q4_1)
TL_EXPORT_AMX_DECODE(q5_0, TL_Q5_0)
TL_EXPORT_AMX_DECODE(q5_1, TL_Q5_1)
TL_EXPORT_AMX_DECODE(q8_0, TL_Q8_0)

/* The gemv and gemm of each instruction set (ggml_quant_tiles_body.h). */
#define TL_ISA avx2
#define TL_TARGET SL_TARGET_AVX2
#define TL_VNNI 0
#include "ggml_quant_tiles_body.h"

#define TL_ISA avx512
#define TL_TARGET SL_TARGET_AVX512
#define TL_VNNI 1
#include "ggml_quant_tiles_body.h"

/* The 512-bit kernels on 16 interleaved rows (AVX-512 only). */
#include "ggml_quant_tiles16.h"

/* Bytes of a decoded tile of rows of k weights (32-weight formats). */
int64_t sl_tile8_bytes_q8_1(int64_t k) {
    return k / SL_QK * (TL_TILE_BLOCK_BYTES + 2 * TL_LANES * (int64_t)sizeof(float));
}

#endif
