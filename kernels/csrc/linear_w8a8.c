/* `--quantization w8a8` linears in one native call, for decode-sized batches and the native
 * decode stack (csrc/decode_stack.c): the rows quantized as csrc/quant_act.c does, the int8
 * products summed exactly with AVX-512 VNNI, then quant_act.c's epilogue.
 *
 *     xu = q + 128 (u8)       vpdpbusd sums u8 x s8 in int32, so the codes of x are shifted
 *     acc = xu . w - 128 * sum_k w      ... and the shift taken back: the exact int32 sum q . w
 *
 * The sums are exact, so the result equals `torch._int_mm`'s path (kernels/cpu_w8a8.py) and
 * the torch reference bit for bit. TILE_M rows x TILE_N outputs at a time (16 accumulators);
 * one OpenMP task per tile of outputs. Without AVX-512 VNNI `linear_w8a8_f32` returns 0 and
 * the caller takes the `_int_mm` path (the native stack declines the layer).
 */
#include <stdint.h>
#include <stdlib.h>

#include <immintrin.h>

void quantize_rows_i8(const float *x, int64_t ldx, int8_t *q, float *scales, int64_t rows,
                      int64_t n, int threads);
void dequant_rows_i32(const int32_t *acc, const float *row_scales, const float *col_scales,
                      const float *bias, float *out, int64_t ldo, int64_t rows, int64_t n,
                      int threads);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TILE_N 4
#define TILE_M 4

int w8a8_vnni(void) { return 1; }

static inline int32_t hsum(__m512i v) { return _mm512_reduce_add_epi32(v); }

/* acc[m][n] = sum_k xu[m][k] * w[n][k] - 128 * wsum[n] for TILE_M rows (the last repeated) */
static void tile(const uint8_t *xu, const int8_t *w, const int32_t *wsum, int32_t *acc,
                 int64_t m0, int64_t m_rows, int64_t n0, int64_t n_rows, int64_t k) {
    const uint8_t *xs[TILE_M];
    const int8_t *ws[TILE_N];
    for (int i = 0; i < TILE_M; i++) xs[i] = xu + (m0 + i < m_rows ? m0 + i : m_rows - 1) * k;
    for (int r = 0; r < TILE_N; r++) ws[r] = w + (n0 + r < n_rows ? n0 + r : n_rows - 1) * k;
    __m512i a[TILE_M][TILE_N];
    for (int i = 0; i < TILE_M; i++)
        for (int r = 0; r < TILE_N; r++) a[i][r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < k; j += 64) {
        const __mmask64 mask = k - j >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - j)) - 1);
        __m512i wv[TILE_N];
        for (int r = 0; r < TILE_N; r++) wv[r] = _mm512_maskz_loadu_epi8(mask, ws[r] + j);
        for (int i = 0; i < TILE_M; i++) {
            const __m512i xv = _mm512_maskz_loadu_epi8(mask, xs[i] + j);
            for (int r = 0; r < TILE_N; r++) a[i][r] = _mm512_dpbusd_epi32(a[i][r], xv, wv[r]);
        }
    }
    for (int i = 0; i < TILE_M && m0 + i < m_rows; i++)
        for (int r = 0; r < TILE_N && n0 + r < n_rows; r++)
            acc[(m0 + i) * n_rows + n0 + r] = hsum(a[i][r]) - 128 * wsum[n0 + r];
}

/* y [m, ldy] = w8a8(x) for codes w [n, k] int8, scales [n], wsum [n] = sum_k w (int32), bias
 * [n] or NULL. Returns 1, or 0 (nothing written) when its scratch cannot be allocated. */
int linear_w8a8_f32(const float *x, int64_t ldx, const int8_t *w, const float *scales,
                    const int32_t *wsum, const float *bias, float *y, int64_t ldy,
                    int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
    int8_t *q = malloc((size_t)(m_rows * k));
    float *row_scales = malloc(sizeof(float) * (size_t)m_rows);
    int32_t *acc = malloc(sizeof(int32_t) * (size_t)(m_rows * n_rows));
    if (!q || !row_scales || !acc) {
        free(q), free(row_scales), free(acc);
        return 0;
    }
    quantize_rows_i8(x, ldx, q, row_scales, m_rows, k, threads);
    for (int64_t i = 0; i < m_rows * k; i++) q[i] = (int8_t)((uint8_t)q[i] ^ 0x80); /* + 128 */
    const int64_t tiles = (n_rows + TILE_N - 1) / TILE_N;
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t m0 = 0; m0 < m_rows; m0 += TILE_M)
            tile((const uint8_t *)q, w, wsum, acc, m0, m_rows, t * TILE_N, n_rows, k);
    dequant_rows_i32(acc, row_scales, scales, bias, y, ldy, m_rows, n_rows, threads);
    free(q), free(row_scales), free(acc);
    return 1;
}
#else
int w8a8_vnni(void) { return 0; }

int linear_w8a8_f32(const float *x, int64_t ldx, const int8_t *w, const float *scales,
                    const int32_t *wsum, const float *bias, float *y, int64_t ldy,
                    int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
    (void)x, (void)ldx, (void)w, (void)scales, (void)wsum, (void)bias, (void)y, (void)ldy;
    (void)m_rows, (void)n_rows, (void)k, (void)threads;
    return 0;
}
#endif
