/*
 * Which kernels a call of sl_quant_matmul (ggml_quant_matmul.c) takes, by its activation row
 * count, and the measurements behind each threshold. Every choice gives the same bits (the
 * same integers, the same float sequence per output): these only decide the speed. Included by
 * ggml_quant_matmul.c alone.
 */
#ifndef SL_GGML_QUANT_DISPATCH_H
#define SL_GGML_QUANT_DISPATCH_H

#include <limits.h>

/* Calls of at most this many activation rows take the tile kernels' gemv (no decode pass);
 * more decode each tile once and run them all against it: from two rows the decoded tile is
 * cheaper (AMX Xeon, SmolLM2's Q4_1 projections: AVX2 1.19x at 2 rows, 1.49x at 3 against a
 * limit of 3, VNNI 1.35x, 1.75x; its Q8_0 head 0.97x, 1.11x). The same bits either way. */
#define SL_GEMV_MAX_ROWS 1
/* The K formats' gemv shares each super-block's unpacking between up to SL_ROWS activation
 * rows, and up to 8 rows (two passes) it is cheaper than decoding the tile: a 1B Q4_K layer's
 * projections at 8 rows 4.2 against 4.8 ms with VNNI on the AMX Xeon, at 4 rows 2.3 against
 * 3.2 (docs/MODEL_PERF.md). Either way gives the same bits. */
#define SL_KGEMV_MAX_ROWS 8
/* Calls of at least this many activation rows take the AMX-INT8 tiles where the CPU and OS
 * allow them (sl_quant_amx_ready) and the format has them: the same bits, faster from here
 * (AMX Xeon, time with AMX / without: SmolLM2's Q8_0 head 0.82x at 12 rows, 0.77x at 16,
 * 0.79x at 64; its Q4_1 projections 0.82-1.03x at 12, 0.87x at 64; at 6 rows 1.06-1.19x). */
#define SL_AMX_MIN_ROWS 12
/* On interleaved rows from 16: the x8 gemv below is faster at 12 (SmolLM2's projections 12.7
 * against 13.4-14.1 ms) and as fast at 16. */
#define SL_AMX_MIN_ROWS_X8 16
/* Calls of 2 to this many activation rows on interleaved rows (SL_X8) take the x8 gemv, each
 * chunk unpacked once per 8 activation rows, instead of decoding a tile: the same bits, faster
 * (AMX Xeon, SmolLM2's 121 projections; AVX2: 0.78-0.86x the time at 2-64 rows, equal at 128;
 * VNNI: 0.87-0.93x at 2-12 rows, equal at 16, 1.06-1.10x at 32-64), per instruction set. */
static const int sl_x8_gemv_max_rows[3] = {0, 64, 16};
/* Q4_0 and Q4_1 (4-bit codes: a decoded tile saves them only the nibble split) take the x8
 * gemv at any row count on AVX2 (prefill chunks): on the Zen 4 EPYC running the AVX2 code, 0.82-
 * 0.86x the time of the decoded tile for a 3072 x 576 Q4_1 call at 128-896 rows, 0.85-0.87x for
 * 576 x 1536, 0.79-0.84x for a 2048 x 640 Q4_0 one; Q5_0 was even there (0.94-1.02x) and Q8_0
 * slower (1.01-1.07x), so they keep the table above. With VNNI (the same CPU's AVX-512 code)
 * the x8 gemv is 0.89-0.91x the tile's time at 20 rows, 0.93-0.96x at 32, and the tile faster
 * from 64 (1.02-1.05x at 64-896). (AMX, where the CPU has it, takes these calls from 16 rows
 * before this is asked.) */
static const int sl_x8_nibble_gemv_max_rows[3] = {0, INT_MAX, 32};
/* The same for Q4_K (SL_ROWS rows a pass; more decode the tile from x8 without a transpose):
 * the 1B file's Q4_K projections, x8 against the file's rows (AMX Xeon): AVX2 0.84x at 1 row,
 * 0.80-0.92x at 2-16, VNNI 1.0x at 1-2, 0.87-0.93x at 4-16; decoded, 0.96-0.98x at 32-64. */
/* On the Zen 4 EPYC running the AVX2 code (the AVX2 machine kind's CPU), a 2048 x 2048 Q4_K
 * call's x8 gemv against the tile decoded from x8: 0.93-0.94x the time at 24-64 rows, 0.99x at
 * 128-512, so AVX2 takes the x8 gemv at any row count; VNNI keeps 16. */
static const int sl_kx8_gemv_max_rows[3] = {0, INT_MAX, 16};
/* Calls of at least this many activation rows on full units of 16 interleaved rows take the
 * 512-bit kernels (ggml_quant_tiles16.h) where the instruction set has them (AVX-512), at any
 * row count from there (before the tables above are asked; AMX, where the CPU has it, first).
 * On the 2-core Zen 5 EPYC (full-width 512-bit units), this kernel's time over the 256-bit x8
 * gemv's or decoded tile's, the same bits (runs of 16 activation rows, SL_X16_ROWS): Q5_0
 * 4096 x 640 (Gemma 3's gate and up) 0.91x at 2 rows, 0.59-0.61x at 12-64, 0.67x at 512; Q4_1
 * 3072 x 576 (SmolLM2's gate_up) 0.85-0.96x at 2-3, 0.60-0.64x at 12-64; Q8_0 8192 x 640
 * 0.77-0.94x at 2, 0.52-0.65x at 12-64. A Q8_0 LM head read from memory at 2-3 rows was
 * slower (262,144 x 640: 1.07-1.10x; 49,152 x 576: 1.00-1.08x; both groups' streams at once),
 * at 4 rows 0.95-1.03x, at 12-64 0.58-0.73x: Q8_0 takes it from 4 rows. */
#define SL_X16_MIN_ROWS 2
#define SL_X16_MIN_ROWS_Q8_0 4
/* The K formats' calls past their gemv (SL_KGEMV_MAX_ROWS; Q4_K's x8 gemv too) decode a full
 * unit's two tiles and run the 512-bit gemm on both (ggml_quant_ktiles16.h) where the
 * instruction set has it (AVX-512). On the 2-core Zen 5 EPYC, its time over the 256-bit
 * kernels', the same bits: Q4_K 640 x 1024 (Gemma 3's attn_output) 0.98x at 9 rows, 0.73x at
 * 16, 0.65x at 64, 0.60x at 256; Q6_K 640 x 2048 (its ffn_down) 0.91x, 0.83x, 0.67x, 0.62x;
 * 2048 x 2048 Q4_K 0.89x, 0.76x, 0.67x, 0.64x, Q6_K 0.91x, 0.86x, 0.57x, 0.65x. */

#endif
