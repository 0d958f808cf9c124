/*
 * The K formats' gemm in 512-bit vectors on two decoded tiles (16 weight rows: lanes 0-7 the
 * first tile's rows, 8-15 the second's), included once by ggml_quant_ktiles.c after its
 * helpers. The same integers per lane and the float sequence at the top of that file, so the
 * same bits as the 256-bit kt_gemm on each tile (tested); twice the products per instruction
 * where the 512-bit datapath is full width (Zen 5), as ggml_quant_tiles16.h for the 32-weight
 * formats.
 */

/* The two tiles' 32 bytes at byte offset `at` of super-block b, side by side. */
SL_TARGET_AVX512 KT_INLINE __m512i kt16_pair(const uint8_t *first, const uint8_t *second, int64_t at) {
    return KT_HALVES512(_mm256_loadu_si256((const __m256i *)(first + at)),
                        _mm256_loadu_si256((const __m256i *)(second + at)));
}

/* R activation rows against the tiles at `first` and `second` (each sl_tile8_bytes_q8_k). */
SL_TARGET_AVX512 KT_INLINE void kt16_gemm(int fmt, int R, const uint8_t *first, const uint8_t *second, int64_t nb,
                                          const sl_block_q8_k *const x[SL_GEMM_ROWS], float *out,
                                          int64_t out_stride) {
    __m512 acc[SL_GEMM_ROWS], macc[SL_GEMM_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    const int sub_blocks = fmt == KT_Q6_K ? 16 : 8, groups = KT_GROUPS / sub_blocks;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sa = first + b * KT_SB_BYTES, *sb = second + b * KT_SB_BYTES;
        __m512i isum[SL_GEMM_ROWS], msum[SL_GEMM_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) isum[r] = msum[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int s = 0; s < sub_blocks; s++) {
            __m512i dot[SL_GEMM_ROWS];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int g = s * groups; g < (s + 1) * groups; g++) {
                const __m512i cv = kt16_pair(sa, sb, 32 * g);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) dot[r] = sl_dpbusd512_bcast(dot[r], cv, x[r][b].qs + 4 * g);
            }
            const __m512i scale = _mm512_srai_epi32(kt16_pair(sa, sb, KT_SP_OFFSET + 32 * s), 16);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot[r], scale));
        }
        /* Q4_K / Q5_K: msum from the minimum pairs; Q6_K: the offset from its scale pairs */
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512i pairs = kt16_pair(sa, sb, KT_MP_OFFSET + 32 * t);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) msum[r] = sl_dpwssd512_bcast(msum[r], pairs, x[r][b].bsums + 2 * t);
        }
        const __m512 d = _mm512_castsi512_ps(kt16_pair(sa, sb, KT_D_OFFSET));
        const __m512 dmin = _mm512_castsi512_ps(kt16_pair(sa, sb, KT_D_OFFSET + 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            if (fmt == KT_Q6_K) {
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(msum[r], 5));
                msum[r] = _mm512_setzero_si512();
            }
            const __m512 vdx = _mm512_set1_ps(x[r][b].d);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, vdx), acc[r]);
            if (kt_has_min(fmt))
                macc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum[r]), _mm512_mul_ps(dmin, vdx), macc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * out_stride, _mm512_sub_ps(acc[r], macc[r]));
}

#define KT16_CASE(fmt, n)                                                                          \
    case n: kt16_gemm(fmt, n, first, second, k / SL_QK_K, xr + r0, out + r0 * out_stride, out_stride); break;
#define KT16_EXPORT(name, fmt)                                                                     \
    SL_TARGET_AVX512 void sl_gemm16_##name##_avx512(const void *tiles, int64_t k,                 \
                                                    const void *const *x, int n_x, float *out,     \
                                                    int64_t out_stride) {                          \
        const uint8_t *first = (const uint8_t *)tiles;                                             \
        const uint8_t *second = first + sl_tile8_bytes_q8_k(k);                                    \
        const sl_block_q8_k *const *xr = (const sl_block_q8_k *const *)x;                          \
        for (int r0 = 0; r0 < n_x; r0 += SL_GEMM_ROWS) {                                           \
            switch (n_x - r0 < SL_GEMM_ROWS ? n_x - r0 : SL_GEMM_ROWS) {                            \
                KT16_CASE(fmt, 1)                                                                  \
                KT16_CASE(fmt, 2)                                                                  \
                KT16_CASE(fmt, 3)                                                                  \
                KT16_CASE(fmt, 4)                                                                  \
                KT16_CASE(fmt, 5)                                                                  \
                KT16_CASE(fmt, 6)                                                                  \
                KT16_CASE(fmt, 7)                                                                  \
            default:                                                                               \
                kt16_gemm(fmt, SL_GEMM_ROWS, first, second, k / SL_QK_K, xr + r0,                  \
                          out + r0 * out_stride, out_stride);                                      \
                break;                                                                             \
            }                                                                                      \
        }                                                                                          \
    }
_Static_assert(SL_GEMM_ROWS == 8, "the switch above lists 1 .. SL_GEMM_ROWS - 1");
KT16_EXPORT(q4_k, KT_Q4_K)
KT16_EXPORT(q5_k, KT_Q5_K)
KT16_EXPORT(q6_k, KT_Q6_K)
#undef KT16_EXPORT
#undef KT16_CASE
