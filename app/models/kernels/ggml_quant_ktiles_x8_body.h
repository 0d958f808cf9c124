/*
 * Q4_K's gemv on rows interleaved eight at a time ("x8", ggml_quant.h) for one instruction
 * set: included by ggml_quant_ktiles_body.h (KT_NAME, KT_EXPORTED, KT_VNNI and the helpers of
 * ggml_quant_ktiles.c defined there). No include guard: included once per instruction set.
 */

/* Q4_K on an x8 group (ggml_quant.h): R <= SL_ROWS activation rows, each chunk of eight rows'
 * codes unpacked once for all, the scales of eight rows unpacked in their lanes. The same
 * integers as kt_gemv's and the same float sequence: the same bits. */
KT_TARGET KT_INLINE void KT_NAME(kt_gemv_x8)(int R, const uint8_t *group, int64_t nb,
                                             const sl_block_q8_k *const x[SL_ROWS], float *out, int64_t out_stride,
                                             const uint8_t *prefetch, int64_t ahead) {
    const int fmt = KT_Q4_K;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[SL_ROWS], macc[SL_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        const uint8_t *blk = group + b * 8 * 144;
        __m256i sc[2], mn[2]; /* the eight rows' 6-bit scales and minima */
        kt_x8_scales_mins(blk, sc, mn);
        __m256i isum[SL_ROWS], msum[SL_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) isum[r] = msum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int i = 0; i < 4; i++) { /* sub-blocks 2i (low nibbles) and 2i + 1 (high) */
            __m256i lo[SL_ROWS], hi[SL_ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * (8 * i + t)));
                const __m256i cl = _mm256_and_si256(v, low4), ch = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const int8_t *q = x[r][b].qs + 64 * i + 4 * t;
#if KT_VNNI
                    lo[r] = sl_dpbusd_bcast(lo[r], cl, q);
                    hi[r] = sl_dpbusd_bcast(hi[r], ch, q + 32);
#else /* int16 sums of 8 pairs of 2 * 15 * 127 at most */
                    lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(cl, KT_NAME(kt_bcast4)(q)));
                    hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(ch, KT_NAME(kt_bcast4)(q + 32)));
#endif
                }
            }
            const __m256i s_lo = kt_x8_byte(sc, 2 * i), s_hi = kt_x8_byte(sc, 2 * i + 1);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
#if KT_VNNI
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(lo[r], s_lo));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(hi[r], s_hi));
#else /* the scale in both int16 halves */
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(lo[r], _mm256_or_si256(s_lo, _mm256_slli_epi32(s_lo, 16))));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(hi[r], _mm256_or_si256(s_hi, _mm256_slli_epi32(s_hi, 16))));
#endif
            }
        }
        /* msum = sum_s m[s] * (bsums[2s] + bsums[2s + 1]): m[s] in both int16 halves */
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m256i ms = kt_x8_byte(mn, s);
            const __m256i pair = _mm256_or_si256(ms, _mm256_slli_epi32(ms, 16));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#if KT_VNNI
                msum[r] = sl_dpwssd_bcast(msum[r], pair, x[r][b].bsums + 2 * s);
#else
                msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(pair, KT_NAME(kt_bcast4)(x[r][b].bsums + 2 * s)));
#endif
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) kt_finish(fmt, isum[r], msum[r], d, dmin, x[r][b].d, &acc[r], &macc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * out_stride, _mm256_sub_ps(acc[r], macc[r]));
}

/* Q4_K on x8 groups (ggml_quant.h, sl_gemvn8x_fn): n_x <= SL_GEMM_ROWS rows, SL_ROWS at a time. */
#define KT_GEMV_X8(n)                                                                              \
    case n: KT_NAME(kt_gemv_x8)(n, group, nb, xr + r0, out + r0 * out_stride, out_stride, prefetch, \
                                r0 == 0 ? ahead : 0);                                              \
        break;
KT_TARGET void KT_EXPORTED(sl_gemvn8x_, q4_k)(const uint8_t *group, int64_t k, const void *const *x, int n_x,
                                              float *out, int64_t out_stride, const uint8_t *prefetch,
                                              int64_t ahead) {
    const int64_t nb = k / SL_QK_K;
    const sl_block_q8_k *const *xr = (const sl_block_q8_k *const *)x;
    for (int r0 = 0; r0 < n_x; r0 += SL_ROWS) {
        switch (n_x - r0 < SL_ROWS ? n_x - r0 : SL_ROWS) {
            KT_GEMV_X8(4)
            KT_GEMV_X8(3)
            KT_GEMV_X8(2)
        default: KT_NAME(kt_gemv_x8)(1, group, nb, xr + r0, out + r0 * out_stride, out_stride, prefetch, r0 == 0 ? ahead : 0);
        }
    }
}
#undef KT_GEMV_X8
