/* Dynamic per-row int8 activations around an int8 x int8 -> int32 matmul (`--quantization
 * w8a8`; kernels/cpu_w8a8.py calls these, torch._int_mm runs the matmul on AMX / VNNI):
 *
 *     amax_i = max(max_j |x_ij|, 1e-30)        one scale per row (token): s_i = amax_i / 127
 *     q_ij   = round_half_even(x_ij * (127 / amax_i))        in [-127, 127]
 *     out_in = ((float) acc_in * s_i) * w_n (+ bias_n)       acc = q @ codes^T, exact in int32
 *
 * The same IEEE operations, in the same order, as `w8a8_linear` in kernels/reference.py (the
 * max is order-free, the products are single roundings), so the two agree bit for bit. A row's
 * result never depends on the other rows: batch-invariant.
 */
#include <math.h>
#include <stdint.h>

void quantize_rows_i8(const float *x, int64_t ldx, int8_t *q, float *scales, int64_t rows,
                      int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > 65536)
    for (int64_t row = 0; row < rows; row++) {
        const float *xr = x + row * ldx;
        int8_t *qr = q + row * n;
        float amax = 0.0f;
        for (int64_t j = 0; j < n; j++) amax = fmaxf(amax, fabsf(xr[j]));
        amax = fmaxf(amax, 1e-30f);
        const float inv = 127.0f / amax;
        for (int64_t j = 0; j < n; j++) qr[j] = (int8_t)nearbyintf(xr[j] * inv);
        scales[row] = amax / 127.0f;
    }
}

/* NOTE: no FMA contraction: torch multiplies, then adds the bias, each rounded once */
__attribute__((optimize("fp-contract=off"))) void dequant_rows_i32(const int32_t *acc, const float *row_scales, const float *col_scales,
                      const float *bias, float *out, int64_t ldo, int64_t rows, int64_t n,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > 65536)
    for (int64_t row = 0; row < rows; row++) {
        const int32_t *ar = acc + row * n;
        float *o = out + row * ldo;
        const float s = row_scales[row];
        if (bias) {
            for (int64_t j = 0; j < n; j++) o[j] = ((float)ar[j] * s) * col_scales[j] + bias[j];
        } else {
            for (int64_t j = 0; j < n; j++) o[j] = ((float)ar[j] * s) * col_scales[j];
        }
    }
}
