/* y = x @ W.T for int8 weights with one float scale per group of input features (GGUF Q8_0's
 * layout: groups of 32), on x86-64 CPUs with AVX-512 or AVX2 + FMA (simd.h; kernels/cpu_native.py
 * builds and loads it beside the paged decode kernel; model/quant.py calls it for decode-sized
 * batches).
 *
 *     W[n][k] = q[n][k] * s[n][k / group]        q int8 [N, K], s float32 [N, K / group]
 *     y[m][n] = sum_k x[m][k] * W[n][k]          x, y float32, accumulated in float32
 *
 * With one scale per row (per-channel int8, group = k) the sum is s[n] * sum_k x[m][k] q[n][k]:
 * the scale once per output instead of once per weight (one multiply fewer a vector of codes).
 *
 * The codes are read once per tile of TILE_N output rows and widened to float32 in registers;
 * one OpenMP task per tile (torch's libgomp). TILE_M x rows at a time (fewer with AVX2's 16
 * registers): tails of M and N repeat their last row and write nothing twice; a single row of
 * x (a decode step of one sequence) takes ROWS_ONE rows of codes per task instead, read one
 * after another. `group` is a multiple of 16; one scale per output row (per-channel int8) is
 * group = k.
 */
#include <stdint.h>

#include "simd.h"

#define TILE_N 4
#define TILE_M (PS_VEC == 16 ? 4 : 2)

/* one row of x against ROWS_ONE rows of codes (the decode case: the codes' bytes are the
 * cost), TOGETHER rows at a time, each stream asking for its lines early (simd.h's
 * `prefetch_ahead`). Over 425 MB of codes on two cores: 9.2 GB/s without the prefetch,
 * 22.3-22.9 now (docs/kernels.md; 8 rows side by side, before the prefetch, ran at half the
 * bandwidth). The same operations per output as the tiled path, so the two agree bit for bit */
#define ROWS_ONE 8
#define TOGETHER 2

/* a vector of weights: q * s (GGUF's groups, s a group's scale), or q alone where the row has
 * one scale (per channel: `whole`), applied once to the row's sum */
AI vf weights(const int8_t *q, vf sv, int whole) {
    return whole ? vf_from_i8(q) : vf_mul(vf_from_i8(q), sv);
}
AI float scaled(float sum, const float *s, int64_t n, int whole) {
    return whole ? sum * s[n] : sum;
}

AI void tile_one(const float *x, const int8_t *q, const float *s, float *y, int64_t n0,
                 int64_t n_rows, int64_t k, int64_t group, int whole) {
    const int64_t groups = k / group;
    for (int64_t a = n0; a < n0 + ROWS_ONE && a < n_rows; a += TOGETHER) {
        int64_t n[TOGETHER];
        vf acc[TOGETHER];
        for (int r = 0; r < TOGETHER; r++) {
            n[r] = a + r < n_rows ? a + r : n_rows - 1;
            acc[r] = vf_zero();
        }
        for (int64_t g = 0; g < groups; g++) {
            vf sv[TOGETHER];
            for (int r = 0; r < TOGETHER; r++) sv[r] = vf_set1(s[n[r] * groups + g]);
            for (int64_t j = g * group; j < (g + 1) * group; j += PS_VEC) {
                vf xv = vf_loadu(x + j);
                if ((j & 63) == 0)
                    for (int r = 0; r < TOGETHER; r++) prefetch_ahead(q + n[r] * k + j);
                for (int r = 0; r < TOGETHER; r++)
                    acc[r] = vf_fmadd(xv, weights(q + n[r] * k + j, sv[r], whole), acc[r]);
            }
        }
        for (int r = 0; r < TOGETHER && a + r < n_rows; r++)
            y[a + r] = scaled(vf_sum(acc[r]), s, n[r], whole);
    }
}

AI void tile(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y,
             int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int64_t group,
             int64_t tile_at, int whole) {
    const int64_t groups = k / group;
    int64_t n[TILE_N];
    for (int r = 0; r < TILE_N; r++) {
        int64_t at = tile_at * TILE_N + r;
        n[r] = at < n_rows ? at : n_rows - 1;
    }
    for (int64_t m0 = 0; m0 < m_rows; m0 += TILE_M) {
        const float *xs[TILE_M];
        for (int i = 0; i < TILE_M; i++) xs[i] = x + (m0 + i < m_rows ? m0 + i : m_rows - 1) * ldx;
        vf acc[TILE_M][TILE_N];
        for (int i = 0; i < TILE_M; i++)
            for (int r = 0; r < TILE_N; r++) acc[i][r] = vf_zero();
        for (int64_t g = 0; g < groups; g++) {
            vf sv[TILE_N];
            for (int r = 0; r < TILE_N; r++) sv[r] = vf_set1(s[n[r] * groups + g]);
            for (int64_t j = g * group; j < (g + 1) * group; j += PS_VEC) {
                vf w[TILE_N];
                for (int r = 0; r < TILE_N; r++) w[r] = weights(q + n[r] * k + j, sv[r], whole);
                for (int i = 0; i < TILE_M; i++) {
                    vf xv = vf_loadu(xs[i] + j);
                    for (int r = 0; r < TILE_N; r++) acc[i][r] = vf_fmadd(xv, w[r], acc[i][r]);
                }
            }
        }
        for (int i = 0; i < TILE_M && m0 + i < m_rows; i++)
            for (int r = 0; r < TILE_N && tile_at * TILE_N + r < n_rows; r++)
                y[(m0 + i) * ldy + n[r]] = scaled(vf_sum(acc[i][r]), s, n[r], whole);
    }
}

/* Linears side by side over the same x (a layer's q / k / v, or gate / up: the same k and
 * group): part i's codes qs[i] and scales ss[i] for ns[i] rows, its outputs at columns [the
 * earlier parts' rows, + ns[i]) of y, in one parallel region (a region's start and barrier
 * cost a decode step of one sequence more than any arithmetic). Returns 0, or 2 for more
 * than PS_MAX_PARTS parts (y is then untouched).
 * NOTE: `whole` is a literal in each loop below: an OpenMP body is outlined before inlining */
int linear_i8g_parts_f32(const float *x, int64_t ldx, int count, const int8_t *const *qs,
                         const float *const *ss, const int64_t *ns, float *y, int64_t ldy,
                         int64_t m_rows, int64_t k, int64_t group, int threads) {
    if (count > PS_MAX_PARTS) return 2;
    const int64_t per = m_rows == 1 ? ROWS_ONE : TILE_N; /* rows of a task */
    /* each part's first task and first column */
    int64_t first[PS_MAX_PARTS + 1] = {0}, col[PS_MAX_PARTS] = {0};
    for (int i = 0; i < count; i++) {
        first[i + 1] = first[i] + (ns[i] + per - 1) / per;
        if (i + 1 < count) col[i + 1] = col[i] + ns[i];
    }
    const int64_t tasks = first[count];
    if (m_rows == 1 && group == k) {
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
        for (int64_t t = 0; t < tasks; t++) {
            const int i = part_of(first, t);
            tile_one(x, qs[i], ss[i], y + col[i], (t - first[i]) * ROWS_ONE, ns[i], k, group, 1);
        }
    } else if (m_rows == 1) {
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
        for (int64_t t = 0; t < tasks; t++) {
            const int i = part_of(first, t);
            tile_one(x, qs[i], ss[i], y + col[i], (t - first[i]) * ROWS_ONE, ns[i], k, group, 0);
        }
    } else if (group == k) {
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
        for (int64_t t = 0; t < tasks; t++) {
            const int i = part_of(first, t);
            tile(x, ldx, qs[i], ss[i], y + col[i], ldy, m_rows, ns[i], k, group, t - first[i], 1);
        }
    } else {
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
        for (int64_t t = 0; t < tasks; t++) {
            const int i = part_of(first, t);
            tile(x, ldx, qs[i], ss[i], y + col[i], ldy, m_rows, ns[i], k, group, t - first[i], 0);
        }
    }
    return 0;
}

/* One linear: linear_i8g_parts_f32 with one part. */
void linear_i8g_f32(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y,
                    int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int64_t group,
                    int threads) {
    linear_i8g_parts_f32(x, ldx, 1, &q, &s, &n_rows, y, ldy, m_rows, k, group, threads);
}
