/* y = x @ W.T for int8 weights with one float scale per group of input features (GGUF Q8_0's
 * layout: groups of 32), on x86-64 CPUs with AVX-512 (kernels/cpu_native.py builds and loads
 * it beside the paged decode kernel; model/quant.py calls it for decode-sized batches).
 *
 *     W[n][k] = q[n][k] * s[n][k / group]        q int8 [N, K], s float32 [N, K / group]
 *     y[m][n] = sum_k x[m][k] * W[n][k]          x, y float32, accumulated in float32
 *
 * The codes are read once per tile of 4 output rows and widened to float32 in registers; one
 * OpenMP task per tile of 4 output rows (torch's libgomp). A tile of 4 x rows at a time: tails
 * of M and N repeat their last row and write nothing twice. `group` is a multiple of 16.
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE 4

static inline __attribute__((always_inline)) __m512 widen(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

void linear_i8g_f32(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y,
                    int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int64_t group,
                    int threads) {
    const int64_t groups = k / group, tiles = (n_rows + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        int64_t n[TILE];
        for (int r = 0; r < TILE; r++) {
            int64_t at = tile * TILE + r;
            n[r] = at < n_rows ? at : n_rows - 1;
        }
        for (int64_t m0 = 0; m0 < m_rows; m0 += TILE) {
            const float *xs[TILE];
            for (int i = 0; i < TILE; i++)
                xs[i] = x + (m0 + i < m_rows ? m0 + i : m_rows - 1) * ldx;
            __m512 acc[TILE][TILE];
            for (int i = 0; i < TILE; i++)
                for (int r = 0; r < TILE; r++) acc[i][r] = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                __m512 sv[TILE];
                for (int r = 0; r < TILE; r++) sv[r] = _mm512_set1_ps(s[n[r] * groups + g]);
                for (int64_t j = g * group; j < (g + 1) * group; j += 16) {
                    __m512 w[TILE];
                    for (int r = 0; r < TILE; r++)
                        w[r] = _mm512_mul_ps(widen(q + n[r] * k + j), sv[r]);
                    for (int i = 0; i < TILE; i++) {
                        __m512 xv = _mm512_loadu_ps(xs[i] + j);
                        for (int r = 0; r < TILE; r++)
                            acc[i][r] = _mm512_fmadd_ps(xv, w[r], acc[i][r]);
                    }
                }
            }
            for (int i = 0; i < TILE && m0 + i < m_rows; i++)
                for (int r = 0; r < TILE && tile * TILE + r < n_rows; r++)
                    y[(m0 + i) * ldy + n[r]] = _mm512_reduce_add_ps(acc[i][r]);
        }
    }
}
