/*
 * Row access to the GGUF-block matrices (see ggml_quant.h): the repack of Q4_0-Q8_0 and Q4_K
 * into rows interleaved eight at a time ("x8", done once at load), a row of an x8
 * group back in the file's layout, and rows decoded to float32 or bfloat16 (token lookups,
 * and whole matrices decoded for a wide call), in either layout.
 */
#include <stdlib.h>

#include "ggml_quant.h"

/* `call(type)` for the type with an x8 layout that qtype is (nothing for any other, which the
 * callers refuse first): a copy of the call per type, its sl_x8_fields constants once inlined. */
#define SL_X8_EACH_TYPE(qtype, call)                                                               \
    switch (qtype) {                                                                               \
    case SL_TYPE_Q4_0: call(SL_TYPE_Q4_0); break;                                                  \
    case SL_TYPE_Q4_1: call(SL_TYPE_Q4_1); break;                                                  \
    case SL_TYPE_Q5_0: call(SL_TYPE_Q5_0); break;                                                  \
    case SL_TYPE_Q5_1: call(SL_TYPE_Q5_1); break;                                                  \
    case SL_TYPE_Q8_0: call(SL_TYPE_Q8_0); break;                                                  \
    case SL_TYPE_Q4_K: call(SL_TYPE_Q4_K); break;                                                  \
    default: break;                                                                                \
    }

/* A Q5 block's qh word (bit i: the fifth bit of weight i, little-endian) in its x8 form
 * (ggml_quant.h): bit 4v + t of the file's word is bit 8t + v of the x8 word (an 8 x 4 bit
 * matrix transposed); to_x8 0 maps back. */
static inline uint32_t sl_x8_qh_transpose(uint32_t qh, int to_x8) {
    uint32_t out = 0;
    for (int v = 0; v < 8; v++)
        for (int t = 0; t < 4; t++) {
            const int file_bit = 4 * v + t, x8_bit = 8 * t + v;
            out |= ((qh >> (to_x8 ? file_bit : x8_bit)) & 1u) << (to_x8 ? x8_bit : file_bit);
        }
    return out;
}

/* Moves one row's block between the file's layout (`file`) and an x8 block of eight rows
 * (`x8`, row j of it): to_x8 1 writes the x8 block's fields, 0 the file block. Inlined where
 * the fields are constants, so each move is one load and one store. */
static inline __attribute__((always_inline)) void sl_x8_move_block(const sl_x8_fields *f, uint8_t *file,
                                                                   uint8_t *x8, int j, int to_x8) {
#define SL_MOVE(file_at, x8_at, n)                                                                 \
    (to_x8 ? memcpy(x8 + (x8_at), file + (file_at), n) : memcpy(file + (file_at), x8 + (x8_at), n))
    SL_MOVE(0, 2 * j, 2); /* d */
    if (f->m_at >= 0) SL_MOVE(f->m_at, f->x8_m_at + 2 * j, 2);
    if (f->side_words == 1) { /* Q5_0, Q5_1: qh bit-transposed (ggml_quant.h) */
        uint32_t qh;
        if (to_x8) {
            memcpy(&qh, file + f->side_at, 4);
            qh = sl_x8_qh_transpose(qh, 1);
            memcpy(x8 + f->x8_side_at + 4 * j, &qh, 4);
        } else {
            memcpy(&qh, x8 + f->x8_side_at + 4 * j, 4);
            qh = sl_x8_qh_transpose(qh, 0);
            memcpy(file + f->side_at, &qh, 4);
        }
    } else {
        for (int c = 0; c < f->side_words; c++) SL_MOVE(f->side_at + 4 * c, f->x8_side_at + 32 * c + 4 * j, 4);
    }
    for (int c = 0; c < f->chunks; c++) SL_MOVE(f->qs_at + 4 * c, f->x8_codes + 32 * c + 4 * j, 4);
#undef SL_MOVE
}

/* `rows` rows of k weights in `qtype` (the file's layout, at src) repacked into dst (the same
 * number of bytes, not overlapping src): each full group of eight rows in the x8 layout, the
 * rows after the last full group copied as they are. A matrix repacked in parts is the same
 * when every part but the last is whole groups. Returns 0, or -1 for a type without an x8
 * layout or k not whole blocks. */
static inline __attribute__((always_inline)) void sl_repack8_of(int qtype, const uint8_t *in, uint8_t *out,
                                                                int64_t full, int64_t nb) {
    const sl_x8_fields f = sl_x8_fields_of(qtype);
    const int64_t row_bytes = nb * f.bytes;
    for (int64_t g = 0; g < full; g += 8) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *x8 = out + g * row_bytes + b * 8 * f.bytes;
            for (int j = 0; j < 8; j++)
                sl_x8_move_block(&f, (uint8_t *)(in + (g + j) * row_bytes + b * f.bytes), x8, j, 1);
        }
    }
}
int sl_quant_repack8(int qtype, const void *src, void *dst, int64_t rows, int64_t k) {
    const sl_x8_fields f = sl_x8_fields_of(qtype);
    if (f.bytes == 0 || k <= 0 || k % f.weights != 0 || rows < 0) return -1;
    const int64_t nb = k / f.weights, row_bytes = nb * f.bytes, full = rows / 8 * 8;
    const uint8_t *in = (const uint8_t *)src;
    uint8_t *out = (uint8_t *)dst;
#define SL_REPACK8_OF(type) sl_repack8_of(type, in, out, full, nb)
    SL_X8_EACH_TYPE(qtype, SL_REPACK8_OF)
#undef SL_REPACK8_OF
    memcpy(out + full * row_bytes, in + full * row_bytes, (size_t)((rows - full) * row_bytes));
    return 0;
}

/* Row j (< 8) of the x8 group at `group` (rows of k weights in `qtype`, without SL_X8) written
 * in the file's layout at out (its blocks). */
static inline __attribute__((always_inline)) void sl_x8_row_of(int qtype, const uint8_t *group, int j,
                                                               int64_t k, uint8_t *out) {
    const sl_x8_fields f = sl_x8_fields_of(qtype);
    for (int64_t b = 0; b < k / f.weights; b++)
        sl_x8_move_block(&f, out + b * f.bytes, (uint8_t *)(group + b * 8 * f.bytes), j, 0);
}
void sl_x8_row_to_file(int qtype, const uint8_t *group, int j, int64_t k, uint8_t *out) {
#define SL_X8_ROW_OF(type) sl_x8_row_of(type, group, j, k, out)
    SL_X8_EACH_TYPE(qtype, SL_X8_ROW_OF)
#undef SL_X8_ROW_OF
}

/* k float32 values rounded to bfloat16 (vectorised where the CPU allows: SL_TARGET_CLONES). */
SL_TARGET_CLONES static void sl_row_to_bf16(const float *row, uint16_t *out, int64_t k) {
    for (int64_t j = 0; j < k; j++) out[j] = sl_fp32_to_bf16(row[j]);
}

/* Rows ids[0..n_ids) of a matrix of n_rows rows of k columns in `qtype` (with SL_X8: its full
 * groups interleaved) decoded into out (n_ids rows of k float32 or bfloat16 values): token
 * lookups (a few rows), and a whole matrix decoded for one wide call (thousands, split over
 * `threads` of the OpenMP team). Returns 0, or -1 for a format not here, an id out of range
 * or no memory. */
int sl_quant_dequantize_rows(int qtype, const void *w, int64_t n_rows, int64_t k,
                             const int64_t *ids, int64_t n_ids, void *out, int out_bf16,
                             int threads) {
    const int x8 = (qtype & SL_X8) != 0;
    qtype &= ~SL_X8;
    const sl_dequantize_row_fn dequantize = sl_quant_dequantizer(qtype);
    const int64_t row_bytes = sl_quant_row_bytes(qtype, k);
    if (dequantize == NULL || row_bytes < 0 || (x8 && sl_x8_fields_of(qtype).bytes == 0)) return -1;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return -1;
    if (threads < 1 || n_ids < 64) threads = 1;
    const int64_t full = x8 ? n_rows / 8 * 8 : 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *row = out_bf16 ? (float *)malloc((size_t)k * sizeof(float)) : NULL;
        uint8_t *file_row = x8 ? (uint8_t *)malloc((size_t)row_bytes) : NULL;
        failed = (out_bf16 && row == NULL) || (x8 && file_row == NULL);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_ids; i++) {
            if (failed) continue;
            const uint8_t *source = (const uint8_t *)w + ids[i] * row_bytes;
            if (ids[i] < full) { /* an interleaved row: its blocks gathered first */
                sl_x8_row_to_file(qtype, (const uint8_t *)w + ids[i] / 8 * 8 * row_bytes,
                                  (int)(ids[i] % 8), k, file_row);
                source = file_row;
            }
            float *decoded = out_bf16 ? row : (float *)out + i * k;
            dequantize(k, source, decoded);
            if (out_bf16) sl_row_to_bf16(row, (uint16_t *)out + i * k, k);
        }
        free(row);
        free(file_row);
    }
    return failed ? -1 : 0;
}
