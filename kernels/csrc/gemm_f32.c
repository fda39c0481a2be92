/* y = x @ W.T (+ bias) for float32, in batches of tens to hundreds of rows of x (prefill
 * chunks, large decode batches), on x86-64 CPUs with AVX-512 or AVX2 + FMA (simd.h;
 * kernels/cpu_native.py builds it with the other kernels; kernels/cpu_linear.py calls it).
 *
 *     y[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n])       x, y float32 [M, K], [M, N]
 *
 * A register-blocked GEMM on y's transpose, so that W needs no packing: x is packed once per
 * call, k-major in panels of MV = 2 vectors of rows ([K][MV], zero past M); each NB x MV block
 * of y.T is NB x 2 vector accumulators, and per k one broadcast of W[n][k] for each of the NB
 * weight rows times the panel's two vectors (no horizontal sums; each weight row is read along
 * k as it lies). One OpenMP task per block of NB weight rows, swept over every panel of x. The
 * outputs leave the accumulators through a small transpose (y is [M, N]).
 *
 * Each output is one FMA chain over k in order (then the bias), whatever M: so rows do not
 * depend on each other (batch invariance), but the sum order differs from linear_f32.c's (one
 * row at a time) and from MKL's: ~1e-7 relative.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MV (2 * PS_VEC)            /* rows of x per panel */
#define NB (PS_VEC == 16 ? 12 : 6) /* weight rows per block: 24 of AVX-512's 32 registers */

/* one panel (rows m0.., MV of them) of packed x against NB weight rows w[r * ldw ..] */
static void block(const float *panel, const float *w, int64_t ldw, int nb, const float *bias,
                  float *y, int64_t ldy, int64_t m0, int64_t m_rows, int64_t n0, int64_t k) {
    vf acc0[NB], acc1[NB];
    const float *rows[NB];
    for (int r = 0; r < NB; r++) {
        rows[r] = w + (r < nb ? r : nb - 1) * ldw;
        acc0[r] = vf_zero();
        acc1[r] = vf_zero();
    }
    const int64_t ms = m_rows - m0 < MV ? m_rows - m0 : MV;
    if (ms > PS_VEC)
        for (int64_t t = 0; t < k; t++) {
            const vf a0 = vf_load(panel + t * MV), a1 = vf_load(panel + t * MV + PS_VEC);
            for (int r = 0; r < NB; r++) {
                const vf b = vf_set1(rows[r][t]);
                acc0[r] = vf_fmadd(b, a0, acc0[r]);
                acc1[r] = vf_fmadd(b, a1, acc1[r]);
            }
        }
    else /* the last panel's rows fit one vector: the same FMAs on its half */
        for (int64_t t = 0; t < k; t++) {
            const vf a0 = vf_load(panel + t * MV);
            for (int r = 0; r < NB; r++) acc0[r] = vf_fmadd(vf_set1(rows[r][t]), a0, acc0[r]);
        }
    float out[NB][MV] __attribute__((aligned(64)));
    for (int r = 0; r < NB; r++) {
        vf_store(out[r], acc0[r]);
        vf_store(out[r] + PS_VEC, acc1[r]);
    }
    for (int64_t i = 0; i < ms; i++) {
        float *row = y + (m0 + i) * ldy + n0;
        for (int r = 0; r < nb; r++) row[r] = bias ? out[r][i] + bias[n0 + r] : out[r][i];
    }
}

/* x [M, K] (rows ldx apart) times w [N, K] (rows contiguous) into y [M, N] (rows ldy apart);
 * 0 when the packed copy of x could not be allocated (nothing written) */
int gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
             int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
    const int64_t panels = (m_rows + MV - 1) / MV, blocks = (n_rows + NB - 1) / NB;
    float *xt = aligned_alloc(64, (size_t)panels * k * MV * sizeof(float));
    if (!xt) return 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++)
            for (int i = 0; i < MV; i++) {
                const int64_t m = p * MV + i;
                float *col = xt + p * k * MV + i;
                if (m < m_rows)
                    for (int64_t t = 0; t < k; t++) col[t * MV] = x[m * ldx + t];
                else
                    for (int64_t t = 0; t < k; t++) col[t * MV] = 0.0f;
            }
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * NB;
            const int nb = n_rows - n0 < NB ? (int)(n_rows - n0) : NB;
            for (int64_t p = 0; p < panels; p++)
                block(xt + p * k * MV, w + n0 * k, k, nb, bias, y, ldy, p * MV, m_rows, n0, k);
        }
    }
    free(xt);
    return 1;
}

/* MKL's cblas_sgemm_compute as torch's own libtorch_cpu exports it (LP64: MKL_INT is int), set
 * once by kernels/mkl_packed.py; NULL where torch has no MKL. */
typedef void (*sgemm_compute_fn)(int layout, int transa, int transb, int m, int n, int k,
                                 const float *a, int lda, const float *b, int ldb, float beta,
                                 float *c, int ldc);
static sgemm_compute_fn packed_compute;

void set_sgemm_compute(void *fn) { packed_compute = (sgemm_compute_fn)fn; }

/* y = x @ W.T (+ bias), W [N, K] packed by cblas_sgemm_pack (B, transposed): MKL's GEMM on
 * the packed copy, as F.linear computes it (addmm: y starts as the bias, beta = 1), without
 * MKL packing W again on every call. 0 when no compute function is set (nothing written). */
int linear_packed_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                      float *y, int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k) {
    enum { ROW_MAJOR = 101, NO_TRANS = 111, PACKED = 151 };
    if (!packed_compute) return 0;
    if (bias)
        for (int64_t m = 0; m < m_rows; m++) memcpy(y + m * ldy, bias, sizeof(float) * n_rows);
    packed_compute(ROW_MAJOR, NO_TRANS, PACKED, (int)m_rows, (int)n_rows, (int)k, x, (int)ldx,
                   packed, (int)k, bias ? 1.0f : 0.0f, y, (int)ldy);
    return 1;
}
