/* RMSNorm over float32 rows, with the residual add before it fused in (simd.h;
 * kernels/cpu_native.py builds and loads it, model/llama.py's RMSNorm calls it):
 *
 *     s = x + residual                      (when residual is given; written to sum_out)
 *     out = weight * (s * (1 / sqrt(mean(s * s) + eps)))
 *
 * transformers' LlamaRMSNorm in float32, operation for operation: the add and the products are
 * the same IEEE operations as torch's, and 1 / sqrt is how torch's CPU rsqrt computes. Only the
 * sum of squares is added in another order (vector accumulator, then vf_sum, then the tail),
 * so the scale can differ from torch's in its last bit. One call replaces the eight torch ops
 * of a norm and its residual add. Rows are split between `threads` OpenMP threads from
 * PS_PARALLEL_ROWS on (a prompt's); a decode step's few stay on the calling thread. A row's
 * arithmetic is the same either way.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

void rms_norm_f32(const float *x, int64_t ldx, const float *residual, int64_t ldr,
                  float *sum_out, const float *weight, float *out, int64_t rows, int64_t n,
                  float eps, int threads) {
    const int64_t nv = n - n % PS_VEC;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= PS_PARALLEL_ROWS)
    for (int64_t row = 0; row < rows; row++) {
        const float *xr = x + row * ldx;
        float *o = out + row * n;
        const float *s = xr;
        if (residual) {
            const float *rr = residual + row * ldr;
            float *sr = sum_out + row * n;
            int64_t j = 0;
            for (; j < nv; j += PS_VEC) vf_storeu(sr + j, vf_add(vf_loadu(xr + j), vf_loadu(rr + j)));
            for (; j < n; j++) sr[j] = xr[j] + rr[j];
            s = sr;
        }
        vf acc = vf_zero();
        int64_t j = 0;
        for (; j < nv; j += PS_VEC) {
            vf v = vf_loadu(s + j);
            acc = vf_fmadd(v, v, acc);
        }
        float squares = vf_sum(acc);
        for (; j < n; j++) squares += s[j] * s[j];
        const float scale = 1.0f / sqrtf(squares / (float)n + eps); /* mean: sum, then div_ */
        const vf sv = vf_set1(scale);
        for (j = 0; j < nv; j += PS_VEC)
            vf_storeu(o + j, vf_mul(vf_loadu(weight + j), vf_mul(vf_loadu(s + j), sv)));
        for (; j < n; j++) o[j] = weight[j] * (s[j] * scale);
    }
}
