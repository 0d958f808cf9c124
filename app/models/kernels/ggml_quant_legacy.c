/*
 * GGML's 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on the CPU: activation quantisation
 * to sl_block_q8_1 (scalar, AVX2, AVX-512), the dot product of one weight row with one
 * activation row in portable C, and the decoding of one row to float32. The contract is
 * ggml_quant.h. With AVX2 or AVX-512 VNNI the products are the tile kernels'
 * (ggml_quant_tiles.c: eight weight rows at a time, the same integers), not this file's.
 *
 * Block layouts (32 weights each; gguf-py's gguf/quants.py is the reference decoder; every
 * multi-byte field is little-endian and blocks are packed, so nothing is aligned):
 *
 *   Q4_0, 18 bytes: fp16 d | 16 bytes qs.                       w = d * (q - 8)
 *   Q4_1, 20 bytes: fp16 d | fp16 m | 16 bytes qs.              w = d * q + m
 *   Q5_0, 22 bytes: fp16 d | uint32 qh | 16 bytes qs.           w = d * (q - 16)
 *   Q5_1, 24 bytes: fp16 d | fp16 m | uint32 qh | 16 bytes qs.  w = d * q + m
 *   Q8_0, 34 bytes: fp16 d | 32 int8 qs.                        w = d * q
 *
 * For the 4- and 5-bit formats, byte j of qs holds the low 4 bits of weight j in its low nibble
 * and those of weight j + 16 in its high nibble; bit j of qh is bit 4 of weight j.
 *
 * Dot products: per block, the integer dot product of the codes with the int8 activations is
 * exact in int32 (Q4_0 / Q5_0 subtract their offset 8 / 16 exactly, as an integer), then
 * scaled by d_w * d_x in float32; Q4_1 / Q5_1 add m * s_x (s_x = d_x * sum of the activation
 * codes). Only the float32 accumulation over blocks differs between this code and the tiles.
 *
 * The SIMD functions carry their own target attributes: the file is built without -march.
 */
#include "ggml_quant.h"

#include <stddef.h>

#if defined(__x86_64__)
#include "ggml_quant_avx2.h"
#define LQ_X86 1
#else
#define LQ_X86 0
#endif

/* The formats, as compile-time constants for the shared inline helpers. */
enum { LQ_Q4_0, LQ_Q4_1, LQ_Q5_0, LQ_Q5_1, LQ_Q8_0 };

/* Bytes per block. */
static inline int64_t lq_block_bytes(int fmt) {
    switch (fmt) {
    case LQ_Q4_0: return 18;
    case LQ_Q4_1: return 20;
    case LQ_Q5_0: return 22;
    case LQ_Q5_1: return 24;
    default: return 34;
    }
}

/* Whether the format has a minimum m (w = d * q + m). */
static inline int lq_has_min(int fmt) { return fmt == LQ_Q4_1 || fmt == LQ_Q5_1; }

/* Offset of the 16 nibble bytes (4- and 5-bit formats) or the 32 int8 codes (Q8_0). */
static inline int lq_qs_offset(int fmt) {
    switch (fmt) {
    case LQ_Q4_0: return 2;
    case LQ_Q4_1: return 4;
    case LQ_Q5_0: return 6;
    case LQ_Q5_1: return 8;
    default: return 2;
    }
}

/* Offset of qh (5-bit formats only). */
static inline int lq_qh_offset(int fmt) { return fmt == LQ_Q5_0 ? 2 : 4; }

/* The offset subtracted from the codes (Q4_0: 8, Q5_0: 16, others none). */
static inline int lq_code_offset(int fmt) {
    return fmt == LQ_Q4_0 ? 8 : fmt == LQ_Q5_0 ? 16 : 0;
}

/* A little-endian uint32 from 4 bytes, whatever the host's byte order. */
static inline uint32_t lq_read_u32le(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* One block's 32 codes as signed integers, the format's offset already subtracted: the weight
 * is d * q[j] (+ m for the formats with a minimum). */
static inline void lq_codes(int fmt, const uint8_t *blk, int8_t q[SL_QK]) {
    const uint8_t *qs = blk + lq_qs_offset(fmt);
    if (fmt == LQ_Q8_0) {
        memcpy(q, qs, SL_QK);
        return;
    }
    const int is5 = fmt == LQ_Q5_0 || fmt == LQ_Q5_1;
    const uint32_t qh = is5 ? lq_read_u32le(blk + lq_qh_offset(fmt)) : 0;
    const int off = lq_code_offset(fmt);
    for (int j = 0; j < SL_QK / 2; j++) {
        /* low nibble: weight j; high nibble: weight j + 16; qh bit: bit 4 of either */
        const int lo = (qs[j] & 0x0F) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        q[j] = (int8_t)(lo - off);
        q[j + SL_QK / 2] = (int8_t)(hi - off);
    }
}

/* Scale d and minimum m of one block (m = 0 for the formats without one). */
static inline void lq_scale_min(int fmt, const uint8_t *blk, float *d, float *m) {
    *d = sl_fp16_to_fp32(sl_read_u16(blk));
    *m = lq_has_min(fmt) ? sl_fp16_to_fp32(sl_read_u16(blk + 2)) : 0.0f;
}

/* One block's contribution to the dot product, portable C: exact integer dot product of the
 * codes, then the float scales. Also the SIMD functions' odd last block. */
static inline int32_t lq_codes_idot(const int8_t q[SL_QK], const sl_block_q8_1 *x) {
    int32_t isum = 0;
    for (int j = 0; j < SL_QK; j++)
        isum += (int32_t)q[j] * (int32_t)x->qs[j];
    return isum;
}

/* The float part of one block's contribution, from its exact integer dot product isum. */
static inline float lq_block_finish(int fmt, float d, float m, int32_t isum,
                                    const sl_block_q8_1 *x) {
    float r = (d * x->d) * (float)isum;
    if (lq_has_min(fmt))
        r += m * x->s;
    return r;
}

static inline float lq_block_dot_scalar(int fmt, const uint8_t *blk, const sl_block_q8_1 *x) {
    int8_t q[SL_QK];
    lq_codes(fmt, blk, q);
    float d, m;
    lq_scale_min(fmt, blk, &d, &m);
    return lq_block_finish(fmt, d, m, lq_codes_idot(q, x), x);
}

static inline float lq_dot_scalar(int fmt, int64_t k, const void *w_row, const void *x_row) {
    const uint8_t *w = (const uint8_t *)w_row;
    const sl_block_q8_1 *x = (const sl_block_q8_1 *)x_row;
    const int64_t nb = k / SL_QK, bs = lq_block_bytes(fmt);
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++)
        sum += lq_block_dot_scalar(fmt, w + i * bs, x + i);
    return sum;
}

static inline void lq_dequantize(int fmt, int64_t k, const void *w_row, float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    const int64_t nb = k / SL_QK, bs = lq_block_bytes(fmt);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = w + i * bs;
        int8_t q[SL_QK];
        float d, m;
        lq_codes(fmt, blk, q);
        lq_scale_min(fmt, blk, &d, &m);
        /* gguf: d * q (+ m), each step rounded to float32 (the product and the sum are two
         * statements: no fused multiply-add) */
        for (int j = 0; j < SL_QK; j++) {
            float v = d * (float)q[j];
            if (lq_has_min(fmt))
                v = v + m;
            out[i * SL_QK + j] = v;
        }
    }
}

/*
 * Activation quantisation, shared by every instruction set. amax is found on the bit patterns
 * of |x| (for non-negative floats, integer order is float order, and NaN sorts above inf), so
 * that it is the same whatever the instruction set's max does with NaN. Then:
 *  - 2^-119 <= amax < inf: d = amax / 127, id = 1 / d, as the header says (d is a normal float,
 *    1 / d is finite and |x * id| <= 127);
 *  - amax < 2^-119 (zeros, or so small that 1 / d would overflow or d lose its precision):
 *    the block is all zeros, d = 0 (for amax = 0 this is exactly the header's rule);
 *  - amax inf or NaN: the codes are 0 and d = amax / 127 (inf or NaN), s = d * 0 (NaN): the
 *    dot products with this block come out NaN rather than silently finite.
 * Returns whether the codes are to be computed (the first case).
 */
#define LQ_AMAX_TINY_BITS 0x04000000u /* 2^-119 */
#define LQ_AMAX_INF_BITS 0x7F800000u

static inline int lq_q8_scale(uint32_t amax_bits, float *d, float *id) {
    float amax;
    memcpy(&amax, &amax_bits, sizeof amax);
    if (amax_bits < LQ_AMAX_TINY_BITS) {
        *d = 0.0f;
        *id = 0.0f;
        return 0;
    }
    *d = amax / 127.0f;
    *id = amax_bits < LQ_AMAX_INF_BITS ? 1.0f / *d : 0.0f;
    return amax_bits < LQ_AMAX_INF_BITS;
}

/* Stores d, s = d * sum and sum into an output block (which may be unaligned). */
static inline void lq_q8_store_ds(uint8_t *blk, float d, int32_t sum) {
    const float s = d * (float)sum;
    memcpy(blk + offsetof(sl_block_q8_1, d), &d, sizeof d);
    memcpy(blk + offsetof(sl_block_q8_1, s), &s, sizeof s);
    memcpy(blk + offsetof(sl_block_q8_1, sum), &sum, sizeof sum);
}

/* Round to nearest, ties to even, for |v| < 2^23, on the bit pattern: integer operations only,
 * so that no compiler setting can fuse the product v into a later floating-point addition (as
 * the "add 1.5 * 2^23" trick would allow under -ffp-contract=fast with FMA). */
static inline int32_t lq_round_even(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    const int e = (int)((b >> 23) & 0xFF) - 127; /* v = m * 2^(e - 23), m = 24-bit mantissa */
    if (e < -1)
        return 0; /* |v| < 0.5 */
    const uint32_t m = (b & 0x7FFFFFu) | 0x800000u;
    const int shift = 23 - e; /* 1 .. 24 for 0.5 <= |v| < 2^23 */
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    r += rem > half || (rem == half && (r & 1));
    return (b >> 31) ? -(int32_t)r : (int32_t)r;
}

void sl_quantize_q8_1_scalar(int64_t k, const float *x, void *out) {
    uint8_t *o = (uint8_t *)out;
    for (int64_t i = 0; i < k / SL_QK; i++, x += SL_QK, o += sizeof(sl_block_q8_1)) {
        /* amax on the bit patterns of |x| */
        uint32_t amax_bits = 0;
        for (int j = 0; j < SL_QK; j++) {
            uint32_t b;
            memcpy(&b, &x[j], sizeof b);
            b &= 0x7FFFFFFFu;
            amax_bits = b > amax_bits ? b : amax_bits;
        }
        float d, id;
        int8_t q[SL_QK] = {0};
        int32_t sum = 0;
        if (lq_q8_scale(amax_bits, &d, &id)) {
            for (int j = 0; j < SL_QK; j++) {
                q[j] = (int8_t)lq_round_even(x[j] * id); /* |x * id| <= 127 */
                sum += q[j];
            }
        }
        memcpy(o + offsetof(sl_block_q8_1, qs), q, SL_QK);
        lq_q8_store_ds(o, d, sum);
    }
}

float sl_dot_q4_0_scalar(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q4_0, k, w, x); }
float sl_dot_q4_1_scalar(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q4_1, k, w, x); }
float sl_dot_q5_0_scalar(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q5_0, k, w, x); }
float sl_dot_q5_1_scalar(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q5_1, k, w, x); }
float sl_dot_q8_0_scalar(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q8_0, k, w, x); }

SL_TARGET_CLONES void sl_dequantize_q4_0(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q4_0, k, w, out); }
SL_TARGET_CLONES void sl_dequantize_q4_1(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q4_1, k, w, out); }
SL_TARGET_CLONES void sl_dequantize_q5_0(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q5_0, k, w, out); }
SL_TARGET_CLONES void sl_dequantize_q5_1(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q5_1, k, w, out); }
SL_TARGET_CLONES void sl_dequantize_q8_0(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q8_0, k, w, out); }

#if LQ_X86

#define LQ_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------------ */
/* AVX2: activation quantisation                                                              */
/* ------------------------------------------------------------------------------------------ */

/* Max of the 8 uint32 lanes (all below 2^31 here). */
SL_TARGET_AVX2 LQ_INLINE uint32_t lq_hmax_epi32_avx2(__m256i v) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* Sum of the 8 int32 lanes. */
SL_TARGET_AVX2 LQ_INLINE int32_t lq_hsum_epi32_avx2(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

SL_TARGET_AVX2 void sl_quantize_q8_1_avx2(int64_t k, const float *x, void *out) {
    uint8_t *o = (uint8_t *)out;
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    for (int64_t i = 0; i < k / SL_QK; i++, x += SL_QK, o += sizeof(sl_block_q8_1)) {
        __m256 v[4];
        __m256i amax = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 8 * j);
            /* amax on the bit patterns of |x| (see lq_q8_scale) */
            amax = _mm256_max_epi32(amax, _mm256_and_si256(_mm256_castps_si256(v[j]), abs_mask));
        }
        float d, id;
        __m256i q8 = _mm256_setzero_si256();
        int32_t sum = 0;
        if (lq_q8_scale(lq_hmax_epi32_avx2(amax), &d, &id)) {
            /* x * id rounded to nearest even (the default MXCSR mode), as int32 */
            const __m256 vid = _mm256_set1_ps(id);
            __m256i q[4];
            for (int j = 0; j < 4; j++)
                q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid));
            sum = lq_hsum_epi32_avx2(
                _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
            /* int32 -> int8 (no saturation happens: |q| <= 127); the packs interleave the
             * 128-bit lanes, the permutation puts the 4-byte groups back in order */
            const __m256i q16 = _mm256_packs_epi32(q[0], q[1]);
            const __m256i q16b = _mm256_packs_epi32(q[2], q[3]);
            q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b),
                                             _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        }
        _mm256_storeu_si256((__m256i *)(o + offsetof(sl_block_q8_1, qs)), q8);
        lq_q8_store_ds(o, d, sum);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* AVX-512: activation quantisation                                                           */
/* ------------------------------------------------------------------------------------------ */

SL_TARGET_AVX512 void sl_quantize_q8_1_avx512(int64_t k, const float *x, void *out) {
    uint8_t *o = (uint8_t *)out;
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t i = 0; i < k / SL_QK; i++, x += SL_QK, o += sizeof(sl_block_q8_1)) {
        const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        /* amax on the bit patterns of |x| (see lq_q8_scale) */
        const __m512i amax = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(v0), abs_mask),
                                              _mm512_and_si512(_mm512_castps_si512(v1), abs_mask));
        float d, id;
        __m128i q0 = _mm_setzero_si128(), q1 = _mm_setzero_si128();
        int32_t sum = 0;
        if (lq_q8_scale((uint32_t)_mm512_reduce_max_epi32(amax), &d, &id)) {
            /* x * id rounded to nearest even (the default MXCSR mode), int32 -> int8 */
            const __m512 vid = _mm512_set1_ps(id);
            const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
            const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
            sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
            q0 = _mm512_cvtsepi32_epi8(a);
            q1 = _mm512_cvtsepi32_epi8(b);
        }
        _mm_storeu_si128((__m128i *)(o + offsetof(sl_block_q8_1, qs)), q0);
        _mm_storeu_si128((__m128i *)(o + offsetof(sl_block_q8_1, qs) + 16), q1);
        lq_q8_store_ds(o, d, sum);
    }
}

#else /* not x86-64: the SIMD entry points are the portable code */

#define LQ_PORTABLE(isa)                                                                        \
    void sl_quantize_q8_1_##isa(int64_t k, const float *x, void *out) {                         \
        sl_quantize_q8_1_scalar(k, x, out);                                                     \
    }
LQ_PORTABLE(avx2)
LQ_PORTABLE(avx512)

#endif
