/*
 * Matmuls on the blocks of a GGUF file (llama.cpp's quantised formats), on the CPU.
 *
 * y[m, n] = x[m, k] . W[n, k]^T, where W's rows are stored as the file stores them: each row
 * is k / block_size blocks of the format's bytes (ggml's block layouts, see ggml-common.h in
 * llama.cpp and gguf-py's gguf/quants.py). The activations x are quantised once per call to
 * 8-bit blocks (SL_Q8_1 for the 32-weight formats, SL_Q8_K for the 256-weight K formats), and
 * every output is the dot product of one weight row with one activation row, computed by one
 * function per (format, instruction set) that never looks at any other row: a row's result
 * does not depend on the batch it is in, nor on the thread that computed it.
 *
 * Instruction sets are chosen at run time from cpuid (__builtin_cpu_supports), never from the
 * build machine: each SIMD function is compiled with its own target attribute.
 */
#ifndef SL_GGML_QUANT_H
#define SL_GGML_QUANT_H

#include <stdint.h>
#include <string.h>

/* ggml's type ids (enum ggml_type), the ids GGUF files store. */
enum sl_qtype {
    SL_TYPE_Q4_0 = 2,
    SL_TYPE_Q4_1 = 3,
    SL_TYPE_Q5_0 = 6,
    SL_TYPE_Q5_1 = 7,
    SL_TYPE_Q8_0 = 8,
    SL_TYPE_Q4_K = 12,
    SL_TYPE_Q5_K = 13,
    SL_TYPE_Q6_K = 14,
};

/* Instruction sets, in order of preference. */
enum sl_isa {
    SL_ISA_SCALAR = 0, /* portable C */
    SL_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C: maddubs for the int8 dot products */
    SL_ISA_AVX512 = 2, /* AVX-512 F/BW/VL/DQ + VNNI: vpdpbusd on 512-bit vectors */
};

#define SL_QK 32    /* weights per block of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 */
#define SL_QK_K 256 /* weights per super-block of Q4_K, Q5_K, Q6_K */

/* Quantised activations for the 32-weight formats: x[i] ~= d * qs[i]; s = d * sum(qs), which
 * the formats with a minimum (Q4_1, Q5_1) need; sum = sum(qs), exact, which Q8_0's tiles on
 * VNNI need (their codes offset to unsigned bytes, ggml_quant_tiles_body.h). 44 bytes. */
typedef struct {
    float d;
    float s;
    int32_t sum;
    int8_t qs[SL_QK];
} sl_block_q8_1;

/* Quantised activations for the K formats: x[i] ~= d * qs[i]; bsums[j] = sum of qs[16j ..
 * 16j + 15], which the formats with minima or offsets (Q4_K, Q5_K, Q6_K) need. 292 bytes. */
typedef struct {
    float d;
    int8_t qs[SL_QK_K];
    int16_t bsums[SL_QK_K / 16];
} sl_block_q8_k;

/*
 * Activation quantisation, one row of k float32 values (k a multiple of the block size):
 * per block, amax = max |x|, d = amax / 127 (0 when amax is 0), id = d ? 1 / d : 0,
 * qs[i] = round-to-nearest-even(x[i] * id), computed in float32: every instruction set gives
 * the same bytes (tested).
 */
typedef void (*sl_quantize_row_fn)(int64_t k, const float *x, void *out);

/* One weight row (k / block_size blocks of the file's bytes) against one quantised activation
 * row: the float32 dot product. */
typedef float (*sl_vec_dot_fn)(int64_t k, const void *w_row, const void *x_row);

/* Activation rows per call of the K formats' gemv. */
#define SL_ROWS 4
/* Activation rows per call of a tile kernel's gemm: AVX-512 VNNI keeps the accumulators of 8
 * in its 32 vector registers, AVX2 computes them 4 at a time (16 registers). */
#define SL_GEMM_ROWS 8
/* Activation rows a pass of the 512-bit kernels on 16 interleaved rows takes
 * (ggml_quant_tiles16.h). */
#define SL_X16_ROWS 16

/* One weight row decoded to float32, as gguf.quants.dequantize decodes it. */
typedef void (*sl_dequantize_row_fn)(int64_t k, const void *w_row, float *out);

/* Exported by ggml_quant_legacy.c (fmt: q4_0 q4_1 q5_0 q5_1 q8_0; isa: scalar avx2 avx512;
 * x: sl_block_q8_1) and by ggml_quant_kquants.c (fmt: q4_k q5_k q6_k; x: sl_block_q8_k):
 *   void  sl_quantize_q8_1_<isa>(int64_t k, const float *x, void *out);      (legacy)
 *   void  sl_quantize_q8_k_<isa>(int64_t k, const float *x, void *out);      (kquants)
 *   float sl_dot_<fmt>_scalar(int64_t k, const void *w_row, const void *x_row);
 *   void  sl_dequantize_<fmt>(int64_t k, const void *w_row, float *out);
 * The portable dot products serve CPUs without AVX2; the SIMD products are the tile kernels
 * below. */
#define SL_DECLARE_FORMAT(fmt)                                                                  \
    float sl_dot_##fmt##_scalar(int64_t k, const void *w_row, const void *x_row);              \
    void sl_dequantize_##fmt(int64_t k, const void *w_row, float *out);

SL_DECLARE_FORMAT(q4_0)
SL_DECLARE_FORMAT(q4_1)
SL_DECLARE_FORMAT(q5_0)
SL_DECLARE_FORMAT(q5_1)
SL_DECLARE_FORMAT(q8_0)
SL_DECLARE_FORMAT(q4_k)
SL_DECLARE_FORMAT(q5_k)
SL_DECLARE_FORMAT(q6_k)

void sl_quantize_q8_1_scalar(int64_t k, const float *x, void *out);
void sl_quantize_q8_1_avx2(int64_t k, const float *x, void *out);
void sl_quantize_q8_1_avx512(int64_t k, const float *x, void *out);
void sl_quantize_q8_k_scalar(int64_t k, const float *x, void *out);
void sl_quantize_q8_k_avx2(int64_t k, const float *x, void *out);
void sl_quantize_q8_k_avx512(int64_t k, const float *x, void *out);

/* Tile kernels of the 32-weight formats (ggml_quant_tiles.c): eight weight rows at a time,
 * rows[j] the start of weight row j (a tail tile repeats its last row); <isa> avx2 or avx512.
 *   sl_gemv8_<fmt>_<isa>(rows, k, x, out, prefetch, ahead): one activation row x (sl_block_q8_1)
 *       -> out[8], prefetching `ahead` bytes from `prefetch` meanwhile (the next rows).
 *   sl_decode8_<fmt>_avx2(rows, k, tile, prefetch, ahead): the rows decoded into a tile of
 *       sl_tile8_bytes_q8_1(k) bytes (one layout for both instruction sets), then
 *   sl_gemm8_<fmt>_<isa>(tile, k, x, n_x, out, out_stride): n_x <= SL_GEMM_ROWS activation rows x[r]
 *       -> out[r * out_stride + j], j < 8.
 * All give every output bit for bit the same, on either instruction set (see the file). */
typedef void (*sl_gemv8_fn)(const uint8_t *const *rows, int64_t k, const void *x, float *out,
                            const uint8_t *prefetch, int64_t ahead);
typedef void (*sl_decode8_fn)(const uint8_t *const *rows, int64_t k, void *tile,
                              const uint8_t *prefetch, int64_t ahead);
typedef void (*sl_gemm8_fn)(const void *tile, int64_t k, const void *const *x, int n_x,
                            float *out, int64_t out_stride);
#define SL_DECLARE_GEMM(fmt)                                                                     \
    void sl_gemm8_##fmt##_avx2(const void *tile, int64_t k, const void *const *x, int n_x,       \
                               float *out, int64_t out_stride);                                  \
    void sl_gemm8_##fmt##_avx512(const void *tile, int64_t k, const void *const *x, int n_x,     \
                                 float *out, int64_t out_stride);                                \
    void sl_decode8_##fmt##_avx2(const uint8_t *const *rows, int64_t k, void *tile,              \
                                 const uint8_t *prefetch, int64_t ahead);
#define SL_DECLARE_TILES(fmt)                                                                    \
    SL_DECLARE_GEMM(fmt)                                                                         \
    void sl_gemv8_##fmt##_avx2(const uint8_t *const *rows, int64_t k, const void *x, float *out,  \
                               const uint8_t *prefetch, int64_t ahead);                          \
    void sl_gemv8_##fmt##_avx512(const uint8_t *const *rows, int64_t k, const void *x,           \
                                 float *out, const uint8_t *prefetch, int64_t ahead);
SL_DECLARE_TILES(q4_0)
SL_DECLARE_TILES(q4_1)
SL_DECLARE_TILES(q5_0)
SL_DECLARE_TILES(q5_1)
SL_DECLARE_TILES(q8_0)
int64_t sl_tile8_bytes_q8_1(int64_t k);
/* The same decode and gemm for the K formats (ggml_quant_ktiles.c; x: sl_block_q8_k rows); their
 * gemv takes up to SL_ROWS activation rows at once (each weight super-block unpacked once for
 * all), instead of sl_gemv8's one:
 *   sl_gemvn8_<fmt>_<isa>(rows, k, x, n_x, out, out_stride, prefetch, ahead): n_x <= SL_ROWS
 *       activation rows x[r] -> out[r * out_stride + j], j < 8; bit for bit the gemm's. */
typedef void (*sl_gemvn8_fn)(const uint8_t *const *rows, int64_t k, const void *const *x, int n_x,
                             float *out, int64_t out_stride, const uint8_t *prefetch, int64_t ahead);
#define SL_DECLARE_KTILES(fmt)                                                                   \
    SL_DECLARE_GEMM(fmt)                                                                         \
    void sl_gemvn8_##fmt##_avx2(const uint8_t *const *rows, int64_t k, const void *const *x,     \
                                int n_x, float *out, int64_t out_stride, const uint8_t *prefetch, \
                                int64_t ahead);                                                  \
    void sl_gemvn8_##fmt##_avx512(const uint8_t *const *rows, int64_t k, const void *const *x,   \
                                  int n_x, float *out, int64_t out_stride,                       \
                                  const uint8_t *prefetch, int64_t ahead);
SL_DECLARE_KTILES(q4_k)
SL_DECLARE_KTILES(q5_k)
SL_DECLARE_KTILES(q6_k)
int64_t sl_tile8_bytes_q8_k(int64_t k);
/*   sl_gemm16_<fmt>_avx512(tiles, k, x, n_x, out, out_stride): two decoded tiles (16 rows: the
 *       second sl_tile8_bytes_q8_k(k) bytes after the first) against n_x activation rows, 16
 *       outputs each in 512-bit vectors (ggml_quant_ktiles16.h): sl_gemm8's bits for both. */
typedef void (*sl_gemm16_fn)(const void *tiles, int64_t k, const void *const *x, int n_x, float *out,
                             int64_t out_stride);
void sl_gemm16_q4_k_avx512(const void *tiles, int64_t k, const void *const *x, int n_x, float *out,
                           int64_t out_stride);
void sl_gemm16_q5_k_avx512(const void *tiles, int64_t k, const void *const *x, int n_x, float *out,
                           int64_t out_stride);
void sl_gemm16_q6_k_avx512(const void *tiles, int64_t k, const void *const *x, int n_x, float *out,
                           int64_t out_stride);

/* AMX-INT8 products of the 32-weight formats (ggml_quant_amx.c): sixteen weight rows at a time
 * against up to sixteen activation rows per tile instruction, the same outputs bit for bit.
 *   sl_quant_amx_ready(): whether they may run here (CPU, OS permission, SLOTSERVE_GGML_AMX);
 *   sl_amx_decode16_<fmt>(rows, k, tile, prefetch, ahead): 16 weight rows (rows[j]; a short
 *       unit repeats its last row) -> a tile of sl_amx_tile_bytes(k) bytes (ggml_quant_tiles.c);
 *   sl_amx_gemm16(tile, k, x, x_bytes, m, signed_codes, out, decode_next, next, next_tile): m
 *       activation rows (sl_block_q8_1, row stride x_bytes) -> out[i * 16 + n]; with
 *       decode_next, it also decodes the next unit of 16 interleaved rows (next) into
 *       next_tile, a few blocks between its own products, so that the next unit's weights
 *       stream in from memory while this one's products run. */
int sl_quant_isa_supported(int isa);
/* Where the tile kernels prefetch the weight rows they read next (ggml_quant_cpu.c): calls of
 * up to sl_prefetch_l2_rows activation rows into L2, wider ones into L1; sl_prefetch_l2_rows
 * set once at load, before any thread computes, and sl_prefetch_l2_now (1: L2) by each call
 * from it and its row count. sl_quant_cpu_is_intel: the CPU's vendor, which the loader's
 * width decides by. */
extern int64_t sl_prefetch_l2_rows;
extern int sl_prefetch_l2_now;
void sl_quant_set_prefetch_l2_rows(int64_t rows);
/* Tiles a thread took over from another's run since the library loaded (ggml_quant_matmul.c,
 * sl_tile_claim): whether the work stealing ever ran, for the tests. */
int64_t sl_quant_tiles_taken_over(void);
int sl_quant_cpu_is_intel(void);
int sl_quant_amx_ready(void);
int64_t sl_amx_tile_bytes(int64_t k);
typedef void (*sl_amx_decode_fn)(const uint8_t *const *rows, int64_t k, void *tile,
                                 const uint8_t *prefetch, int64_t ahead);
typedef void (*sl_amx_decode_blocks_fn)(const uint8_t *group, int64_t k, void *tile, int64_t b0,
                                        int64_t b1);
void sl_amx_decode16_q4_0(const uint8_t *const *rows, int64_t k, void *tile,
                          const uint8_t *prefetch, int64_t ahead);
void sl_amx_decode16_q4_1(const uint8_t *const *rows, int64_t k, void *tile,
                          const uint8_t *prefetch, int64_t ahead);
void sl_amx_decode16_q5_0(const uint8_t *const *rows, int64_t k, void *tile,
                          const uint8_t *prefetch, int64_t ahead);
void sl_amx_decode16_q5_1(const uint8_t *const *rows, int64_t k, void *tile,
                          const uint8_t *prefetch, int64_t ahead);
void sl_amx_decode16_q8_0(const uint8_t *const *rows, int64_t k, void *tile,
                          const uint8_t *prefetch, int64_t ahead);
void sl_amx_gemm16(const void *tile, int64_t k, const uint8_t *x, int64_t x_bytes, int64_t m,
                   int signed_codes, float *out, sl_amx_decode_blocks_fn decode_next,
                   const uint8_t *next, void *next_tile);
void sl_amx_gemm16_q8_0x(const uint8_t *group, int64_t k, const uint8_t *x, int64_t x_bytes,
                         int64_t m, float *out, const uint8_t *prefetch, int64_t ahead);
void sl_amx_release(void);

/*
 * Rows interleaved eight at a time ("x8"; qtype | SL_X8): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_K
 * blocks repacked once at load (sl_quant_repack8), the same bytes in another order. Rows 8G ..
 * 8G + 7 of a matrix (a full group) keep their byte range, and block b of the group sits at
 * group + b * 8 * block_bytes, holding the eight rows' fields side by side:
 *     d[8] (fp16), then m[8] (fp16: Q4_1 and Q5_1's m, Q4_K's dmin), then the side words in
 *     chunks of 32 bytes (Q5_0, Q5_1: qh, one chunk; Q4_K: its 12 scale bytes, three), then
 *     the codes in chunks of 32 bytes: chunk c holds bytes 4c .. 4c + 3 of each row j's qs at
 *     bytes 4j .. 4j + 3 (4 chunks for the 4- and 5-bit formats, 8 for Q8_0, 32 for Q4_K);
 *     side chunk c holds side word c of each row the same way, except Q5_0 and Q5_1's qh,
 *     whose bits are transposed: byte 4j + t of the chunk holds at bit v the fifth bit of the
 *     code in byte 4j + t of tile group v (groups 0-3 the low nibbles of code chunks 0-3,
 *     groups 4-7 their high nibbles), i.e. bit 4v + t of row j's qh, so that one shift and one
 *     mask give a group's fifth bits (a shuffle, a compare and three masks in the file's order).
 * So one 32-byte load gives eight rows' codes in the tile kernels' lanes (the low nibbles are
 * weights 4c .. 4c + 3, the high ones 16 + 4c ..; Q4_K: of its sub-block pair c / 8), and the
 * scales of eight rows are one load: the one-row gemv needs no horizontal sums and no per-row
 * scale inserts. The rows past the last full group stay in the file's layout at their own
 * offsets. The idea of repacking rows interleaved at load is llama.cpp's
 * (ggml-cpu/repack.cpp, "block_q4_0x8"); this layout and its code are our own.
 */
#define SL_X8 0x100
typedef struct {
    int bytes, weights;           /* bytes and weights of a block (0, 0: no x8 layout) */
    int m_at, side_at, qs_at;     /* a file block's fields (-1: none) */
    int side_words;               /* 4-byte side words per row: qh 1, Q4_K's scales 3 */
    int x8_m_at, x8_side_at, x8_codes; /* offsets in an x8 block of eight rows */
    int chunks;                   /* 4-byte pieces of qs per row */
} sl_x8_fields;

/* The fields of a type with an x8 layout (qtype without SL_X8); bytes 0 for any other. */
static inline sl_x8_fields sl_x8_fields_of(int qtype) {
    switch (qtype) {
    case SL_TYPE_Q4_0: return (sl_x8_fields){18, 32, -1, -1, 2, 0, -1, -1, 16, 4};
    case SL_TYPE_Q4_1: return (sl_x8_fields){20, 32, 2, -1, 4, 0, 16, -1, 32, 4};
    case SL_TYPE_Q5_0: return (sl_x8_fields){22, 32, -1, 2, 6, 1, -1, 16, 48, 4};
    case SL_TYPE_Q5_1: return (sl_x8_fields){24, 32, 2, 4, 8, 1, 16, 32, 64, 4};
    case SL_TYPE_Q8_0: return (sl_x8_fields){34, 32, -1, -1, 2, 0, -1, -1, 16, 8};
    case SL_TYPE_Q4_K: return (sl_x8_fields){144, 256, 2, 4, 16, 3, 16, 32, 128, 32};
    default: return (sl_x8_fields){0, 0, -1, -1, -1, 0, -1, -1, 0, 0};
    }
}

/* x8 kernels (ggml_quant_tiles.c; `group`: the first byte of a full group of eight rows):
 *   sl_gemv8x_<fmt>_<isa>(group, k, x, out, prefetch, ahead): sl_gemv8's outputs, bit for bit;
 *   sl_decode8x_<fmt>(group, k, tile, prefetch, ahead): sl_decode8's tile;
 *   sl_amx_decode16x_<fmt>(group, k, tile, prefetch, ahead): two groups (16 rows from group)
 *       into sl_amx_decode16's tile;
 *   sl_amx_decode16x_blocks_<fmt>(group, k, tile, b0, b1): the same for blocks b0 .. b1 - 1
 *       only (sl_amx_gemm16 decodes the next unit's tile a few blocks at a time).
 * And ggml_quant_rows.c: sl_x8_row_to_file(qtype, group, j, k, out), row j of a group in the
 * file's layout (its blocks at out). */
typedef void (*sl_gemv8x_fn)(const uint8_t *group, int64_t k, const void *x, float *out,
                             const uint8_t *prefetch, int64_t ahead);
typedef void (*sl_decode8x_fn)(const uint8_t *group, int64_t k, void *tile,
                               const uint8_t *prefetch, int64_t ahead);
/*   sl_gemvn8x_<fmt>_<isa>(group, k, x, n_x, out, out_stride, prefetch, ahead): n_x <=
 *       SL_GEMM_ROWS activation rows, each chunk unpacked once for all: the same bits. */
typedef void (*sl_gemvn8x_fn)(const uint8_t *group, int64_t k, const void *const *x, int n_x,
                              float *out, int64_t out_stride, const uint8_t *prefetch,
                              int64_t ahead);
#define SL_DECLARE_X8(fmt)                                                                       \
    void sl_gemvn8x_##fmt##_avx2(const uint8_t *group, int64_t k, const void *const *x, int n_x, \
                                 float *out, int64_t out_stride, const uint8_t *prefetch,        \
                                 int64_t ahead);                                                 \
    void sl_gemvn8x_##fmt##_avx512(const uint8_t *group, int64_t k, const void *const *x,        \
                                   int n_x, float *out, int64_t out_stride,                      \
                                   const uint8_t *prefetch, int64_t ahead);                      \
    void sl_gemv8x_##fmt##_avx2(const uint8_t *group, int64_t k, const void *x, float *out,      \
                                const uint8_t *prefetch, int64_t ahead);                         \
    void sl_gemv8x_##fmt##_avx512(const uint8_t *group, int64_t k, const void *x, float *out,    \
                                  const uint8_t *prefetch, int64_t ahead);                       \
    void sl_decode8x_##fmt(const uint8_t *group, int64_t k, void *tile, const uint8_t *prefetch, \
                           int64_t ahead);                                                       \
    void sl_amx_decode16x_##fmt(const uint8_t *group, int64_t k, void *tile,                     \
                                const uint8_t *prefetch, int64_t ahead);                         \
    void sl_amx_decode16x_blocks_##fmt(const uint8_t *group, int64_t k, void *tile, int64_t b0,  \
                                       int64_t b1);
SL_DECLARE_X8(q4_0)
SL_DECLARE_X8(q4_1)
SL_DECLARE_X8(q5_0)
SL_DECLARE_X8(q5_1)
SL_DECLARE_X8(q8_0)
/*   sl_gemvn16x_<fmt>_avx512(unit, k, x, n_x, out, out_stride, prefetch, ahead): a unit of two
 *       groups (16 rows from unit), n_x <= SL_X16_ROWS activation rows, 16 outputs each in
 *       512-bit vectors (ggml_quant_tiles16.h): sl_gemvn8x's bits for both groups. */
typedef void (*sl_gemvn16x_fn)(const uint8_t *unit, int64_t k, const void *const *x, int n_x,
                               float *out, int64_t out_stride, const uint8_t *prefetch,
                               int64_t ahead);
#define SL_DECLARE_X16(fmt)                                                                      \
    void sl_gemvn16x_##fmt##_avx512(const uint8_t *unit, int64_t k, const void *const *x,        \
                                    int n_x, float *out, int64_t out_stride,                     \
                                    const uint8_t *prefetch, int64_t ahead);
SL_DECLARE_X16(q4_0)
SL_DECLARE_X16(q4_1)
SL_DECLARE_X16(q5_0)
SL_DECLARE_X16(q5_1)
SL_DECLARE_X16(q8_0)
void sl_gemvn8x_q4_k_avx2(const uint8_t *group, int64_t k, const void *const *x, int n_x, float *out,
                          int64_t out_stride, const uint8_t *prefetch, int64_t ahead);
void sl_gemvn8x_q4_k_avx512(const uint8_t *group, int64_t k, const void *const *x, int n_x,
                            float *out, int64_t out_stride, const uint8_t *prefetch, int64_t ahead);
void sl_decode8x_q4_k(const uint8_t *group, int64_t k, void *tile, const uint8_t *prefetch,
                      int64_t ahead);
void sl_x8_row_to_file(int qtype, const uint8_t *group, int j, int64_t k, uint8_t *out);
sl_dequantize_row_fn sl_quant_dequantizer(int qtype);
/* The driver's entry point (ggml_quant_matmul.c), which ggml_quant_sketch.c calls for the
 * rows it computes exactly; ctypes binds the library's exports by name. */
int sl_quant_matmul(int isa, int n_segments, const int32_t *qtypes, const void *const *weights,
                    const int64_t *seg_rows, int64_t k, const void *x, int x_bf16, int64_t m,
                    int64_t ldx, const float *bias, const void *residual, int64_t ldr, void *y,
                    int y_bf16, int64_t ldy, void *scratch, int threads);
int64_t sl_quant_row_bytes(int qtype, int64_t k);

/* Target attributes of the SIMD functions. */
#define SL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SL_TARGET_AVX512                                                                         \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

/* Plain C loops (the row decodes) compiled for AVX-512, AVX2 and the baseline, one picked at
 * load by the CPU (GCC / Clang function multiversioning): the library is built without
 * -march, and the baseline's 4-wide vectors left a row's decode at ~0.6 G weights/s. The
 * same float operations in the same order, so the same values (no contraction under -std=c11). */
#if defined(__has_attribute)
#if __has_attribute(target_clones) && defined(__x86_64__) && defined(__GLIBC__)
#define SL_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef SL_TARGET_CLONES /* (the resolver is an ifunc: glibc only) */
#define SL_TARGET_CLONES
#endif

/* IEEE half -> float, exact, portable (the scale fields of every format). */
static inline float sl_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q4_K / Q5_K: their 12 packed scale bytes to the 6-bit sc[0..7] and m[0..7] (bytes 0-3: sc[0..3]
 * in the low 6 bits, bits 4-5 of sc[4..7] on top; bytes 4-7 the same for m; bytes 8-11 the low
 * 4 bits of sc[4..7] (low nibble) and m[4..7] (high nibble)). */
static inline void sl_kq_scales_mins(const uint8_t *p, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 0x3F;
        m[j] = p[j + 4] & 0x3F;
        sc[j + 4] = (uint8_t)((p[j + 8] & 0x0F) | ((p[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4));
    }
}

static inline float sl_bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> bfloat16, round to nearest even (torch's rounding), NaN kept quiet. */
static inline uint16_t sl_fp32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline uint16_t sl_read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif
