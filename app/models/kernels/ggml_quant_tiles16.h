/*
 * 512-bit kernels for the 32-weight formats on a unit of 16 interleaved rows (two x8 groups,
 * ggml_quant.h), included once by ggml_quant_tiles.c after its helpers.
 *
 * Why: the VNNI tile kernels (ggml_quant_tiles_body.h) hold eight weight rows in a 256-bit
 * vector, 32 byte products per vpdpbusd. A CPU whose 512-bit datapath is full width (Zen 5:
 * 5.1 G vpdpbusd a second on one core either width, so 336 against 163 G products) does twice
 * the products per instruction with the two groups of a unit side by side: lanes 0-7 the first
 * group's rows, 8-15 the second's. Per lane the integers are the same exact sums and the float
 * sequence is the one at the top of ggml_quant_tiles.c, so every output is the same bits as the
 * 256-bit kernels' (tested): only the speed differs, and the dispatch (ggml_quant_dispatch.h)
 * picks by the instruction set and the call's rows. Q8_0's codes are read in place (no decode
 * pass, at any row count); the 4- and 5-bit formats unpack each chunk once per run of
 * SL_X16_ROWS activation rows (16: 8 codes, 16 accumulators and the temporaries fit the 32
 * registers; runs of 16 took 0.88-0.93x the time of runs of 8 at 64 rows).
 */

/* Two 256-bit vectors side by side: first in lanes 0-7 (the unit's first group's rows),
 * second in lanes 8-15. */
SL_TARGET_AVX512 TL_INLINE __m512i tl16_pair(__m256i first, __m256i second) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
}

/* d and mo (the top of ggml_quant_tiles.c) of block b of both groups: lanes 0-7, 8-15. */
SL_TARGET_AVX512 TL_INLINE void tl16_scales(int fmt, const uint8_t *blk0, const uint8_t *blk1, __m512 *d,
                                             __m512 *mo) {
    __m256 d0, mo0, d1, mo1;
    tl_x8_scales(fmt, blk0, &d0, &mo0);
    tl_x8_scales(fmt, blk1, &d1, &mo1);
    *d = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
    *mo = _mm512_insertf32x8(_mm512_castps256_ps512(mo0), mo1, 1);
}

/* R <= SL_X16_ROWS activation rows against the unit's 16 rows: out + r * out_stride gets row
 * r's 16 outputs. */
SL_TARGET_AVX512 TL_INLINE void tl16_gemvn(int fmt, int R, const uint8_t *unit, int64_t nb,
                                           const sl_block_q8_1 *const x[SL_X16_ROWS], float *out,
                                           int64_t out_stride, const uint8_t *prefetch, int64_t ahead) {
    const int64_t gbs = 8 * tl_block_bytes(fmt);
    const uint8_t *second = unit + nb * gbs; /* the unit's second group of eight rows */
    __m512 acc[SL_X16_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        const uint8_t *blk0 = unit + b * gbs, *blk1 = second + b * gbs;
        __m512i codes[TL_GROUPS];
        if (fmt == TL_Q8_0) { /* offset to unsigned bytes, w + 128, as the VNNI tiles do */
#pragma GCC unroll 8
            for (int g = 0; g < TL_GROUPS; g++)
                codes[g] = _mm512_xor_si512(
                    tl16_pair(_mm256_loadu_si256((const __m256i *)(blk0 + 16 + 32 * g)),
                              _mm256_loadu_si256((const __m256i *)(blk1 + 16 + 32 * g))),
                    _mm512_set1_epi8((char)0x80));
        } else {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                __m256i lo0, hi0, lo1, hi1;
                tl_x8_codes(fmt, blk0, c, &lo0, &hi0);
                tl_x8_codes(fmt, blk1, c, &lo1, &hi1);
                codes[c] = tl16_pair(lo0, lo1);
                codes[4 + c] = tl16_pair(hi0, hi1);
            }
        }
        __m512 d, mo;
        tl16_scales(fmt, blk0, blk1, &d, &mo);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const sl_block_q8_1 *xb = x[r] + b;
            __m512i isum = fmt == TL_Q8_0 ? _mm512_set1_epi32(-128 * xb->sum) : _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int g = 0; g < TL_GROUPS; g++) isum = sl_dpbusd512_bcast(isum, codes[g], xb->qs + 4 * g);
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xb->d));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
        }
    }
    /* the offset terms in a pass of their own, as tl_gemvn_x8's: the same fmas per lane */
    __m512 macc[SL_X16_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) macc[r] = _mm512_setzero_ps();
    if (tl_has_mo(fmt))
        for (int64_t b = 0; b < nb; b++) {
            __m512 d, mo;
            tl16_scales(fmt, unit + b * gbs, second + b * gbs, &d, &mo);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) macc[r] = _mm512_fmadd_ps(mo, _mm512_set1_ps(x[r][b].s), macc[r]);
        }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * out_stride, _mm512_add_ps(acc[r], macc[r]));
}

#define TL16_CASE(fmt, n)                                                                          \
    case n: tl16_gemvn(fmt, n, unit, k / SL_QK, xr, out, out_stride, prefetch, ahead); break;
#define TL16_EXPORT(name, fmt)                                                                     \
    SL_TARGET_AVX512 void sl_gemvn16x_##name##_avx512(const uint8_t *unit, int64_t k,              \
                                                      const void *const *x, int n_x, float *out,   \
                                                      int64_t out_stride, const uint8_t *prefetch, \
                                                      int64_t ahead) {                             \
        const sl_block_q8_1 *const *xr = (const sl_block_q8_1 *const *)x;                          \
        switch (n_x) {                                                                             \
            TL16_CASE(fmt, 1)                                                                      \
            TL16_CASE(fmt, 2)                                                                      \
            TL16_CASE(fmt, 3)                                                                      \
            TL16_CASE(fmt, 4)                                                                      \
            TL16_CASE(fmt, 5)                                                                      \
            TL16_CASE(fmt, 6)                                                                      \
            TL16_CASE(fmt, 7)                                                                      \
            TL16_CASE(fmt, 8)                                                                      \
            TL16_CASE(fmt, 9)                                                                      \
            TL16_CASE(fmt, 10)                                                                     \
            TL16_CASE(fmt, 11)                                                                     \
            TL16_CASE(fmt, 12)                                                                     \
            TL16_CASE(fmt, 13)                                                                     \
            TL16_CASE(fmt, 14)                                                                     \
            TL16_CASE(fmt, 15)                                                                     \
        default: tl16_gemvn(fmt, SL_X16_ROWS, unit, k / SL_QK, xr, out, out_stride, prefetch, ahead); break; \
        }                                                                                          \
    }
_Static_assert(SL_X16_ROWS == 16, "the switch above lists 1 .. SL_X16_ROWS - 1");
TL16_EXPORT(q4_0, TL_Q4_0)
TL16_EXPORT(q4_1, TL_Q4_1)
TL16_EXPORT(q5_0, TL_Q5_0)
TL16_EXPORT(q5_1, TL_Q5_1)
TL16_EXPORT(q8_0, TL_Q8_0)
#undef TL16_EXPORT
#undef TL16_CASE
