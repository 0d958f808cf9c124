/*
 * Tile kernels for the K formats (Q4_K, Q5_K, Q6_K): eight weight rows at a time, their eight
 * outputs in the eight float32 lanes of one vector, as ggml_quant_tiles.c does for the 32-weight
 * formats.
 *
 * Why: the one-row dot products of ggml_quant_kquants.c decode a weight super-block (nibbles,
 * high bits, 6-bit scales, minima) for at most four activation rows, and spend a multiply-add
 * chain per 32 weights and row. A batched decode step of 8-64 rows redid that decode 2-16 times
 * per weight row. Here eight weight rows are decoded once per call into an interleaved copy in
 * the thread's cache (lane j of a vector holds 4 codes of weight row j, the integer sub-block
 * scales per lane beside them), and every activation row of the call runs against it: four
 * broadcast activation bytes times 32 codes per vpdpbusd (or vpmaddubsw), one scale multiply
 * per 32 (Q6_K: 16) weights for eight outputs at once.
 *
 * The integers. Per (weight row j, activation row i, super-block b), exactly in int32:
 *
 *     isum = sum_s sc[s] * dot_s            dot_s: codes (unsigned) . activation bytes of
 *                                                  sub-block s (32 weights; Q6_K: 16)
 *     msum = sum_s m[s] * (bsums[2s] + bsums[2s + 1])                       (Q4_K, Q5_K)
 *     isum -= 32 * sum_s scale[s] * bsums[s]                                (Q6_K's offset)
 *
 * whatever order they are summed in: from the file's rows with a horizontal-sum tree (one
 * activation row: "gemv"), or from the decoded tile (many rows: "gemm"); by vpmaddubsw pairs
 * on AVX2 or vpdpbusd on AVX-512 VNNI. Then the one float sequence all paths share, per lane:
 *
 *     acc  = fma((float)isum, d_w * d_x, acc)
 *     macc = fma((float)msum, dmin_w * d_x, macc)                           (Q4_K, Q5_K)
 *     out  = acc - macc                                           (after the last super-block)
 *
 * So a row's output is the same bit for bit in any batch and on either instruction set
 * (tested). The bounds that keep the int16 steps exact (activation bytes within +-127):
 * vpmaddubsw pairs are at most 2 * 15 * 127 (Q4_K), 2 * 31 * 127 (Q5_K), 2 * 63 * 127 (Q6_K),
 * so 8, 4 and 2 of them are summed in int16 before vpmaddwd widens them times the scale.
 *
 * Super-block layouts: ggml_quant_kquants.c. The decoded super-block of eight rows
 * (KT_SB_BYTES): codes[64][32] (group g = weights 4g .. 4g + 3 of each row), scale pairs
 * sp[16][8] (int32 lane j: sub-block s's scale of row j in both int16 halves, Q6_K's
 * sign-extended; Q4_K and Q5_K use 8), minimum pairs mp[8][8] (Q4_K, Q5_K: m[s] in both
 * halves; Q6_K: its scales 2t and 2t + 1, for the offset), d[8], dmin[8] (float32).
 *
 * The many-rows layout follows llama.cpp's "repack" idea of interleaving weight rows
 * (ggml-cpu/repack.cpp); the code is our own.
 */
#include "ggml_quant.h"

#include <stddef.h>

#if defined(__x86_64__)
#include <string.h>

#include "ggml_quant_avx2.h"

enum { KT_Q4_K, KT_Q5_K, KT_Q6_K };

#define KT_INLINE static inline __attribute__((always_inline))
/* A 512-bit vector: a in the low 256 bits, b in the high. */
#define KT_HALVES512(a, b) _mm512_inserti64x4(_mm512_castsi256_si512(a), (b), 1)
/* int32 lanes holding the int16 element j of each 128-bit lane, zero-extended (shuffle_epi8
 * control). */
#define KT_PICK32(j) (int)(0x80800000 | ((2 * (j) + 1) << 8) | (2 * (j)))
#define KT_LANES 8
#define KT_GROUPS (SL_QK_K / 4) /* 4-code groups per super-block */
#define KT_CODES_BYTES (KT_GROUPS * 32)
#define KT_SP_OFFSET KT_CODES_BYTES
#define KT_MP_OFFSET (KT_SP_OFFSET + 16 * KT_LANES * 4)
#define KT_D_OFFSET (KT_MP_OFFSET + 8 * KT_LANES * 4)
#define KT_SB_BYTES (KT_D_OFFSET + 2 * KT_LANES * 4)

static inline int kt_block_bytes(int fmt) { return fmt == KT_Q4_K ? 144 : fmt == KT_Q5_K ? 176 : 210; }
static inline int kt_has_min(int fmt) { return fmt != KT_Q6_K; }

/* sl_kq_scales_mins as 8 + 8 bytes of two words (x86: little-endian), for the gemv's vectors. */
static inline void kt_scales_mins_u64(const uint8_t *p, uint64_t *sc, uint64_t *m) {
    uint32_t a, b, c;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    memcpy(&c, p + 8, 4);
    /* ">> 2" moves each byte's bits 6-7 to its bits 4-5; the bits shifted in are masked off. */
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc = (a & 0x3F3F3F3Fu) | ((uint64_t)sc_hi << 32);
    *m = (b & 0x3F3F3F3Fu) | ((uint64_t)m_hi << 32);
}

/* The int16 value v in both halves of an int32 lane. */
static inline int32_t kt_pair(int v) { return (int32_t)(((uint32_t)(uint16_t)v << 16) | (uint16_t)v); }
static inline int32_t kt_pair2(int lo, int hi) {
    return (int32_t)(((uint32_t)(uint16_t)hi << 16) | (uint16_t)lo);
}

/* Codes of weights 32v .. 32v + 31 of super-block w, unsigned, in weight order. */
SL_TARGET_AVX2 KT_INLINE __m256i kt_chunk(int fmt, const uint8_t *w, int v) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (fmt == KT_Q6_K) {
        const int h = v >> 2, t = v & 3;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (t & 1)));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
        const __m256i low = t < 2 ? _mm256_and_si256(q, low4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        /* bits 2t, 2t + 1 of qh to bits 4-5 */
        const __m256i high = t == 0   ? _mm256_slli_epi16(hb, 4)
                             : t == 1 ? _mm256_slli_epi16(hb, 2)
                             : t == 2 ? hb
                                      : _mm256_srli_epi16(hb, 2);
        return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    }
    const uint8_t *q = w + (fmt == KT_Q4_K ? 16 : 48) + 32 * (v >> 1);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)q);
    __m256i c = (v & 1) ? _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4) : _mm256_and_si256(bytes, low4);
    if (fmt == KT_Q5_K) { /* bit v of qh[l] is bit 4 of weight l */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, v), _mm256_set1_epi8(0x01));
        c = _mm256_or_si256(c, _mm256_slli_epi16(bit, 4));
    }
    return c;
}

/* Q4_K / Q5_K: the minima's integer parts of one weight row against R activation blocks: lane s
 * of mpart[r] is m[s] * (bsums[2s] + bsums[2s + 1]) (m64: the 8 minima as bytes). */
SL_TARGET_AVX2 KT_INLINE void kt_min_parts(uint64_t m64, int R, const sl_block_q8_k *const x[SL_ROWS], int64_t b,
                                           __m256i mpart[SL_ROWS]) {
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m64));
    /* m[s] twice in a row */
    const __m256i m_pairs = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        mpart[r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r][b].bsums), m_pairs);
}

/* d and dmin of super-block `at` of the eight rows, as float32 lanes (dmin: zero for Q6_K). */
SL_TARGET_AVX2 KT_INLINE void kt_factors(int fmt, const uint8_t *const rows[KT_LANES], int64_t at, __m256 *d,
                                         __m256 *dmin) {
    __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
#pragma GCC unroll 8
    for (int j = 0; j < KT_LANES; j++) {
        if (fmt == KT_Q6_K) {
            dh = _mm_insert_epi16(dh, sl_read_u16(rows[j] + at + 208), j);
        } else {
            dh = _mm_insert_epi16(dh, sl_read_u16(rows[j] + at), j);
            mh = _mm_insert_epi16(mh, sl_read_u16(rows[j] + at + 2), j);
        }
    }
    *d = _mm256_cvtph_ps(dh);
    *dmin = fmt == KT_Q6_K ? _mm256_setzero_ps() : _mm256_cvtph_ps(mh);
}

/* The one float sequence of a super-block (see the top). */
SL_TARGET_AVX2 KT_INLINE void kt_finish(int fmt, __m256i isum, __m256i msum, __m256 d, __m256 dmin, float dx,
                                        __m256 *acc, __m256 *macc) {
    const __m256 vdx = _mm256_set1_ps(dx);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, vdx), *acc);
    if (kt_has_min(fmt)) *macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, vdx), *macc);
}

/* Decode eight rows into the tile (layout at the top). */
SL_TARGET_AVX2 KT_INLINE void kt_decode(int fmt, const uint8_t *const rows[KT_LANES], int64_t nb, uint8_t *tile,
                                        const uint8_t *prefetch, int64_t ahead) {
    const int64_t bs = kt_block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        uint8_t *sb = tile + b * KT_SB_BYTES;
#pragma GCC unroll 1
        for (int v = 0; v < 8; v++) {
            __m256i c[KT_LANES];
#pragma GCC unroll 8
            for (int j = 0; j < KT_LANES; j++) c[j] = kt_chunk(fmt, rows[j] + b * bs, v);
            sl_transpose8_store_avx2(c, sb + v * 8 * 32);
        }
        int32_t *sp = (int32_t *)(sb + KT_SP_OFFSET), *mp = (int32_t *)(sb + KT_MP_OFFSET);
        for (int j = 0; j < KT_LANES; j++) {
            const uint8_t *w = rows[j] + b * bs;
            if (fmt == KT_Q6_K) {
                const int8_t *scale = (const int8_t *)(w + 192);
                for (int s = 0; s < 16; s++) sp[s * KT_LANES + j] = kt_pair(scale[s]);
                for (int t = 0; t < 8; t++) mp[t * KT_LANES + j] = kt_pair2(scale[2 * t], scale[2 * t + 1]);
            } else {
                uint8_t sc[8], m[8];
                sl_kq_scales_mins(w + 4, sc, m);
                for (int s = 0; s < 8; s++) {
                    sp[s * KT_LANES + j] = kt_pair(sc[s]);
                    mp[s * KT_LANES + j] = kt_pair(m[s]);
                }
            }
        }
        __m256 d, dmin;
        kt_factors(fmt, rows, b * bs, &d, &dmin);
        _mm256_storeu_ps((float *)(sb + KT_D_OFFSET), d);
        _mm256_storeu_ps((float *)(sb + KT_D_OFFSET) + KT_LANES, dmin);
    }
}

#define KT_EXPORT_DECODE(name, fmt)                                                                \
    SL_TARGET_AVX2 void sl_decode8_##name##_avx2(const uint8_t *const *rows, int64_t k, void *tile, \
                                                 const uint8_t *prefetch, int64_t ahead) {        \
        kt_decode(fmt, rows, k / SL_QK_K, (uint8_t *)tile, prefetch, ahead);                       \
    }
KT_EXPORT_DECODE(q4_k, KT_Q4_K)
KT_EXPORT_DECODE(q5_k, KT_Q5_K)
KT_EXPORT_DECODE(q6_k, KT_Q6_K)

/* Q4_K's 6-bit scales and minima of an x8 block's eight rows, unpacked in their lanes as
 * sl_kq_scales_mins unpacks one row's: byte s % 4 of lane j of sc[s / 4] is row j's sc[s]
 * (mn: m[s]). */
SL_TARGET_AVX2 KT_INLINE void kt_x8_scales_mins(const uint8_t *blk, __m256i sc[2], __m256i mn[2]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low6 = _mm256_set1_epi8(0x3F), bits45 = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 32));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + 64));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 96));
    sc[0] = _mm256_and_si256(a, low6);
    sc[1] = _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_srli_epi32(a, 2), bits45));
    mn[0] = _mm256_and_si256(b, low6);
    mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), low4), _mm256_and_si256(_mm256_srli_epi32(b, 2), bits45));
}

/* Sub-block s's value of each lane of kt_x8_scales_mins' pair v, as int32 lanes. */
SL_TARGET_AVX2 KT_INLINE __m256i kt_x8_byte(const __m256i v[2], int s) {
    return _mm256_and_si256(_mm256_srl_epi32(v[s / 4], _mm_cvtsi32_si128(8 * (s % 4))), _mm256_set1_epi32(0xFF));
}

/* Q4_K's tile (the layout at the top) from an x8 group (ggml_quant.h): the same bytes as
 * kt_decode's from the file's rows, without a transpose (the chunks hold the rows' lanes). */
SL_TARGET_AVX2 void sl_decode8x_q4_k(const uint8_t *group, int64_t k, void *tile, const uint8_t *prefetch,
                                     int64_t ahead) {
    const int64_t nb = k / SL_QK_K;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        sl_prefetch_share(prefetch, ahead, nb, b);
        const uint8_t *blk = group + b * 8 * 144;
        uint8_t *sb = (uint8_t *)tile + b * KT_SB_BYTES;
        for (int c = 0; c < 32; c++) { /* pair c / 8: group 16 (c / 8) + c % 8, and 8 after */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
            uint8_t *at = sb + 32 * (16 * (c / 8) + c % 8);
            _mm256_storeu_si256((__m256i *)at, _mm256_and_si256(v, low4));
            _mm256_storeu_si256((__m256i *)(at + 8 * 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
        }
        __m256i sc[2], mn[2];
        kt_x8_scales_mins(blk, sc, mn);
        for (int s = 0; s < 8; s++) { /* sub-block s's scale and minimum in both int16 halves */
            const __m256i scale = kt_x8_byte(sc, s), min = kt_x8_byte(mn, s);
            _mm256_storeu_si256((__m256i *)(sb + KT_SP_OFFSET) + s, _mm256_or_si256(scale, _mm256_slli_epi32(scale, 16)));
            _mm256_storeu_si256((__m256i *)(sb + KT_MP_OFFSET) + s, _mm256_or_si256(min, _mm256_slli_epi32(min, 16)));
        }
        _mm256_storeu_ps((float *)(sb + KT_D_OFFSET), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
        _mm256_storeu_ps((float *)(sb + KT_D_OFFSET) + KT_LANES,
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))));
    }
}

/* The gemv and gemm of each instruction set (ggml_quant_ktiles_body.h). */
#define KT_ISA avx2
#define KT_TARGET SL_TARGET_AVX2
#define KT_VNNI 0
#include "ggml_quant_ktiles_body.h"

#define KT_ISA avx512
#define KT_TARGET SL_TARGET_AVX512
#define KT_VNNI 1
#include "ggml_quant_ktiles_body.h"

/* Bytes of a decoded tile of rows of k weights (K formats). */
int64_t sl_tile8_bytes_q8_k(int64_t k) { return k / SL_QK_K * (int64_t)KT_SB_BYTES; }

/* The gemm on two tiles in 512-bit vectors (AVX-512 only). */
#include "ggml_quant_ktiles16.h"

#endif
