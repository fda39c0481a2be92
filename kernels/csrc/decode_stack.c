/* A decode step's whole decoder stack in one call: every layer of a Llama-family model for a
 * batch of single-token rows, float32 activations and KV cache (kernels/cpu_stack.py binds it,
 * model/native_stack.py builds its layer table).
 *
 * The Python path makes ~14 calls per layer (norms, linears, rope, KV write, attention, the
 * activation), each a few microseconds of dispatch on top of the work: at one token per step
 * that overhead is a third of the step on SmolLM2 (30 layers). This file calls the same
 * kernels in the same order from C:
 *
 *     h, r   = rms_norm(x + r)                  (r = x at the first layer)
 *     qkv    = h @ [Wq; Wk; Wv].T (+ b)          one to three linears, side by side per row
 *     q, k   = rope(q), rope(k)                 x * cos + rotate_half(x) * sin, as torch
 *     cache  <- k, v at each row's slot
 *     a      = paged_decode(q, cache)
 *     h, r   = rms_norm(a @ Wo.T + r)
 *     g | u  = h @ [Wg; Wu].T
 *     x      = (silu(g) * u) @ Wd.T             and the next layer adds r
 *
 * so its outputs are the Python path's: rope and the activation are layer_ops.c's in both (with
 * the native kernels off, torch's silu there differs from libmvec's expf here by a few ulp).
 * Its attention has no soft cap: model/native_stack.py declines a layer with one (Gemma 2's).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

void linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int threads);
int gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
             int64_t m_rows, int64_t n_rows, int64_t k, int threads);
int linear_packed_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                      float *y, int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k);
void linear_i8g_f32(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y,
                    int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int64_t group,
                    int threads);
int linear_i8g_parts_f32(const float *x, int64_t ldx, int count, const int8_t *const *qs,
                         const float *const *ss, const int64_t *ns, float *y, int64_t ldy,
                         int64_t m_rows, int64_t k, int64_t group, int threads);
int linear_i4g_f32(const float *x, int64_t ldx, const uint8_t *q, const uint16_t *pairs, float *y,
                   int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int64_t group,
                   int threads);
int linear_i4g_parts_f32(const float *x, int64_t ldx, int count, const uint8_t *const *qs,
                         const uint16_t *const *pairs, const int64_t *ns, float *y,
                         int64_t ldy, int64_t m_rows, int64_t k, int64_t group, int threads);
void rms_norm_f32(const float *x, int64_t ldx, const float *residual, int64_t ldr,
                  float *sum_out, const float *weight, float *out, int64_t rows, int64_t n,
                  float eps, int threads);
void rope_f32(float *x, int64_t ldx, int64_t heads, int64_t d, const float *cos, const float *sin,
              int64_t rows, int threads);
void silu_mul_f32(const float *g, int64_t ldg, const float *u, int64_t ldu, float *out,
                  int64_t rows, int64_t inter, int threads);
int paged_decode_f32(const float *q, int64_t q_tok, const float *k, const float *v, int64_t blk,
                     int64_t pos, const int64_t *tables, int64_t tstride, const int64_t *qrow,
                     const int64_t *trow, const int64_t *first, const int64_t *end, float *out,
                     int64_t o_tok, int n, int hq, int hkv, int d, int bs, float scale,
                     float softcap, int threads);

int linear_w8a8_f32(const float *x, int64_t ldx, const int8_t *w, const float *scales,
                    const int32_t *wsum, const float *bias, float *y, int64_t ldy,
                    int64_t m_rows, int64_t n_rows, int64_t k, int threads);

enum { LIN_F32 = 0, LIN_I8G = 1, LIN_I4G = 2, LIN_W8A8 = 3 };

/* One linear layer's weights, as kernels/cpu_stack.py's `Linear` structure lays them out. */
typedef struct {
    int64_t kind;          /* LIN_F32: w float [n, k]; LIN_I8G: int8 codes [n, k] and scales
                              [n, k / group]; LIN_I4G: cpu_native.pack_int4 codes [n, k / 2]
                              and, in `scales`, pack_int4_scales' float16 pairs; LIN_W8A8:
                              int8 codes [n, k], scales [n] and, in `zeros`, the codes' int32
                              row sums */
    const void *w;
    const float *scales, *zeros, *bias; /* bias [n] or NULL (added after, as torch does) */
    int64_t n, k, group;
    const float *packed; /* LIN_F32: w packed for MKL (kernels/mkl_packed.py), or NULL */
} ps_linear;

enum { MAX_PARTS = 3 };

/* One decoder layer: its norms, linears (q/k/v and gate/up as one to three parts whose outputs
 * lie side by side) and its K/V views [blocks, block_size, kv_heads, head_dim]. */
typedef struct {
    const float *input_norm, *post_norm;
    ps_linear qkv[MAX_PARTS], o, gate_up[MAX_PARTS], down;
    int64_t qkv_parts, gate_up_parts;
    float *k_cache, *v_cache;
    int64_t windowed; /* 1: attend from `firsts_window` (a sliding-window layer) */
} ps_layer;

/* The step's shapes and shared inputs. */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter;
    int64_t block_size, blk_stride, pos_stride; /* the K/V views' block and position strides */
    const float *cos, *sin;                     /* [rows, head_dim], each row's position */
    const int64_t *slots;                       /* [rows] where each row's K/V goes */
    const int64_t *tables;                      /* [rows, table_stride] block ids */
    int64_t table_stride;
    const int64_t *row_ids;                     /* 0 .. rows - 1 */
    const int64_t *firsts, *firsts_window, *ends;
    float eps, scale;
    int threads;
} ps_step;

static void add_bias(const ps_linear *l, float *y, int64_t ldy, int64_t rows) {
    if (l->bias)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t j = 0; j < l->n; j++) y[m * ldy + j] += l->bias[j];
}

/* Returns 0, or 1 when a w8a8 or int4 linear could not allocate its scratch (y is then
 * undefined). */
static int linear(const ps_linear *l, const float *x, int64_t ldx, float *y, int64_t ldy,
                  int64_t rows, int threads) {
    if (l->kind == LIN_F32) { /* as kernels/cpu_linear.py chooses: MKL or the GEMM above 16 */
        if (rows > 16 && l->packed &&
            linear_packed_f32(x, ldx, l->packed, l->bias, y, ldy, rows, l->n, l->k))
            return 0;
        if (rows <= 16 ||
            !gemm_f32(x, ldx, (const float *)l->w, l->bias, y, ldy, rows, l->n, l->k, threads))
            linear_f32(x, ldx, (const float *)l->w, l->bias, y, ldy, rows, l->n, l->k, threads);
        return 0;
    }
    if (l->kind == LIN_W8A8) /* its bias is added in its epilogue */
        return !linear_w8a8_f32(x, ldx, (const int8_t *)l->w, l->scales,
                                (const int32_t *)l->zeros, l->bias, y, ldy, rows, l->n, l->k,
                                threads);
    if (l->kind == LIN_I8G)
        linear_i8g_f32(x, ldx, (const int8_t *)l->w, l->scales, y, ldy, rows, l->n, l->k,
                       l->group, threads);
    else if (linear_i4g_f32(x, ldx, (const uint8_t *)l->w, (const uint16_t *)(const void *)l->scales,
                            y, ldy, rows, l->n, l->k, l->group, threads))
        return 1;
    add_bias(l, y, ldy, rows);
    return 0;
}

/* int8 or int4 parts of one kind, k and group (q / k / v, gate / up) in one call of their
 * kernel: one parallel region for all of them. Returns 1 when they are not such parts, or
 * the kernel failed (y is then untouched). */
static int quantized_parts(const ps_linear *parts, int64_t count, const float *x, int64_t ldx,
                           float *y, int64_t width, int64_t rows, int threads) {
    const int64_t kind = parts[0].kind, k = parts[0].k, group = parts[0].group;
    const int8_t *q8[MAX_PARTS];
    const uint8_t *q4[MAX_PARTS];
    const float *scales[MAX_PARTS];
    const uint16_t *pairs[MAX_PARTS];
    int64_t ns[MAX_PARTS];
    if (kind != LIN_I4G && kind != LIN_I8G) return 1;
    for (int64_t i = 0; i < count; i++) {
        if (parts[i].kind != kind || parts[i].k != k || parts[i].group != group) return 1;
        q8[i] = (const int8_t *)parts[i].w, q4[i] = (const uint8_t *)parts[i].w;
        scales[i] = parts[i].scales, pairs[i] = (const uint16_t *)(const void *)parts[i].scales;
        ns[i] = parts[i].n;
    }
    const int n = (int)count;
    if (kind == LIN_I8G
            ? linear_i8g_parts_f32(x, ldx, n, q8, scales, ns, y, width, rows, k, group, threads)
            : linear_i4g_parts_f32(x, ldx, n, q4, pairs, ns, y, width, rows, k, group, threads))
        return 1;
    for (int64_t i = 0, col = 0; i < count; col += parts[i].n, i++)
        add_bias(&parts[i], y + col, width, rows);
    return 0;
}

/* parts side by side: part i's outputs at columns [sum of earlier n, + n) of each row of y.
 * Returns the total width, or -1 when a part failed (see `linear`). */
static int64_t linear_parts(const ps_linear *parts, int64_t count, const float *x, int64_t ldx,
                            float *y, int64_t rows, int threads) {
    int64_t width = 0;
    for (int64_t i = 0; i < count; i++) width += parts[i].n;
    if (count > 1 && !quantized_parts(parts, count, x, ldx, y, width, rows, threads)) return width;
    for (int64_t i = 0, col = 0; i < count; col += parts[i].n, i++)
        if (linear(&parts[i], x, ldx, y + col, width, rows, threads)) return -1;
    return width;
}

static void write_kv(const ps_layer *l, const float *qkv, int64_t width, const ps_step *s) {
    const int64_t kv = s->kv_heads * s->head_dim, q = s->heads * s->head_dim;
    for (int64_t m = 0; m < s->rows; m++) {
        const int64_t slot = s->slots[m];
        const int64_t at = (slot / s->block_size) * s->blk_stride + (slot % s->block_size) * s->pos_stride;
        memcpy(l->k_cache + at, qkv + m * width + q, sizeof(float) * kv);
        memcpy(l->v_cache + at, qkv + m * width + q + kv, sizeof(float) * kv);
    }
}

/* Scratch (floats) the caller provides for `rows` rows. */
int64_t decode_stack_scratch(int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, int64_t inter) {
    return rows * (3 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 3 * inter);
}

/* x [rows, hidden]: the embeddings in, the final norm's output (`final_norm`) out. Returns 0,
 * or 1 when attention or a w8a8 linear could not allocate its scratch (x is then undefined). */
int decode_stack_f32(const ps_layer *layers, int64_t num_layers, const ps_step *s,
                     const float *final_norm, float *x, float *scratch) {
    const int64_t rows = s->rows, hidden = s->hidden, d = s->head_dim;
    float *residual = scratch, *h = residual + rows * hidden, *mlp = h + rows * hidden;
    float *qkv = mlp + rows * hidden;
    float *attn = qkv + rows * (s->heads + 2 * s->kv_heads) * d;
    float *gu = attn + rows * s->heads * d, *act = gu + rows * 2 * s->inter;
    memcpy(residual, x, sizeof(float) * rows * hidden);
    for (int64_t i = 0; i < num_layers; i++) {
        const ps_layer *l = &layers[i];
        if (i == 0)
            rms_norm_f32(residual, hidden, NULL, 0, NULL, l->input_norm, h, rows, hidden, s->eps,
                         s->threads);
        else
            rms_norm_f32(mlp, hidden, residual, hidden, residual, l->input_norm, h, rows, hidden,
                         s->eps, s->threads);
        const int64_t width = linear_parts(l->qkv, l->qkv_parts, h, hidden, qkv, rows, s->threads);
        if (width < 0) return 1;
        rope_f32(qkv, width, s->heads + s->kv_heads, d, s->cos, s->sin, rows, s->threads);
        write_kv(l, qkv, width, s);
        if (paged_decode_f32(qkv, width, l->k_cache, l->v_cache, s->blk_stride, s->pos_stride,
                             s->tables, s->table_stride, s->row_ids, s->row_ids,
                             l->windowed ? s->firsts_window : s->firsts, s->ends, attn,
                             s->heads * d, (int)rows, (int)s->heads, (int)s->kv_heads, (int)d,
                             (int)s->block_size, s->scale, 0.0f /* no soft cap */,
                             s->threads))
            return 1;
        if (linear(&l->o, attn, s->heads * d, mlp, hidden, rows, s->threads)) return 1;
        rms_norm_f32(mlp, hidden, residual, hidden, residual, l->post_norm, h, rows, hidden, s->eps,
                     s->threads);
        if (linear_parts(l->gate_up, l->gate_up_parts, h, hidden, gu, rows, s->threads) < 0)
            return 1;
        silu_mul_f32(gu, 2 * s->inter, gu + s->inter, 2 * s->inter, act, rows, s->inter,
                     s->threads);
        if (linear(&l->down, act, s->inter, mlp, hidden, rows, s->threads)) return 1;
    }
    rms_norm_f32(mlp, hidden, residual, hidden, residual, final_norm, x, rows, hidden, s->eps, s->threads);
    return 0;
}
