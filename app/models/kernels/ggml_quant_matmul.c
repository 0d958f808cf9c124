/*
 * The driver of the GGUF-block matmuls (see ggml_quant.h): which function computes each
 * format on each instruction set, the activation quantisation, the split of a call's output
 * rows over threads, the epilogue (bias, residual, rounding to bfloat16), and token lookups.
 *
 * One call computes one projection, which may stack several weight matrices of different
 * formats (a Q4_K_M file stores attn_q and attn_k as Q4_K but attn_v as Q6_K): each is a
 * segment of the output columns. The activations are quantised once per activation format the
 * segments need (SL_Q8_1 and/or SL_Q8_K), then every output row of every segment is one
 * vec_dot per activation row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#define SL_THREAD_NUM() omp_get_thread_num()
#define SL_THREAD_COUNT() omp_get_num_threads()
#else /* built without OpenMP (no torch libgomp, app/models/kernels/build.py): one thread */
#define SL_THREAD_NUM() 0
#define SL_THREAD_COUNT() 1
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "ggml_quant.h"

/* Weight rows per unit of work handed to a thread: 16 rows of a 2048-wide Q4_K matrix are
 * 18 KiB, which stay in L1/L2 while every activation row of the call is dotted with them. */
#define SL_TILE_ROWS 16
#define SL_CHUNK 256 /* values converted from bfloat16 at a time to be quantised (x 256) */

#include "ggml_quant_dispatch.h" /* which kernels a call takes, by its row count */

typedef struct {
    int block_size;  /* weights per block */
    int block_bytes; /* bytes per block in the file */
    int q8k;         /* activations in SL_Q8_K blocks (else SL_Q8_1) */
    sl_vec_dot_fn dot[3]; /* per instruction set; NULL where the tiles compute */
    sl_dequantize_row_fn dequantize;
    /* Tile kernels (eight weight rows at a time) per instruction set, or NULL: the dot
     * functions above. One decoded layout serves both sets' gemm. The gemv (no decode pass) is
     * gemv8, one activation row at a time (the 32-weight formats), or gemvn8, up to SL_ROWS at
     * once (the K formats); the other is NULL. */
    sl_gemv8_fn gemv8[3];
    sl_gemvn8_fn gemvn8[3];
    sl_decode8_fn decode8;
    sl_gemm8_fn gemm8[3];
    int64_t (*tile_bytes)(int64_t k); /* bytes of a decoded tile of rows of k weights */
    /* AMX-INT8 products (ggml_quant_amx.c), or NULL; Q8_0's codes are signed */
    sl_amx_decode_fn amx_decode;
    int signed_codes;
    /* the same on rows interleaved eight at a time (SL_X8), or NULL: no such layout */
    sl_gemv8x_fn gemv8x[3];
    sl_gemvn8x_fn gemvn8x[3];
    sl_decode8x_fn decode8x, amx_decode16x;
    sl_amx_decode_blocks_fn amx_decode16x_blocks;
    const int *x8_gemv_max_rows; /* per instruction set: the most activation rows whose x8
                                  * rows take the x8 gemv (ggml_quant_dispatch.h), not a tile */
    /* 512-bit kernels on a unit of 16 interleaved rows, per instruction set, or NULL */
    sl_gemvn16x_fn gemvn16x[3];
    int x16_min_rows; /* the fewest activation rows they take (ggml_quant_dispatch.h) */
    sl_gemm16_fn gemm16[3]; /* the K formats' gemm on two decoded tiles in 512-bit vectors */
} sl_format;

#define SL_FORMAT_TILES(fmt, bytes, signed_codes, x8_max_rows, x16_min_rows)                     \
    { SL_QK, bytes, 0, {sl_dot_##fmt##_scalar, NULL, NULL}, sl_dequantize_##fmt,                  \
      {NULL, sl_gemv8_##fmt##_avx2, sl_gemv8_##fmt##_avx512}, {NULL, NULL, NULL},                  \
      sl_decode8_##fmt##_avx2, {NULL, sl_gemm8_##fmt##_avx2, sl_gemm8_##fmt##_avx512},            \
      sl_tile8_bytes_q8_1, sl_amx_decode16_##fmt, signed_codes,                                  \
      {NULL, sl_gemv8x_##fmt##_avx2, sl_gemv8x_##fmt##_avx512},                                  \
      {NULL, sl_gemvn8x_##fmt##_avx2, sl_gemvn8x_##fmt##_avx512}, sl_decode8x_##fmt,             \
      sl_amx_decode16x_##fmt, sl_amx_decode16x_blocks_##fmt, x8_max_rows,                       \
      {NULL, NULL, sl_gemvn16x_##fmt##_avx512}, x16_min_rows, {NULL, NULL, NULL} }
#define SL_FORMAT_KTILES(fmt, bytes, x8_avx2, x8_avx512, x8_decode)                          \
    { SL_QK_K, bytes, 1, {sl_dot_##fmt##_scalar, NULL, NULL}, sl_dequantize_##fmt,                \
      {NULL, NULL, NULL}, {NULL, sl_gemvn8_##fmt##_avx2, sl_gemvn8_##fmt##_avx512},                \
      sl_decode8_##fmt##_avx2, {NULL, sl_gemm8_##fmt##_avx2, sl_gemm8_##fmt##_avx512},            \
      sl_tile8_bytes_q8_k, NULL, 0, {NULL, NULL, NULL}, {NULL, x8_avx2, x8_avx512}, x8_decode, NULL, \
      NULL, sl_kx8_gemv_max_rows, {NULL, NULL, NULL}, 0, {NULL, NULL, sl_gemm16_##fmt##_avx512} }

static const sl_format *sl_format_of(int qtype) {
    static const sl_format q4_0 = SL_FORMAT_TILES(q4_0, 18, 0, sl_x8_nibble_gemv_max_rows,
                                                   SL_X16_MIN_ROWS);
    static const sl_format q4_1 = SL_FORMAT_TILES(q4_1, 20, 0, sl_x8_nibble_gemv_max_rows,
                                                   SL_X16_MIN_ROWS);
    static const sl_format q5_0 = SL_FORMAT_TILES(q5_0, 22, 0, sl_x8_gemv_max_rows,
                                                   SL_X16_MIN_ROWS);
    static const sl_format q5_1 = SL_FORMAT_TILES(q5_1, 24, 0, sl_x8_gemv_max_rows,
                                                   SL_X16_MIN_ROWS);
    static const sl_format q8_0 = SL_FORMAT_TILES(q8_0, 34, 1, sl_x8_gemv_max_rows,
                                                   SL_X16_MIN_ROWS_Q8_0);
    static const sl_format q4_k = SL_FORMAT_KTILES(q4_k, 144, sl_gemvn8x_q4_k_avx2,
                                                   sl_gemvn8x_q4_k_avx512, sl_decode8x_q4_k);
    static const sl_format q5_k = SL_FORMAT_KTILES(q5_k, 176, NULL, NULL, NULL);
    static const sl_format q6_k = SL_FORMAT_KTILES(q6_k, 210, NULL, NULL, NULL);
    switch (qtype) {
    case SL_TYPE_Q4_0: return &q4_0;
    case SL_TYPE_Q4_1: return &q4_1;
    case SL_TYPE_Q5_0: return &q5_0;
    case SL_TYPE_Q5_1: return &q5_1;
    case SL_TYPE_Q8_0: return &q8_0;
    case SL_TYPE_Q4_K: return &q4_k;
    case SL_TYPE_Q5_K: return &q5_k;
    case SL_TYPE_Q6_K: return &q6_k;
    default: return NULL;
    }
}

static const sl_quantize_row_fn sl_quantize_q8_1[3] = {
    sl_quantize_q8_1_scalar, sl_quantize_q8_1_avx2, sl_quantize_q8_1_avx512};
static const sl_quantize_row_fn sl_quantize_q8_k[3] = {
    sl_quantize_q8_k_scalar, sl_quantize_q8_k_avx2, sl_quantize_q8_k_avx512};

/* Bytes of one row of k weights in `qtype`, or -1 when the format is not computed here or k
 * is not a whole number of its blocks. */
int64_t sl_quant_row_bytes(int qtype, int64_t k) {
    const sl_format *format = sl_format_of(qtype);
    if (format == NULL || k <= 0 || k % format->block_size != 0) return -1;
    return k / format->block_size * format->block_bytes;
}

/* Bytes of one quantised activation row of k values, per activation format. */
static int64_t sl_q8_1_row_bytes(int64_t k) { return k / SL_QK * (int64_t)sizeof(sl_block_q8_1); }
static int64_t sl_q8_k_row_bytes(int64_t k) { return k / SL_QK_K * (int64_t)sizeof(sl_block_q8_k); }

/* Scratch bytes sl_quant_matmul needs for m activation rows of k values. */
int64_t sl_quant_scratch_bytes(int64_t m, int64_t k) {
    return m * (sl_q8_1_row_bytes(k) + (k % SL_QK_K == 0 ? sl_q8_k_row_bytes(k) : 0));
}

/* Quantise activation row `row` (float32 or bfloat16) into one activation format. Values are
 * widened SL_CHUNK at a time (a multiple of both block sizes), so the result is the same as
 * quantising the whole float32 row. */
static void sl_quantize_activation_row(const void *x, int x_bf16, int64_t ldx, int64_t row,
                                       int64_t k, sl_quantize_row_fn quantize,
                                       int64_t block_size, int64_t block_bytes, uint8_t *out) {
    if (!x_bf16) {
        quantize(k, (const float *)x + row * ldx, out);
        return;
    }
    const uint16_t *source = (const uint16_t *)x + row * ldx;
    float chunk[SL_CHUNK];
    for (int64_t start = 0; start < k; start += SL_CHUNK) {
        const int64_t count = k - start < SL_CHUNK ? k - start : SL_CHUNK;
        for (int64_t i = 0; i < count; i++) chunk[i] = sl_bf16_to_fp32(source[start + i]);
        quantize(count, chunk, out + start / block_size * block_bytes);
    }
}

/* A row's best output so far: its value and column (SL_NO_COLUMN: nothing above -inf yet). */
typedef struct {
    float value;
    int64_t column;
} sl_argmax_best;

/* A call of sl_quant_argmax (calls are not concurrent): each thread's best per activation row,
 * [thread][m], instead of storing the outputs; NULL otherwise. */
static sl_argmax_best *sl_argmax_bests = NULL;
static int64_t sl_argmax_rows = 0;
#define SL_NO_COLUMN INT64_MAX /* nothing above -inf seen (yet) */

/* `value` at `column` is better than `best` at `best_column`: torch.argmax's order, a NaN the
 * largest and of equal values (a NaN among them) the first column. */
static inline int sl_argmax_better(float value, int64_t column, float best, int64_t best_column) {
    if (value > best) return 1;
    if (value == best) return column < best_column;
    return value != value && (best == best || column < best_column);
}

/* Whether `rows` values at v hold one above `best` or a NaN: four independent maxima (no
 * loop-carried compare per value; a scan of each value against the best so far took 3-4 ns a
 * value), then the exact rule only where this says a chunk may change the best. */
static inline int sl_argmax_may_improve(const float *v, int64_t rows, float best) {
    int64_t r = 0;
    int improve = 0;
#if defined(__SSE2__)
    __m128 top = _mm_set1_ps(-INFINITY), unordered = _mm_setzero_ps();
    for (; r + 4 <= rows; r += 4) {
        const __m128 values = _mm_loadu_ps(v + r);
        top = _mm_max_ps(top, values);
        unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(values, values));
    }
    improve = _mm_movemask_ps(_mm_or_ps(unordered, _mm_cmpgt_ps(top, _mm_set1_ps(best))));
#endif
    for (; r < rows; r++) improve |= v[r] > best || v[r] != v[r];
    return improve && best == best; /* after a NaN, only an earlier column would replace it */
}

/* The calling thread's bests in a call of sl_quant_argmax: its row [m] of [thread][m]. */
static inline sl_argmax_best *sl_argmax_thread_bests(void) {
#ifdef _OPENMP
    return sl_argmax_bests + omp_get_thread_num() * sl_argmax_rows;
#else
    return sl_argmax_bests;
#endif
}

/* The argmax epilogue of one activation row i over `rows` outputs from column `column` (bias
 * added first): the calling thread's best so far. A tile after the best's column can only
 * replace it with a strictly larger value (or a first NaN): the quick check first. A tile
 * before it (a thread meets its own run's columns in increasing order, but a tile taken over
 * from another run can lie before them: sl_tile_claim) is compared in full, where an equal value
 * or a NaN in an earlier column wins. */
static void sl_argmax_row(const float *out, int64_t rows, int64_t i, int64_t column,
                          const float *bias) {
    sl_argmax_best *const bests = sl_argmax_thread_bests();
    float biased[SL_TILE_ROWS];
    if (bias != NULL) {
        for (int64_t r = 0; r < rows; r++) biased[r] = out[r] + bias[column + r];
        out = biased;
    }
    sl_argmax_best best = bests[i];
    if (column > best.column && !sl_argmax_may_improve(out, rows, best.value)) return;
    for (int64_t r = 0; r < rows; r++)
        if (sl_argmax_better(out[r], column + r, best.value, best.column))
            best = (sl_argmax_best){out[r], column + r};
    bests[i] = best;
}

#if defined(__x86_64__)
/* sl_argmax_row of n activation rows i0 .. i0 + n - 1 (row g's outputs at out + g *
 * out_stride), with the quick check of a tile after the best's column as one compare per
 * sixteen outputs: "not less than or equal, unordered" holds where a value is above the best
 * or a NaN, sl_argmax_may_improve's rule. A row that may improve, and a call with a bias, goes
 * to sl_argmax_row, which decides. The scalar check called per row took 3.3% of a 16-row and
 * 4.3% of a 64-row Gemma 3 greedy step (perf, Zen 5). */
SL_TARGET_AVX512 static void sl_argmax_rows_avx512(const float *out, int64_t out_stride,
                                                   int64_t n, int64_t rows, int64_t i0,
                                                   int64_t column, const float *bias) {
    const sl_argmax_best *bests = sl_argmax_thread_bests();
    for (int64_t g = 0; g < n; g++) {
        const float *o = out + g * out_stride;
        const sl_argmax_best best = bests[i0 + g];
        if (bias == NULL && column > best.column) {
            if (best.value != best.value) continue; /* only an earlier column replaces a NaN */
            const __m512 top = _mm512_set1_ps(best.value);
            __mmask16 above = 0;
            int64_t r = 0;
            for (; r + 16 <= rows; r += 16)
                above |= _mm512_cmp_ps_mask(_mm512_loadu_ps(o + r), top, _CMP_NLE_UQ);
            if (r < rows) {
                const __mmask16 tail = (__mmask16)((1u << (rows - r)) - 1u);
                above |= _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, o + r), top,
                                                 _CMP_NLE_UQ);
            }
            if (!above) continue;
        }
        sl_argmax_row(o, rows, i0 + g, column, bias);
    }
}

/* sl_argmax_rows_avx512 eight outputs a compare, for AVX2. */
SL_TARGET_AVX2 static void sl_argmax_rows_avx2(const float *out, int64_t out_stride, int64_t n,
                                               int64_t rows, int64_t i0, int64_t column,
                                               const float *bias) {
    const sl_argmax_best *bests = sl_argmax_thread_bests();
    for (int64_t g = 0; g < n; g++) {
        const float *o = out + g * out_stride;
        const sl_argmax_best best = bests[i0 + g];
        if (bias == NULL && column > best.column) {
            if (best.value != best.value) continue;
            const __m256 top = _mm256_set1_ps(best.value);
            __m256 above = _mm256_setzero_ps();
            int64_t r = 0;
            for (; r + 8 <= rows; r += 8)
                above = _mm256_or_ps(above, _mm256_cmp_ps(_mm256_loadu_ps(o + r), top, _CMP_NLE_UQ));
            int improve = _mm256_movemask_ps(above);
            for (; r < rows; r++) improve |= !(o[r] <= best.value);
            if (!improve) continue;
        }
        sl_argmax_row(o, rows, i0 + g, column, bias);
    }
}
#endif

/* Outputs r0 .. rows - 1 of activation row i, one at a time (the tail the vector stores leave). */
static inline __attribute__((always_inline)) void sl_store_scalar(
    const float *out, int64_t r0, int64_t rows, int64_t i, int64_t column, const float *bias,
    const void *residual, int64_t ldr, void *y, int y_bf16, int64_t ldy) {
    for (int64_t r = r0; r < rows; r++) {
        float v = out[r];
        if (bias != NULL) v += bias[column + r];
        if (residual != NULL) {
            const int64_t at = i * ldr + column + r;
            v += y_bf16 ? sl_bf16_to_fp32(((const uint16_t *)residual)[at])
                        : ((const float *)residual)[at];
        }
        if (y_bf16)
            ((uint16_t *)y)[i * ldy + column + r] = sl_fp32_to_bf16(v);
        else
            ((float *)y)[i * ldy + column + r] = v;
    }
}

#if defined(__x86_64__)
/* sl_store_scalar of eight outputs with AVX2: the same sums in the same order and the same bits
 * (sl_fp32_to_bf16's rounding to nearest even, a NaN's high half made quiet), eight at a time.
 * The scalar loop cost ~1 cycle an output: 4% of a 64-row SmolLM2 step on the AVX2 code. */
SL_TARGET_AVX2 static inline __attribute__((always_inline)) void sl_store8_avx2(
    const float *out, int64_t i, int64_t column, const float *bias, const void *residual,
    int64_t ldr, void *y, int y_bf16, int64_t ldy) {
    __m256 v = _mm256_loadu_ps(out);
    if (bias != NULL) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + column));
    if (residual != NULL) {
        const int64_t at = i * ldr + column;
        v = _mm256_add_ps(v, y_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                          _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                              (const __m128i *)((const uint16_t *)residual + at))),
                                          16))
                                    : _mm256_loadu_ps((const float *)residual + at));
    }
    if (!y_bf16) {
        _mm256_storeu_ps((float *)y + i * ldy + column, v);
        return;
    }
    const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i h = _mm256_blendv_epi8(rounded, quiet, nan); /* each lane < 2^16 */
    _mm_storeu_si128((__m128i *)((uint16_t *)y + i * ldy + column),
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* The epilogue of n activation rows i0 .. i0 + n - 1 (row g's `rows` outputs at out + g *
 * out_stride) with AVX2: one call for all of them. A call per eight outputs (the store could
 * not be inlined into the untargeted driver) spent as much on the call, its stack arguments,
 * the constants made again and vzeroupper as on the stores: 7.8% of a 64 x 17-token Gemma 3
 * prefill step (perf, Zen 5). */
SL_TARGET_AVX2 static void sl_store_rows_avx2(const float *out, int64_t out_stride, int64_t n,
                                              int64_t rows, int64_t i0, int64_t column,
                                              const float *bias, const void *residual, int64_t ldr,
                                              void *y, int y_bf16, int64_t ldy) {
    for (int64_t g = 0; g < n; g++) {
        const float *o = out + g * out_stride;
        int64_t r = 0;
        for (; r + 8 <= rows; r += 8) sl_store8_avx2(o + r, i0 + g, column + r, bias, residual, ldr, y, y_bf16, ldy);
        sl_store_scalar(o, r, rows, i0 + g, column, bias, residual, ldr, y, y_bf16, ldy);
    }
}

/* sl_store8_avx2 on sixteen outputs in 512-bit vectors: the same integer steps, the same bits. */
SL_TARGET_AVX512 static inline __attribute__((always_inline)) void sl_store16_avx512(
    const float *out, int64_t i, int64_t column, const float *bias, const void *residual,
    int64_t ldr, void *y, int y_bf16, int64_t ldy) {
    __m512 v = _mm512_loadu_ps(out);
    if (bias != NULL) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + column));
    if (residual != NULL) {
        const int64_t at = i * ldr + column;
        v = _mm512_add_ps(v, y_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                          _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                              (const __m256i *)((const uint16_t *)residual + at))),
                                          16))
                                    : _mm512_loadu_ps((const float *)residual + at));
    }
    if (!y_bf16) {
        _mm512_storeu_ps((float *)y + i * ldy + column, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __m512i h = _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + i * ldy + column), _mm512_cvtepi32_epi16(h));
}

/* sl_store_rows_avx2 with sixteen outputs at a time, then eight, then one. */
SL_TARGET_AVX512 static void sl_store_rows_avx512(const float *out, int64_t out_stride, int64_t n,
                                                  int64_t rows, int64_t i0, int64_t column,
                                                  const float *bias, const void *residual,
                                                  int64_t ldr, void *y, int y_bf16, int64_t ldy) {
    for (int64_t g = 0; g < n; g++) {
        const float *o = out + g * out_stride;
        int64_t r = 0;
        for (; r + 16 <= rows; r += 16)
            sl_store16_avx512(o + r, i0 + g, column + r, bias, residual, ldr, y, y_bf16, ldy);
        for (; r + 8 <= rows; r += 8) sl_store8_avx2(o + r, i0 + g, column + r, bias, residual, ldr, y, y_bf16, ldy);
        sl_store_scalar(o, r, rows, i0 + g, column, bias, residual, ldr, y, y_bf16, ldy);
    }
}
#endif

/* The epilogue of n activation rows i0 .. i0 + n - 1 over `rows` outputs each from column
 * `column` (row g's at out + g * out_stride): bias, residual, and the one rounding to bfloat16
 * (or, in a call of sl_quant_argmax, each row's best output so far: nothing is stored). isa:
 * the call's; AVX2 and AVX-512 store eight or sixteen outputs at a time (the same bits), the
 * rest one at a time. */
static inline __attribute__((always_inline)) void sl_store_rows(
    int isa, const float *out, int64_t out_stride, int64_t n, int64_t rows, int64_t i0,
    int64_t column, const float *bias, const void *residual, int64_t ldr, void *y, int y_bf16,
    int64_t ldy) {
    if (sl_argmax_bests != NULL) {
#if defined(__x86_64__)
        if (isa >= SL_ISA_AVX512) {
            sl_argmax_rows_avx512(out, out_stride, n, rows, i0, column, bias);
            return;
        }
        if (isa >= SL_ISA_AVX2) {
            sl_argmax_rows_avx2(out, out_stride, n, rows, i0, column, bias);
            return;
        }
#endif
        for (int64_t g = 0; g < n; g++) sl_argmax_row(out + g * out_stride, rows, i0 + g, column, bias);
        return;
    }
#if defined(__x86_64__)
    if (isa >= SL_ISA_AVX512) {
        sl_store_rows_avx512(out, out_stride, n, rows, i0, column, bias, residual, ldr, y, y_bf16, ldy);
        return;
    }
    if (isa >= SL_ISA_AVX2) {
        sl_store_rows_avx2(out, out_stride, n, rows, i0, column, bias, residual, ldr, y, y_bf16, ldy);
        return;
    }
#else
    (void)isa;
#endif
    for (int64_t g = 0; g < n; g++)
        sl_store_scalar(out + g * out_stride, 0, rows, i0 + g, column, bias, residual, ldr, y, y_bf16, ldy);
}

/* sl_store_rows of one activation row i. */
static inline __attribute__((always_inline)) void sl_store_row(
    int isa, const float *out, int64_t rows, int64_t i, int64_t column, const float *bias,
    const void *residual, int64_t ldr, void *y, int y_bf16, int64_t ldy) {
    sl_store_rows(isa, out, 0, 1, rows, i, column, bias, residual, ldr, y, y_bf16, ldy);
}

/* One thread's run of tiles in a call, [next, end) packed in one word (end in the high half)
 * so that its owner taking the front and another thread taking the back agree by one
 * compare-and-swap; a line of its own. */
typedef struct {
    _Alignas(64) uint64_t state;
} sl_tile_range;

/* Calls of one activation row keep the static runs: each thread streams its weights from
 * memory with its prefetches ahead, and a tile taken over measured 1.0-1.04x (AVX2 code, Zen 4);
 * at 2-3 rows 0.70-1.03x (the 262,144-row Gemma 3 head at 2 rows 0.70x). */
#define SL_STEAL_MIN_ROWS 2

static int64_t sl_tiles_taken_over = 0;

int64_t sl_quant_tiles_taken_over(void) { return __atomic_load_n(&sl_tiles_taken_over, __ATOMIC_RELAXED); }

/* This thread's run: the contiguous share schedule(static) gives it (the first tiles % n
 * threads one tile more). Before the barrier that precedes sl_tile_claim. */
static void sl_tile_range_init(sl_tile_range *ranges, int64_t tiles) {
    const int64_t t = SL_THREAD_NUM(), n = SL_THREAD_COUNT();
    const int64_t base = tiles / n, extra = tiles % n;
    const int64_t first = t * base + (t < extra ? t : extra);
    const int64_t end = first + base + (t < extra);
    __atomic_store_n(&ranges[t].state, (uint64_t)end << 32 | (uint64_t)first, __ATOMIC_RELAXED);
}

/* The next tile of this thread's run; when it is done, the last tile of the run with the most
 * left (work stealing: a thread that a busy neighbour on the core, or a slower share, holds back
 * no longer keeps the other waiting at the barrier with its own tiles undone). -1: none left.
 * Any thread computes any tile to the same bits; only the order differs. */
static int64_t sl_tile_claim(sl_tile_range *ranges, int steal) {
    const int t = SL_THREAD_NUM(), n = SL_THREAD_COUNT();
    uint64_t state = __atomic_load_n(&ranges[t].state, __ATOMIC_RELAXED);
    if (!steal) { /* no other thread writes this run: no locked instruction */
        if ((uint32_t)state >= (uint32_t)(state >> 32)) return -1;
        __atomic_store_n(&ranges[t].state, state + 1, __ATOMIC_RELAXED);
        return (int64_t)(uint32_t)state;
    }
    while ((uint32_t)state < (uint32_t)(state >> 32))
        if (__atomic_compare_exchange_n(&ranges[t].state, &state, state + 1, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return (int64_t)(uint32_t)state;
    for (;;) {
        int victim = -1;
        int64_t most = 0;
        for (int v = 0; v < n; v++) {
            const uint64_t other = __atomic_load_n(&ranges[v].state, __ATOMIC_RELAXED);
            const int64_t left = (int64_t)(other >> 32) - (int64_t)(uint32_t)other;
            if (v != t && left > most) {
                most = left;
                victim = v;
            }
        }
        if (victim < 0) return -1;
        uint64_t other = __atomic_load_n(&ranges[victim].state, __ATOMIC_RELAXED);
        const uint64_t end = other >> 32;
        if ((uint32_t)other >= end) continue;
        const uint64_t taken = (end - 1) << 32 | (uint32_t)other;
        if (__atomic_compare_exchange_n(&ranges[victim].state, &other, taken, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            __atomic_fetch_add(&sl_tiles_taken_over, 1, __ATOMIC_RELAXED);
            return (int64_t)(end - 1);
        }
    }
}

/* Which sl_quant_matmul call runs (calls are not concurrent): a tile decoded ahead is used
 * only in the call that decoded it. */
static int64_t sl_call_id = 0;

/* One unit of `rows` (<= SL_TILE_ROWS) weight rows at w on the tile kernels of `isa`, for all m
 * activation rows, stored from `column`; its first x8_rows rows (0, 8 or 16) are full groups
 * interleaved (SL_X8), and so are the 16 rows after it when next_x8. The decoded tile lives in
 * a buffer of the thread's. */
static void sl_tile_unit(const sl_format *format, int isa, int amx, const uint8_t *w,
                         int64_t x8_rows, int next_x8, int64_t row_bytes, int64_t rows, int64_t k,
                         const uint8_t *xq, int64_t xq_bytes, int64_t m, int64_t column,
                         const float *bias, const void *residual, int64_t ldr, void *y,
                         int y_bf16, int64_t ldy) {
    static _Thread_local void *tile = NULL;
    static _Thread_local int64_t capacity = 0;
    const int gemv_max_rows = format->gemvn8[isa] != NULL ? SL_KGEMV_MAX_ROWS : SL_GEMV_MAX_ROWS;
    const int gemm = m > gemv_max_rows;
    const int64_t tile_bytes = format->tile_bytes(k);
    /* AMX: the 16 rows decoded into one tile (two halves: this unit's, the next one's), then
     * m x 16 outputs at once */
    amx = amx && format->amx_decode != NULL && x8_rows != 8 &&
          m >= (x8_rows ? SL_AMX_MIN_ROWS_X8 : SL_AMX_MIN_ROWS);
    const int64_t needed =
        amx ? 2 * sl_amx_tile_bytes(k) + m * 16 * (int64_t)sizeof(float)
            : format->gemm16[isa] != NULL ? 2 * tile_bytes : tile_bytes;
    if (gemm && needed > capacity) {
        void *grown = realloc(tile, (size_t)needed);
        if (grown != NULL) { /* else gemv, which needs no buffer: the same outputs */
            tile = grown;
            capacity = needed;
        }
    }
    if (amx && capacity >= needed) {
        /* A unit of interleaved rows followed by another one decodes the next unit's tile
         * between its own products (sl_amx_gemm16), into the other half; the next unit, when
         * this thread runs it (its contiguous run of units), finds it there. */
        static _Thread_local const uint8_t *ahead = NULL; /* the unit decoded ahead */
        static _Thread_local int64_t ahead_call = -1;
        static _Thread_local int half = 0; /* the half holding it */
        const int64_t amx_bytes = sl_amx_tile_bytes(k);
        float *out = (float *)((uint8_t *)tile + 2 * amx_bytes);
        if (x8_rows == 16 && format->signed_codes) { /* Q8_0: its x8 codes read in place */
            sl_amx_gemm16_q8_0x(w, k, xq, xq_bytes, m, out, w + 16 * row_bytes,
                                16 * row_bytes);
            sl_store_rows(isa, out, 16, m, rows, 0, column, bias, residual, ldr, y, y_bf16, ldy);
            return;
        }
        const int overlap = x8_rows == 16 && next_x8;
        const int found = x8_rows == 16 && ahead == w && ahead_call == sl_call_id;
        ahead = NULL; /* used now, or not this unit's: either way no longer ahead */
        if (!found && x8_rows == 16) {
            half = 0;
            format->amx_decode16x(w, k, tile, overlap ? NULL : w + 16 * row_bytes,
                                  overlap ? 0 : 16 * row_bytes);
        } else if (!found) {
            const uint8_t *row_at[16];
            for (int j = 0; j < 16; j++) /* a short unit repeats its last row */
                row_at[j] = w + (j < rows ? j : rows - 1) * row_bytes;
            half = 0;
            format->amx_decode(row_at, k, tile, w + 16 * row_bytes, 16 * row_bytes);
        }
        uint8_t *current = (uint8_t *)tile + half * amx_bytes;
        uint8_t *next_tile = (uint8_t *)tile + (1 - half) * amx_bytes;
        sl_amx_gemm16(current, k, xq, xq_bytes, m, format->signed_codes, out,
                      overlap ? format->amx_decode16x_blocks : NULL, w + 16 * row_bytes,
                      next_tile);
        if (overlap) {
            ahead = w + 16 * row_bytes;
            ahead_call = sl_call_id;
            half = 1 - half;
        }
        sl_store_rows(isa, out, 16, m, rows, 0, column, bias, residual, ldr, y, y_bf16, ldy);
        return;
    }
    const int x8_max = format->x8_gemv_max_rows[isa];
    const int no_tile = !gemm || capacity < tile_bytes;
    if (x8_rows == 16 && format->gemvn16x[isa] != NULL && m >= format->x16_min_rows) {
        /* x8, a full unit in 512-bit vectors: both groups at once (ggml_quant_tiles16.h), the
         * same bits as the two groups' gemvn8x below */
        float out[SL_X16_ROWS][16];
        for (int64_t i0 = 0; i0 < m; i0 += SL_X16_ROWS) {
            const int n_x = m - i0 < SL_X16_ROWS ? (int)(m - i0) : SL_X16_ROWS;
            const void *x_rows[SL_X16_ROWS];
            for (int g = 0; g < n_x; g++) x_rows[g] = xq + (i0 + g) * xq_bytes;
            format->gemvn16x[isa](w, k, x_rows, n_x, out[0], 16, w + 16 * row_bytes,
                                  i0 == 0 ? 16 * row_bytes : 0);
            sl_store_rows(isa, out[0], 16, n_x, 16, i0, column, bias, residual, ldr, y, y_bf16, ldy);
        }
        return;
    }
    if (rows == 16 && format->gemm16[isa] != NULL && gemm && capacity >= 2 * tile_bytes) {
        /* a full unit of a K format in 512-bit vectors: both tiles decoded, then every run of
         * activation rows against the 16 rows at once (ggml_quant_ktiles16.h), the same bits
         * as each tile's gemm8 below */
        for (int h = 0; h < 2; h++) {
            const uint8_t *first = w + 8 * h * row_bytes, *next = w + (8 * h + 16) * row_bytes;
            uint8_t *to = (uint8_t *)tile + h * tile_bytes;
            if (8 * h < x8_rows) {
                format->decode8x(first, k, to, next, 8 * row_bytes);
            } else {
                const uint8_t *row_at[8];
                for (int j = 0; j < 8; j++) row_at[j] = first + j * row_bytes;
                format->decode8(row_at, k, to, next, 8 * row_bytes);
            }
        }
        float out[SL_GEMM_ROWS][16];
        for (int64_t i0 = 0; i0 < m; i0 += SL_GEMM_ROWS) {
            const int n_x = m - i0 < SL_GEMM_ROWS ? (int)(m - i0) : SL_GEMM_ROWS;
            const void *x_rows[SL_GEMM_ROWS];
            for (int g = 0; g < n_x; g++) x_rows[g] = xq + (i0 + g) * xq_bytes;
            format->gemm16[isa](tile, k, x_rows, n_x, out[0], 16);
            sl_store_rows(isa, out[0], 16, n_x, 16, i0, column, bias, residual, ldr, y, y_bf16, ldy);
        }
        return;
    }
    if (x8_rows == 16 && (m <= x8_max || no_tile) && m > 1) {
        /* x8, a full unit: both groups of eight for each run of activation rows, then each
         * row's 16 outputs stored in one epilogue call (half the calls: a 64-row call of
         * SmolLM2's gate_up spent 9% of its time in the epilogue). The same kernel calls on
         * the same rows as one group at a time below, so the same bits. */
        float out[SL_GEMM_ROWS][16];
        for (int64_t i0 = 0; i0 < m; i0 += SL_GEMM_ROWS) {
            const int n_x = m - i0 < SL_GEMM_ROWS ? (int)(m - i0) : SL_GEMM_ROWS;
            const void *x_rows[SL_GEMM_ROWS];
            for (int g = 0; g < n_x; g++) x_rows[g] = xq + (i0 + g) * xq_bytes;
            for (int64_t r0 = 0; r0 < 16; r0 += 8)
                format->gemvn8x[isa](w + r0 * row_bytes, k, x_rows, n_x, out[0] + r0, 16,
                                     w + (r0 + 2 * 8) * row_bytes, i0 == 0 ? 8 * row_bytes : 0);
            sl_store_rows(isa, out[0], 16, n_x, 16, i0, column, bias, residual, ldr, y, y_bf16, ldy);
        }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int64_t lanes = rows - r0 < 8 ? rows - r0 : 8;
        const uint8_t *row_at[8];
        for (int j = 0; j < 8; j++) /* a tail tile repeats its last row */
            row_at[j] = w + (r0 + (j < lanes ? j : lanes - 1)) * row_bytes;
        const uint8_t *group = r0 < x8_rows ? w + r0 * row_bytes : NULL; /* x8 */
        float out[SL_GEMM_ROWS][8];
        /* x8: a gemv of several rows, no decode pass (and wherever no tile buffer was had) */
        if (group != NULL && (m <= x8_max || no_tile) && (m > 1 || format->gemv8x[isa] == NULL)) {
            for (int64_t i0 = 0; i0 < m; i0 += SL_GEMM_ROWS) {
                const int n_x = m - i0 < SL_GEMM_ROWS ? (int)(m - i0) : SL_GEMM_ROWS;
                const void *x_rows[SL_GEMM_ROWS];
                for (int g = 0; g < n_x; g++) x_rows[g] = xq + (i0 + g) * xq_bytes;
                format->gemvn8x[isa](group, k, x_rows, n_x, out[0], 8,
                                     w + (r0 + 2 * 8) * row_bytes, i0 == 0 ? 8 * row_bytes : 0);
                sl_store_rows(isa, out[0], 8, n_x, lanes, i0, column + r0, bias, residual, ldr, y,
                              y_bf16, ldy);
            }
            continue;
        }
        if (group == NULL && no_tile && format->gemvn8[isa] != NULL) { /* the K formats' */
            for (int64_t i0 = 0; i0 < m; i0 += SL_ROWS) {
                const int n_x = m - i0 < SL_ROWS ? (int)(m - i0) : SL_ROWS;
                const void *x_rows[SL_ROWS];
                for (int g = 0; g < n_x; g++) x_rows[g] = xq + (i0 + g) * xq_bytes;
                format->gemvn8[isa](row_at, k, x_rows, n_x, out[0], 8,
                                    w + (r0 + 2 * 8) * row_bytes, i0 == 0 ? 8 * row_bytes : 0);
                sl_store_rows(isa, out[0], 8, n_x, lanes, i0, column + r0, bias, residual, ldr, y,
                              y_bf16, ldy);
            }
            continue;
        }
        if (no_tile || (group != NULL && m == 1)) { /* one row at a time */
            for (int64_t i = 0; i < m; i++) {
                /* prefetch two tiles ahead while the first activation row runs */
                const uint8_t *next = w + (r0 + 2 * 8) * row_bytes;
                const int64_t ahead = i == 0 ? 8 * row_bytes : 0;
                if (group != NULL)
                    format->gemv8x[isa](group, k, xq + i * xq_bytes, out[0], next, ahead);
                else
                    format->gemv8[isa](row_at, k, xq + i * xq_bytes, out[0], next, ahead);
                sl_store_row(isa, out[0], lanes, i, column + r0, bias, residual, ldr, y, y_bf16, ldy);
            }
            continue;
        }
        if (group != NULL)
            format->decode8x(group, k, tile, w + (r0 + 2 * 8) * row_bytes, 8 * row_bytes);
        else
            format->decode8(row_at, k, tile, w + (r0 + 2 * 8) * row_bytes, 8 * row_bytes);
        for (int64_t i0 = 0; i0 < m; i0 += SL_GEMM_ROWS) {
            const int group = m - i0 < SL_GEMM_ROWS ? (int)(m - i0) : SL_GEMM_ROWS;
            const void *x_rows[SL_GEMM_ROWS];
            for (int g = 0; g < group; g++) x_rows[g] = xq + (i0 + g) * xq_bytes;
            format->gemm8[isa](tile, k, x_rows, group, out[0], 8);
            sl_store_rows(isa, out[0], 8, group, lanes, i0, column + r0, bias, residual, ldr, y,
                          y_bf16, ldy);
        }
    }
}

/*
 * y[i, c] = sum_j x[i, j] * W[c, j] (+ bias[c]) (+ residual[i, c]) for i < m, c < n, where the
 * n output columns are the segments' rows in order (segment s: qtypes[s], weights[s] holding
 * seg_rows[s] rows of k weights in the file's blocks). x: m rows of k float32 or bfloat16
 * values, row stride ldx; residual: NULL or m rows of y's dtype, stride ldr; y: float32 or
 * bfloat16, stride ldy; bias: NULL or n float32. scratch: sl_quant_scratch_bytes(m, k) bytes,
 * or NULL: a buffer of the calling thread's own, kept between calls and grown as needed.
 * threads: the OpenMP team (the process's, torch's own libgomp when linked with -fopenmp).
 * A qtype with SL_X8 set: that segment's full groups of eight rows are interleaved (ggml_quant.h).
 * Returns 0, -1 when a segment's format (or layout) is not computed here or k does not fit it,
 * -2 when the scratch buffer (or the portable code's rows gathered from x8) cannot be allocated.
 */
int sl_quant_matmul(int isa, int n_segments, const int32_t *qtypes, const void *const *weights,
                    const int64_t *seg_rows, int64_t k, const void *x, int x_bf16, int64_t m,
                    int64_t ldx, const float *bias, const void *residual, int64_t ldr, void *y,
                    int y_bf16, int64_t ldy, void *scratch, int threads) {
    int need_q8_1 = 0, need_q8_k = 0;
    int64_t n = 0, tiles = 0;
    for (int s = 0; s < n_segments; s++) { /* (SL_X8: only where the format has the layout) */
        const sl_format *format = sl_format_of(qtypes[s] & ~SL_X8);
        if (format == NULL || sl_quant_row_bytes(qtypes[s] & ~SL_X8, k) < 0) return -1;
        if ((qtypes[s] & SL_X8) && format->decode8x == NULL) return -1;
        need_q8_k |= format->q8k;
        need_q8_1 |= !format->q8k;
        n += seg_rows[s];
        tiles += (seg_rows[s] + SL_TILE_ROWS - 1) / SL_TILE_ROWS;
    }
    if (isa < SL_ISA_SCALAR || isa > SL_ISA_AVX512) return -1;
    if (scratch == NULL) {
        static _Thread_local void *buffer = NULL;
        static _Thread_local int64_t capacity = 0;
        const int64_t needed = sl_quant_scratch_bytes(m, k);
        if (needed > capacity) {
            void *grown = realloc(buffer, (size_t)needed);
            if (grown == NULL) return -2;
            buffer = grown;
            capacity = needed;
        }
        scratch = buffer;
    }
    const int64_t q8_1_bytes = sl_q8_1_row_bytes(k), q8_k_bytes = sl_q8_k_row_bytes(k);
    uint8_t *q8_1 = (uint8_t *)scratch;
    uint8_t *q8_k = q8_1 + m * q8_1_bytes;
    if (threads < 1) threads = 1;
    const int amx = isa == SL_ISA_AVX512 && sl_quant_amx_ready();
    sl_prefetch_l2_now = m <= sl_prefetch_l2_rows; /* (calls are not concurrent) */
    sl_call_id++;
    int no_memory = 0;
    sl_tile_range ranges[threads];

#pragma omp parallel num_threads(threads) reduction(| : no_memory)
    {
        sl_tile_range_init(ranges, tiles);
        /* Activations: each thread quantises a share of the rows. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            if (need_q8_1)
                sl_quantize_activation_row(x, x_bf16, ldx, i, k, sl_quantize_q8_1[isa], SL_QK,
                                           sizeof(sl_block_q8_1), q8_1 + i * q8_1_bytes);
            if (need_q8_k)
                sl_quantize_activation_row(x, x_bf16, ldx, i, k, sl_quantize_q8_k[isa], SL_QK_K,
                                           sizeof(sl_block_q8_k), q8_k + i * q8_k_bytes);
        }
        /* (the implied barrier: every activation row is quantised, and every thread's range
         * of tiles set, before any dot) */

        /* Outputs: tiles of SL_TILE_ROWS weight rows of one segment, each thread a contiguous
         * run of them (tiles handed out one at a time made the threads write the same cache
         * lines of a one-row output: a 49152-row LM head ran slower on two threads than on
         * one), then the last tiles of the others' runs (sl_tile_claim). */
        for (;;) {
            const int64_t tile = sl_tile_claim(ranges, m >= SL_STEAL_MIN_ROWS);
            if (tile < 0) break;
            int s = 0;
            int64_t first = tile, column = 0;
            for (;; s++) { /* find the tile's segment */
                const int64_t seg_tiles = (seg_rows[s] + SL_TILE_ROWS - 1) / SL_TILE_ROWS;
                if (first < seg_tiles) break;
                first -= seg_tiles;
                column += seg_rows[s];
            }
            const sl_format *format = sl_format_of(qtypes[s] & ~SL_X8);
            const sl_vec_dot_fn dot = format->dot[isa];
            const int64_t row_bytes = k / format->block_size * format->block_bytes;
            const int64_t row0 = first * SL_TILE_ROWS;
            const int64_t rows =
                seg_rows[s] - row0 < SL_TILE_ROWS ? seg_rows[s] - row0 : SL_TILE_ROWS;
            const uint8_t *w = (const uint8_t *)weights[s] + row0 * row_bytes;
            const uint8_t *xq = format->q8k ? q8_k : q8_1;
            const int64_t xq_bytes = format->q8k ? q8_k_bytes : q8_1_bytes;
            column += row0;
            /* rows of this unit in full interleaved groups (row0 is a multiple of 16) */
            const int64_t full = (qtypes[s] & SL_X8) ? seg_rows[s] / 8 * 8 - row0 : 0;
            const int64_t x8_rows = full < 0 ? 0 : full < rows ? full : rows;
            if (format->gemm8[isa] != NULL) {
                sl_tile_unit(format, isa, amx, w, x8_rows, full >= 2 * SL_TILE_ROWS, row_bytes,
                             rows, k, xq, xq_bytes, m, column, bias, residual, ldr, y, y_bf16,
                             ldy);
                continue;
            }
            /* the portable C: one dot product per output, an x8 row gathered first */
            static _Thread_local uint8_t *file_rows = NULL;
            static _Thread_local int64_t file_capacity = 0;
            if (x8_rows * row_bytes > file_capacity) {
                uint8_t *grown = (uint8_t *)realloc(file_rows, (size_t)(x8_rows * row_bytes));
                if (grown == NULL) {
                    no_memory = 1;
                    continue;
                }
                file_rows = grown;
                file_capacity = x8_rows * row_bytes;
            }
            for (int64_t r = 0; r < x8_rows; r++)
                sl_x8_row_to_file(qtypes[s] & ~SL_X8, w + r / 8 * 8 * row_bytes, (int)(r % 8), k,
                                  file_rows + r * row_bytes);
            for (int64_t i = 0; i < m; i++) {
                float out[SL_TILE_ROWS];
                for (int64_t r = 0; r < rows; r++)
                    out[r] = dot(k, (r < x8_rows ? file_rows : w) + r * row_bytes, xq + i * xq_bytes);
                sl_store_row(isa, out, rows, i, column, bias, residual, ldr, y, y_bf16, ldy);
            }
        }
        if (amx) sl_amx_release();
    }
    return no_memory ? -2 : 0;
}

/*
 * index[i] = argmax over c of y[i, c] for sl_quant_matmul's y (float32, no residual), without
 * storing y: torch.argmax's index (the first of equal values, a NaN the largest; a row of -inf
 * gives 0), from the same float sums as sl_quant_matmul's outputs. A greedy step's LM head:
 * Gemma 3's 16 rows x 262,144 logits are 16 MiB written and read again (docs/MODEL_PERF.md).
 * Returns as sl_quant_matmul; -2 also when the threads' bests cannot be allocated.
 */
int sl_quant_argmax(int isa, int n_segments, const int32_t *qtypes, const void *const *weights,
                    const int64_t *seg_rows, int64_t k, const void *x, int x_bf16, int64_t m,
                    int64_t ldx, const float *bias, int64_t *index, int threads) {
    if (threads < 1) threads = 1;
    const int64_t slots = (int64_t)threads * (m > 0 ? m : 1);
    sl_argmax_best *bests = (sl_argmax_best *)malloc((size_t)slots * sizeof(sl_argmax_best));
    if (bests == NULL) return -2;
    for (int64_t j = 0; j < slots; j++) bests[j] = (sl_argmax_best){-INFINITY, SL_NO_COLUMN};
    sl_argmax_bests = bests, sl_argmax_rows = m;
    const int status = sl_quant_matmul(isa, n_segments, qtypes, weights, seg_rows, k, x, x_bf16,
                                       m, ldx, bias, NULL, 0, NULL, 0, 0, NULL, threads);
    sl_argmax_bests = NULL;
    for (int64_t i = 0; status == 0 && i < m; i++) { /* the threads' columns, in order */
        sl_argmax_best best = bests[i];
        for (int t = 1; t < threads; t++) {
            const sl_argmax_best other = bests[t * m + i];
            if (other.column != SL_NO_COLUMN &&
                sl_argmax_better(other.value, other.column, best.value, best.column))
                best = other;
        }
        index[i] = best.column == SL_NO_COLUMN ? 0 : best.column;
    }
    free(bests);
    return status;
}

/* The row decode of `qtype` (without SL_X8), or NULL for a type not computed here. */
sl_dequantize_row_fn sl_quant_dequantizer(int qtype) {
    const sl_format *format = sl_format_of(qtype);
    return format == NULL ? NULL : format->dequantize;
}
