/*
 * AVX2 pieces shared by the GGUF-block kernels of ggml_quant_legacy.c, ggml_quant_tiles.c and
 * ggml_quant_ktiles.c.
 */
#ifndef SL_GGML_QUANT_AVX2_H
#define SL_GGML_QUANT_AVX2_H

#include <immintrin.h>

#include "ggml_quant.h"

/* The 32 codes of one 4- or 5-bit block as unsigned bytes 0..15 / 0..31 in weight order: qs
 * holds 16 bytes, byte j the low 4 bits of weight j (low nibble) and of weight j + 16 (high
 * nibble); qh, when not NULL, 4 bytes whose bit j is bit 4 of weight j. */
SL_TARGET_AVX2 static inline __attribute__((always_inline)) __m256i
sl_nibble_codes_avx2(const uint8_t *qs, const uint8_t *qh) {
    const __m128i low = _mm_loadu_si128((const __m128i *)qs);
    __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(low), _mm_srli_epi16(low, 4), 1);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
    if (qh != NULL) { /* qh bit j -> 0x10 in byte j: byte j takes qh byte j / 8, keeps bit j % 8 */
        uint32_t bits;
        memcpy(&bits, qh, 4);
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32((int)bits),
            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return q;
}

/* Block b's share of prefetching `ahead` bytes from `prefetch` over a pass of nb blocks: the
 * tile kernels spread the next tiles' cache lines over the blocks of this one, into L2
 * (PREFETCHT1) where sl_prefetch_l2_now says so, else into L1 (PREFETCHT0); see
 * ggml_quant_cpu.c. */
static inline __attribute__((always_inline)) void sl_prefetch_share(const uint8_t *prefetch, int64_t ahead,
                                                                     int64_t nb, int64_t b) {
    const int64_t lines = (ahead + 63) / 64, per_block = (lines + nb - 1) / nb;
    const int64_t first = b * per_block, end = first + per_block < lines ? first + per_block : lines;
    if (sl_prefetch_l2_now)
        for (int64_t l = first; l < end; l++) _mm_prefetch((const char *)prefetch + 64 * l, _MM_HINT_T1);
    else
        for (int64_t l = first; l < end; l++) _mm_prefetch((const char *)prefetch + 64 * l, _MM_HINT_T0);
}

/* Eight rows of 32 codes (c[j]: row j's codes of 32 weights) into the tile layout: eight
 * 32-byte vectors, vector g at out + g * stride holding codes 4g .. 4g + 3 of row j at bytes
 * 4j .. 4j + 3 (an 8 x 8 transpose of 4-byte groups). */
SL_TARGET_AVX2 static inline __attribute__((always_inline)) void
sl_transpose8_store_strided_avx2(const __m256i c[8], uint8_t *out, int64_t stride) {
    __m256i t[8], u[8];
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_epi32(c[j], c[j + 1]);
        t[j + 1] = _mm256_unpackhi_epi32(c[j], c[j + 1]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);         /* groups 0 | 4, rows j..j+3 */
        u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);     /* groups 1 | 5 */
        u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]); /* groups 2 | 6 */
        u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]); /* groups 3 | 7 */
    }
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        _mm256_storeu_si256((__m256i *)(out + g * stride),
                            _mm256_permute2x128_si256(u[g], u[g + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(out + (g + 4) * stride),
                            _mm256_permute2x128_si256(u[g], u[g + 4], 0x31));
    }
}

/* The same, the eight vectors contiguous. */
SL_TARGET_AVX2 static inline __attribute__((always_inline)) void
sl_transpose8_store_avx2(const __m256i c[8], uint8_t *out) {
    sl_transpose8_store_strided_avx2(c, out, 32);
}

/* Eight int32 vectors -> one vector whose lane j is the sum of v[j]'s lanes (exact). */
SL_TARGET_AVX2 static inline __attribute__((always_inline)) __m256i sl_sum8_epi32(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* a: [rows 0-3 of the low 128-bit halves | rows 0-3 of the high halves]; b: rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* acc + vpdpbusd(u, the four signed bytes at p broadcast to the eight lanes), with the
 * broadcast embedded in the instruction's memory operand ({1to8}): one macro-op where
 * vpbroadcastd + vpdpbusd are two. Compilers do not fold the broadcast themselves, and the
 * tile kernels' inner loops were bound by dispatch, not by vpdpbusd (Zen 4: a Q4_K gemv of 4
 * rows issued 19 macro-ops per 8 vpdpbusd it could run in 4 cycles). */
SL_TARGET_AVX512 static inline __attribute__((always_inline)) __m256i sl_dpbusd_bcast(__m256i acc, __m256i u,
                                                                                   const void *p) {
#ifdef SL_NO_EMBEDDED_BROADCAST /* (the same sums the other way, for a side-by-side build) */
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_dpbusd_epi32(acc, u, _mm256_set1_epi32(four));
#else
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
#endif
}

/* The same two on 512-bit vectors, the four bytes (two int16) at p broadcast to the 16 lanes
 * ({1to16}): the kernels on units of sixteen rows (ggml_quant_tiles16.h, ggml_quant_ktiles16.h). */
SL_TARGET_AVX512 static inline __attribute__((always_inline)) __m512i sl_dpbusd512_bcast(__m512i acc, __m512i u,
                                                                                      const void *p) {
#ifdef SL_NO_EMBEDDED_BROADCAST
    int32_t four;
    memcpy(&four, p, 4);
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(four));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
#endif
}

SL_TARGET_AVX512 static inline __attribute__((always_inline)) __m512i sl_dpwssd512_bcast(__m512i acc, __m512i a,
                                                                                      const void *p) {
#ifdef SL_NO_EMBEDDED_BROADCAST
    int32_t two;
    memcpy(&two, p, 4);
    return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(two));
#else
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)p));
    return acc;
#endif
}

/* acc + vpdpwssd(a, the two int16 at p broadcast to the eight lanes): the sums of
 * _mm256_madd_epi16(a, broadcast) added to acc, in one macro-op ({1to8}) for three. */
SL_TARGET_AVX512 static inline __attribute__((always_inline)) __m256i sl_dpwssd_bcast(__m256i acc, __m256i a,
                                                                                   const void *p) {
#ifdef SL_NO_EMBEDDED_BROADCAST
    int32_t two;
    memcpy(&two, p, 4);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(two)));
#else
    __asm__("vpdpwssd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)p));
    return acc;
#endif
}

#endif
