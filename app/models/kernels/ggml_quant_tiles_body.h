/*
 * The tile kernels' gemv and gemm for one instruction set, included by ggml_quant_tiles.c once
 * per set with TL_ISA (the name suffix: avx2, avx512), TL_TARGET (its function attribute) and
 * TL_VNNI (1: the int32 sums by vpdpbusd; 0: vpmaddubsw pairs summed in int16, then vpmaddwd)
 * defined; it undefines them at the end. The decode and the float work per block are the
 * file's, shared by both. No include guard: it is meant to be included more than once.
 */
#define TL_PASTE(a, b) a##_##b
#define TL_PASTE2(a, b) TL_PASTE(a, b)
#define TL_NAME(name) TL_PASTE2(name, TL_ISA)
#define TL_EXPORTED_PASTE(prefix, name, isa) prefix##name##_##isa
#define TL_EXPORTED_PASTE2(prefix, name, isa) TL_EXPORTED_PASTE(prefix, name, isa)
#define TL_EXPORTED(prefix, name) TL_EXPORTED_PASTE2(prefix, name, TL_ISA)

/* Exact integer dot product of 32 codes with 32 int8 activations, as 8 int32 partial sums. */
TL_TARGET TL_INLINE __m256i TL_NAME(tl_idot32)(int fmt, __m256i codes, __m256i xq) {
#if TL_VNNI
    if (fmt == TL_Q8_0) /* unsigned |w| against the activations' sign-corrected bytes */
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(codes), _mm256_sign_epi8(xq, codes));
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xq);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (fmt == TL_Q8_0) /* |w| <= 128, |x| <= 127: the pairs stay below 2^15 */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(xq, codes)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), ones);
#endif
}

/* gemv: one activation row against eight weight rows read from the file's layout. Eight rows
 * read side by side are eight streams the hardware prefetchers follow poorly (a Q8_0 LM head ran
 * at 0.4x the one-row code), so the loop prefetches `ahead` bytes from `prefetch` (the tiles
 * after this one: the rows are contiguous), a share per block. */
TL_TARGET TL_INLINE void TL_NAME(tl_gemv)(int fmt, const uint8_t *const rows[TL_LANES], int64_t nb,
                                                const sl_block_q8_1 *x, float out[TL_LANES],
                                                const uint8_t *prefetch, int64_t ahead) {
    const int64_t bs = tl_block_bytes(fmt);
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        __m256i partial[TL_LANES];
#pragma GCC unroll 8
        for (int j = 0; j < TL_LANES; j++) partial[j] = TL_NAME(tl_idot32)(fmt, tl_codes(fmt, rows[j] + b * bs), xq);
        __m256 d, mo;
        tl_scales(fmt, rows, b * bs, &d, &mo);
        tl_finish_block(fmt, tl_sum8(partial), d, mo, x + b, &acc, &macc);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, macc));
}

/* The integer sums of one x8 block (ggml_quant.h) against activation block x: lane j = row j's,
 * the same integers as tl_gemv's. */
TL_TARGET TL_INLINE __m256i TL_NAME(tl_x8_isum)(int fmt, const uint8_t *blk, const sl_block_q8_1 *x) {
    if (fmt == TL_Q8_0) {
        __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < TL_GROUPS; g++) {
            const __m256i cv = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * g));
#if TL_VNNI /* codes offset to unsigned bytes, as tl_tile_block's */
            isum = _mm256_dpbusd_epi32(isum, _mm256_xor_si256(cv, _mm256_set1_epi8((char)0x80)), tl_bcast4(x->qs + 4 * g));
#else
            isum = _mm256_add_epi32(isum, TL_NAME(tl_idot32)(fmt, cv, tl_bcast4(x->qs + 4 * g)));
#endif
        }
#if TL_VNNI
        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(x->sum * 128));
#endif
        return isum;
    }
#if TL_VNNI
    __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        tl_x8_codes(fmt, blk, c, &lo, &hi);
        isum = _mm256_dpbusd_epi32(isum, lo, tl_group_x(fmt, x, c, lo));
        isum = _mm256_dpbusd_epi32(isum, hi, tl_group_x(fmt, x, 4 + c, hi));
    }
    return isum;
#else
    /* int16 pair sums: 4-bit codes 2 * 15 * 127 per pair, all eight groups fit; 5-bit 2 * 31 *
     * 127, four (two chunks) at a time */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i isum = _mm256_setzero_si256(), s16 = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        tl_x8_codes(fmt, blk, c, &lo, &hi);
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, tl_group_x(fmt, x, c, lo)));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, tl_group_x(fmt, x, 4 + c, hi)));
        if (tl_is5(fmt) && (c & 1)) {
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, ones));
            s16 = _mm256_setzero_si256();
        }
    }
    return tl_is5(fmt) ? isum : _mm256_madd_epi16(s16, ones);
#endif
}

/* gemv on an x8 group (ggml_quant.h): tl_gemv's outputs, bit for bit, from one stream of
 * bytes, without its horizontal sums and scale inserts (1.45x its speed on SmolLM2's Q4_1
 * projections from L3, one thread on the AMX Xeon). */
TL_TARGET TL_INLINE void TL_NAME(tl_gemv_x8)(int fmt, const uint8_t *group, int64_t nb, const sl_block_q8_1 *x,
                                             float out[TL_LANES], const uint8_t *prefetch, int64_t ahead) {
    const int64_t gbs = 8 * tl_block_bytes(fmt);
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        const uint8_t *blk = group + b * gbs;
        const __m256i isum = TL_NAME(tl_x8_isum)(fmt, blk, x + b);
        __m256 d, mo;
        tl_x8_scales(fmt, blk, &d, &mo);
        tl_finish_block(fmt, isum, d, mo, x + b, &acc, &macc);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, macc));
}

/* gemv of R activation rows on an x8 group: each chunk's codes unpacked once for all R (no
 * decode pass through a tile), then tl_gemv_x8's integers and float sequence per row, so the
 * same bits as one row at a time. */
TL_TARGET TL_INLINE void TL_NAME(tl_gemvn_x8)(int fmt, int R, const uint8_t *group, int64_t nb,
                                              const sl_block_q8_1 *const x[SL_GEMM_ROWS], float *out,
                                              int64_t out_stride, const uint8_t *prefetch, int64_t ahead) {
    const int64_t gbs = 8 * tl_block_bytes(fmt);
    __m256 acc[SL_GEMM_ROWS], macc[SL_GEMM_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        const uint8_t *blk = group + b * gbs;
        __m256i isum[SL_GEMM_ROWS];
        if (fmt == TL_Q8_0) {
#if TL_VNNI /* the codes offset to unsigned bytes once for all rows, as tl_x8_isum does */
            __m256i cu[TL_GROUPS];
#pragma GCC unroll 8
            for (int g = 0; g < TL_GROUPS; g++)
                cu[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * g)),
                                         _mm256_set1_epi8((char)0x80));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                isum[r] = _mm256_set1_epi32(-128 * x[r][b].sum);
#pragma GCC unroll 8
                for (int g = 0; g < TL_GROUPS; g++)
                    isum[r] = sl_dpbusd_bcast(isum[r], cu[g], x[r][b].qs + 4 * g);
            }
#else /* (sixteen registers: each row takes its own signs, tl_x8_isum) */
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) isum[r] = TL_NAME(tl_x8_isum)(fmt, blk, x[r] + b);
#endif
        } else {
            __m256i codes[TL_GROUPS];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) tl_x8_codes(fmt, blk, c, &codes[c], &codes[4 + c]);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
#if TL_VNNI
                isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int g = 0; g < TL_GROUPS; g++)
                    isum[r] = sl_dpbusd_bcast(isum[r], codes[g], x[r][b].qs + 4 * g); /* (not Q8_0) */
#else
                const __m256i ones = _mm256_set1_epi16(1);
                const int run = tl_is5(fmt) ? 4 : 8;
                isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int g0 = 0; g0 < TL_GROUPS; g0 += run) {
                    __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int g = g0; g < g0 + run; g++)
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(codes[g], tl_group_x(fmt, x[r] + b, g, codes[g])));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16, ones));
                }
#endif
            }
        }
        __m256 d, mo;
        tl_x8_scales(fmt, blk, &d, &mo);
#pragma GCC unroll 8 /* (TL_Q8_0: the scaled sums alone; the offset terms below) */
        for (int r = 0; r < R; r++) tl_finish_block(TL_Q8_0, isum[r], d, mo, x[r] + b, &acc[r], &macc[r]);
    }
    /* The offset terms in a pass of their own: the same sequence of fmas per lane as
     * tl_finish_block's, so the same bits, with R fewer accumulators live in the loop above
     * (sixteen AVX2 registers: 8 rows' acc and macc were all of them). */
    if (tl_has_mo(fmt))
        for (int64_t b = 0; b < nb; b++) {
            __m256 d, mo;
            tl_x8_scales(fmt, group + b * gbs, &d, &mo);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) macc[r] = _mm256_fmadd_ps(mo, _mm256_set1_ps(x[r][b].s), macc[r]);
        }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * out_stride, _mm256_add_ps(acc[r], macc[r]));
}

/* The integer sums of one block for R activation rows from the tile: lane j = row j's. */
TL_TARGET TL_INLINE void TL_NAME(tl_tile_block)(int fmt, int R, const uint8_t *codes,
                                                const sl_block_q8_1 *const x[SL_GEMM_ROWS], int64_t b,
                                                __m256i isum[SL_GEMM_ROWS]) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
#if TL_VNNI
    /* four byte products a lane straight into int32 */
    if (fmt == TL_Q8_0) {
        /* Q8_0's codes offset to unsigned bytes, w + 128 (one xor per group, shared by the
         * rows, instead of a sign per group and row): sum((w + 128) x) - 128 sum(x), the same
         * integer as the AVX2 path's |w| * sign(x, w) sums. */
        const __m256i offset = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 8
        for (int g = 0; g < TL_GROUPS; g++) {
            const __m256i cu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + g * 32)), offset);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) isum[r] = sl_dpbusd_bcast(isum[r], cu, x[r][b].qs + 4 * g);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(x[r][b].sum * 128));
        return;
    }
#pragma GCC unroll 8
    for (int g = 0; g < TL_GROUPS; g++) {
        __m256i cv;
        const __m256i cu = tl_group_codes(fmt, codes, g, &cv);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) isum[r] = sl_dpbusd_bcast(isum[r], cu, x[r][b].qs + 4 * g); /* (not Q8_0) */
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    /* int16 sums of maddubs pairs: 4-bit codes 2 * 15 * 127 per pair, 8 groups fit in int16;
     * 5-bit 2 * 31 * 127, 4 groups; Q8_0 2 * 128 * 127, one. */
    const int run = fmt == TL_Q8_0 ? 1 : tl_is5(fmt) ? 4 : 8;
    for (int g0 = 0; g0 < TL_GROUPS; g0 += run) {
        __m256i s16[SL_GEMM_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = g0; g < g0 + run; g++) {
            __m256i cv;
            const __m256i cu = tl_group_codes(fmt, codes, g, &cv);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(cu, tl_group_x(fmt, x[r] + b, g, cv)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16[r], ones));
    }
#endif
}

/* gemm: R activation rows against a decoded tile. */
TL_TARGET TL_INLINE void TL_NAME(tl_gemm)(int fmt, int R, const uint8_t *codes, const float *d,
                                          const float *mo, int64_t nb,
                                          const sl_block_q8_1 *const x[SL_GEMM_ROWS], float *out,
                                          int64_t out_stride) {
    __m256 acc[SL_GEMM_ROWS], macc[SL_GEMM_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[SL_GEMM_ROWS];
        TL_NAME(tl_tile_block)(fmt, R, codes + b * TL_TILE_BLOCK_BYTES, x, b, isum);
        const __m256 vd = _mm256_loadu_ps(d + b * TL_LANES);
        const __m256 vmo = _mm256_loadu_ps(mo + b * TL_LANES);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) tl_finish_block(fmt, isum[r], vd, vmo, x[r] + b, &acc[r], &macc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * out_stride, _mm256_add_ps(acc[r], macc[r]));
}

/* n_x activation rows, TL_GEMM_MOST at a time: a constant row count in each inlined copy. */
#define TL_GEMM_MOST (TL_VNNI ? 8 : 4)
#define TL_GEMM_CASE(n) \
    case n: TL_NAME(tl_gemm)(fmt, n, codes, d, mo, nb, x + r0, out + r0 * out_stride, out_stride); break;
TL_TARGET TL_INLINE void TL_NAME(tl_gemm_rows)(int fmt, int n_x, const uint8_t *codes, const float *d,
                                               const float *mo, int64_t nb, const sl_block_q8_1 *const *x,
                                               float *out, int64_t out_stride) {
    for (int r0 = 0; r0 < n_x; r0 += TL_GEMM_MOST) {
        switch (n_x - r0 < TL_GEMM_MOST ? n_x - r0 : TL_GEMM_MOST) {
#if TL_VNNI
            TL_GEMM_CASE(8)
            TL_GEMM_CASE(7)
            TL_GEMM_CASE(6)
            TL_GEMM_CASE(5)
#endif
            TL_GEMM_CASE(4)
            TL_GEMM_CASE(3)
            TL_GEMM_CASE(2)
        default: TL_NAME(tl_gemm)(fmt, 1, codes, d, mo, nb, x + r0, out + r0 * out_stride, out_stride); break;
        }
    }
}
#undef TL_GEMM_CASE
#undef TL_GEMM_MOST

/* The exported entry points, one per format (see ggml_quant.h, sl_tile_fns). */
#define TL_GEMVN_X8(fmt, n)                                                                        \
    TL_NAME(tl_gemvn_x8)(fmt, n, group, k / SL_QK, xr, out, out_stride, prefetch, ahead);         \
    break;
#define TL_EXPORT(name, fmt)                                                                       \
    TL_TARGET void TL_EXPORTED(sl_gemv8_, name)(const uint8_t *const *rows, int64_t k,             \
                                                const void *x, float *out,                         \
                                                const uint8_t *prefetch, int64_t ahead) {          \
        TL_NAME(tl_gemv)(fmt, rows, k / SL_QK, (const sl_block_q8_1 *)x, out, prefetch, ahead);    \
    }                                                                                              \
    TL_TARGET void TL_EXPORTED(sl_gemvn8x_, name)(const uint8_t *group, int64_t k,                 \
                                                  const void *const *x, int n_x, float *out,       \
                                                  int64_t out_stride, const uint8_t *prefetch,     \
                                                  int64_t ahead) {                                 \
        const sl_block_q8_1 *const *xr = (const sl_block_q8_1 *const *)x;                          \
        switch (n_x) {                                                                             \
        case 1: TL_GEMVN_X8(fmt, 1) case 2: TL_GEMVN_X8(fmt, 2) case 3: TL_GEMVN_X8(fmt, 3)        \
        case 4: TL_GEMVN_X8(fmt, 4) case 5: TL_GEMVN_X8(fmt, 5) case 6: TL_GEMVN_X8(fmt, 6)        \
        case 7: TL_GEMVN_X8(fmt, 7) default: TL_GEMVN_X8(fmt, 8)                                   \
        }                                                                                          \
    }                                                                                              \
    TL_TARGET void TL_EXPORTED(sl_gemv8x_, name)(const uint8_t *group, int64_t k, const void *x,   \
                                                 float *out, const uint8_t *prefetch,              \
                                                 int64_t ahead) {                                  \
        TL_NAME(tl_gemv_x8)(fmt, group, k / SL_QK, (const sl_block_q8_1 *)x, out, prefetch, ahead); \
    }                                                                                              \
    TL_TARGET void TL_EXPORTED(sl_gemm8_, name)(const void *tile, int64_t k, const void *const *x, \
                                                int n_x, float *out, int64_t out_stride) {         \
        const int64_t nb = k / SL_QK;                                                              \
        const uint8_t *codes = (const uint8_t *)tile;                                              \
        const float *d = (const float *)(codes + nb * TL_TILE_BLOCK_BYTES);                        \
        const float *mo = d + nb * TL_LANES;                                                       \
        const sl_block_q8_1 *const *xr = (const sl_block_q8_1 *const *)x;                          \
        TL_NAME(tl_gemm_rows)(fmt, n_x, codes, d, mo, nb, xr, out, out_stride);                    \
    }

TL_EXPORT(q4_0, TL_Q4_0)
TL_EXPORT(q4_1, TL_Q4_1)
TL_EXPORT(q5_0, TL_Q5_0)
TL_EXPORT(q5_1, TL_Q5_1)
TL_EXPORT(q8_0, TL_Q8_0)

#undef TL_EXPORT
#undef TL_GEMVN_X8
#undef TL_EXPORTED
#undef TL_EXPORTED_PASTE2
#undef TL_EXPORTED_PASTE
#undef TL_NAME
#undef TL_PASTE2
#undef TL_PASTE
#undef TL_ISA
#undef TL_TARGET
#undef TL_VNNI
