/* y = x @ W.T (+ bias) for float32 weights in nn.Linear's own layout (W [N, K], rows
 * contiguous), for decode-sized batches, on x86-64 CPUs with AVX-512 or AVX2 + FMA (simd.h;
 * kernels/cpu_native.py builds and loads it, kernels/cpu_linear.py calls it).
 *
 *     y[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n])       x, W, y float32
 *
 * At one token per step the cost is reading W once: each thread streams whole rows of its own
 * slice of W (one OpenMP task per tile of rows, torch's libgomp) while x stays in L1. With more
 * rows of x each weight vector is loaded once for a tile of them (TILE_M).
 *
 * Every output is the same sum in the same order whatever the tiling: one vector accumulator
 * over k in steps of PS_VEC, reduced by vf_sum, then the k % PS_VEC tail in scalar, then the
 * bias. So a sequence's outputs do not depend on how many others share its step (batch
 * invariance), and the M = 1 and M > 1 paths agree bit for bit.
 */
#include <stdint.h>

#include "simd.h"

#define ROWS_ONE 8                      /* rows of W per tile when x has one row ... */
#define TOGETHER 1                      /* ... read side by side */
#define ROWS_MANY (PS_VEC == 16 ? 8 : 4) /* ... when it has more (AVX2 has 16 registers) */
#define TILE_M 2                        /* rows of x per tile */

static inline float finish(vf acc, const float *x, const float *w, int64_t kv, int64_t k,
                           const float *bias, int64_t n) {
    float s = vf_sum(acc);
    for (int64_t t = kv; t < k; t++) s += x[t] * w[t];
    return bias ? s + bias[n] : s;
}

/* one row of x against ROWS_ONE rows of W from row n0 (rows past N repeat the last),
 * TOGETHER rows at a time (one contiguous stream for the prefetcher; linear_i8g.c) */
static void tile_one(const float *x, const float *w, const float *bias, float *y, int64_t n0,
                     int64_t n_rows, int64_t k, int64_t kv) {
    for (int64_t a = n0; a < n0 + ROWS_ONE && a < n_rows; a += TOGETHER) {
        const float *rows[TOGETHER];
        vf acc[TOGETHER];
        for (int r = 0; r < TOGETHER; r++) {
            rows[r] = w + (a + r < n_rows ? a + r : n_rows - 1) * k;
            acc[r] = vf_zero();
        }
        for (int64_t j = 0; j < kv; j += PS_VEC) {
            vf xv = vf_loadu(x + j);
            for (int r = 0; r < TOGETHER; r++) acc[r] = vf_fmadd(xv, vf_loadu(rows[r] + j), acc[r]);
        }
        for (int r = 0; r < TOGETHER && a + r < n_rows; r++)
            y[a + r] = finish(acc[r], x, rows[r], kv, k, bias, a + r);
    }
}

/* TILE_M rows of x (from m0) against ROWS_MANY rows of W (from n0); tails repeat their last */
static void tile_many(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                      int64_t ldy, int64_t m0, int64_t m_rows, int64_t n0, int64_t n_rows,
                      int64_t k, int64_t kv) {
    const float *xs[TILE_M], *rows[ROWS_MANY];
    vf acc[TILE_M][ROWS_MANY];
    for (int i = 0; i < TILE_M; i++) xs[i] = x + (m0 + i < m_rows ? m0 + i : m_rows - 1) * ldx;
    for (int r = 0; r < ROWS_MANY; r++) rows[r] = w + (n0 + r < n_rows ? n0 + r : n_rows - 1) * k;
    for (int i = 0; i < TILE_M; i++)
        for (int r = 0; r < ROWS_MANY; r++) acc[i][r] = vf_zero();
    for (int64_t j = 0; j < kv; j += PS_VEC) {
        vf wv[ROWS_MANY];
        for (int r = 0; r < ROWS_MANY; r++) wv[r] = vf_loadu(rows[r] + j);
        for (int i = 0; i < TILE_M; i++) {
            vf xv = vf_loadu(xs[i] + j);
            for (int r = 0; r < ROWS_MANY; r++) acc[i][r] = vf_fmadd(xv, wv[r], acc[i][r]);
        }
    }
    for (int i = 0; i < TILE_M && m0 + i < m_rows; i++)
        for (int r = 0; r < ROWS_MANY && n0 + r < n_rows; r++)
            y[(m0 + i) * ldy + n0 + r] = finish(acc[i][r], xs[i], rows[r], kv, k, bias, n0 + r);
}

void linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
    const int64_t kv = k - k % PS_VEC;
    if (m_rows == 1) {
        const int64_t tiles = (n_rows + ROWS_ONE - 1) / ROWS_ONE;
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
        for (int64_t tile = 0; tile < tiles; tile++)
            tile_one(x, w, bias, y, tile * ROWS_ONE, n_rows, k, kv);
        return;
    }
    const int64_t tiles = (n_rows + ROWS_MANY - 1) / ROWS_MANY;
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
    for (int64_t tile = 0; tile < tiles; tile++)
        for (int64_t m0 = 0; m0 < m_rows; m0 += TILE_M)
            tile_many(x, ldx, w, bias, y, ldy, m0, m_rows, tile * ROWS_MANY, n_rows, k, kv);
}
