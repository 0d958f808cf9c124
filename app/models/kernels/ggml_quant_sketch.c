/*
 * A greedy step's LM head on a sketch: the argmax of one activation row against a Q8_0 matrix
 * (an LM head; Gemma 3's is 262,144 x 640, 178 MB a token), exactly sl_quant_argmax's index,
 * while reading 24% fewer bytes. A one-stream decode step reads every weight once, so its
 * time is bytes over memory bandwidth, and the head is most of the bytes of a small model with
 * a large vocabulary (Gemma 3 270M: 178 of 246 MB).
 *
 * The sketch: each Q8_0 code q (-128..127) without its two low bits, u = (q >> 2) + 32
 * (0..63, six bits), kept with the block's scale d. The dropped bits e = q - 4 (q >> 2) are
 * 0..3, so for the quantised activations (dx, qx) of a block
 *     d dx sum(q qx) = 4 d dx sum(u qx) - 128 d dx sum(qx) + d dx sum(e qx),
 * and the last term lies between 3 d dx sum(min(qx, 0)) and 3 d dx sum(max(qx, 0)) (d >= 0,
 * as Q8_0's d = max |w| / 127 is). Pass one streams the sketch and gives every row an interval
 * that holds its exact output (the terms' float rounding included, with a wide margin); the
 * rows whose interval reaches the largest lower end are the only ones that can be the
 * argmax (the true argmax's output is at least every row's lower end). Pass two computes those
 * rows' groups of eight exactly with sl_quant_matmul (the same kernels and bits as the whole
 * head's call) and takes torch.argmax's index among them (the first of equal values). On
 * Gemma 3's hidden states 2-52 of 262,144 rows remain (docs/MODEL_PERF.md); with five bits
 * kept instead of six, hundreds to 11,000, and with four all of them, so six it is.
 *
 * Bounding a quantised dot product to skip rows is the idea of bound-and-verify top-k search
 * (maximum inner product search); this sketch, its layout and code are our own.
 *
 * A sketch block (208 bytes) holds block b of eight rows (a full group; the rows after the
 * last full group are always computed exactly): d[8] (fp16, the rows' own), then u's low
 * nibbles in four chunks of 32 bytes laid out as the x8 layout's codes (ggml_quant.h: chunk c,
 * byte 4j + t: weight 4c + t of row j in the low nibble, 16 + 4c + t in the high one), then
 * u's two high bits in two chunks: chunk h, byte 4j + t holds at bits 2g, 2g + 1 those of tile
 * group 4h + g (group v: weights 4v .. 4v + 3).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#define SL_SKETCH_THREAD() omp_get_thread_num()
#else /* built without OpenMP (app/models/kernels/build.py): one thread */
#define SL_SKETCH_THREAD() 0
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ggml_quant.h"

#define SK_BLOCK 208 /* bytes of a sketch block of eight rows */
#define SK_CODES 16  /* its nibble chunks */
#define SK_HIGH 144  /* its two-bit chunks */

/* Bytes of the sketch of `rows` rows of k weights (their full groups), or -1. */
int64_t sl_sketch_q8_0_bytes(int64_t rows, int64_t k) {
    if (rows < 0 || k <= 0 || k % SL_QK != 0) return -1;
    return rows / 8 * (k / SL_QK) * SK_BLOCK;
}

/*
 * The sketch of a Q8_0 matrix of `rows` rows of k weights at w (x8: its full groups
 * interleaved, ggml_quant.h; else the file's layout) into out (sl_sketch_q8_0_bytes).
 * Returns 0; -1 for a bad shape; -2 when a scale is not finite (no interval bounds such a row)
 * or negative (not Q8_0's d = max |w| / 127; pass one's bounds assume d >= 0): the caller keeps
 * the whole head's call.
 */
int sl_sketch_q8_0(const uint8_t *w, int x8, int64_t rows, int64_t k, uint8_t *out) {
    if (sl_sketch_q8_0_bytes(rows, k) < 0) return -1;
    const int64_t nb = k / SL_QK, groups = rows / 8, block = 34;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * SK_BLOCK;
            const uint8_t *group_block = w + (g * nb + b) * 8 * block; /* (x8) */
            memset(o, 0, SK_BLOCK);
            for (int j = 0; j < 8; j++) {
                const uint8_t *row_block = w + ((g * 8 + j) * nb + b) * block; /* (file) */
                uint16_t d;
                memcpy(&d, x8 ? group_block + 2 * j : row_block, 2);
                bad |= (d & 0x7C00) == 0x7C00 || (d & 0x8000 && d != 0x8000); /* inf, NaN, < 0 */
                memcpy(o + 2 * j, &d, 2);
                for (int i = 0; i < SL_QK; i++) {
                    const int8_t q = (int8_t)(x8 ? group_block[16 + 32 * (i / 4) + 4 * j + i % 4]
                                                 : row_block[2 + i]);
                    const int u = (q >> 2) + 32; /* floor(q / 4) + 32 (GCC: arithmetic) */
                    const int v = i / 4, at = 4 * j + i % 4;
                    o[SK_CODES + 32 * (v % 4) + at] |= (uint8_t)((u & 15) << (v >= 4 ? 4 : 0));
                    o[SK_HIGH + 32 * (v / 4) + at] |= (uint8_t)((u >> 4) << (2 * (v % 4)));
                }
            }
        }
    }
    return bad ? -2 : 0;
}

#if defined(__x86_64__)
#include "ggml_quant_avx2.h"

/* Tile group 4h + g's two high bits (chunk h of the block) moved to bits 4 and 5 of each byte:
 * one shift within 16-bit lanes (no other byte's bit reaches bits 4-5) and a mask. */
#define SK_HIGH_BITS(chunk, g)                                                                    \
    _mm256_and_si256((g) == 0   ? _mm256_slli_epi16(chunk, 4)                                    \
                     : (g) == 1 ? _mm256_slli_epi16(chunk, 2)                                    \
                     : (g) == 2 ? (chunk)                                                         \
                                : _mm256_srli_epi16(chunk, 2),                                    \
                     _mm256_set1_epi8(0x30))

/* Pass one on one group, lower and upper ends of its eight rows' exact outputs:
 *     4 d dx sum(u qx) + d (-128 s + 3 dx sum(min(qx, 0)))   (lower, before the margin)
 *     4 d dx sum(u qx) + d (-128 s + 3 dx sum(max(qx, 0)))   (upper)
 * with below[b] and above[b] the activation block's terms in parentheses (every d >= 0: the
 * sketch refuses others), and the margin (nb + 8) 2^-12 of the interval's width taken off and
 * added (the float rounding of both passes' sums is far under it: each sum's terms are at most
 * ~400 / 3 times that width, rounded nb + 3 times). VNNI: the int32 sums by vpdpbusd; else
 * vpmaddubsw pairs (|u x| <= 2 * 63 * 127: two of them fit int16), then vpmaddwd. */
#define SK_GROUP_BOUNDS(name, target, vnni)                                                      \
    target static void name(const uint8_t *group, int64_t nb, const sl_block_q8_1 *x,             \
                            const float *below, const float *above, float margin, float *lower, \
                            float *upper) {                                                       \
        const __m256i low4 = _mm256_set1_epi8(0x0F);                                             \
        __m256 acc = _mm256_setzero_ps(), lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();     \
        for (int64_t b = 0; b < nb; b++) {                                                        \
            const uint8_t *blk = group + b * SK_BLOCK;                                            \
            const __m256i h0 = _mm256_loadu_si256((const __m256i *)(blk + SK_HIGH));              \
            const __m256i h1 = _mm256_loadu_si256((const __m256i *)(blk + SK_HIGH + 32));         \
            __m256i isum = _mm256_setzero_si256();                                                \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                                 \
                const __m256i nib = _mm256_loadu_si256((const __m256i *)(blk + SK_CODES + 32 * c)); \
                const __m256i u_lo = _mm256_or_si256(_mm256_and_si256(nib, low4), SK_HIGH_BITS(h0, c)); \
                const __m256i u_hi = _mm256_or_si256(                                             \
                    _mm256_and_si256(_mm256_srli_epi16(nib, 4), low4), SK_HIGH_BITS(h1, c));     \
                SK_DOT(vnni, isum, u_lo, u_hi, x[b].qs + 4 * c, x[b].qs + 16 + 4 * c);           \
            }                                                                                     \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));              \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(4.0f * x[b].d)), acc); \
            lo = _mm256_fmadd_ps(d, _mm256_set1_ps(below[b]), lo);                                \
            hi = _mm256_fmadd_ps(d, _mm256_set1_ps(above[b]), hi);                                \
        }                                                                                         \
        const __m256 slack = _mm256_mul_ps(_mm256_sub_ps(hi, lo), _mm256_set1_ps(margin));       \
        _mm256_storeu_ps(lower, _mm256_sub_ps(_mm256_add_ps(acc, lo), slack));                    \
        _mm256_storeu_ps(upper, _mm256_add_ps(_mm256_add_ps(acc, hi), slack));                    \
    }

SL_TARGET_AVX2 static inline __m256i sk_bcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}
#define SK_DOT(vnni, isum, u_lo, u_hi, x_lo, x_hi)                                                \
    do {                                                                                          \
        if (vnni) {                                                                               \
            isum = SK_DPBUSD(isum, u_lo, x_lo);                                                   \
            isum = SK_DPBUSD(isum, u_hi, x_hi);                                                   \
        } else {                                                                                  \
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(u_lo, sk_bcast4(x_lo)),     \
                                                 _mm256_maddubs_epi16(u_hi, sk_bcast4(x_hi)));    \
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));          \
        }                                                                                         \
    } while (0)
#define SK_DPBUSD(isum, u, x) (isum) /* (never taken on AVX2) */
SK_GROUP_BOUNDS(sk_group_bounds_avx2, SL_TARGET_AVX2, 0)
#undef SK_DPBUSD
#define SK_DPBUSD(isum, u, x) sl_dpbusd_bcast(isum, u, x)
SK_GROUP_BOUNDS(sk_group_bounds_avx512, SL_TARGET_AVX512, 1)
#undef SK_DPBUSD
#endif

/* torch.argmax's order for the rows computed exactly, taken in increasing row order: a
 * larger value wins, an equal one does not. */
typedef struct {
    float value;
    int64_t row;
} sk_best;

static int sk_consider(sk_best *best, const float *values, int64_t first, int64_t n) {
    for (int64_t r = 0; r < n; r++) {
        if (isnan(values[r])) return 1; /* torch's largest: the whole head's call decides */
        if (best->row < 0 || values[r] > best->value) *best = (sk_best){values[r], first + r};
    }
    return 0;
}

/*
 * index[0] = sl_quant_argmax's index for one activation row x (k float32 or bfloat16 values)
 * against the Q8_0 matrix w (rows x k; x8 as for sl_sketch_q8_0) whose sketch is `sketch`,
 * without a bias; *exact = the rows computed exactly in pass two (tests, statistics).
 * Returns 0; 1 when the bounds cannot decide (an activation or a bound not finite: the
 * caller makes the whole head's call); -1 for a bad argument or no AVX2 here; -2 no memory.
 */
int sl_argmax_q8_0_sketched(int isa, const uint8_t *w, int x8, const uint8_t *sketch, int64_t rows,
                            int64_t k, const void *x, int x_bf16, int64_t *index, int64_t *exact,
                            int threads) {
#if defined(__x86_64__)
    if (isa < SL_ISA_AVX2 || isa > SL_ISA_AVX512 || sl_sketch_q8_0_bytes(rows, k) < 0 || rows < 1)
        return -1;
    if (threads < 1) threads = 1;
    const int64_t nb = k / SL_QK, groups = rows / 8, tail = rows - groups * 8;
    const int64_t row_bytes = nb * 34;
    float *xf = (float *)malloc((size_t)k * sizeof(float));
    sl_block_q8_1 *xq = (sl_block_q8_1 *)malloc((size_t)nb * sizeof(sl_block_q8_1));
    float *below = (float *)malloc((size_t)nb * 2 * sizeof(float)), *above = below + nb;
    float *upper = (float *)malloc((size_t)(groups > 0 ? groups : 1) * 8 * sizeof(float));
    float *lower_max = (float *)malloc((size_t)threads * sizeof(float));
    int64_t *candidates = (int64_t *)malloc((size_t)(groups > 0 ? groups : 1) * sizeof(int64_t));
    int status = 0;
    if (xf == NULL || xq == NULL || below == NULL || upper == NULL || lower_max == NULL ||
        candidates == NULL) {
        status = -2;
        goto done;
    }
    for (int64_t i = 0; i < k; i++) {
        xf[i] = x_bf16 ? sl_bf16_to_fp32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        if (!isfinite(xf[i])) {
            status = 1;
            goto done;
        }
    }
    (isa == SL_ISA_AVX512 ? sl_quantize_q8_1_avx512 : sl_quantize_q8_1_avx2)(k, xf, xq);
    for (int64_t b = 0; b < nb; b++) {
        int32_t p = 0, n = 0;
        for (int i = 0; i < SL_QK; i++) *(xq[b].qs[i] > 0 ? &p : &n) += xq[b].qs[i];
        below[b] = -128.0f * xq[b].s + 3.0f * xq[b].d * (float)n;
        above[b] = -128.0f * xq[b].s + 3.0f * xq[b].d * (float)p;
    }
    const float margin = (float)(nb + 8) * 0x1p-12f; /* (SK_GROUP_BOUNDS) */
    const int team = groups >= 64 * threads ? threads : 1;
    for (int t = 0; t < threads; t++) lower_max[t] = -INFINITY;
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        float lower[8];
        (isa == SL_ISA_AVX512 ? sk_group_bounds_avx512 : sk_group_bounds_avx2)(
            sketch + g * nb * SK_BLOCK, nb, xq, below, above, margin, lower, upper + 8 * g);
        float best = lower_max[SL_SKETCH_THREAD()];
        for (int j = 0; j < 8; j++) best = lower[j] > best ? lower[j] : best;
        lower_max[SL_SKETCH_THREAD()] = best;
    }
    /* the tail's rows exactly (the file's layout), then the groups whose upper ends reach the
     * largest lower end, in one call of a segment per group */
    float threshold = -INFINITY;
    for (int t = 0; t < team; t++) threshold = lower_max[t] > threshold ? lower_max[t] : threshold;
    float tail_out[8];
    sk_best best = {-INFINITY, -1};
    if (tail > 0) {
        const int32_t qtype = SL_TYPE_Q8_0;
        const void *tail_w = w + groups * 8 * row_bytes;
        status = sl_quant_matmul(isa, 1, &qtype, &tail_w, &tail, k, x, x_bf16, 1, k, NULL, NULL, 0,
                                 tail_out, 0, tail, NULL, 1);
        if (status != 0) goto done;
        for (int64_t r = 0; r < tail; r++) threshold = tail_out[r] > threshold ? tail_out[r] : threshold;
    }
    if (!isfinite(threshold)) {
        status = 1;
        goto done;
    }
    int64_t n_candidates = 0;
    for (int64_t g = 0; g < groups; g++) {
        int reach = 0;
        for (int j = 0; j < 8; j++) reach |= !(upper[8 * g + j] < threshold); /* (NaN: reach) */
        if (reach) candidates[n_candidates++] = g;
    }
    if (n_candidates > 0) {
        int32_t *qtypes = (int32_t *)malloc((size_t)n_candidates * sizeof(int32_t));
        const void **ws = (const void **)malloc((size_t)n_candidates * sizeof(void *));
        int64_t *seg_rows = (int64_t *)malloc((size_t)n_candidates * sizeof(int64_t));
        float *out = (float *)malloc((size_t)n_candidates * 8 * sizeof(float));
        if (qtypes == NULL || ws == NULL || seg_rows == NULL || out == NULL) status = -2;
        for (int64_t c = 0; status == 0 && c < n_candidates; c++) {
            qtypes[c] = SL_TYPE_Q8_0 | (x8 ? SL_X8 : 0);
            ws[c] = w + candidates[c] * 8 * row_bytes;
            seg_rows[c] = 8;
        }
        if (status == 0)
            status = sl_quant_matmul(isa, (int)n_candidates, qtypes, ws, seg_rows, k, x, x_bf16, 1, k,
                                     NULL, NULL, 0, out, 0, n_candidates * 8, NULL, threads);
        for (int64_t c = 0; status == 0 && c < n_candidates; c++)
            status = sk_consider(&best, out + 8 * c, candidates[c] * 8, 8);
        free(qtypes);
        free(ws);
        free(seg_rows);
        free(out);
        if (status != 0) goto done;
    }
    if (tail > 0 && sk_consider(&best, tail_out, groups * 8, tail)) status = 1;
    if (status != 0 || best.row < 0 || !isfinite(best.value)) {
        status = 1;
        goto done;
    }
    index[0] = best.row;
    *exact = n_candidates * 8 + tail;
done:
    free(xf);
    free(xq);
    free(below);
    free(upper);
    free(lower_max);
    free(candidates);
    return status;
#else
    (void)isa, (void)w, (void)x8, (void)sketch, (void)rows, (void)k, (void)x, (void)x_bf16;
    (void)index, (void)exact, (void)threads;
    return -1;
#endif
}
