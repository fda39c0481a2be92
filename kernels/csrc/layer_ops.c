/* A decoder layer's element-wise steps on float32 rows: rope and the SwiGLU activation
 * (kernels/cpu_layer_ops.py binds them for the Python layer path; decode_stack.c calls them).
 *
 *     rope_f32:      x = x * cos + rotate_half(x) * sin      in place, each head of each row
 *     silu_mul_f32:  out = silu(g) * u
 *
 * rope is torch's arithmetic operation for operation (two products and a sum, each rounded:
 * no FMA contraction), so its output equals `model/llama.py`'s `rotate` bit for bit. silu's
 * exponential is libmvec's expf, torch's is its own: the two differ by a few ulp.
 *
 * Rows are split between `threads` OpenMP threads (torch's libgomp) from PS_PARALLEL_ROWS rows
 * on: a prompt's thousands of rows; a decode step's few stay on the calling thread.
 */
#pragma GCC optimize("fp-contract=off") /* rope: two products and a sum, each rounded, as torch */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { MAX_HEAD_DIM = 512 };

/* x [rows, heads, d] with `ldx` floats between rows (heads packed); cos, sin [rows, d]. */
void rope_f32(float *x, int64_t ldx, int64_t heads, int64_t d, const float *cos, const float *sin,
              int64_t rows, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= PS_PARALLEL_ROWS)
    for (int64_t m = 0; m < rows; m++) {
        const float *c = cos + m * d, *sn = sin + m * d;
        float tmp[MAX_HEAD_DIM];
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + m * ldx + h * d;
            memcpy(tmp, xh, sizeof(float) * d);
            for (int64_t i = 0; i < half; i++) {
                const float a = tmp[i] * c[i], b = -tmp[i + half] * sn[i];
                xh[i] = a + b;
            }
            for (int64_t i = half; i < d; i++) {
                const float a = tmp[i] * c[i], b = tmp[i - half] * sn[i];
                xh[i] = a + b;
            }
        }
    }
}

/* g, u [rows, inter] with `ldg`, `ldu` floats between rows (a fused gate/up linear's halves,
 * or two linears' outputs); out [rows, inter], contiguous. */
void silu_mul_f32(const float *g, int64_t ldg, const float *u, int64_t ldu, float *out,
                  int64_t rows, int64_t inter, int threads) {
    const int64_t nv = inter - inter % PS_VEC;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= PS_PARALLEL_ROWS)
    for (int64_t m = 0; m < rows; m++) {
        const vf one = vf_set1(1.0f), zero = vf_zero();
        const float *gr = g + m * ldg, *ur = u + m * ldu;
        float *o = out + m * inter;
        int64_t i = 0;
        for (; i < nv; i += PS_VEC) {
            const vf x = vf_loadu(gr + i);
            const vf act = vf_div(x, vf_add(one, vf_expf(vf_sub(zero, x))));
            vf_storeu(o + i, vf_mul(act, vf_loadu(ur + i)));
        }
        for (; i < inter; i++) o[i] = gr[i] / (1.0f + expf(-gr[i])) * ur[i];
    }
}
