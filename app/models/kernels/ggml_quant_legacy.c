/*
 * GGML's 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on the CPU: activation quantisation
 * to sl_block_q8_1, the dot product of one weight row with one activation row (scalar, AVX2,
 * AVX-512 VNNI), and the decoding of one row to float32. The contract is ggml_quant.h.
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
 * codes). Only the float32 accumulation over blocks differs between instruction sets.
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

/* Stores d and s = d * sum into an output block (which may be unaligned). */
static inline void lq_q8_store_ds(uint8_t *blk, float d, int32_t sum) {
    const float s = d * (float)sum;
    memcpy(blk + offsetof(sl_block_q8_1, d), &d, sizeof d);
    memcpy(blk + offsetof(sl_block_q8_1, s), &s, sizeof s);
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

void sl_dequantize_q4_0(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q4_0, k, w, out); }
void sl_dequantize_q4_1(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q4_1, k, w, out); }
void sl_dequantize_q5_0(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q5_0, k, w, out); }
void sl_dequantize_q5_1(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q5_1, k, w, out); }
void sl_dequantize_q8_0(int64_t k, const void *w, float *out) { lq_dequantize(LQ_Q8_0, k, w, out); }

#if LQ_X86

#define LQ_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------------ */
/* Helpers shared by both SIMD sets (SSE4.1 / F16C level, compiled into each caller)          */
/* ------------------------------------------------------------------------------------------ */

/* The float scales of two blocks A and B at once are [dA * dxA, mA * sxA, dB * dxB, mB * sxB]:
 * lq_pair_wscales(wa, wb) * lq_pair_xscales(xa, xb), one float32 product per lane. The first
 * 4 bytes of each weight block are fp16 d and fp16 m (for the formats without a minimum the
 * second half is the start of the codes, and lanes 1 and 3 are junk, never used); the first
 * 8 bytes of each activation block are float d and float s. (AVX2-level helpers are inlined
 * into the AVX-512 functions too: their target is a subset.) */
SL_TARGET_AVX2 LQ_INLINE __m128 lq_pair_wscales(const uint8_t *wa, const uint8_t *wb) {
    uint32_t ha, hb;
    memcpy(&ha, wa, 4);
    memcpy(&hb, wb, 4);
    return _mm_cvtph_ps(_mm_setr_epi32((int)ha, (int)hb, 0, 0));
}

SL_TARGET_AVX2 LQ_INLINE __m128 lq_pair_xscales(const sl_block_q8_1 *xa, const sl_block_q8_1 *xb) {
    uint64_t fa, fb;
    memcpy(&fa, xa, 8);
    memcpy(&fb, xb, 8);
    return _mm_castsi128_ps(_mm_set_epi64x((long long)fb, (long long)fa));
}

/* Lanes 1 + 3 of the pair scales' running sum: the sum of m * s_x. */
SL_TARGET_AVX2 LQ_INLINE float lq_min_sum(__m128 macc) {
    const __m128 odd = _mm_movehdup_ps(macc); /* [1, 1, 3, 3] */
    return _mm_cvtss_f32(_mm_add_ss(odd, _mm_movehl_ps(odd, odd)));
}

/* Sum of the 8 floats of a 256-bit vector. */
SL_TARGET_AVX2 LQ_INLINE float lq_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ------------------------------------------------------------------------------------------ */
/* AVX2: one block per 256-bit vector, maddubs (u8 x s8 -> s16 pairs) + madd (-> s32)       */
/* ------------------------------------------------------------------------------------------ */

/* The 32 codes of one 4-/5-bit block as unsigned bytes 0..15 / 0..31 in weight order. */
SL_TARGET_AVX2 LQ_INLINE __m256i lq_codes_avx2(int fmt, const uint8_t *blk) {
    const int is5 = fmt == LQ_Q5_0 || fmt == LQ_Q5_1;
    return sl_nibble_codes_avx2(blk + lq_qs_offset(fmt), is5 ? blk + lq_qh_offset(fmt) : NULL);
}

/* One weight block decoded once for the integer dot products with every activation row: the
 * unsigned maddubs operand u and, where the codes are signed, the sign source s (the activation
 * bytes take s's sign: u * sign(x, s) = |s| * sgn(s) * x = s * x, |x| <= 127). */
typedef struct {
    __m256i u, s;
} lq_wblk_avx2;

/* R: the number of activation rows sharing the decoded block. One row (the memory-bound decode
 * path) keeps Q4_0 / Q5_0's codes unsigned and subtracts the offset's dot product per row; more
 * rows make the codes signed once and pay one sign per row instead. The integer lanes are the
 * same either way (exact sums of the same bytes). */
SL_TARGET_AVX2 LQ_INLINE lq_wblk_avx2 lq_decode_avx2(int fmt, int R, const uint8_t *blk) {
    lq_wblk_avx2 b;
    if (fmt == LQ_Q8_0) {
        /* |w| <= 128, |x| <= 127: maddubs pairs stay below 2^15 */
        b.s = _mm256_loadu_si256((const __m256i *)(blk + 2));
        b.u = _mm256_abs_epi8(b.s);
    } else if (lq_code_offset(fmt) && R > 1) {
        b.s = _mm256_sub_epi8(lq_codes_avx2(fmt, blk), _mm256_set1_epi8((char)lq_code_offset(fmt)));
        b.u = _mm256_abs_epi8(b.s);
    } else {
        b.u = lq_codes_avx2(fmt, blk);
        b.s = b.u; /* unused */
    }
    return b;
}

/* Exact integer dot product of one decoded weight block with one activation block: 8 int32
 * partial sums (lane j: bytes 4j .. 4j + 3). */
SL_TARGET_AVX2 LQ_INLINE __m256i lq_block_idot_avx2(int fmt, int R, lq_wblk_avx2 b,
                                                    const sl_block_q8_1 *x) {
    const __m256i xq = _mm256_loadu_si256((const __m256i *)x->qs);
    __m256i p;
    if (fmt == LQ_Q8_0 || (lq_code_offset(fmt) && R > 1)) {
        p = _mm256_maddubs_epi16(b.u, _mm256_sign_epi8(xq, b.s));
    } else {
        p = _mm256_maddubs_epi16(b.u, xq);
        if (lq_code_offset(fmt))
            /* (q - c) . x = q . x - c . x, in int16 pairs (|pair| <= 2 * 31 * 127 + 2 * 16 * 127) */
            p = _mm256_sub_epi16(
                p, _mm256_maddubs_epi16(_mm256_set1_epi8((char)lq_code_offset(fmt)), xq));
    }
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* R activation rows (row r at x_rows + r * x_stride bytes) against one weight row, each weight
 * block decoded once for all of them. Every row's arithmetic is the one-row function's, in the
 * same order: per block pair, the scales [dA * dxA, mA * sxA, dB * dxB, mB * sxB] (one float32
 * product each), A's integer sums into acc0 and B's into acc1 (one FMA per lane), the minima's
 * products summed in lanes 1 and 3; then acc0 + acc1 summed across, plus the minima, plus an odd
 * last block computed as the scalar code computes it. */
SL_TARGET_AVX2 LQ_INLINE void lq_dot_rows_avx2(int fmt, int R, int64_t k, const void *w_row,
                                               const void *x_rows, int64_t x_stride, float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    const sl_block_q8_1 *x[SL_ROWS];
    const int64_t nb = k / SL_QK, bs = lq_block_bytes(fmt);
    __m256 acc0[SL_ROWS], acc1[SL_ROWS];
    __m128 macc[SL_ROWS]; /* m * s of the formats with a minimum, lanes 1 and 3 */
    const __m256i two = _mm256_set1_epi32(2);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        x[r] = (const sl_block_q8_1 *)((const uint8_t *)x_rows + r * x_stride);
        acc0[r] = _mm256_setzero_ps();
        acc1[r] = _mm256_setzero_ps();
        macc[r] = _mm_setzero_ps();
    }
    int64_t i = 0;
    /* two blocks per step, one accumulator each */
    for (; i + 2 <= nb; i += 2) {
        const uint8_t *wa = w + i * bs, *wb = wa + bs;
        const __m128 ws = lq_pair_wscales(wa, wb);
        const lq_wblk_avx2 ba = lq_decode_avx2(fmt, R, wa), bb = lq_decode_avx2(fmt, R, wb);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m128 sc = _mm_mul_ps(ws, lq_pair_xscales(x[r] + i, x[r] + i + 1));
            const __m256 sa = _mm256_broadcastss_ps(sc);
            const __m256 sb = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sc), two);
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lq_block_idot_avx2(fmt, R, ba, x[r] + i)),
                                      sa, acc0[r]);
            acc1[r] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(lq_block_idot_avx2(fmt, R, bb, x[r] + i + 1)), sb, acc1[r]);
            if (lq_has_min(fmt))
                macc[r] = _mm_add_ps(macc[r], sc);
        }
    }
    float sum[SL_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        sum[r] = lq_hsum256(_mm256_add_ps(acc0[r], acc1[r]));
        if (lq_has_min(fmt))
            sum[r] += lq_min_sum(macc[r]);
    }
    if (i < nb) { /* odd last block: as lq_block_dot_scalar, its codes decoded once */
        const uint8_t *blk = w + i * bs;
        int8_t q[SL_QK];
        float d, m;
        lq_codes(fmt, blk, q);
        lq_scale_min(fmt, blk, &d, &m);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            sum[r] += lq_block_finish(fmt, d, m, lq_codes_idot(q, x[r] + i), x[r] + i);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        out[r] = sum[r];
}

SL_TARGET_AVX2 LQ_INLINE float lq_dot_avx2(int fmt, int64_t k, const void *w_row,
                                           const void *x_row) {
    float out;
    lq_dot_rows_avx2(fmt, 1, k, w_row, x_row, 0, &out);
    return out;
}

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

SL_TARGET_AVX2 float sl_dot_q4_0_avx2(int64_t k, const void *w, const void *x) { return lq_dot_avx2(LQ_Q4_0, k, w, x); }
SL_TARGET_AVX2 float sl_dot_q4_1_avx2(int64_t k, const void *w, const void *x) { return lq_dot_avx2(LQ_Q4_1, k, w, x); }
SL_TARGET_AVX2 float sl_dot_q5_0_avx2(int64_t k, const void *w, const void *x) { return lq_dot_avx2(LQ_Q5_0, k, w, x); }
SL_TARGET_AVX2 float sl_dot_q5_1_avx2(int64_t k, const void *w, const void *x) { return lq_dot_avx2(LQ_Q5_1, k, w, x); }
SL_TARGET_AVX2 float sl_dot_q8_0_avx2(int64_t k, const void *w, const void *x) { return lq_dot_avx2(LQ_Q8_0, k, w, x); }

/* SL_ROWS activation rows: each out[r] bit for bit the one-row function's result */
SL_TARGET_AVX2 void sl_dot4_q4_0_avx2(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx2(LQ_Q4_0, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX2 void sl_dot4_q4_1_avx2(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx2(LQ_Q4_1, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX2 void sl_dot4_q5_0_avx2(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx2(LQ_Q5_0, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX2 void sl_dot4_q5_1_avx2(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx2(LQ_Q5_1, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX2 void sl_dot4_q8_0_avx2(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx2(LQ_Q8_0, SL_ROWS, k, w, x, xs, out); }

/* ------------------------------------------------------------------------------------------ */
/* AVX-512: two blocks per 512-bit vector, vpdpbusd (u8 x s8, 4 products summed into s32)    */
/* ------------------------------------------------------------------------------------------ */

/* The 64 codes of blocks A and B ([A 0..31 | B 0..31]) as unsigned bytes (4-/5-bit formats), or
 * Q8_0's codes plus 128 (w ^ 0x80), so that every format's codes are the unsigned operand. */
SL_TARGET_AVX512 LQ_INLINE __m512i lq_pair_codes_avx512(int fmt, const uint8_t *wa,
                                                        const uint8_t *wb) {
    const int qo = lq_qs_offset(fmt);
    if (fmt == LQ_Q8_0) {
        const __m512i w = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wa + qo))),
            _mm256_loadu_si256((const __m256i *)(wb + qo)), 1);
        return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    }
    /* [qsA | qsB] -> [qsA | qsA | qsB | qsB]; the second copy of each shifted right by 4 (its
     * high nibbles, weights 16..31), then the low nibbles kept */
    const __m256i ab = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(wa + qo))),
        _mm_loadu_si128((const __m128i *)(wb + qo)), 1);
    __m512i q = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                         _mm512_castsi256_si512(ab));
    q = _mm512_mask_srli_epi16(q, (__mmask32)0xFF00FF00u, q, 4);
    q = _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
    if (fmt == LQ_Q5_0 || fmt == LQ_Q5_1) {
        /* bit 4 of the codes: qh of A and B as a 64-bit byte mask */
        uint32_t ha, hb;
        memcpy(&ha, wa + lq_qh_offset(fmt), 4);
        memcpy(&hb, wb + lq_qh_offset(fmt), 4);
        const __mmask64 hi = _cvtu64_mask64((uint64_t)ha | (uint64_t)hb << 32);
        q = _mm512_mask_add_epi8(q, hi, q, _mm512_set1_epi8(0x10));
    }
    return q;
}

/* Blocks A and B decoded once for the integer dot products with every activation row.
 * Formats with a minimum: u = the unsigned codes, against the signed activations. Offset
 * formats (Q4_0, Q5_0, Q8_0), one row: u = the codes made unsigned (Q8_0: w + 128), the offset's
 * dot product subtracted per row (c . x). More rows: s = the signed codes w, against the
 * activations made unsigned (x + 128), the accumulator starting at neg = -128 * (sums of w by
 * 4 bytes), which is a property of the weights alone: (x + 128) . w - 128 * sum(w) = x . w. The
 * int32 lanes are the same exact sums either way. */
typedef struct {
    __m512i u, s, neg;
} lq_wpair_avx512;

SL_TARGET_AVX512 LQ_INLINE lq_wpair_avx512 lq_pair_decode_avx512(int fmt, int R, const uint8_t *wa,
                                                                 const uint8_t *wb) {
    lq_wpair_avx512 b;
    const __m512i zero = _mm512_setzero_si512();
    b.u = lq_pair_codes_avx512(fmt, wa, wb);
    b.s = b.u;
    b.neg = zero;
    if (R > 1 && (fmt == LQ_Q8_0 || lq_code_offset(fmt))) {
        const int c = fmt == LQ_Q8_0 ? 128 : lq_code_offset(fmt);
        /* (q + 128) ^ 0x80 for Q8_0 is a subtraction of 128 too (wrapping) */
        b.s = _mm512_sub_epi8(b.u, _mm512_set1_epi8((char)c));
        b.neg = _mm512_sub_epi32(zero,
                                 _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)0x80), b.s));
    }
    return b;
}

/* Exact integer dot products of decoded blocks A and B with their activation blocks (xa, xb):
 * lanes 0..7 sum to A's, lanes 8..15 to B's (lane j: bytes 4j .. 4j + 3 of the pair). */
SL_TARGET_AVX512 LQ_INLINE __m512i lq_pair_idot_avx512(int fmt, int R, lq_wpair_avx512 b,
                                                       const sl_block_q8_1 *xa,
                                                       const sl_block_q8_1 *xb) {
    const __m512i xq = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xa->qs)),
        _mm256_loadu_si256((const __m256i *)xb->qs), 1);
    const __m512i zero = _mm512_setzero_si512();
    const int c = fmt == LQ_Q8_0 ? 128 : lq_code_offset(fmt);
    if (!c)
        return _mm512_dpbusd_epi32(zero, b.u, xq);
    if (R > 1)
        return _mm512_dpbusd_epi32(b.neg, _mm512_xor_si512(xq, _mm512_set1_epi8((char)0x80)), b.s);
    /* the codes' offset (8, 16, or Q8_0's 128): (q - c) . x = q . x - c . x */
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, b.u, xq),
                            _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)c), xq));
}

/* One block pair's step for R rows: the weight scales converted and the codes decoded once,
 * then per row the pair scales sc[r] (kept for the minima) and the FMA of the integer sums into
 * acc[r]. */
SL_TARGET_AVX512 LQ_INLINE void lq_pair_step_avx512(int fmt, int R, const uint8_t *wa,
                                                    const uint8_t *wb,
                                                    const sl_block_q8_1 *const *x, int64_t i,
                                                    __m512 *acc, __m128 *sc) {
    /* lanes 0..7 take the scale of block A (lane 0 of the pair scales), 8..15 of B (lane 2) */
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m128 ws = lq_pair_wscales(wa, wb);
    const lq_wpair_avx512 b = lq_pair_decode_avx512(fmt, R, wa, wb);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        sc[r] = _mm_mul_ps(ws, lq_pair_xscales(x[r] + i, x[r] + i + 1));
        const __m512i d = lq_pair_idot_avx512(fmt, R, b, x[r] + i, x[r] + i + 1);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d),
                                 _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sc[r])),
                                 acc[r]);
    }
}

/* R activation rows against one weight row (see lq_dot_rows_avx2): every row's arithmetic is the
 * one-row function's, in the same order, the weight blocks decoded once for all of them. Four
 * blocks per step, two pairs, one accumulator each; a last pair into the first accumulator; the
 * sum across; the minima (lanes 1 + 3); an odd last block. */
SL_TARGET_AVX512 LQ_INLINE void lq_dot_rows_avx512(int fmt, int R, int64_t k, const void *w_row,
                                                   const void *x_rows, int64_t x_stride,
                                                   float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    const sl_block_q8_1 *x[SL_ROWS];
    const int64_t nb = k / SL_QK, bs = lq_block_bytes(fmt);
    __m512 acc0[SL_ROWS], acc1[SL_ROWS];
    __m128 macc[SL_ROWS]; /* m * s of the formats with a minimum, lanes 1 and 3 */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        x[r] = (const sl_block_q8_1 *)((const uint8_t *)x_rows + r * x_stride);
        acc0[r] = _mm512_setzero_ps();
        acc1[r] = _mm512_setzero_ps();
        macc[r] = _mm_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const uint8_t *w0 = w + i * bs;
        __m128 sc0[SL_ROWS], sc1[SL_ROWS];
        lq_pair_step_avx512(fmt, R, w0, w0 + bs, x, i, acc0, sc0);
        lq_pair_step_avx512(fmt, R, w0 + 2 * bs, w0 + 3 * bs, x, i + 2, acc1, sc1);
        if (lq_has_min(fmt)) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                macc[r] = _mm_add_ps(macc[r], _mm_add_ps(sc0[r], sc1[r]));
        }
    }
    if (i + 2 <= nb) { /* a last pair */
        __m128 sc[SL_ROWS];
        lq_pair_step_avx512(fmt, R, w + i * bs, w + (i + 1) * bs, x, i, acc0, sc);
        if (lq_has_min(fmt)) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                macc[r] = _mm_add_ps(macc[r], sc[r]);
        }
        i += 2;
    }
    float sum[SL_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
        if (lq_has_min(fmt))
            sum[r] += lq_min_sum(macc[r]);
    }
    if (i < nb) { /* odd last block: one block, 256-bit vpdpbusd, decoded once */
        const uint8_t *blk = w + i * bs;
        const __m256i zero = _mm256_setzero_si256();
        __m256i q;
        if (fmt == LQ_Q8_0) {
            q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                 _mm256_set1_epi8((char)0x80));
        } else {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + lq_qs_offset(fmt)));
            q = _mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1);
            q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
            if (fmt == LQ_Q5_0 || fmt == LQ_Q5_1) {
                uint32_t qh;
                memcpy(&qh, blk + lq_qh_offset(fmt), 4);
                q = _mm256_mask_add_epi8(q, _cvtu32_mask32(qh), q, _mm256_set1_epi8(0x10));
            }
        }
        float d, m;
        lq_scale_min(fmt, blk, &d, &m);
        const int c = fmt == LQ_Q8_0 ? 128 : lq_code_offset(fmt);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const sl_block_q8_1 *xb = x[r] + i;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)xb->qs);
            __m256i dot = _mm256_dpbusd_epi32(zero, q, xq);
            if (c)
                dot = _mm256_sub_epi32(dot,
                                       _mm256_dpbusd_epi32(zero, _mm256_set1_epi8((char)c), xq));
            sum[r] += (d * xb->d) * (float)lq_hsum_epi32_avx2(dot);
            if (lq_has_min(fmt))
                sum[r] += m * xb->s;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        out[r] = sum[r];
}

SL_TARGET_AVX512 LQ_INLINE float lq_dot_avx512(int fmt, int64_t k, const void *w_row,
                                               const void *x_row) {
    float out;
    lq_dot_rows_avx512(fmt, 1, k, w_row, x_row, 0, &out);
    return out;
}

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

SL_TARGET_AVX512 float sl_dot_q4_0_avx512(int64_t k, const void *w, const void *x) { return lq_dot_avx512(LQ_Q4_0, k, w, x); }
SL_TARGET_AVX512 float sl_dot_q4_1_avx512(int64_t k, const void *w, const void *x) { return lq_dot_avx512(LQ_Q4_1, k, w, x); }
SL_TARGET_AVX512 float sl_dot_q5_0_avx512(int64_t k, const void *w, const void *x) { return lq_dot_avx512(LQ_Q5_0, k, w, x); }
SL_TARGET_AVX512 float sl_dot_q5_1_avx512(int64_t k, const void *w, const void *x) { return lq_dot_avx512(LQ_Q5_1, k, w, x); }
SL_TARGET_AVX512 float sl_dot_q8_0_avx512(int64_t k, const void *w, const void *x) { return lq_dot_avx512(LQ_Q8_0, k, w, x); }

/* SL_ROWS activation rows: each out[r] bit for bit the one-row function's result */
SL_TARGET_AVX512 void sl_dot4_q4_0_avx512(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx512(LQ_Q4_0, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX512 void sl_dot4_q4_1_avx512(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx512(LQ_Q4_1, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX512 void sl_dot4_q5_0_avx512(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx512(LQ_Q5_0, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX512 void sl_dot4_q5_1_avx512(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx512(LQ_Q5_1, SL_ROWS, k, w, x, xs, out); }
SL_TARGET_AVX512 void sl_dot4_q8_0_avx512(int64_t k, const void *w, const void *x, int64_t xs, float *out) { lq_dot_rows_avx512(LQ_Q8_0, SL_ROWS, k, w, x, xs, out); }

#else /* not x86-64: the SIMD entry points are the portable code */

#define LQ_PORTABLE(isa)                                                                        \
    void sl_quantize_q8_1_##isa(int64_t k, const float *x, void *out) {                         \
        sl_quantize_q8_1_scalar(k, x, out);                                                     \
    }                                                                                           \
    float sl_dot_q4_0_##isa(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q4_0, k, w, x); } \
    float sl_dot_q4_1_##isa(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q4_1, k, w, x); } \
    float sl_dot_q5_0_##isa(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q5_0, k, w, x); } \
    float sl_dot_q5_1_##isa(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q5_1, k, w, x); } \
    float sl_dot_q8_0_##isa(int64_t k, const void *w, const void *x) { return lq_dot_scalar(LQ_Q8_0, k, w, x); }
LQ_PORTABLE(avx2)
LQ_PORTABLE(avx512)

static inline void lq_dot_rows_scalar(int fmt, int64_t k, const void *w_row, const void *x_rows,
                                      int64_t x_stride, float *out) {
    for (int r = 0; r < SL_ROWS; r++)
        out[r] = lq_dot_scalar(fmt, k, w_row, (const uint8_t *)x_rows + r * x_stride);
}

#define LQ_PORTABLE_ROWS(fmt, FMT)                                                              \
    void sl_dot4_##fmt##_avx2(int64_t k, const void *w, const void *x, int64_t xs, float *out) { \
        lq_dot_rows_scalar(FMT, k, w, x, xs, out);                                              \
    }                                                                                           \
    void sl_dot4_##fmt##_avx512(int64_t k, const void *w, const void *x, int64_t xs, float *out) { \
        lq_dot_rows_scalar(FMT, k, w, x, xs, out);                                              \
    }
LQ_PORTABLE_ROWS(q4_0, LQ_Q4_0)
LQ_PORTABLE_ROWS(q4_1, LQ_Q4_1)
LQ_PORTABLE_ROWS(q5_0, LQ_Q5_0)
LQ_PORTABLE_ROWS(q5_1, LQ_Q5_1)
LQ_PORTABLE_ROWS(q8_0, LQ_Q8_0)

#endif
