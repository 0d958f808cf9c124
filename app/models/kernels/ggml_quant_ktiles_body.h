/*
 * The K-format tile kernels' gemv and gemm for one instruction set, included by
 * ggml_quant_ktiles.c once per set with KT_ISA (the name suffix: avx2, avx512), KT_TARGET (its
 * function attribute) and KT_VNNI (1: the tile's integer sums by vpdpbusd; 0: vpmaddubsw pairs
 * summed in int16, then vpmaddwd) defined; it undefines them at the end. The decode and the
 * float work per super-block are the file's, shared by both. No include guard: it is meant to
 * be included more than once.
 */
#define KT_PASTE(a, b) a##_##b
#define KT_PASTE2(a, b) KT_PASTE(a, b)
#define KT_NAME(name) KT_PASTE2(name, KT_ISA)
#define KT_EXPORTED_PASTE(prefix, name, isa) prefix##name##_##isa
#define KT_EXPORTED_PASTE2(prefix, name, isa) KT_EXPORTED_PASTE(prefix, name, isa)
#define KT_EXPORTED(prefix, name) KT_EXPORTED_PASTE2(prefix, name, KT_ISA)

/* Broadcast of the int16 element j of each 128-bit lane (shuffle_epi8 control). */
#ifndef KT_PICK16
#define KT_PICK16(j) (short)(((2 * (j) + 1) << 8) | (2 * (j)))
#endif

/* Four bytes at p broadcast to the eight int32 lanes. */
KT_TARGET KT_INLINE __m256i KT_NAME(kt_bcast4)(const void *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}

#if KT_VNNI
/* One weight row's integer partial sums of one super-block against R activation blocks
 * x[r] + b: part[r] (8 int32 lanes summing to isum) and mpart[r] (to msum; Q4_K, Q5_K). On
 * 512-bit vectors: 64 codes (two sub-blocks, or four of Q6_K) per vpdpbusd, whose sums of four
 * products fit an int16 (at most 4 * 63 * 127), times the sub-block scale by vpdpwssd. */
KT_TARGET KT_INLINE void KT_NAME(kt_row_sums)(int fmt, int R, const uint8_t *w, const sl_block_q8_k *const x[SL_ROWS],
                                              int64_t b, __m256i part[SL_ROWS], __m256i mpart[SL_ROWS]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i sum[SL_ROWS];
    if (fmt == KT_Q6_K) {
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        /* qh shifts for the low nibbles (bits 0-1 -> 4-5 | bits 2-3 -> 4-5) and the high ones
         * (bits 4-5 stay | bits 6-7 -> 4-5) */
        const __m512i shift_lo = KT_HALVES512(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
        const __m512i shift_hi = KT_HALVES512(_mm256_setzero_si256(), _mm256_set1_epi16(2));
        const __m128i scale_bytes = _mm_loadu_si128((const __m128i *)(w + 192));
        /* the 16 signed scales as int32 lanes, the scale in the low int16, zero on top */
        const __m512i scales = _mm512_and_si512(_mm512_cvtepi8_epi32(scale_bytes), _mm512_set1_epi32(0xFFFF));
        const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            /* the offset, 32 * sum_s scale[s] * bsums[s], subtracted up front */
            const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r][b].bsums), scales16);
            sum[r] = KT_HALVES512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5)),
                                  _mm256_setzero_si256());
            mpart[r] = _mm256_setzero_si256();
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i lq = _mm512_loadu_si512((const void *)(w + 64 * h));
            const __m512i hq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
            /* weights 128h + 0..63 (low nibbles) and 128h + 64..127 (high nibbles) */
            const __m512i lo = _mm512_or_si512(_mm512_and_si512(lq, low4),
                                               _mm512_and_si512(_mm512_sllv_epi16(hq, shift_lo), bits45));
            const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lq, 4), low4),
                                               _mm512_and_si512(_mm512_srlv_epi16(hq, shift_hi), bits45));
            /* scales of sub-blocks 8h + 0..3 and 8h + 4..7, one per 128-bit lane */
            const int j0 = 8 * h, j1 = 8 * h + 4;
            const __m512i s_lo = _mm512_permutexvar_epi32(
                _mm512_setr_epi32(j0, j0, j0, j0, j0 + 1, j0 + 1, j0 + 1, j0 + 1, j0 + 2, j0 + 2, j0 + 2, j0 + 2,
                                  j0 + 3, j0 + 3, j0 + 3, j0 + 3),
                scales);
            const __m512i s_hi = _mm512_permutexvar_epi32(
                _mm512_setr_epi32(j1, j1, j1, j1, j1 + 1, j1 + 1, j1 + 1, j1 + 1, j1 + 2, j1 + 2, j1 + 2, j1 + 2,
                                  j1 + 3, j1 + 3, j1 + 3, j1 + 3),
                scales);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i dot_lo =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)(x[r][b].qs + 128 * h)));
                const __m512i dot_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi,
                                                           _mm512_loadu_si512((const void *)(x[r][b].qs + 128 * h + 64)));
                sum[r] = _mm512_dpwssd_epi32(sum[r], dot_lo, s_lo);
                sum[r] = _mm512_dpwssd_epi32(sum[r], dot_hi, s_hi);
            }
        }
    } else {
        uint64_t sc64, m64;
        kt_scales_mins_u64(w + 4, &sc64, &m64);
        const __m512i sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc64)));
        /* shift counts: 0 for the low half (low nibbles), 4 for the high half (high nibbles) */
        const __m512i nibble_shift = KT_HALVES512(_mm256_setzero_si256(), _mm256_set1_epi16(4));
        const uint8_t *q = w + (fmt == KT_Q4_K ? 16 : 48);
        const __m512i qh =
            fmt == KT_Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16))) : _mm512_setzero_si512();
        kt_min_parts(m64, R, x, b, mpart);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            /* low nibbles: sub-block 2i (low half); high nibbles: 2i + 1 (high half) */
            const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + 32 * i)));
            __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(bytes, nibble_shift), low4);
            if (fmt == KT_Q5_K) { /* plus 16 where bit 2i (low half) or 2i + 1 (high half) of qh is set */
                const __mmask64 high = _mm512_test_epi8_mask(
                    qh, KT_HALVES512(_mm256_set1_epi8((char)(1 << (2 * i))), _mm256_set1_epi8((char)(2 << (2 * i)))));
                codes = _mm512_mask_add_epi8(codes, high, codes, _mm512_set1_epi8(0x10));
            }
            const __m512i scale = _mm512_shuffle_epi8(
                sc16, KT_HALVES512(_mm256_set1_epi32(KT_PICK32(2 * i)), _mm256_set1_epi32(KT_PICK32(2 * i + 1))));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                                        _mm512_loadu_si512((const void *)(x[r][b].qs + 64 * i)));
                sum[r] = _mm512_dpwssd_epi32(sum[r], dot, scale);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        part[r] = _mm256_add_epi32(_mm512_castsi512_si256(sum[r]), _mm512_extracti64x4_epi64(sum[r], 1));
}
#else
/* One weight row's integer partial sums of one super-block against R activation blocks
 * x[r] + b: part[r] (8 int32 lanes summing to isum) and mpart[r] (to msum; Q4_K, Q5_K). */
KT_TARGET KT_INLINE void KT_NAME(kt_row_sums)(int fmt, int R, const uint8_t *w, const sl_block_q8_k *const x[SL_ROWS],
                                              int64_t b, __m256i part[SL_ROWS], __m256i mpart[SL_ROWS]) {
    if (fmt == KT_Q6_K) {
        const __m128i s_first = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192)));
        const __m128i s_second = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 200)));
        const __m256i s_all = _mm256_set_m128i(s_second, s_first);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            /* the offset, 32 * sum_s scale[s] * bsums[s], subtracted up front */
            const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r][b].bsums), s_all);
            part[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
            mpart[r] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            /* chunk v: sub-blocks 2v (low 128 bits) and 2v + 1 (high), of half v / 4 */
            const __m256i half = _mm256_broadcastsi128_si256(v < 4 ? s_first : s_second);
            const int t = v & 3;
            const __m256i s = _mm256_shuffle_epi8(
                half, _mm256_set_m128i(_mm_set1_epi16(KT_PICK16(2 * t + 1)), _mm_set1_epi16(KT_PICK16(2 * t))));
            const __m256i c = kt_chunk(fmt, w, v);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)(x[r][b].qs + 32 * v)));
                part[r] = _mm256_add_epi32(part[r], _mm256_madd_epi16(p, s));
            }
        }
        return;
    }
    uint64_t sc64, m64;
    kt_scales_mins_u64(w + 4, &sc64, &m64);
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc64)));
    kt_min_parts(m64, R, x, b, mpart);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int v = 0; v < 8; v++) {
        const __m256i s = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(KT_PICK16(v)));
        const __m256i c = kt_chunk(fmt, w, v);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i p = _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)(x[r][b].qs + 32 * v)));
            part[r] = _mm256_add_epi32(part[r], _mm256_madd_epi16(p, s));
        }
    }
}

#endif

/* gemv: R activation rows against eight weight rows read from the file's layout (no decode
 * pass), prefetching `ahead` bytes from `prefetch` (the next tiles), a share per super-block. */
KT_TARGET KT_INLINE void KT_NAME(kt_gemv)(int fmt, int R, const uint8_t *const rows[KT_LANES], int64_t nb,
                                          const sl_block_q8_k *const x[SL_ROWS], float *out, int64_t out_stride,
                                          const uint8_t *prefetch, int64_t ahead) {
    const int64_t bs = kt_block_bytes(fmt);
    __m256 acc[SL_ROWS], macc[SL_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        __m256i part[SL_ROWS][KT_LANES], mpart[SL_ROWS][KT_LANES];
#pragma GCC unroll 8
        for (int j = 0; j < KT_LANES; j++) {
            __m256i p[SL_ROWS], mp[SL_ROWS];
            KT_NAME(kt_row_sums)(fmt, R, rows[j] + b * bs, x, b, p, mp);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                part[r][j] = p[r];
                mpart[r][j] = mp[r];
            }
        }
        __m256 d, dmin;
        kt_factors(fmt, rows, b * bs, &d, &dmin);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i msum = kt_has_min(fmt) ? sl_sum8_epi32(mpart[r]) : _mm256_setzero_si256();
            kt_finish(fmt, sl_sum8_epi32(part[r]), msum, d, dmin, x[r][b].d, &acc[r], &macc[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * out_stride, _mm256_sub_ps(acc[r], macc[r]));
}

/* The exact integer sum of `groups` code groups (from group g0 of the decoded super-block)
 * against R activation rows, as int32 lanes per row, each times the sub-block scale pair sp
 * (both int16 halves: the scale). */
KT_TARGET KT_INLINE void KT_NAME(kt_sub_block)(int fmt, int R, const uint8_t *codes, int g0, int groups,
                                               __m256i sp, const sl_block_q8_k *const x[SL_GEMM_ROWS], int64_t b,
                                               __m256i isum[SL_GEMM_ROWS]) {
#if KT_VNNI
    (void)fmt;
    __m256i dot[SL_GEMM_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = g0; g < g0 + groups; g++) {
        const __m256i cv = _mm256_loadu_si256((const __m256i *)(codes + 32 * g));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) dot[r] = sl_dpbusd_bcast(dot[r], cv, x[r][b].qs + 4 * g);
    }
    const __m256i scale = _mm256_srai_epi32(sp, 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(dot[r], scale));
#else
    /* int16 runs of vpmaddubsw pairs (see the top of ggml_quant_ktiles.c) */
    const int run = fmt == KT_Q4_K ? 8 : fmt == KT_Q5_K ? 4 : 2;
#pragma GCC unroll 8
    for (int g1 = g0; g1 < g0 + groups; g1 += run) {
        __m256i s16[SL_GEMM_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = g1; g < g1 + run; g++) {
            const __m256i cv = _mm256_loadu_si256((const __m256i *)(codes + 32 * g));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(cv, KT_NAME(kt_bcast4)(x[r][b].qs + 4 * g)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16[r], sp));
    }
#endif
}

/* gemm: R activation rows against a decoded tile. */
KT_TARGET KT_INLINE void KT_NAME(kt_gemm)(int fmt, int R, const uint8_t *tile, int64_t nb,
                                          const sl_block_q8_k *const x[SL_GEMM_ROWS], float *out, int64_t out_stride) {
    __m256 acc[SL_GEMM_ROWS], macc[SL_GEMM_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = tile + b * KT_SB_BYTES;
        const __m256i *sp = (const __m256i *)(sb + KT_SP_OFFSET), *mp = (const __m256i *)(sb + KT_MP_OFFSET);
        __m256i isum[SL_GEMM_ROWS], msum[SL_GEMM_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) isum[r] = msum[r] = _mm256_setzero_si256();
        const int sub_blocks = fmt == KT_Q6_K ? 16 : 8, groups = KT_GROUPS / sub_blocks;
#pragma GCC unroll 1
        for (int s = 0; s < sub_blocks; s++)
            KT_NAME(kt_sub_block)(fmt, R, sb, s * groups, groups, _mm256_loadu_si256(sp + s), x, b, isum);
        /* Q4_K / Q5_K: msum from the minimum pairs; Q6_K: the offset from its scale pairs */
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m256i pairs = _mm256_loadu_si256(mp + t);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
#if KT_VNNI
                msum[r] = sl_dpwssd_bcast(msum[r], pairs, x[r][b].bsums + 2 * t);
#else
                msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(pairs, KT_NAME(kt_bcast4)(x[r][b].bsums + 2 * t)));
#endif
        }
        const __m256 d = _mm256_loadu_ps((const float *)(sb + KT_D_OFFSET));
        const __m256 dmin = _mm256_loadu_ps((const float *)(sb + KT_D_OFFSET) + KT_LANES);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            if (fmt == KT_Q6_K) {
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(msum[r], 5));
                msum[r] = _mm256_setzero_si256();
            }
            kt_finish(fmt, isum[r], msum[r], d, dmin, x[r][b].d, &acc[r], &macc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * out_stride, _mm256_sub_ps(acc[r], macc[r]));
}

/* n_x activation rows, KT_GEMM_MOST at a time: a constant row count in each inlined copy. */
#define KT_GEMM_MOST (KT_VNNI ? 8 : 4)
#define KT_GEMM_CASE(n) \
    case n: KT_NAME(kt_gemm)(fmt, n, tile, nb, x + r0, out + r0 * out_stride, out_stride); break;
KT_TARGET KT_INLINE void KT_NAME(kt_gemm_rows)(int fmt, int n_x, const uint8_t *tile, int64_t nb,
                                               const sl_block_q8_k *const *x, float *out, int64_t out_stride) {
    for (int r0 = 0; r0 < n_x; r0 += KT_GEMM_MOST) {
        switch (n_x - r0 < KT_GEMM_MOST ? n_x - r0 : KT_GEMM_MOST) {
#if KT_VNNI
            KT_GEMM_CASE(8)
            KT_GEMM_CASE(7)
            KT_GEMM_CASE(6)
            KT_GEMM_CASE(5)
#endif
            KT_GEMM_CASE(4)
            KT_GEMM_CASE(3)
            KT_GEMM_CASE(2)
        default: KT_NAME(kt_gemm)(fmt, 1, tile, nb, x + r0, out + r0 * out_stride, out_stride); break;
        }
    }
}
#undef KT_GEMM_CASE
#undef KT_GEMM_MOST

/* The exported entry points, one per format (see ggml_quant.h, sl_tile_fns). */
#define KT_EXPORT(name, fmt)                                                                       \
    KT_TARGET void KT_EXPORTED(sl_gemvn8_, name)(const uint8_t *const *rows, int64_t k,            \
                                                 const void *const *x, int n_x, float *out,        \
                                                 int64_t out_stride, const uint8_t *prefetch,      \
                                                 int64_t ahead) {                                  \
        const int64_t nb = k / SL_QK_K;                                                            \
        const sl_block_q8_k *const *xr = (const sl_block_q8_k *const *)x;                          \
        switch (n_x) {                                                                             \
        case 4: KT_NAME(kt_gemv)(fmt, 4, rows, nb, xr, out, out_stride, prefetch, ahead); break;   \
        case 3: KT_NAME(kt_gemv)(fmt, 3, rows, nb, xr, out, out_stride, prefetch, ahead); break;   \
        case 2: KT_NAME(kt_gemv)(fmt, 2, rows, nb, xr, out, out_stride, prefetch, ahead); break;   \
        default: KT_NAME(kt_gemv)(fmt, 1, rows, nb, xr, out, out_stride, prefetch, ahead); break;  \
        }                                                                                          \
    }                                                                                              \
    KT_TARGET void KT_EXPORTED(sl_gemm8_, name)(const void *tile, int64_t k, const void *const *x, \
                                                int n_x, float *out, int64_t out_stride) {         \
        const int64_t nb = k / SL_QK_K;                                                            \
        const uint8_t *t = (const uint8_t *)tile;                                                  \
        const sl_block_q8_k *const *xr = (const sl_block_q8_k *const *)x;                          \
        KT_NAME(kt_gemm_rows)(fmt, n_x, t, nb, xr, out, out_stride);                               \
    }

KT_EXPORT(q4_k, KT_Q4_K)
KT_EXPORT(q5_k, KT_Q5_K)
KT_EXPORT(q6_k, KT_Q6_K)

/* Q4_K on rows interleaved eight at a time (its gemv of one or more rows) */
#include "ggml_quant_ktiles_x8_body.h"

#undef KT_EXPORT
#undef KT_EXPORTED
#undef KT_EXPORTED_PASTE2
#undef KT_EXPORTED_PASTE
#undef KT_NAME
#undef KT_PASTE2
#undef KT_PASTE
#undef KT_ISA
#undef KT_TARGET
#undef KT_VNNI
