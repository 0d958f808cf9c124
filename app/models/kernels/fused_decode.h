/*
 * Fused CPU kernels for the decode steps of a Llama-family model in bfloat16: the per-layer glue
 * between the projections, one call where eager torch runs 5-10 small ops. Built into one
 * library and loaded by app/models/kernels/fused_decode.py (cc -O3 -march=native, -fopenmp when torch's
 * libgomp is in the process). They work on plain row-major arrays; only the attention uses
 * threads.
 *
 *   fused_decode.h            this header: the bfloat16 type and arithmetic the kernels share,
 *                             and the functions the library exports (called via ctypes)
 *   fused_decode_norms.c      sl_rms_norm, sl_silu_mul, sl_gelu_tanh_mul: row-wise kernels;
 *                             sl_argmax_rows: the greedy sampler's argmax
 *   fused_decode_sampling.c   sl_sample_rows: the sampler's draws (temperature, top-k, top-p,
 *                             min-p)
 *   fused_decode_attention.c  sl_decode_attention: rope, K/V cache write, paged attention
 *   fused_decode_layers.c     sl_decode_layers: every layer of a step in one call, for models
 *                             whose projections compute on GGUF blocks; sl_rms_norm_rows and
 *                             sl_activate_rows: the row-wise kernels over threads
 *
 * bfloat16 values are uint16_t bit patterns. Arithmetic is float32; results are rounded to
 * bfloat16 (round to nearest even) at the same points where the eager torch path rounds, so
 * the two paths agree to within a bfloat16 ulp or so per op (reductions are summed in a
 * different order).
 */
#ifndef SLOTSERVE_FUSED_DECODE_H
#define SLOTSERVE_FUSED_DECODE_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline bf16 float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    /* Round to nearest, ties to even; a NaN stays a (quiet) NaN. Branch-free, so loops
     * around it vectorise. */
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (bits >> 16) | 0x0040u;
    return (bf16)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* Lanes of the partial sums below: 16 float32 = one AVX-512 register, two AVX2 ones. */
#define LANES 16

/* Sum of LANES partial sums as a tree (vectorisable; a left-to-right sum is a chain of 16
 * dependent adds, which dominated the attention's dot products). */
static inline float sum_lanes(float partial[LANES]) {
    for (int width = LANES / 2; width > 0; width /= 2) {
        for (int lane = 0; lane < width; ++lane) {
            partial[lane] += partial[lane + width];
        }
    }
    return partial[0];
}

/*
 * exp(x) in float32 without libm, so that loops over it vectorise (glibc's vector expf is
 * only declared under -ffast-math). Range reduction x = n ln2 + r, |r| <= ln2 / 2, then the
 * degree-6 Taylor polynomial of exp(r) (error below 2e-7 relative, under a float32 ulp
 * after rounding, far under the bfloat16 rounding that follows), times 2^n built in the
 * exponent bits. Inputs are clamped to [-87, 88] (results 1.6e-38 .. 1.7e38).
 */
static inline float exp_approx(float x) {
    const float log2e = 1.44269504f;
    const float ln2_hi = 0.693359375f; /* ln 2 split in two, so n * ln2_hi is exact */
    const float ln2_lo = -2.12194440e-4f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to an integer (no floorf,
     * which blocks vectorisation without -fno-trapping-math). */
    float n = (x * log2e + 12582912.0f) - 12582912.0f;
    float r = x - n * ln2_hi - n * ln2_lo;
    float poly = 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return poly * scale;
}

/* s[0 .. length) replaced by its softmax, in float32. The max and the sum go through LANES
 * partial results, so the loops vectorise. */
static inline void softmax_in_place(float *s, int64_t length) {
    float best_lanes[LANES];
    for (int lane = 0; lane < LANES; ++lane) {
        best_lanes[lane] = s[0];
    }
    int64_t t = 0;
    for (; t + LANES <= length; t += LANES) {
        for (int lane = 0; lane < LANES; ++lane) {
            float v = s[t + lane];
            best_lanes[lane] = v > best_lanes[lane] ? v : best_lanes[lane];
        }
    }
    float best = best_lanes[0];
    for (int lane = 1; lane < LANES; ++lane) {
        best = best_lanes[lane] > best ? best_lanes[lane] : best;
    }
    for (; t < length; ++t) {
        best = s[t] > best ? s[t] : best;
    }
    for (t = 0; t < length; ++t) {
        s[t] = exp_approx(s[t] - best);
    }
    float partial[LANES] = {0};
    for (t = 0; t + LANES <= length; t += LANES) {
        for (int lane = 0; lane < LANES; ++lane) {
            partial[lane] += s[t + lane];
        }
    }
    float total = sum_lanes(partial);
    for (; t < length; ++t) {
        total += s[t];
    }
    const float inv_total = 1.0f / total;
    for (t = 0; t < length; ++t) {
        s[t] *= inv_total;
    }
}

/* Which file holds the tiled inner loops of the attention (sl_tile_scores, sl_tile_values):
 * fused_attention_tiles.c with AVX-512 BF16, fused_attention_tiles_avx2.c with AVX2 and FMA;
 * 0: neither, and fused_decode_attention.c keeps its portable loops. */
#define SL_TILES_AVX512BF16 1
#define SL_TILES_AVX2 2
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SL_TILED_ATTENTION SL_TILES_AVX512BF16
#elif defined(__AVX2__) && defined(__FMA__)
#define SL_TILED_ATTENTION SL_TILES_AVX2
#else
#define SL_TILED_ATTENTION 0
#endif

/* Block size the tiled loops assume (KV_BLOCK_SIZE in app/models/forward/kv_cache.py). */
#define SL_TILE_POSITIONS 16

/* The library's exported functions; each is documented where it is defined. */
void sl_rms_norm(bf16 *x, int64_t x_stride, const bf16 *residual, const bf16 *weight,
                 bf16 *out, int64_t rows, int64_t dim, float eps);
void sl_silu_mul(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t ffn);
void sl_gelu_tanh_mul(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t ffn);
void sl_argmax_rows(const void *logits, int is_bf16, int64_t rows, int64_t n, int64_t stride,
                    int64_t *out, int64_t threads);
int sl_sample_rows(const void *logits, int is_bf16, int64_t rows, int64_t n, int64_t stride,
                   const float *temperature, const int64_t *top_k, const float *top_p,
                   const float *min_p, const float *uniform, int64_t *out, int64_t threads);
void sl_rms_norm_rows(bf16 *x, int64_t x_stride, const bf16 *residual, const bf16 *weight,
                      bf16 *out, int64_t rows, int64_t dim, float eps, int64_t threads);
void sl_activate_rows(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t ffn, int gelu_tanh,
                      int64_t threads);
void sl_decode_attention(const bf16 *qkv, int64_t qkv_stride, const bf16 *rope_cos,
                         const bf16 *rope_sin, const int64_t *positions,
                         const int64_t *block_tables, int64_t table_stride, bf16 *keys,
                         bf16 *values, int64_t pool_len, int64_t block_size, float *scores,
                         int64_t scores_per_thread, bf16 *out, int64_t rows, int64_t n_heads,
                         int64_t n_kv_heads, int64_t head_dim, int64_t threads,
                         const bf16 *q_norm, const bf16 *k_norm, float eps, int64_t window,
                         float scale);

/* The GGUF-block library's sl_quant_matmul (app/models/kernels/ggml_quant_matmul.c). */
typedef int (*sl_matmul_fn)(int isa, int n_segments, const int32_t *qtypes,
                            const void *const *weights, const int64_t *seg_rows, int64_t k,
                            const void *x, int x_bf16, int64_t m, int64_t ldx, const float *bias,
                            const void *residual, int64_t ldr, void *y, int y_bf16, int64_t ldy,
                            void *scratch, int threads);

/* One projection's sl_quant_matmul arguments (ctypes mirror: fused_decode.py's
 * _BlockProjection). */
typedef struct {
    int64_t n_segments;
    const int32_t *qtypes;
    const void *const *weights;
    const int64_t *seg_rows;
    int64_t out_features;
    const float *bias; /* [out_features] or NULL */
} sl_block_projection;

/* One decoder layer (ctypes mirror: _DecoderLayer). */
typedef struct {
    sl_block_projection qkv, output, gate_up, down;
    const bf16 *attn_norm, *ffn_norm;           /* [hidden] each (NULL: folded) */
    const bf16 *attn_post_norm, *ffn_post_norm; /* [hidden] each, or NULL (Gemma 3's) */
    const bf16 *q_norm, *k_norm;                /* [head_dim] each, or NULL */
    bf16 *keys, *values;               /* [n_kv_heads, pool_len, head_dim] each */
    const bf16 *rope_cos, *rope_sin;   /* [max_positions, head_dim] each: this layer's rope */
    int64_t window;                    /* 0, or the layer's sliding window */
} sl_decoder_layer;

/* The model (ctypes mirror: _Decoder). */
typedef struct {
    sl_matmul_fn matmul;
    int64_t isa, threads; /* sl_quant_matmul's instruction set and OpenMP team */
    int64_t n_layers;
    const sl_decoder_layer *layers;
    int64_t hidden, ffn, n_heads, n_kv_heads, head_dim;
    int64_t pool_len, block_size;
    int64_t gelu_tanh; /* the gated MLP's activation: 0 silu, 1 GELU (tanh approximation) */
    float eps;
    float attention_scale; /* 0: 1 / sqrt(head_dim) */
} sl_decoder;

int sl_decode_layers(const sl_decoder *model, bf16 *hidden, int64_t rows,
                     const int64_t *positions, const int64_t *block_tables, int64_t table_stride,
                     float *scores, int64_t scores_per_thread, int64_t attention_threads,
                     bf16 *workspace);
int64_t sl_decode_layers_workspace(const sl_decoder *model, int64_t rows);

#if SL_TILED_ATTENTION
void sl_tile_scores(const float *query, int64_t query_stride, int64_t group, const bf16 *pool,
                    const int64_t *table, int64_t head_base, int64_t head_dim, int64_t skip,
                    int64_t length, float scale, float *scores);
void sl_tile_values(const float *probs, int64_t group, const bf16 *pool, const int64_t *table,
                    int64_t head_base, int64_t head_dim, int64_t skip, int64_t length,
                    float *out, int64_t out_stride);

/* sl_tile_values's definition for a tile file: its query heads VALUE_GROUP at a time and its
 * dimensions `dims` (VALUE_CHUNK vectors) at a time, each run by the file's value_chunk with the
 * group's head count as a constant (its accumulators then stay in registers). */
#define SL_DEFINE_TILE_VALUES(dims)                                                                 \
    void sl_tile_values(const float *probs, int64_t group, const bf16 *pool, const int64_t *table, \
                        int64_t head_base, int64_t head_dim, int64_t skip, int64_t length,         \
                        float *out, int64_t out_stride) {                                          \
        for (int64_t g0 = 0; g0 < group; g0 += VALUE_GROUP) {                                      \
            const float *p = probs + g0 * length;                                                  \
            float *o = out + g0 * out_stride;                                                      \
            for (int64_t d0 = 0; d0 < head_dim; d0 += (dims)) {                                    \
                switch (group - g0 < VALUE_GROUP ? group - g0 : VALUE_GROUP) {                     \
                case 1: value_chunk(p, pool, table, head_base, head_dim, skip, length, d0, o, out_stride, 1); break; \
                case 2: value_chunk(p, pool, table, head_base, head_dim, skip, length, d0, o, out_stride, 2); break; \
                case 3: value_chunk(p, pool, table, head_base, head_dim, skip, length, d0, o, out_stride, 3); break; \
                default: value_chunk(p, pool, table, head_base, head_dim, skip, length, d0, o, out_stride, 4); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
#endif

#endif /* SLOTSERVE_FUSED_DECODE_H */
