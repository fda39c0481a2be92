/* y = x @ W.T for 4-bit weights with one affine (scale, zero) pair per group of input features
 * (model/quant.py's int4, GGUF Q4_0 / Q4_1), on x86-64 CPUs with AVX-512 or AVX2 + FMA (simd.h;
 * kernels/cpu_native.py builds it with the other kernels; model/quant.py calls it for fp32
 * activations in decode-sized batches).
 *
 *     W[n][k] = (q[n][k] - 8) * scale[n][g] + zero[n][g]      q in [0, 15], g = k / group
 *     y[m][n] = sum_k x[m][k] * W[n][k]                         accumulated in float32
 *
 * The codes: K / 2 bytes per output row, in blocks of 32 codes (16 bytes) where byte j holds
 * code j in its low nibble and code j + 16 in its high one:
 *
 *     block bytes   | 0      | 1      | ... | 15      |
 *     low nibble    | k = 0  | k = 1  | ... | k = 15  |
 *     high nibble   | k = 16 | k = 17 | ... | k = 31  |
 *
 * so PS_VEC bytes widen to two vectors of PS_VEC consecutive codes (AVX-512: bytes 0-15 give
 * k 0-15 and 16-31; AVX2: bytes 0-7 give k 0-7 and 16-23, bytes 8-15 give 8-15 and 24-31) with
 * one zero-extension and one shift. Each code becomes its weight in registers (simd.h's
 * `vq4_weights`: with AVX-512 a lookup in the group's 16 weights, with AVX2 an FMA).
 * scale[n][g] is at scale + n * ls_n + g * ls_g (zero likewise): model/quant.py passes views
 * of its [groups, N, 2] buffer.
 *
 * One OpenMP task per tile of output rows, as linear_i8g.c: a single row of x (a decode step
 * of one sequence) takes ROWS_ONE rows of codes per task, TOGETHER side by side, and reads
 * them once; more rows take TILE_M x TILE_N tiles. Every output is the same sequence of
 * vector operations in both, so a row's output does not depend on the batch. `group` is a multiple of 32 that divides k.
 */
#include <stdint.h>

#include "simd.h"

#define BLOCK 32 /* codes per block of 16 bytes */
#define TILE_N 4
#define TILE_M (PS_VEC == 16 ? 4 : 2)
#define ROWS_ONE 8 /* rows of codes per tile at one row of x ... */
#define TOGETHER (PS_VEC == 16 ? 4 : 2) /* ... read side by side (two FMA chains a block) */

typedef struct {
    const uint8_t *q;
    const float *scale, *zero;
    int64_t ls_n, ls_g, k, group;
} int4_weights;

static inline vq4 group_of(const int4_weights *w, int64_t n, int64_t g) {
    const int64_t at = n * w->ls_n + g * w->ls_g;
    return vq4_group(w->scale[at], w->zero[at]);
}

static inline int64_t row_at(int64_t at, int64_t n_rows) { return at < n_rows ? at : n_rows - 1; }

/* one row of x against ROWS_ONE rows of codes, TOGETHER rows at a time: each row's two FMAs a
 * block are a chain, so one row at a time waited on their latency; each row asks for its
 * lines PREFETCH_AHEAD bytes early (simd.h). With AVX-512, 4 rows and the prefetch read
 * 13.5-14.9 GB/s of codes on two cores where 1 row without it read 9.8 (docs/kernels.md) */
static void tile_one(const float *x, const int4_weights *w, float *y, int64_t n0, int64_t n_rows) {
    const int64_t groups = w->k / w->group;
    for (int64_t a = n0; a < n0 + ROWS_ONE && a < n_rows; a += TOGETHER) {
        const uint8_t *q[TOGETHER];
        vf acc[TOGETHER];
        for (int r = 0; r < TOGETHER; r++) {
            q[r] = w->q + row_at(a + r, n_rows) * (w->k / 2);
            acc[r] = vf_zero();
        }
        for (int64_t g = 0; g < groups; g++) {
            vq4 gw[TOGETHER];
            for (int r = 0; r < TOGETHER; r++) gw[r] = group_of(w, row_at(a + r, n_rows), g);
            for (int64_t j = g * w->group; j < (g + 1) * w->group; j += BLOCK)
                for (int h = 0; h < BLOCK / 2; h += PS_VEC) {
                    if (((j / 2 + h) & 63) == 0)
                        for (int r = 0; r < TOGETHER; r++) prefetch_ahead(q[r] + j / 2 + h);
                    const vf x_lo = vf_loadu(x + j + h), x_hi = vf_loadu(x + j + BLOCK / 2 + h);
                    for (int r = 0; r < TOGETHER; r++) {
                        vf lo, hi;
                        vq4_weights(q[r] + j / 2 + h, gw[r], &lo, &hi);
                        acc[r] = vf_fmadd(x_hi, hi, vf_fmadd(x_lo, lo, acc[r]));
                    }
                }
        }
        for (int r = 0; r < TOGETHER && a + r < n_rows; r++) y[a + r] = vf_sum(acc[r]);
    }
}

static void tile(const float *x, int64_t ldx, const int4_weights *w, float *y, int64_t ldy,
                 int64_t m_rows, int64_t n0, int64_t n_rows) {
    const int64_t groups = w->k / w->group;
    int64_t n[TILE_N];
    const uint8_t *q[TILE_N];
    for (int r = 0; r < TILE_N; r++) {
        n[r] = row_at(n0 + r, n_rows);
        q[r] = w->q + n[r] * (w->k / 2);
    }
    for (int64_t m0 = 0; m0 < m_rows; m0 += TILE_M) {
        const float *xr[TILE_M];
        for (int i = 0; i < TILE_M; i++) xr[i] = x + row_at(m0 + i, m_rows) * ldx;
        vf acc[TILE_M][TILE_N];
        for (int i = 0; i < TILE_M; i++)
            for (int r = 0; r < TILE_N; r++) acc[i][r] = vf_zero();
        for (int64_t g = 0; g < groups; g++) {
            vq4 gw[TILE_N];
            for (int r = 0; r < TILE_N; r++) gw[r] = group_of(w, n[r], g);
            for (int64_t j = g * w->group; j < (g + 1) * w->group; j += BLOCK)
                for (int h = 0; h < BLOCK / 2; h += PS_VEC) {
                    vf lo[TILE_N], hi[TILE_N];
                    for (int r = 0; r < TILE_N; r++)
                        vq4_weights(q[r] + j / 2 + h, gw[r], &lo[r], &hi[r]);
                    for (int i = 0; i < TILE_M; i++) {
                        const vf x_lo = vf_loadu(xr[i] + j + h);
                        const vf x_hi = vf_loadu(xr[i] + j + BLOCK / 2 + h);
                        for (int r = 0; r < TILE_N; r++)
                            acc[i][r] = vf_fmadd(x_hi, hi[r], vf_fmadd(x_lo, lo[r], acc[i][r]));
                    }
                }
        }
        for (int i = 0; i < TILE_M && m0 + i < m_rows; i++)
            for (int r = 0; r < TILE_N && n0 + r < n_rows; r++)
                y[(m0 + i) * ldy + n[r]] = vf_sum(acc[i][r]);
    }
}

void linear_i4g_f32(const float *x, int64_t ldx, const uint8_t *q, const float *scale,
                    const float *zero, int64_t ls_n, int64_t ls_g, float *y, int64_t ldy,
                    int64_t m_rows, int64_t n_rows, int64_t k, int64_t group, int threads) {
    const int4_weights w = {q, scale, zero, ls_n, ls_g, k, group};
    if (m_rows == 1) {
        const int64_t tiles = (n_rows + ROWS_ONE - 1) / ROWS_ONE;
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
        for (int64_t t = 0; t < tiles; t++) tile_one(x, &w, y, t * ROWS_ONE, n_rows);
        return;
    }
    const int64_t tiles = (n_rows + TILE_N - 1) / TILE_N;
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
    for (int64_t t = 0; t < tiles; t++) tile(x, ldx, &w, y, ldy, m_rows, t * TILE_N, n_rows);
}
