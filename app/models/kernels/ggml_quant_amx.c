/*
 * AMX-INT8 tile products for the 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): sixteen
 * weight rows against up to sixteen activation rows per block in one tile instruction, where
 * the VNNI gemm of ggml_quant_tiles_body.h takes 8 x 8 vpdpbusd per 8 x 8 outputs.
 *
 * Layout: a unit of 16 weight rows is decoded (sl_amx_decode16_<fmt>, ggml_quant_tiles.c)
 * into tile B's VNNI layout per block: 8 rows of 64 bytes, row g holding codes
 * 4g .. 4g + 3 of weight row n at bytes 4n .. 4n + 3, with the 16 scales d and offsets mo of
 * the block as float32. Tile A is the activations' 32 int8 codes of the block, one tile row per
 * activation row (their sl_block_q8_1 rows, read in place with their stride). One TDPBSUD
 * (signed activations, unsigned codes) or TDPBSSD (Q8_0's signed codes) gives the exact int32
 * sums of the 16 x 16 outputs; then, per lane, the float sequence every other path runs:
 *
 *     acc  = fma((float)isum, d * d_x, acc),   macc = fma(mo, s_x, macc),   out = acc + macc
 *
 * so the outputs are bit for bit those of the AVX2 and VNNI tiles (tested).
 *
 * Reading the weights is as slow as the products (a 262,144 x 640 Q8_0 head at 16 rows on the
 * 2-core AMX Xeon: 6.6 ms decoding alone, 5.9 ms of products alone, 14-15 ms both), and a
 * decode's stores, waiting on memory, hold up the tile loads behind them. So rows interleaved
 * eight at a time (x8) skip the decode where they can: Q8_0's x8 codes are tile B's layout
 * already, read in place as two 8-column tiles per block (sl_amx_gemm16_q8_0x: 10.7 ms); the
 * other formats decode the next unit between this unit's products (sl_amx_gemm16's
 * decode_next), which took a SmolLM2 step of 24-32 rows 5-8% faster.
 *
 * The OS must let the process use the tile registers (Linux: arch_prctl ARCH_REQ_XCOMP_PERM,
 * which torch's oneDNN also asks for); sl_quant_amx_ready says whether it did. Each thread
 * loads its tile configuration before a product and releases the tiles after it.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "ggml_quant.h"

#include <stddef.h>

#if defined(__x86_64__) && defined(__linux__) &&                                                \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <cpuid.h>
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SL_TARGET_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

static int sl_amx_state = -1; /* -1: not asked yet, 0: no, 1: yes */

/* Whether AMX-INT8 tiles may be used: the CPU has AMX-TILE and AMX-INT8 (cpuid leaf 7), the
 * kernel granted the tile state, and SLOTSERVE_GGML_AMX is not 0. Called once at load, before
 * any thread computes (it asks the kernel the first time). */
int sl_quant_amx_ready(void) {
    if (sl_amx_state < 0) {
        unsigned a, b, c, d;
        const char *setting = getenv("SLOTSERVE_GGML_AMX");
        int ok = !(setting != NULL && strcmp(setting, "0") == 0) &&
                 __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
                 sl_quant_isa_supported(SL_ISA_AVX512);
        if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        sl_amx_state = ok;
    }
    return sl_amx_state;
}

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) sl_tile_config;

/* The rows of the configuration this thread's tiles have (0: none). */
static _Thread_local int sl_amx_rows = 0;

/* Tiles: 0 the int32 sums [m][16], 1 the activations [m][32 bytes], 2 the codes [8][64 bytes]
 * of an even block, 3-5 the same of an odd one; loaded only when this thread's tiles are
 * configured otherwise. */
SL_TARGET_AMX static void sl_amx_configure(int m) {
    if (sl_amx_rows == m) return;
    sl_amx_rows = m;
    sl_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; t += 3) { /* two blocks in flight: tiles 0-2 and 3-5 */
        config.rows[t] = (uint8_t)m, config.colsb[t] = 64;
        config.rows[t + 1] = (uint8_t)m, config.colsb[t + 1] = SL_QK;
        config.rows[t + 2] = SL_QK / 4, config.colsb[t + 2] = 64;
    }
    _tile_loadconfig(&config);
}

/*
 * out[i * 16 + n] for i < m, n < 16: activation row i (x + i * x_bytes, sl_block_q8_1 blocks)
 * against the 16 weight rows of `tile` (sl_amx_tile_bytes(k) bytes, sl_amx_decode16's layout).
 * signed_codes: Q8_0 (TDPBSSD), the one format without an offset or minimum (macc); the others'
 * codes are unsigned (TDPBSUD).
 */
SL_TARGET_AMX void sl_amx_gemm16(const void *tile, int64_t k, const uint8_t *x, int64_t x_bytes,
                                 int64_t m, int signed_codes, float *out,
                                 sl_amx_decode_blocks_fn decode_next, const uint8_t *next,
                                 void *next_tile) {
    const int64_t nb = k / SL_QK;
    const uint8_t *codes = (const uint8_t *)tile;
    const float *d = (const float *)(codes + nb * 512);
    const float *mo = d + nb * 16;
    for (int64_t i0 = 0; i0 < m; i0 += 16) {
        const int rows = m - i0 < 16 ? (int)(m - i0) : 16;
        sl_amx_configure(rows);
        __m512 acc[16], macc[16];
        for (int r = 0; r < rows; r++) acc[r] = macc[r] = _mm512_setzero_ps();
        int32_t sums[2][16][16];
        const uint8_t *xi = x + i0 * x_bytes + offsetof(sl_block_q8_1, qs);
        const int64_t xb = (int64_t)sizeof(sl_block_q8_1);
        for (int64_t b0 = 0; b0 < nb; b0 += 2) {
            /* the next unit's blocks b0, b0 + 1: their loads overlap this unit's products */
            if (decode_next != NULL && i0 == 0)
                decode_next(next, k, next_tile, b0, b0 + 2 < nb ? b0 + 2 : nb);
            /* two blocks' products in flight (tiles 0-2 and 3-5), then their float work */
            _tile_loadd(1, xi + b0 * xb, x_bytes);
            _tile_loadd(2, codes + b0 * 512, 64);
            _tile_zero(0);
            if (b0 + 1 < nb) {
                _tile_loadd(4, xi + (b0 + 1) * xb, x_bytes);
                _tile_loadd(5, codes + (b0 + 1) * 512, 64);
                _tile_zero(3);
            }
            if (signed_codes)
                _tile_dpbssd(0, 1, 2);
            else
                _tile_dpbsud(0, 1, 2);
            if (b0 + 1 < nb) {
                if (signed_codes)
                    _tile_dpbssd(3, 4, 5);
                else
                    _tile_dpbsud(3, 4, 5);
            }
            _tile_stored(0, sums[0], 64);
            if (b0 + 1 < nb) _tile_stored(3, sums[1], 64);
            for (int64_t b = b0; b < b0 + 2 && b < nb; b++) {
                const __m512 vd = _mm512_loadu_ps(d + b * 16), vmo = _mm512_loadu_ps(mo + b * 16);
                for (int r = 0; r < rows; r++) {
                    const sl_block_q8_1 *block =
                        (const sl_block_q8_1 *)(x + (i0 + r) * x_bytes) + b;
                    const __m512 scale = _mm512_mul_ps(vd, _mm512_set1_ps(block->d));
                    const __m512 isum = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums[b - b0][r]));
                    acc[r] = _mm512_fmadd_ps(isum, scale, acc[r]);
                    if (!signed_codes) macc[r] = _mm512_fmadd_ps(vmo, _mm512_set1_ps(block->s), macc[r]);
                }
            }
        }
        for (int r = 0; r < rows; r++)
            _mm512_storeu_ps(out + (i0 + r) * 16, _mm512_add_ps(acc[r], macc[r]));
    }
}

/* Tiles of sl_amx_gemm16_q8_0x: 0 the activations [m][32 bytes], 1 and 2 the codes of a
 * block's two groups of eight rows [8][32 bytes], 3 and 4 their int32 sums [m][8]. */
SL_TARGET_AMX static void sl_amx_configure_x8(int m) {
    if (sl_amx_rows == 100 + m) return;
    sl_amx_rows = 100 + m;
    sl_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = (uint8_t)m, config.colsb[0] = SL_QK;
    for (int t = 1; t < 3; t++) config.rows[t] = SL_QK / 4, config.colsb[t] = 32;
    for (int t = 3; t < 5; t++) config.rows[t] = (uint8_t)m, config.colsb[t] = 32;
    _tile_loadconfig(&config);
}

/*
 * sl_amx_gemm16's outputs, bit for bit, for 16 rows of Q8_0 interleaved eight at a time (two
 * full groups from `group`, ggml_quant.h's x8 layout) read in place: an x8 block's codes are
 * already tile B's VNNI layout for its eight rows (chunk c: bytes 4c .. 4c + 3 of each row), so
 * each group is one 8-column tile and no decode pass (no stores) comes between the weights and
 * the products. `prefetch`, `ahead`: the bytes to fetch into L2 meanwhile (the next unit).
 */
SL_TARGET_AMX void sl_amx_gemm16_q8_0x(const uint8_t *group, int64_t k, const uint8_t *x,
                                       int64_t x_bytes, int64_t m, float *out,
                                       const uint8_t *prefetch, int64_t ahead) {
    const int64_t nb = k / SL_QK, gbs = 8 * 34; /* an x8 block: d[8] fp16, then 8 x 32 codes */
    const int64_t lines = (ahead + 63) / 64, per_block = (lines + nb - 1) / nb;
    const int64_t xb = (int64_t)sizeof(sl_block_q8_1);
    for (int64_t i0 = 0; i0 < m; i0 += 16) {
        const int rows = m - i0 < 16 ? (int)(m - i0) : 16;
        sl_amx_configure_x8(rows);
        __m512 acc[16];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        int32_t sums[16][16] __attribute__((aligned(64)));
        const uint8_t *xi = x + i0 * x_bytes + offsetof(sl_block_q8_1, qs);
        for (int64_t b = 0; b < nb; b++) {
            if (i0 == 0)
                for (int64_t l = b * per_block; l < (b + 1) * per_block && l < lines; l++)
                    _mm_prefetch((const char *)prefetch + 64 * l, _MM_HINT_T1);
            const uint8_t *g0 = group + b * gbs, *g1 = group + nb * gbs + b * gbs;
            _tile_loadd(0, xi + b * xb, x_bytes);
            _tile_loadd(1, g0 + 16, 32);
            _tile_loadd(2, g1 + 16, 32);
            _tile_zero(3);
            _tile_zero(4);
            _tile_dpbssd(3, 0, 1);
            _tile_dpbssd(4, 0, 2);
            _tile_stored(3, sums[0], 64);
            _tile_stored(4, sums[0] + 8, 64);
            const __m512 vd = _mm512_cvtph_ps(_mm256_set_m128i(
                _mm_loadu_si128((const __m128i *)g1), _mm_loadu_si128((const __m128i *)g0)));
            for (int r = 0; r < rows; r++) {
                const sl_block_q8_1 *block = (const sl_block_q8_1 *)(x + (i0 + r) * x_bytes) + b;
                const __m512 scale = _mm512_mul_ps(vd, _mm512_set1_ps(block->d));
                const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]));
                acc[r] = _mm512_fmadd_ps(isum, scale, acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) /* + 0: the other paths' acc + macc, a -0 made +0 */
            _mm512_storeu_ps(out + (i0 + r) * 16, _mm512_add_ps(acc[r], _mm512_setzero_ps()));
    }
}

/* Gives the calling thread's tiles back (after its share of a product: the OS then saves no
 * tile state for it). */
SL_TARGET_AMX void sl_amx_release(void) {
    if (sl_amx_rows != 0) {
        _tile_release();
        sl_amx_rows = 0;
    }
}

#else
int sl_quant_amx_ready(void) { return 0; }
void sl_amx_gemm16(const void *tile, int64_t k, const uint8_t *x, int64_t x_bytes, int64_t m,
                   int signed_codes, float *out, sl_amx_decode_blocks_fn decode_next,
                   const uint8_t *next, void *next_tile) {
    (void)tile, (void)k, (void)x, (void)x_bytes, (void)m, (void)signed_codes, (void)out;
    (void)decode_next, (void)next, (void)next_tile;
}
void sl_amx_gemm16_q8_0x(const uint8_t *group, int64_t k, const uint8_t *x, int64_t x_bytes,
                         int64_t m, float *out, const uint8_t *prefetch, int64_t ahead) {
    (void)group, (void)k, (void)x, (void)x_bytes, (void)m, (void)out, (void)prefetch, (void)ahead;
}
void sl_amx_release(void) {}
#endif

/* Bytes of a 16-row AMX tile of rows of k weights. */
int64_t sl_amx_tile_bytes(int64_t k) { return k / SL_QK * (512 + 2 * 16 * (int64_t)sizeof(float)); }
