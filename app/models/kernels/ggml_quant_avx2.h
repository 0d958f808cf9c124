/*
 * AVX2 pieces shared by the GGUF-block kernels of ggml_quant_legacy.c and ggml_quant_tiles.c.
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

#endif
