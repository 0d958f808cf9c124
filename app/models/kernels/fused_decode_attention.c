/*
 * Decode attention of single-token rows over the paged KV cache, with the rotary embedding,
 * the optional per-head q/k RMSNorm (Qwen3) and the K/V cache write; its (row, KV head) pairs
 * shared among OpenMP threads. Part of the fused decode library (fused_decode.h says which file holds what).
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fused_decode.h"

/* Dot product of float32 q [n] with bfloat16 k [n], n a multiple of LANES. With AVX-512 or
 * AVX2 (and FMA) in registers, ending in one horizontal sum; otherwise portable C. */
static inline float dot_bf16(const float *q, const bf16 *k, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + d)));
        __m512 kf = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), kf, acc);
    }
    return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(k + d)));
        __m256 kf = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kf, acc);
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
#else
    float partial[LANES] = {0};
    for (int64_t d = 0; d < n; d += LANES) {
        for (int lane = 0; lane < LANES; ++lane) {
            partial[lane] += q[d + lane] * bf16_to_float(k[d + lane]);
        }
    }
    return sum_lanes(partial);
#endif
}

/* Hugging Face's rotary embedding of one head, rounded as decoder.apply_rope: with
 * cos = (c, c) and sin = (-s, s) per position, out = bf16(bf16(x * cos) + swap(x) * sin). */
static void rope_head(const bf16 *x, const bf16 *cos, const bf16 *sin, float *out,
                      int64_t head_dim) {
    int64_t half = head_dim / 2;
    for (int64_t i = 0; i < head_dim; ++i) {
        float swapped = bf16_to_float(i < half ? x[i + half] : x[i - half]);
        float scaled = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * bf16_to_float(cos[i])));
        out[i] = bf16_to_float(float_to_bf16(scaled + swapped * bf16_to_float(sin[i])));
    }
}

/* What sl_decode_attention was given, shared by the threads that split its rows. */
struct attention_args {
    const bf16 *qkv;
    int64_t qkv_stride;
    const bf16 *rope_cos;
    const bf16 *rope_sin;
    const int64_t *positions;
    const int64_t *block_tables;
    int64_t table_stride;
    bf16 *keys;
    bf16 *values;
    int64_t pool_len;
    int64_t block_size;
    bf16 *out;
    int64_t n_heads;
    int64_t n_kv_heads;
    int64_t head_dim;
    const bf16 *q_norm;
    const bf16 *k_norm;
    float eps;
    int64_t window; /* > 0: a key is visible while position - key < window */
    float scale;    /* the scores' factor */
};

/* One head of the QKV row, RMS-normalised into scratch when the model norms its heads
 * (Qwen3); the head itself otherwise. sl_rms_norm leaves x alone without a residual. */
static const bf16 *normed_head(const bf16 *head, const bf16 *weight, float eps, bf16 *scratch,
                               int64_t head_dim) {
    if (weight == NULL) {
        return head;
    }
    sl_rms_norm((bf16 *)head, head_dim, NULL, weight, scratch, 1, head_dim, eps);
    return scratch;
}

/* Offset (in elements) of position t of KV head kv, for a row whose block table is `table`. */
static inline int64_t pool_offset(const struct attention_args *a, const int64_t *table,
                                  int64_t kv, int64_t t) {
    const int64_t block = table[t / a->block_size];
    return (kv * a->pool_len + block * a->block_size + t % a->block_size) * a->head_dim;
}

/* Walks positions 0, 1, ... of one KV head of one row through its block table without a
 * division per position (a 64-bit division costs more than the dot product it would address). */
struct block_walk {
    const bf16 *pool;     /* keys or values of the layer */
    const int64_t *table; /* the row's block table */
    int64_t head_base;    /* kv * pool_len, in positions */
    int64_t block_size, head_dim, next_block, offset;
    const bf16 *block;
};

static inline struct block_walk walk_start(const struct attention_args *a, const bf16 *pool,
                                           const int64_t *table, int64_t kv) {
    const struct block_walk walk = {pool, table, kv * a->pool_len, a->block_size, a->head_dim,
                                    0,    a->block_size, NULL};
    return walk;
}

/* The next position's head_dim elements. Entering a block, the next block of the table is
 * prefetched: blocks lie anywhere in the pool, where the hardware prefetcher cannot guess them
 * (the caller never walks past the row's length, so table[next_block] is read only while the
 * walk is inside the table; the last block's successor is not prefetched). */
static inline const bf16 *walk_next(struct block_walk *w, int64_t blocks) {
    if (w->offset == w->block_size) {
        const int64_t first = w->head_base + w->table[w->next_block++] * w->block_size;
        w->block = w->pool + first * w->head_dim;
        w->offset = 0;
        if (w->next_block < blocks) {
            const int64_t next = w->head_base + w->table[w->next_block] * w->block_size;
            const char *lines = (const char *)(w->pool + next * w->head_dim);
            const int64_t bytes = w->block_size * w->head_dim * (int64_t)sizeof(bf16);
            for (int64_t line = 0; line < bytes; line += 64) {
                __builtin_prefetch(lines + line, 0, 1);
            }
        }
    }
    return w->block + w->offset++ * w->head_dim;
}

/* A walk of positions first, first + 1, ... (a windowed layer's keys): the block holding
 * `first` entered, its earlier positions skipped. */
static inline struct block_walk walk_from(const struct attention_args *a, const bf16 *pool,
                                          const int64_t *table, int64_t kv, int64_t first,
                                          int64_t blocks) {
    struct block_walk walk = walk_start(a, pool, table, kv);
    if (first > 0) {
        walk.next_block = first / a->block_size;
        walk_next(&walk, blocks);
        walk.offset = first % a->block_size;
    }
    return walk;
}

enum { MAX_HEAD_DIM = 256, MAX_GROUP = 16 };

/* The new key (normed when the model norms its heads, rotated) and value of rows [begin, end)
 * go into the cache. Every row of a call is written before any row attends: rows of one
 * sequence (a short prompt chunk, one row per token) read each other's keys. */
static void write_rows(const struct attention_args *a, int64_t begin, int64_t end) {
    const int64_t head_dim = a->head_dim, n_heads = a->n_heads, n_kv_heads = a->n_kv_heads;
    float key[MAX_HEAD_DIM];
    bf16 normed[MAX_HEAD_DIM];
    if (head_dim > MAX_HEAD_DIM) {
        return; /* the Python side checks the shapes before calling */
    }
    for (int64_t r = begin; r < end; ++r) {
        const int64_t position = a->positions[r];
        const bf16 *row = a->qkv + r * a->qkv_stride;
        const bf16 *cos = a->rope_cos + position * head_dim;
        const bf16 *sin = a->rope_sin + position * head_dim;
        const int64_t *table = a->block_tables + r * a->table_stride;
        for (int64_t kv = 0; kv < n_kv_heads; ++kv) {
            const int64_t written = pool_offset(a, table, kv, position);
            const bf16 *new_key = normed_head(row + (n_heads + kv) * head_dim, a->k_norm, a->eps,
                                              normed, head_dim);
            rope_head(new_key, cos, sin, key, head_dim);
            for (int64_t d = 0; d < head_dim; ++d) {
                a->keys[written + d] = float_to_bf16(key[d]);
            }
            memcpy(a->values + written, row + (n_heads + n_kv_heads + kv) * head_dim,
                   (size_t)head_dim * sizeof(bf16));
        }
    }
}

/* Calls with less work than this run on one thread: below it a parallel region's fork and
 * join cost more than the split saves. The work is the positions attended (all rows and KV
 * heads together) times the query heads of a KV head times head_dim, the multiply-adds of a
 * position's scores (its weighted values as many again). Measured as 512 positions of
 * SmolLM2's units (3 query heads of 64 dimensions); a position of Gemma 3 270M's (4 heads of
 * 256) is 5.3 times that work, and its 16-row decode steps of short sequences ran on one
 * thread under a limit counted in positions. */
#define SPLIT_MIN_WORK (512 * 3 * 64)

/* How many positions row r attends: all up to its own, or its window's. */
static inline int64_t attended_length(const struct attention_args *a, int64_t r) {
    const int64_t position = a->positions[r];
    return a->window > 0 && position + 1 > a->window ? a->window : position + 1;
}

/* Attention of units [begin, end), unit u being KV head u % n_kv_heads (its query group) of row
 * u / n_kv_heads; the rows' keys and values are in the cache. A unit is computed the same way
 * whichever thread takes it, so the split among threads changes no value. */
static void attend_units(const struct attention_args *a, int64_t begin, int64_t end,
                         float *scores) {
    const int64_t head_dim = a->head_dim, n_heads = a->n_heads, n_kv_heads = a->n_kv_heads;
    const int64_t group = n_heads / n_kv_heads;
    const float scale = a->scale;
    float query[MAX_GROUP][MAX_HEAD_DIM];
    float key[MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    bf16 normed[MAX_HEAD_DIM];
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || head_dim % LANES != 0) {
        return; /* the Python side checks the shapes before calling */
    }
    const int tiled =
        SL_TILED_ATTENTION && a->block_size == SL_TILE_POSITIONS && head_dim % 64 == 0;
    for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t r = unit / n_kv_heads, kv = unit % n_kv_heads;
        const int64_t position = a->positions[r];
        /* positions first .. position are attended: all of them, or the window's */
        const int64_t length = attended_length(a, r), first = position + 1 - length;
        const bf16 *row = a->qkv + r * a->qkv_stride;
        const bf16 *cos = a->rope_cos + position * head_dim;
        const bf16 *sin = a->rope_sin + position * head_dim;
        const int64_t *table = a->block_tables + r * a->table_stride;
#if SL_TILED_ATTENTION
        /* the tiles start at the block holding `first`, skip positions into it */
        const int64_t *tile_table = table + first / a->block_size, skip = first % a->block_size;
#endif
        for (int64_t g = 0; g < group; ++g) {
            const bf16 *head = normed_head(row + (kv * group + g) * head_dim, a->q_norm,
                                           a->eps, normed, head_dim);
            rope_head(head, cos, sin, query[g], head_dim);
        }
        const int64_t blocks = (position + a->block_size) / a->block_size;
#if SL_TILED_ATTENTION
        if (tiled) {
            sl_tile_scores(query[0], MAX_HEAD_DIM, group, a->keys, tile_table, kv * a->pool_len,
                           head_dim, skip, length, scale, scores);
        }
#endif
        if (!tiled) {
            /* Scores: each cached key is read once for the whole query group. */
            struct block_walk keys_walk = walk_from(a, a->keys, table, kv, first, blocks);
            for (int64_t t = 0; t < length; ++t) {
                const bf16 *k = walk_next(&keys_walk, blocks);
                for (int64_t g = 0; g < group; ++g) {
                    scores[g * length + t] = dot_bf16(query[g], k, head_dim) * scale;
                }
            }
        }
        /* Softmax per query head. */
        for (int64_t g = 0; g < group; ++g) {
            softmax_in_place(scores + g * length, length);
            memset(acc[g], 0, (size_t)head_dim * sizeof(float));
        }
#if SL_TILED_ATTENTION
        if (tiled) {
            sl_tile_values(scores, group, a->values, tile_table, kv * a->pool_len, head_dim,
                           skip, length, acc[0], MAX_HEAD_DIM);
        }
#endif
        if (!tiled) {
            /* Weighted sum of the values: each cached value is read once for the group. */
            struct block_walk values_walk = walk_from(a, a->values, table, kv, first, blocks);
            for (int64_t t = 0; t < length; ++t) {
                const bf16 *v = walk_next(&values_walk, blocks);
                for (int64_t d = 0; d < head_dim; ++d) {
                    key[d] = bf16_to_float(v[d]);
                }
                for (int64_t g = 0; g < group; ++g) {
                    const float p = scores[g * length + t];
                    for (int64_t d = 0; d < head_dim; ++d) {
                        acc[g][d] += p * key[d];
                    }
                }
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            bf16 *dst = a->out + r * n_heads * head_dim + (kv * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) {
                dst[d] = float_to_bf16(acc[g][d]);
            }
        }
    }
}

/*
 * Attention for single-token rows (decode rows, or the tokens of short prompt chunks), with
 * the rotary embedding and the K/V cache write.
 *
 * qkv:       [rows, (n_heads + 2 * n_kv_heads) * head_dim] bfloat16, row stride qkv_stride:
 *            the fused QKV projection's output (queries, keys, values; heads in order).
 * rope_cos, rope_sin: [max_positions, head_dim] bfloat16 tables (see rope_head).
 * positions: [rows] int64, the position of each row's token (its K/V go there).
 * block_tables: [rows, table_stride] int64, each row's KV blocks (its block table): position t
 *            of row r lives in block block_tables[r * table_stride + t / block_size] at offset
 *            t % block_size. Rows write distinct positions; rows of one sequence (a short
 *            prompt chunk given one row per token) share a table and read each other's keys:
 *            every row's key and value are written before any row attends.
 * keys, values: one layer of the paged cache, [n_kv_heads, pool_len, head_dim] bfloat16, with
 *            pool_len = num_blocks * block_size.
 * scores:    float32 workspace, threads * scores_per_thread elements; scores_per_thread at
 *            least group_size * (max position + 1).
 * out:       [rows, n_heads * head_dim] bfloat16, contiguous.
 * threads:   how many OpenMP threads share the work: the rows' K/V writes, then the
 *            attention of each (row, KV head) pair, split by the positions they attend.
 *
 * q_norm, k_norm: NULL, or [head_dim] bfloat16 RMSNorm weights applied to every query head and
 *            every key head before the rotary embedding (Qwen3's per-head q/k norm), rounded as
 *            sl_rms_norm rounds; eps is their epsilon.
 *
 * window:    0, or a sliding window (Gemma 3's local layers): then row r attends to positions
 *            max(0, positions[r] - window + 1)..positions[r] only.
 * scale:     the scores' factor; 0: 1 / sqrt(head_dim).
 *
 * Query head h reads KV head h / (n_heads / n_kv_heads) (grouped-query attention). Row r
 * attends to positions 0..positions[r] of its blocks (its own new key included), with scores
 * times `scale` and a float32 softmax; the output is rounded once.
 */
void sl_decode_attention(const bf16 *qkv, int64_t qkv_stride, const bf16 *rope_cos,
                         const bf16 *rope_sin, const int64_t *positions,
                         const int64_t *block_tables, int64_t table_stride, bf16 *keys,
                         bf16 *values, int64_t pool_len, int64_t block_size, float *scores,
                         int64_t scores_per_thread, bf16 *out, int64_t rows, int64_t n_heads,
                         int64_t n_kv_heads, int64_t head_dim, int64_t threads,
                         const bf16 *q_norm, const bf16 *k_norm, float eps, int64_t window,
                         float scale) {
    const struct attention_args args = {
        qkv,      qkv_stride, rope_cos,   rope_sin, positions, block_tables,
        table_stride, keys,   values,     pool_len, block_size, out,
        n_heads,  n_kv_heads, head_dim,   q_norm,   k_norm,    eps,
        window,   scale > 0.0f ? scale : 1.0f / sqrtf((float)head_dim)};
    const int64_t units = rows * n_kv_heads;
    int64_t total = 0; /* positions to attend, over every unit */
    for (int64_t r = 0; r < rows; ++r) {
        total += attended_length(&args, r) * n_kv_heads;
    }
#ifndef _OPENMP
    threads = 1; /* built without OpenMP (app/models/kernels/fused_decode.py says when) */
    (void)scores_per_thread;
#endif
    if (threads > units) {
        threads = units;
    }
    if (threads < 2 || total * (n_heads / n_kv_heads) * head_dim < SPLIT_MIN_WORK) {
        write_rows(&args, 0, rows);
        attend_units(&args, 0, units, scores);
        return;
    }
#ifdef _OPENMP
    /* OpenMP from the process's runtime: torch's libgomp.so.1, already loaded, so these are
     * torch's own worker threads, not a second team competing with them for the cores. */
#pragma omp parallel num_threads((int)threads)
    {
        const int64_t share = omp_get_thread_num(), count = omp_get_num_threads();
        write_rows(&args, share * rows / count, (share + 1) * rows / count);
        /* Thread i takes the units whose middle lies in its 1/count of all the positions to
         * attend (one row's KV heads can go to different threads: a single long row is
         * shared too). */
        int64_t begin = units, end = units, seen = 0;
        for (int64_t unit = 0; unit < units; ++unit) {
            const int64_t length = attended_length(&args, unit / n_kv_heads);
            const int64_t owner = (2 * seen + length) * count / (2 * total);
            if (owner == share && begin == units) {
                begin = unit;
            }
            if (owner > share) {
                end = unit;
                break;
            }
            seen += length;
        }
#pragma omp barrier
        if (begin < end) {
            attend_units(&args, begin, end, scores + share * scores_per_thread);
        }
    }
#endif
}
