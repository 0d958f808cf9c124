/*
 * Every decoder layer of a single-token-rows step in one call, for models whose projections
 * compute on GGUF blocks (Llama-style blocks, and Gemma 3's: norms after attention and MLP,
 * GELU, sliding-window layers with their own rope, its attention scale): the loop of DecoderModel._forward_fused_decode moved into C, so a
 * step costs the kernels' time and not ~7 ctypes calls, tensor allocations and Python
 * statements per layer (on SmolLM2, 30 layers, one row: ~3 ms of a ~12 ms step went between
 * the kernels; docs/MODEL_PERF.md).
 *
 * The same kernels run in the same order with the same arguments as the Python loop, so the
 * hidden states are bit for bit what that loop computes (tests/models/test_fused_decode_layers.py).
 * The projections are the GGUF-block library's sl_quant_matmul, reached through a function
 * pointer (the two libraries are built apart: that one chooses its instruction set at run
 * time, this one is built for the machine). Part of the fused decode library (fused_decode.h
 * says which file holds what).
 */
#include "fused_decode.h"

/* Steps of at least this many rows share the row-wise kernels (norms, the MLP's activation)
 * among the projections' threads; fewer rows are not worth a parallel region's ~2-5 us. */
#define SL_PARALLEL_ROWS 4

/* sl_rms_norm over rows (x's row stride x_stride), split among `threads`: each row is computed
 * alone, so the values are sl_rms_norm's whatever the split. Also the Python layer loop's
 * norm (DecoderModel._forward_fused_decode beside dense projections). */
void sl_rms_norm_rows(bf16 *x, int64_t x_stride, const bf16 *residual, const bf16 *weight,
                      bf16 *out, int64_t rows, int64_t dim, float eps, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(static) if (rows >= SL_PARALLEL_ROWS && threads > 1)
#endif
    for (int64_t r = 0; r < rows; ++r)
        sl_rms_norm(x + r * x_stride, x_stride, residual == NULL ? NULL : residual + r * dim,
                    weight, out + r * dim, 1, dim, eps);
    (void)threads;
}

/* The gated MLP's activation (gelu_tanh: sl_gelu_tanh_mul, else sl_silu_mul) over rows, split
 * among `threads` (each row alone: the same values). */
void sl_activate_rows(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t ffn, int gelu_tanh,
                      int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(static) if (rows >= SL_PARALLEL_ROWS && threads > 1)
#endif
    for (int64_t r = 0; r < rows; ++r) {
        if (gelu_tanh)
            sl_gelu_tanh_mul(gate_up + r * 2 * ffn, out + r * ffn, 1, ffn);
        else
            sl_silu_mul(gate_up + r * 2 * ffn, out + r * ffn, 1, ffn);
    }
    (void)threads;
}

/*
 * Run layers [0, n_layers) over `rows` single-token rows.
 *
 * hidden:     [rows, hidden] bfloat16, contiguous: the embedded tokens in, the last layer's
 *             residual sum out (before the output norm).
 * positions, block_tables, table_stride, scores, scores_per_thread, attention_threads: as
 *             sl_decode_attention takes them (the same for every layer).
 * workspace:  sl_decode_layers_workspace(model, rows) bfloat16 values.
 * Returns 0, or the first non-zero status of a projection (then hidden is undefined).
 */
int sl_decode_layers(const sl_decoder *model, bf16 *hidden, int64_t rows,
                     const int64_t *positions, const int64_t *block_tables, int64_t table_stride,
                     float *scores, int64_t scores_per_thread, int64_t attention_threads,
                     bf16 *workspace) {
    const int64_t dim = model->hidden, ffn = model->ffn;
    const int64_t q_width = model->n_heads * model->head_dim;
    const int64_t qkv_width = q_width + 2 * model->n_kv_heads * model->head_dim;
    bf16 *normed = workspace;                   /* [rows, dim] */
    bf16 *qkv = normed + rows * dim;            /* [rows, qkv_width] */
    bf16 *attended = qkv + rows * qkv_width;    /* [rows, q_width] */
    bf16 *gate_up = attended + rows * q_width;  /* [rows, 2 * ffn] */
    bf16 *activated = gate_up + rows * 2 * ffn; /* [rows, ffn] */
    /* Three [rows, dim] buffers take turns: the residual stream, a block's output, and its
     * post norm (Gemma 3); the stream starts in `hidden` and is copied back at the end. */
    bf16 *buffers[3] = {hidden, activated + rows * ffn, activated + rows * ffn + rows * dim};
    int stream = 0;
    const sl_matmul_fn matmul = model->matmul;
    const float eps = model->eps;

    sl_rms_norm_rows(hidden, dim, NULL, model->layers[0].attn_norm, normed, rows, dim, eps,
                     model->threads);
    for (int64_t index = 0; index < model->n_layers; ++index) {
        const sl_decoder_layer *layer = &model->layers[index];
        /* The next layer's attention norm (after the last layer the norm is the output
         * norm, torch's: only the residual add is wanted here). */
        const bf16 *following = index + 1 < model->n_layers ? model->layers[index + 1].attn_norm
                                                             : NULL;
        int status;
#define SL_PROJECT(p, x, width, y)                                                             \
    matmul((int)model->isa, (int)(p)->n_segments, (p)->qtypes, (p)->weights, (p)->seg_rows,    \
           width, x, 1, rows, width, (p)->bias, NULL, 0, y, 1, (p)->out_features, NULL,         \
           (int)model->threads)
/* stream += post_norm(out) (or out without a post norm); normed = norm(stream) with
 * `weight`. The sum is rounded, then normalised: DecoderModel's order. */
#define SL_RESIDUAL(out_index, post_norm, weight)                                               \
    do {                                                                                        \
        int sum_index = out_index;                                                              \
        if ((post_norm) != NULL) {                                                              \
            sum_index = 3 - stream - (out_index);                                               \
            sl_rms_norm_rows(buffers[out_index], dim, NULL, post_norm, buffers[sum_index], rows, \
                             dim, eps, model->threads);                                         \
        }                                                                                       \
        sl_rms_norm_rows(buffers[sum_index], dim, buffers[stream], weight, normed, rows, dim,    \
                         eps, model->threads);                                                  \
        stream = sum_index;                                                                     \
    } while (0)
        if ((status = SL_PROJECT(&layer->qkv, normed, dim, qkv)) != 0) return status;
        sl_decode_attention(qkv, qkv_width, layer->rope_cos, layer->rope_sin, positions,
                            block_tables, table_stride, layer->keys, layer->values,
                            model->pool_len, model->block_size, scores, scores_per_thread,
                            attended, rows, model->n_heads, model->n_kv_heads, model->head_dim,
                            attention_threads, layer->q_norm, layer->k_norm, eps, layer->window,
                            model->attention_scale);
        const int attention_out = (stream + 1) % 3;
        if ((status = SL_PROJECT(&layer->output, attended, q_width, buffers[attention_out])) != 0)
            return status;
        SL_RESIDUAL(attention_out, layer->attn_post_norm, layer->ffn_norm);
        if ((status = SL_PROJECT(&layer->gate_up, normed, dim, gate_up)) != 0) return status;
        sl_activate_rows(gate_up, activated, rows, ffn, (int)model->gelu_tanh, model->threads);
        const int mlp_out = (stream + 1) % 3;
        if ((status = SL_PROJECT(&layer->down, activated, ffn, buffers[mlp_out])) != 0)
            return status;
        SL_RESIDUAL(mlp_out, layer->ffn_post_norm, following);
#undef SL_RESIDUAL
#undef SL_PROJECT
    }
    if (stream != 0) memcpy(hidden, buffers[stream], (size_t)(rows * dim) * sizeof(bf16));
    return 0;
}

/* bfloat16 values of sl_decode_layers' workspace for `rows` rows. */
int64_t sl_decode_layers_workspace(const sl_decoder *model, int64_t rows) {
    const int64_t q_width = model->n_heads * model->head_dim;
    const int64_t qkv_width = q_width + 2 * model->n_kv_heads * model->head_dim;
    return rows * (model->hidden + qkv_width + q_width + 3 * model->ffn + 2 * model->hidden);
}
