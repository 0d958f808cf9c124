/*
 * GGML's K formats (Q4_K, Q5_K, Q6_K) on the CPU: activation quantisation to sl_block_q8_k,
 * the dot product of one weight row with one activation row (scalar, AVX2, AVX-512 VNNI), the
 * same for up to SL_ROWS activation rows at once (AVX2, AVX-512 VNNI: each weight super-block
 * decoded once for all of them, every result bit for bit the one-row result), and the decoding of one
 * row to float32. The contract is ggml_quant.h.
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
 * Only the float32 accumulation over super-blocks differs between instruction sets.
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

/* Q4_K / Q5_K: the 12 packed scale bytes to sc[0..7] and m[0..7], byte by byte (portable). */
static inline void kq_scales_bytes(const uint8_t *p, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 0x3F;
        m[j] = p[j + 4] & 0x3F;
        sc[j + 4] = (uint8_t)((p[j + 8] & 0x0F) | ((p[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4));
    }
}

/* The same on 32-bit words, for the SIMD code (x86: little-endian): sc and m as 8 bytes each. */
static inline void kq_scales_u64(const uint8_t *p, uint64_t *sc, uint64_t *m) {
    uint32_t a, b, c;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    memcpy(&c, p + 8, 4);
    /* ">> 2" moves each byte's bits 6-7 to its bits 4-5; the bits shifted in are masked off. */
    const uint32_t sc_lo = a & 0x3F3F3F3Fu, m_lo = b & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc = sc_lo | ((uint64_t)sc_hi << 32);
    *m = m_lo | ((uint64_t)m_hi << 32);
}

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

SL_TARGET_AVX2 static inline float kq_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
        kq_scales_bytes(w + 4, sc, m);
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

/* Broadcast of the int16 element j of each 128-bit lane (shuffle_epi8 control). */
#define KQ_PICK16(j) (short)(((2 * (j) + 1) << 8) | (2 * (j)))

/* A 512-bit vector: a in the low 256 bits, b in the high. */
#define KQ_HALVES512(a, b) _mm512_inserti64x4(_mm512_castsi256_si512(a), (b), 1)

/* int32 lanes holding the int16 element j of each 128-bit lane, zero-extended (shuffle_epi8
 * control). */
#define KQ_PICK32(j) (int)(0x80800000 | ((2 * (j) + 1) << 8) | (2 * (j)))

/*
 * Every SIMD dot product below is one body, inlined with a compile-time row count R (1 for
 * sl_dot_*, 1 to SL_ROWS for sl_dotn_*): each weight super-block is decoded once (codes, high bits,
 * scales, minima, fp16 factors) and used for the R activation rows, each row with its own
 * accumulators. Per row, the body performs exactly the operations of the one-row case, in
 * the same order and on the same lanes, so out[r] of the R-row call equals the one-row result
 * bit for bit. Row r's block b is at x + r * x_stride + b * sizeof(sl_block_q8_k).
 */
#define KQ_INLINE static inline __attribute__((always_inline))
/* An empty asm that "changes" v: the compiler keeps each row's running integer sum as written
 * (no reassociated tree of products held in spilled registers). */
#define KQ_KEEP(v) __asm__("" : "+x"(v))
#define KQ_X(xb, r, x_stride) ((const sl_block_q8_k *)((xb) + (r) * (x_stride)))
/* The statements once per row r = 0 .. R - 1, r a constant in each copy: the arrays of per-row
 * state (indexed by constants only) then live in registers, whatever the loop unrolling. */
#define KQ_ROW(R, n, ...)                                                                         \
    {                                                                                             \
        const int r = (n);                                                                        \
        if (r < (R)) { __VA_ARGS__; }                                                             \
    }
#define KQ_ROWS(R, ...)                                                                           \
    do {                                                                                          \
        _Static_assert(SL_ROWS == 4, "KQ_ROWS expands 4 rows");                                   \
        KQ_ROW(R, 0, __VA_ARGS__) KQ_ROW(R, 1, __VA_ARGS__) KQ_ROW(R, 2, __VA_ARGS__)             \
        KQ_ROW(R, 3, __VA_ARGS__)                                                                 \
    } while (0)

/* sl_dotn_<fmt>_<isa>: 1 to SL_ROWS activation rows through kq_dot_<fmt>_<isa>_rows, with a
 * constant row count in each inlined copy of the body. */
#define KQ_DOTN(fmt, isa, target)                                                                 \
    target void sl_dotn_##fmt##_##isa(int64_t k, const void *w_row, const void *x_rows,           \
                                      int64_t x_stride, int n, float *out) {                      \
        switch (n) {                                                                              \
        case 4: kq_dot_##fmt##_##isa##_rows(4, k, w_row, x_rows, x_stride, out); break;           \
        case 3: kq_dot_##fmt##_##isa##_rows(3, k, w_row, x_rows, x_stride, out); break;           \
        case 2: kq_dot_##fmt##_##isa##_rows(2, k, w_row, x_rows, x_stride, out); break;           \
        default: kq_dot_##fmt##_##isa##_rows(1, k, w_row, x_rows, x_stride, out); break;          \
        }                                                                                         \
    }

SL_TARGET_AVX2 KQ_INLINE void kq_dot_q4_k_avx2_rows(const int R, int64_t k, const void *w_row, const void *x_rows,
                                                    int64_t x_stride, float *out) {
    const uint8_t *w = (const uint8_t *)w_row, *xb = (const uint8_t *)x_rows;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[SL_ROWS], acc_min[SL_ROWS];
    KQ_ROWS(R, acc[r] = acc_min[r] = _mm256_setzero_ps());
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q4_K_BYTES, xb += sizeof(sl_block_q8_k)) {
        const float dw = _cvtsh_ss(sl_read_u16(w)), dminw = _cvtsh_ss(sl_read_u16(w + 2));
        uint64_t sc, mn;
        kq_scales_u64(w + 4, &sc, &mn);
        /* The 8 scales as int16, in both 128-bit lanes. */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));

        /* Minima: m[j] * (bsums[2j] + bsums[2j + 1]), with each m[j] twice in a row. */
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        const __m256i m_pairs = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
        KQ_ROWS(R, {
            const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)x->bsums);
            acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(dminw * x->d),
                                         _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, m_pairs)), acc_min[r]);
        });

        /* Codes: 32 bytes hold sub-blocks 2i (low nibbles) and 2i + 1 (high nibbles). */
        const uint8_t *q = w + 16;
        __m256i sumi[SL_ROWS];
        KQ_ROWS(R, sumi[r] = _mm256_setzero_si256());
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
            const __m256i lo = _mm256_and_si256(bytes, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(KQ_PICK16(2 * i)));
            const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(KQ_PICK16(2 * i + 1)));
            KQ_ROWS(R, {
                const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
                /* u8 codes x s8 activations -> int16 pair sums, then x scale -> int32. */
                __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x->qs + 64 * i)));
                __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x->qs + 64 * i + 32)));
                p0 = _mm256_madd_epi16(p0, s0);
                p1 = _mm256_madd_epi16(p1, s1);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
                KQ_KEEP(sumi[r]);
            });
        }
        KQ_ROWS(R, acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * KQ_X(xb, r, x_stride)->d),
                                            _mm256_cvtepi32_ps(sumi[r]), acc[r]));
    }
    KQ_ROWS(R, out[r] = kq_hsum256(_mm256_sub_ps(acc[r], acc_min[r])));
}

SL_TARGET_AVX2 float sl_dot_q4_k_avx2(int64_t k, const void *w_row, const void *x_row) {
    float out;
    kq_dot_q4_k_avx2_rows(1, k, w_row, x_row, 0, &out);
    return out;
}

KQ_DOTN(q4_k, avx2, SL_TARGET_AVX2)

SL_TARGET_AVX512 KQ_INLINE void kq_dot_q4_k_avx512_rows(const int R, int64_t k, const void *w_row,
                                                        const void *x_rows, int64_t x_stride, float *out) {
    const uint8_t *w = (const uint8_t *)w_row, *xb = (const uint8_t *)x_rows;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* Shift counts: 0 for the low half (low nibbles), 4 for the high half (high nibbles). */
    const __m512i nibble_shift = KQ_HALVES512(_mm256_setzero_si256(), _mm256_set1_epi16(4));
    __m512 acc[SL_ROWS];
    __m256 acc_min[SL_ROWS];
    KQ_ROWS(R, {
        acc[r] = _mm512_setzero_ps();
        acc_min[r] = _mm256_setzero_ps();
    });
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q4_K_BYTES, xb += sizeof(sl_block_q8_k)) {
        const float dw = _cvtsh_ss(sl_read_u16(w)), dminw = _cvtsh_ss(sl_read_u16(w + 2));
        uint64_t sc, mn;
        kq_scales_u64(w + 4, &sc, &mn);
        const __m512i sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));

        /* Minima, as in the AVX2 code. */
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        const __m256i m_pairs = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
        KQ_ROWS(R, {
            const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)x->bsums);
            acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(dminw * x->d),
                                         _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, m_pairs)), acc_min[r]);
        });

        const uint8_t *q = w + 16;
        __m512i sumi[SL_ROWS];
        KQ_ROWS(R, sumi[r] = _mm512_setzero_si512());
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            /* 32 code bytes in both halves; the low half keeps the low nibbles (sub-block 2i),
             * the high half the high ones (2i + 1): 64 codes in the order of x->qs[64i ...]. */
            const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + 32 * i)));
            const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(bytes, nibble_shift), low4);
            /* The sub-block scales as int32 lanes with the scale in the low int16, zero on top. */
            const __m512i scale = _mm512_shuffle_epi8(
                sc16, KQ_HALVES512(_mm256_set1_epi32(KQ_PICK32(2 * i)), _mm256_set1_epi32(KQ_PICK32(2 * i + 1))));
            KQ_ROWS(R, {
                const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
                /* Sums of 4 products per int32 lane (|sum| <= 7680: fits the low int16) ... */
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                                        _mm512_loadu_si512((const void *)(x->qs + 64 * i)));
                /* ... times the scale: dpwssd adds dot_lo16 * scale + dot_hi16 * 0. */
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], dot, scale);
            });
        }
        KQ_ROWS(R, acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dw * KQ_X(xb, r, x_stride)->d),
                                            _mm512_cvtepi32_ps(sumi[r]), acc[r]));
    }
    KQ_ROWS(R, out[r] = _mm512_reduce_add_ps(acc[r]) - kq_hsum256(acc_min[r]));
}

SL_TARGET_AVX512 float sl_dot_q4_k_avx512(int64_t k, const void *w_row, const void *x_row) {
    float out;
    kq_dot_q4_k_avx512_rows(1, k, w_row, x_row, 0, &out);
    return out;
}

KQ_DOTN(q4_k, avx512, SL_TARGET_AVX512)

SL_TARGET_CLONES void sl_dequantize_q4_k(int64_t k, const void *w_row, float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q4_K_BYTES, out += SL_QK_K) {
        const float d = sl_fp16_to_fp32(sl_read_u16(w)), dmin = sl_fp16_to_fp32(sl_read_u16(w + 2));
        uint8_t sc[8], m[8];
        kq_scales_bytes(w + 4, sc, m);
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
        kq_scales_bytes(w + 4, sc, m);
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

SL_TARGET_AVX2 KQ_INLINE void kq_dot_q5_k_avx2_rows(const int R, int64_t k, const void *w_row, const void *x_rows,
                                                    int64_t x_stride, float *out) {
    const uint8_t *w = (const uint8_t *)w_row, *xb = (const uint8_t *)x_rows;
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    __m256 acc[SL_ROWS], acc_min[SL_ROWS];
    KQ_ROWS(R, acc[r] = acc_min[r] = _mm256_setzero_ps());
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q5_K_BYTES, xb += sizeof(sl_block_q8_k)) {
        const float dw = _cvtsh_ss(sl_read_u16(w)), dminw = _cvtsh_ss(sl_read_u16(w + 2));
        uint64_t sc, mn;
        kq_scales_u64(w + 4, &sc, &mn);
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));

        /* Minima, as Q4_K. */
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        const __m256i m_pairs = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
        KQ_ROWS(R, {
            const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)x->bsums);
            acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(dminw * x->d),
                                         _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, m_pairs)), acc_min[r]);
        });

        const uint8_t *q = w + 48;
        /* qh shifted right by 2i (16-bit shifts: bit 0 of each byte is that byte's bit 2i). */
        __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
        __m256i sumi[SL_ROWS];
        KQ_ROWS(R, sumi[r] = _mm256_setzero_si256());
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
            /* Bits 2i and 2i + 1 of qh moved to bit 4, over the two nibbles. */
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(bytes, low4),
                                               _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4),
                                               _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
            qh = _mm256_srli_epi16(qh, 2);
            const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(KQ_PICK16(2 * i)));
            const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(KQ_PICK16(2 * i + 1)));
            KQ_ROWS(R, {
                const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
                __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x->qs + 64 * i)));
                __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x->qs + 64 * i + 32)));
                p0 = _mm256_madd_epi16(p0, s0);
                p1 = _mm256_madd_epi16(p1, s1);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
                KQ_KEEP(sumi[r]);
            });
        }
        KQ_ROWS(R, acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * KQ_X(xb, r, x_stride)->d),
                                            _mm256_cvtepi32_ps(sumi[r]), acc[r]));
    }
    KQ_ROWS(R, out[r] = kq_hsum256(_mm256_sub_ps(acc[r], acc_min[r])));
}

SL_TARGET_AVX2 float sl_dot_q5_k_avx2(int64_t k, const void *w_row, const void *x_row) {
    float out;
    kq_dot_q5_k_avx2_rows(1, k, w_row, x_row, 0, &out);
    return out;
}

KQ_DOTN(q5_k, avx2, SL_TARGET_AVX2)

SL_TARGET_AVX512 KQ_INLINE void kq_dot_q5_k_avx512_rows(const int R, int64_t k, const void *w_row,
                                                        const void *x_rows, int64_t x_stride, float *out) {
    const uint8_t *w = (const uint8_t *)w_row, *xb = (const uint8_t *)x_rows;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    const __m512i nibble_shift = KQ_HALVES512(_mm256_setzero_si256(), _mm256_set1_epi16(4));
    __m512 acc[SL_ROWS];
    __m256 acc_min[SL_ROWS];
    KQ_ROWS(R, {
        acc[r] = _mm512_setzero_ps();
        acc_min[r] = _mm256_setzero_ps();
    });
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q5_K_BYTES, xb += sizeof(sl_block_q8_k)) {
        const float dw = _cvtsh_ss(sl_read_u16(w)), dminw = _cvtsh_ss(sl_read_u16(w + 2));
        uint64_t sc, mn;
        kq_scales_u64(w + 4, &sc, &mn);
        const __m512i sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));

        /* Minima, as Q4_K. */
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        const __m256i m_pairs = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
        KQ_ROWS(R, {
            const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)x->bsums);
            acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(dminw * x->d),
                                         _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, m_pairs)), acc_min[r]);
        });

        const uint8_t *q = w + 48;
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16)));
        __m512i sumi[SL_ROWS];
        KQ_ROWS(R, sumi[r] = _mm512_setzero_si512());
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            /* Low nibbles of sub-block 2i | high nibbles of sub-block 2i + 1, as Q4_K ... */
            const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + 32 * i)));
            __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(bytes, nibble_shift), low4);
            /* ... plus 16 where bit 2i (low half) or 2i + 1 (high half) of qh is set. */
            const __mmask64 high = _mm512_test_epi8_mask(
                qh, KQ_HALVES512(_mm256_set1_epi8((char)(1 << (2 * i))), _mm256_set1_epi8((char)(2 << (2 * i)))));
            codes = _mm512_mask_add_epi8(codes, high, codes, bit4);
            const __m512i scale = _mm512_shuffle_epi8(
                sc16, KQ_HALVES512(_mm256_set1_epi32(KQ_PICK32(2 * i)), _mm256_set1_epi32(KQ_PICK32(2 * i + 1))));
            KQ_ROWS(R, {
                const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
                /* |sum of 4 products| <= 4 * 31 * 128: fits the low int16 (see Q4_K). */
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                                        _mm512_loadu_si512((const void *)(x->qs + 64 * i)));
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], dot, scale);
            });
        }
        KQ_ROWS(R, acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dw * KQ_X(xb, r, x_stride)->d),
                                            _mm512_cvtepi32_ps(sumi[r]), acc[r]));
    }
    KQ_ROWS(R, out[r] = _mm512_reduce_add_ps(acc[r]) - kq_hsum256(acc_min[r]));
}

SL_TARGET_AVX512 float sl_dot_q5_k_avx512(int64_t k, const void *w_row, const void *x_row) {
    float out;
    kq_dot_q5_k_avx512_rows(1, k, w_row, x_row, 0, &out);
    return out;
}

KQ_DOTN(q5_k, avx512, SL_TARGET_AVX512)

SL_TARGET_CLONES void sl_dequantize_q5_k(int64_t k, const void *w_row, float *out) {
    const uint8_t *w = (const uint8_t *)w_row;
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q5_K_BYTES, out += SL_QK_K) {
        const float d = sl_fp16_to_fp32(sl_read_u16(w)), dmin = sl_fp16_to_fp32(sl_read_u16(w + 2));
        uint8_t sc[8], m[8];
        kq_scales_bytes(w + 4, sc, m);
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

SL_TARGET_AVX2 KQ_INLINE void kq_dot_q6_k_avx2_rows(const int R, int64_t k, const void *w_row, const void *x_rows,
                                                    int64_t x_stride, float *out) {
    const uint8_t *w = (const uint8_t *)w_row, *xb = (const uint8_t *)x_rows;
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    __m256 acc[SL_ROWS];
    KQ_ROWS(R, acc[r] = _mm256_setzero_ps());
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q6_K_BYTES, xb += sizeof(sl_block_q8_k)) {
        const uint8_t *ql = w, *qh = w + 128;
        const float dw = _cvtsh_ss(sl_read_u16(w + 208));
        /* Scales as int16: sub-blocks 0-7 and 8-15. */
        const __m128i s_first = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192)));
        const __m128i s_second = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 200)));
        const __m256i s_all = _mm256_set_m128i(s_second, s_first);

        /* The offset: 32 * sum_j scale[j] * bsums[j], subtracted up front. */
        __m256i sumi[SL_ROWS];
        KQ_ROWS(R, {
            const __m256i offset =
                _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)KQ_X(xb, r, x_stride)->bsums), s_all);
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
        });

#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i scales = _mm256_broadcastsi128_si256(h ? s_second : s_first);
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            /* The half's four groups of 32 codes: low bits from a nibble of ql, bits 4-5 from a
             * bit pair of qh moved to bits 4-5. */
            __m256i codes[4];
            codes[0] = _mm256_or_si256(_mm256_and_si256(q0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45));
            codes[1] = _mm256_or_si256(_mm256_and_si256(q1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45));
            codes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), low4), _mm256_and_si256(hb, bits45));
            codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), low4),
                                       _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45));
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                /* Group t is sub-blocks 2t (low 128 bits) and 2t + 1 (high) of the half. */
                const __m256i s = _mm256_shuffle_epi8(
                    scales, _mm256_setr_epi16(KQ_PICK16(2 * t), KQ_PICK16(2 * t), KQ_PICK16(2 * t), KQ_PICK16(2 * t),
                                              KQ_PICK16(2 * t), KQ_PICK16(2 * t), KQ_PICK16(2 * t), KQ_PICK16(2 * t),
                                              KQ_PICK16(2 * t + 1), KQ_PICK16(2 * t + 1), KQ_PICK16(2 * t + 1),
                                              KQ_PICK16(2 * t + 1), KQ_PICK16(2 * t + 1), KQ_PICK16(2 * t + 1),
                                              KQ_PICK16(2 * t + 1), KQ_PICK16(2 * t + 1)));
                KQ_ROWS(R, {
                    const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
                    const __m256i p = _mm256_maddubs_epi16(
                        codes[t], _mm256_loadu_si256((const __m256i *)(x->qs + 128 * h + 32 * t)));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s));
                    KQ_KEEP(sumi[r]);
                });
            }
        }
        KQ_ROWS(R, acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * KQ_X(xb, r, x_stride)->d),
                                            _mm256_cvtepi32_ps(sumi[r]), acc[r]));
    }
    KQ_ROWS(R, out[r] = kq_hsum256(acc[r]));
}

SL_TARGET_AVX2 float sl_dot_q6_k_avx2(int64_t k, const void *w_row, const void *x_row) {
    float out;
    kq_dot_q6_k_avx2_rows(1, k, w_row, x_row, 0, &out);
    return out;
}

KQ_DOTN(q6_k, avx2, SL_TARGET_AVX2)

SL_TARGET_AVX512 KQ_INLINE void kq_dot_q6_k_avx512_rows(const int R, int64_t k, const void *w_row,
                                                        const void *x_rows, int64_t x_stride, float *out) {
    const uint8_t *w = (const uint8_t *)w_row, *xb = (const uint8_t *)x_rows;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    /* qh shifts for the low nibbles (bits 0-1 -> 4-5 | bits 2-3 -> 4-5) and the high ones
     * (bits 4-5 stay | bits 6-7 -> 4-5). */
    const __m512i shift_lo = KQ_HALVES512(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
    const __m512i shift_hi = KQ_HALVES512(_mm256_setzero_si256(), _mm256_set1_epi16(2));
    __m512 acc[SL_ROWS];
    KQ_ROWS(R, acc[r] = _mm512_setzero_ps());
    for (int64_t b = 0; b < k / SL_QK_K; b++, w += KQ_Q6_K_BYTES, xb += sizeof(sl_block_q8_k)) {
        const uint8_t *ql = w, *qh = w + 128;
        const float dw = _cvtsh_ss(sl_read_u16(w + 208));
        const __m128i scale_bytes = _mm_loadu_si128((const __m128i *)(w + 192));
        /* The 16 signed scales as int32 lanes with the scale in the low int16, zero on top. */
        const __m512i scales = _mm512_and_si512(_mm512_cvtepi8_epi32(scale_bytes), _mm512_set1_epi32(0xFFFF));
        const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes);

        /* The offset: 32 * sum_j scale[j] * bsums[j], in the low half of the accumulator. */
        __m512i sumi[SL_ROWS];
        KQ_ROWS(R, {
            const __m256i offset =
                _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)KQ_X(xb, r, x_stride)->bsums), scales16);
            sumi[r] = KQ_HALVES512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5)),
                                   _mm256_setzero_si256());
        });

#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i lq = _mm512_loadu_si512((const void *)(ql + 64 * h));
            const __m512i hq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
            /* Weights 128h + 0..63 (low nibbles) and 128h + 64..127 (high nibbles). */
            const __m512i lo = _mm512_or_si512(_mm512_and_si512(lq, low4),
                                               _mm512_and_si512(_mm512_sllv_epi16(hq, shift_lo), bits45));
            const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lq, 4), low4),
                                               _mm512_and_si512(_mm512_srlv_epi16(hq, shift_hi), bits45));
            /* Scales of sub-blocks 8h + 0..3 and 8h + 4..7, one per 128-bit lane. */
            const int j0 = 8 * h, j1 = 8 * h + 4;
            const __m512i s_lo = _mm512_permutexvar_epi32(
                _mm512_setr_epi32(j0, j0, j0, j0, j0 + 1, j0 + 1, j0 + 1, j0 + 1, j0 + 2, j0 + 2, j0 + 2, j0 + 2,
                                  j0 + 3, j0 + 3, j0 + 3, j0 + 3),
                scales);
            const __m512i s_hi = _mm512_permutexvar_epi32(
                _mm512_setr_epi32(j1, j1, j1, j1, j1 + 1, j1 + 1, j1 + 1, j1 + 1, j1 + 2, j1 + 2, j1 + 2, j1 + 2,
                                  j1 + 3, j1 + 3, j1 + 3, j1 + 3),
                scales);
            KQ_ROWS(R, {
                const sl_block_q8_k *x = KQ_X(xb, r, x_stride);
                /* Sums of 4 products per int32 lane (<= 4 * 63 * 128: fits the low int16); each
                 * 128-bit lane is one 16-weight sub-block. */
                const __m512i dot_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                           _mm512_loadu_si512((const void *)(x->qs + 128 * h)));
                const __m512i dot_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi,
                                                           _mm512_loadu_si512((const void *)(x->qs + 128 * h + 64)));
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], dot_lo, s_lo);
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], dot_hi, s_hi);
            });
        }
        KQ_ROWS(R, acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dw * KQ_X(xb, r, x_stride)->d),
                                            _mm512_cvtepi32_ps(sumi[r]), acc[r]));
    }
    KQ_ROWS(R, out[r] = _mm512_reduce_add_ps(acc[r]));
}

SL_TARGET_AVX512 float sl_dot_q6_k_avx512(int64_t k, const void *w_row, const void *x_row) {
    float out;
    kq_dot_q6_k_avx512_rows(1, k, w_row, x_row, 0, &out);
    return out;
}

KQ_DOTN(q6_k, avx512, SL_TARGET_AVX512)

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
