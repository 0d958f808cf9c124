/*
 * GGML's K formats (Q4_K, Q5_K, Q6_K) on the CPU: activation quantisation to sl_block_q8_k
 * (scalar, AVX2, AVX-512), the portable dot product of one weight row with one activation row,
 * and the decoding of one row to float32. The SIMD products are the tile kernels of
 * ggml_quant_ktiles.c. The contract is ggml_quant.h.
 *
 * Super-block layouts (256 weights each; gguf-py's gguf/quants.py is the reference decoder):
 *
 *   Q4_K, 144 bytes: fp16 d | fp16 dmin | 12 bytes of 6-bit scales sc[8] and minima m[8] |
 *         128 bytes of 4-bit codes. Sub-block j (32 weights) = d * sc[j] * q - dmin * m[j];
 *         code byte 32 * (j / 2) + l holds weight l of sub-block j in its low nibble (j even)
 *         or its high nibble (j odd).
 *   Q5_K, 176 bytes: fp16 d | fp16 dmin | 12 bytes of scales and minima (as Q4_K) | 32 bytes qh
 *         | 128 bytes of low nibbles (as Q4_K). Bit j of qh[l] is bit 4 of weight l of
 *         sub-block j.
 *   Q6_K, 210 bytes: 128 bytes ql | 64 bytes qh | 16 int8 scales | fp16 d. Sub-block j (16
 *         weights) = d * scale[j] * (q - 32). In half h of the block, ql[64h + l] holds weight
 *         128h + l (low nibble) and 128h + 64 + l (high nibble); qh[32h + l] holds bits 4-5 of
 *         weight 128h + 32s + l at its bits 2s, 2s + 1 (s = 0..3).
 *
 * The packed Q4_K / Q5_K scale bytes: bytes 0-3 hold sc[0..3] in their low 6 bits and bits 4-5
 * of sc[4..7] on top; bytes 4-7 the same for m; bytes 8-11 hold the low 4 bits of sc[4..7]
 * (low nibble) and of m[4..7] (high nibble).
 *
 * Dot products: for every sub-block the integer dot product of the codes with the int8
 * activations (exact int32), times the integer sub-block scale, summed over the super-block in
 * int32 (exact), then times d_w * d_x in float32. The minima (Q4_K, Q5_K) and Q6_K's -32 offset
 * come from the activation block's bsums (sums of 16 activation codes), also exactly in integers.
 *
 * The SIMD functions carry their own target attributes: the file is built without -march.
 */
#include "ggml_quant.h"

#include <immintrin.h>

#define KQ_Q4_K_BYTES 144
#define KQ_Q5_K_BYTES 176
#define KQ_Q6_K_BYTES 210

/* ------------------------------------------------------------------------------------------ */
/* Shared helpers                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* Round to nearest, ties to even, in float32 (|v| < 2^22; default rounding mode). */
static inline float kq_round_even(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: the sum's last bit has weight 1 */
    return (v + magic) - magic;
}

/* ------------------------------------------------------------------------------------------ */
/* Activation quantisation: float32 -> sl_block_q8_k                                          */
/* ------------------------------------------------------------------------------------------ */

void sl_quantize_q8_k_scalar(int64_t k, const float *x, void *out) {
    sl_block_q8_k *y = (sl_block_q8_k *)out;
    for (int64_t b = 0; b < k / SL_QK_K; b++, x += SL_QK_K, y++) {
        /* Scale from the largest magnitude. */
        float amax = 0.0f;
        for (int i = 0; i < SL_QK_K; i++) {
            const float a = x[i] < 0.0f ? -x[i] : x[i];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y->d = d;
        /* Codes, then the sums of each 16 codes. */
        for (int i = 0; i < SL_QK_K; i++) y->qs[i] = (int8_t)(int)kq_round_even(x[i] * id);
        for (int j = 0; j < SL_QK_K / 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += y->qs[16 * j + i];
            y->bsums[j] = (int16_t)sum;
        }
    }
}

SL_TARGET_AVX2 static inline float kq_hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* 8 floats times id, rounded to nearest even, to int32. */
SL_TARGET_AVX2 static inline __m256i kq_codes8_avx2(const float *x, __m256 id) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x), id);
    return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

SL_TARGET_AVX2 void sl_quantize_q8_k_avx2(int64_t k, const float *x, void *out) {
    sl_block_q8_k *y = (sl_block_q8_k *)out;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / SL_QK_K; b++, x += SL_QK_K, y++) {
        /* Largest magnitude (max is exact: same value as the scalar loop). */
        __m256 vmax = _mm256_setzero_ps();
        for (int i = 0; i < SL_QK_K; i += 8)
            vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
        const float d = kq_hmax256(vmax) / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        y->d = d;
        for (int g = 0; g < SL_QK_K / 32; g++) {
            /* 32 codes as four int32 vectors. */
            const __m256i r0 = kq_codes8_avx2(x + 32 * g, id), r1 = kq_codes8_avx2(x + 32 * g + 8, id);
            const __m256i r2 = kq_codes8_avx2(x + 32 * g + 16, id), r3 = kq_codes8_avx2(x + 32 * g + 24, id);
            /* Pack to int8 (|q| <= 127: no saturation); the packs interleave 128-bit lanes, the
             * dword permutation puts the codes back in order. */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r0, r1), _mm256_packs_epi32(r2, r3));
            _mm256_storeu_si256((__m256i *)(y->qs + 32 * g), _mm256_permutevar8x32_epi32(p, byte_order));
            /* bsums of codes 0-15 and 16-31 of the group. */
            const __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(r0, r1), _mm256_add_epi32(r2, r3));
            const __m256i hh = _mm256_hadd_epi32(h, h);
            const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(hh), _mm256_extracti128_si256(hh, 1));
            y->bsums[2 * g] = (int16_t)_mm_cvtsi128_si32(s);
            y->bsums[2 * g + 1] = (int16_t)_mm_extract_epi32(s, 1);
        }
    }
}

SL_TARGET_AVX512 void sl_quantize_q8_k_avx512(int64_t k, const float *x, void *out) {
    sl_block_q8_k *y = (sl_block_q8_k *)out;
    for (int64_t b = 0; b < k / SL_QK_K; b++, x += SL_QK_K, y++) {
        /* Largest magnitude. */
        __m512 vmax = _mm512_setzero_ps();
        for (int i = 0; i < SL_QK_K; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
        const float d = _mm512_reduce_max_ps(vmax) / 127.0f;
        const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        y->d = d;
        for (int j = 0; j < SL_QK_K / 16; j++) {
            /* 16 codes: multiply, convert with round-to-nearest-even, narrow to int8. */
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * j), id);
            const __m512i r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(y->qs + 16 * j), _mm512_cvtepi32_epi8(r));
            y->bsums[j] = (int16_t)_mm512_reduce_add_epi32(r);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Q4_K                                                                                        */
/* ------------------------------------------------------------------------------------------ */

float sl_dot_q4_k_scalar(int64_t k, const void *w_row, const void *x_row) {
    const uint8_t *w = (const uint8_t *)w_row;
    const sl_block_q8_k *x = (const sl_block_q8_k *)x_row;
    float sum = 0.0f;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q4_K_BYTES, x++) {
        const float d = sl_fp16_to_fp32(sl_read_u16(w)) * x->d;
        const float dmin = sl_fp16_to_fp32(sl_read_u16(w + 2)) * x->d;
        uint8_t sc[8], m[8];
        sl_kq_scales_mins(w + 4, sc, m);
        const uint8_t *q = w + 16;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            /* Sub-block j: nibble (j & 1) of the 32 bytes q[32 * (j / 2) ...]. */
            const uint8_t *qj = q + 32 * (j >> 1);
            const int shift = 4 * (j & 1);
            int32_t dot = 0;
            for (int l = 0; l < 32; l++) dot += ((qj[l] >> shift) & 0x0F) * x->qs[32 * j + l];
            sumi += sc[j] * dot;
            summ += m[j] * (x->bsums[2 * j] + x->bsums[2 * j + 1]);
        }
        sum += d * (float)sumi - dmin * (float)summ;
    }
    return sum;
}

SL_TARGET_CLONES void sl_dequantize_q4_k(int64_t k, const void *w_row, float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q4_K_BYTES, out += SL_QK_K) {
        const float d = sl_fp16_to_fp32(sl_read_u16(w)), dmin = sl_fp16_to_fp32(sl_read_u16(w + 2));
        uint8_t sc[8], m[8];
        sl_kq_scales_mins(w + 4, sc, m);
        for (int j = 0; j < 8; j++) {
            /* Same float32 operations as gguf-py: (d * sc) * q - (dmin * m). */
            const float scale = d * (float)sc[j], offset = dmin * (float)m[j];
            const uint8_t *qj = w + 16 + 32 * (j >> 1);
            const int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) out[32 * j + l] = scale * (float)((qj[l] >> shift) & 0x0F) - offset;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Q5_K                                                                                        */
/* ------------------------------------------------------------------------------------------ */

float sl_dot_q5_k_scalar(int64_t k, const void *w_row, const void *x_row) {
    const uint8_t *w = (const uint8_t *)w_row;
    const sl_block_q8_k *x = (const sl_block_q8_k *)x_row;
    float sum = 0.0f;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q5_K_BYTES, x++) {
        const float d = sl_fp16_to_fp32(sl_read_u16(w)) * x->d;
        const float dmin = sl_fp16_to_fp32(sl_read_u16(w + 2)) * x->d;
        uint8_t sc[8], m[8];
        sl_kq_scales_mins(w + 4, sc, m);
        const uint8_t *qh = w + 16, *q = w + 48;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            /* Low 4 bits as Q4_K, bit 4 from bit j of qh[l]. */
            const uint8_t *qj = q + 32 * (j >> 1);
            const int shift = 4 * (j & 1);
            int32_t dot = 0;
            for (int l = 0; l < 32; l++) {
                const int code = ((qj[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
                dot += code * x->qs[32 * j + l];
            }
            sumi += sc[j] * dot;
            summ += m[j] * (x->bsums[2 * j] + x->bsums[2 * j + 1]);
        }
        sum += d * (float)sumi - dmin * (float)summ;
    }
    return sum;
}

SL_TARGET_CLONES void sl_dequantize_q5_k(int64_t k, const void *w_row, float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q5_K_BYTES, out += SL_QK_K) {
        const float d = sl_fp16_to_fp32(sl_read_u16(w)), dmin = sl_fp16_to_fp32(sl_read_u16(w + 2));
        uint8_t sc[8], m[8];
        sl_kq_scales_mins(w + 4, sc, m);
        const uint8_t *qh = w + 16;
        for (int j = 0; j < 8; j++) {
            const float scale = d * (float)sc[j], offset = dmin * (float)m[j];
            const uint8_t *qj = w + 48 + 32 * (j >> 1);
            const int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) {
                const int code = ((qj[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
                out[32 * j + l] = scale * (float)code - offset;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Q6_K                                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* The 256 codes (0..63) of a Q6_K block, in weight order. */
static inline void kq_q6_codes(const uint8_t *ql, const uint8_t *qh, uint8_t q[SL_QK_K]) {
    for (int h = 0; h < 2; h++, ql += 64, qh += 32, q += 128) {
        for (int l = 0; l < 32; l++) {
            q[l] = (uint8_t)((ql[l] & 0x0F) | ((qh[l] & 0x03) << 4));
            q[l + 32] = (uint8_t)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 0x03) << 4));
            q[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 0x03) << 4));
            q[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) << 4));
        }
    }
}

float sl_dot_q6_k_scalar(int64_t k, const void *w_row, const void *x_row) {
    const uint8_t *w = (const uint8_t *)w_row;
    const sl_block_q8_k *x = (const sl_block_q8_k *)x_row;
    float sum = 0.0f;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q6_K_BYTES, x++) {
        const int8_t *scales = (const int8_t *)(w + 192);
        const float d = sl_fp16_to_fp32(sl_read_u16(w + 208)) * x->d;
        uint8_t q[SL_QK_K];
        kq_q6_codes(w, w + 128, q);
        int32_t sumi = 0;
        for (int j = 0; j < 16; j++) {
            /* Sub-block j: unsigned codes, then the -32 offset from bsums[j]. */
            int32_t dot = 0;
            for (int l = 16 * j; l < 16 * j + 16; l++) dot += q[l] * x->qs[l];
            sumi += scales[j] * (dot - 32 * x->bsums[j]);
        }
        sum += d * (float)sumi;
    }
    return sum;
}

SL_TARGET_CLONES void sl_dequantize_q6_k(int64_t k, const void *w_row, float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q6_K_BYTES, out += SL_QK_K) {
        const int8_t *scales = (const int8_t *)(w + 192);
        const float d = sl_fp16_to_fp32(sl_read_u16(w + 208));
        uint8_t q[SL_QK_K];
        kq_q6_codes(w, w + 128, q);
        for (int l = 0; l < SL_QK_K; l++) {
            /* As gguf-py: (d * scale) * (q - 32) in float32. */
            const float scale = d * (float)scales[l >> 4];
            out[l] = scale * (float)(q[l] - 32);
        }
    }
}
