/* y = x @ W.T for 4-bit weights with one affine (scale, minimum) pair per group of input
 * features (model/quant.py's int4, GGUF Q4_0 / Q4_1), on x86-64 CPUs with AVX-512 or AVX2 + FMA
 * + F16C (simd.h; kernels/cpu_native.py builds it with the other kernels; model/quant.py calls
 * it for fp32 activations in decode-sized batches).
 *
 *     W[n][k] = q[n][k] * scale[n][g] + low[n][g]      q in [0, 15], g = k / group
 *     y[m][n] = sum_g scale[n][g] * sum_{k in g} x[m][k] * q[n][k]
 *                 + low[n][g] * sum_{k in g} x[m][k]
 *
 * (model/quant.py's (scale, zero) with low = zero - 8 scale: the group's minimum, GGUF Q4_1's
 * m, Q4_0's -8 d). Scale and low are float16, as GGUF stores them.
 *
 * One vector lane per output row: the codes of 16 rows lie side by side (cpu_native.pack_int4),
 * one 32-bit word per row and 8 consecutive codes, code j of the word in bits 4j .. 4j + 3:
 *
 *     tile of rows n0 .. n0 + 15 (fewer in the last tile: r rows, words r apart)
 *     | row n0: k 0-7 | row n0 + 1: k 0-7 | ... | row n0 + 15: k 0-7 | row n0: k 8-15 | ...
 *
 * and their scales and minimums likewise, tile by tile (cpu_native.pack_int4_scales; a last
 * tile is padded to 16 rows):
 *
 *     tile t: | group 0: scales of rows 16t .. 16t + 15, their lows | group 1: ... | ...
 *                                       32 halves (one cache line) a group
 *
 * so one load gives 16 rows' codes for 8 k's, and code j of all 16 is one shift and one
 * lookup (simd.h's `vq4_code`), multiplied by x[m][k] broadcast. The scale is applied once a
 * group, not once a code: a row's 16 weights were rebuilt per group before, two operations in
 * every eight where a group is 32 codes (docs/kernels.md).
 *
 * One OpenMP task per PS_VEC rows (a panel: with AVX2 a tile is two). Each output is the same
 * sequence of operations whatever the number of rows of x: its lane sums x[m][k] * q in CHAINS
 * chains by k mod CHAINS (the FMA latency), adds them ((0 + 1) + (2 + 3)) at the end of a
 * group and folds the group in. `group` is a multiple of 32 that divides k.
 */
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define TILE_ROWS 16 /* rows of a tile of codes (the layout's) */
#define CODES 8      /* codes of one row in one word */
#define CHAINS 4
#define TILE_M (PS_VEC == 16 ? 4 : 2) /* rows of x per pass over a panel's codes */
#define SCALES_AHEAD 4 /* groups between a group's pairs' prefetch and their use */

typedef struct {
    const uint8_t *q;
    const uint16_t *pairs;
    const float *x, *sums; /* sums[m][g]: x[m]'s sum over group g */
    int64_t k, group, ldx, m_rows, n_rows;
} int4_linear;

static inline int64_t row_at(int64_t at, int64_t rows) { return at < rows ? at : rows - 1; }

/* Rows n0 .. n0 + lanes - 1 (one panel) for rows m0 .. m0 + tm - 1 of x (repeating the last
 * row of x past m_rows): y[m][n] for each. `words` is the panel's first word, `stride` the
 * bytes from one word of a row to its next (the tile's rows x 4), `pairs` its group 0's
 * first scale (the next group's 2 TILE_ROWS halves on). */
AI void panel(const int4_linear *l, const uint8_t *words, int64_t stride, const uint16_t *pairs,
              int64_t n0, int lanes, int64_t m0, int tm, float *y, int64_t ldy) {
    const float *xr[TILE_M], *sr[TILE_M];
    const int64_t groups = l->k / l->group;
    for (int i = 0; i < tm; i++) {
        const int64_t m = row_at(m0 + i, l->m_rows);
        xr[i] = l->x + m * l->ldx;
        sr[i] = l->sums + m * groups;
    }
    vf out[TILE_M];
    for (int i = 0; i < tm; i++) out[i] = vf_zero();
    for (int64_t g = 0; g < groups; g++) {
        if (tm == 1) /* the pairs of a group SCALES_AHEAD on: one cache line */
            prefetch_at(pairs + (g + SCALES_AHEAD) * 2 * TILE_ROWS, 0);
        vf acc[TILE_M][CHAINS];
        for (int i = 0; i < tm; i++)
            for (int c = 0; c < CHAINS; c++) acc[i][c] = vf_zero();
        for (int64_t k0 = g * l->group; k0 < (g + 1) * l->group; k0 += CODES) {
            const uint8_t *p = words + k0 / CODES * stride;
            if (tm == 1) prefetch_ahead(p);
            const vq4c v = vq4_load(p, lanes);
            for (int j = 0; j < CODES; j++) {
                const vf q = vq4_code(v, j);
                for (int i = 0; i < tm; i++)
                    acc[i][j % CHAINS] = vf_fmadd(vf_set1(xr[i][k0 + j]), q, acc[i][j % CHAINS]);
            }
        }
        vf scale, low;
        vq4_pairs(pairs + g * 2 * TILE_ROWS, &scale, &low);
        for (int i = 0; i < tm; i++) {
            const vf sum = vf_add(vf_add(acc[i][0], acc[i][1]), vf_add(acc[i][2], acc[i][3]));
            out[i] = vf_fmadd(low, vf_set1(sr[i][g]), vf_fmadd(scale, sum, out[i]));
        }
    }
    for (int i = 0; i < tm && m0 + i < l->m_rows; i++)
        vf_store_lanes(y + (m0 + i) * ldy + n0, out[i], lanes);
}

/* panel `t` (PS_VEC rows; two of them a tile with AVX2) for every row of x */
static void rows_of_panel(const int4_linear *l, int64_t t, float *y, int64_t ldy) {
    const int64_t n0 = t * PS_VEC, tile = n0 / TILE_ROWS * TILE_ROWS;
    const int64_t tile_rows = l->n_rows - tile < TILE_ROWS ? l->n_rows - tile : TILE_ROWS;
    const int lanes = (int)(l->n_rows - n0 < PS_VEC ? l->n_rows - n0 : PS_VEC);
    const uint8_t *words = l->q + tile * (l->k / 2) + (n0 - tile) * 4;
    const uint16_t *pairs = l->pairs + tile * (l->k / l->group) * 2 + (n0 - tile);
    const int64_t stride = tile_rows * 4;
    if (l->m_rows == 1 && lanes == PS_VEC) /* whole panels: no masks (a constant to inline) */
        panel(l, words, stride, pairs, n0, PS_VEC, 0, 1, y, ldy);
    else if (l->m_rows == 1)
        panel(l, words, stride, pairs, n0, lanes, 0, 1, y, ldy);
    else
        for (int64_t m0 = 0; m0 < l->m_rows; m0 += TILE_M)
            panel(l, words, stride, pairs, n0, lanes, m0, TILE_M, y, ldy);
}

/* sums[m][g] = x[m]'s sum over group g, in vectors of PS_VEC then their lanes */
static void group_sums(const float *x, int64_t ldx, int64_t m_rows, int64_t k, int64_t group,
                       float *sums) {
    for (int64_t m = 0; m < m_rows; m++)
        for (int64_t g = 0; g < k / group; g++) {
            vf s = vf_zero();
            for (int64_t j = g * group; j < (g + 1) * group; j += PS_VEC)
                s = vf_add(s, vf_loadu(x + m * ldx + j));
            sums[m * (k / group) + g] = vf_sum(s);
        }
}

/* Linears side by side over the same x (a layer's q / k / v, or gate / up: the same k and
 * group): part i's codes qs[i] and pairs[i] for ns[i] rows, its outputs at columns [the
 * earlier parts' rows, + ns[i]) of y. One set of group sums and one parallel region for all
 * of them (a region's start and its barrier cost a decode step of one sequence more than the
 * sums). Returns 0; 1 when the group sums could not be allocated, 2 for more than PS_MAX_PARTS
 * parts (y is then untouched). */
int linear_i4g_parts_f32(const float *x, int64_t ldx, int count, const uint8_t *const *qs,
                         const uint16_t *const *pairs, const int64_t *ns, float *y,
                         int64_t ldy, int64_t m_rows, int64_t k, int64_t group, int threads) {
    if (count > PS_MAX_PARTS) return 2;
    float *sums = malloc(sizeof(float) * m_rows * (k / group));
    if (!sums) return 1;
    group_sums(x, ldx, m_rows, k, group, sums);
    int4_linear parts[PS_MAX_PARTS];
    /* each part's first panel and first column */
    int64_t first[PS_MAX_PARTS + 1] = {0}, col[PS_MAX_PARTS] = {0};
    for (int i = 0; i < count; i++) {
        parts[i] = (int4_linear){qs[i], pairs[i], x, sums, k, group, ldx, m_rows, ns[i]};
        first[i + 1] = first[i] + (ns[i] + PS_VEC - 1) / PS_VEC;
        if (i + 1 < count) col[i + 1] = col[i] + ns[i];
    }
#pragma omp parallel for num_threads(threads) schedule(guided, 2)
    for (int64_t t = 0; t < first[count]; t++) {
        const int i = part_of(first, t);
        rows_of_panel(&parts[i], t - first[i], y + col[i], ldy);
    }
    free(sums);
    return 0;
}

/* One linear: linear_i4g_parts_f32 with one part. */
int linear_i4g_f32(const float *x, int64_t ldx, const uint8_t *q, const uint16_t *pairs, float *y,
                   int64_t ldy, int64_t m_rows, int64_t n_rows, int64_t k, int64_t group,
                   int threads) {
    return linear_i4g_parts_f32(x, ldx, 1, &q, &pairs, &n_rows, y, ldy, m_rows, k, group,
                                threads);
}

/* w [n_rows, k] float32 = q * scale + low, the weight the sums above stand for (q * scale is
 * exact: a 4-bit code times a float16; one rounding, the add's), for batches where one
 * dequantized copy and a GEMM beat reading the codes per tile of rows (model/quant.py). Per
 * panel and block of CODES columns the lanes' weights are built in registers, then written
 * row by row. */
void dequant_i4g_f32(const uint8_t *q, const uint16_t *pairs, float *w, int64_t n_rows,
                     int64_t k, int64_t group, int threads) {
    const int64_t panels = (n_rows + PS_VEC - 1) / PS_VEC;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < panels; t++) {
        const int64_t n0 = t * PS_VEC, tile = n0 / TILE_ROWS * TILE_ROWS;
        const int64_t tile_rows = n_rows - tile < TILE_ROWS ? n_rows - tile : TILE_ROWS;
        const int lanes = (int)(n_rows - n0 < PS_VEC ? n_rows - n0 : PS_VEC);
        const uint8_t *words = q + tile * (k / 2) + (n0 - tile) * 4;
        const uint16_t *tp = pairs + tile * (k / group) * 2 + (n0 - tile);
        float block[CODES][PS_VEC];
        for (int64_t g = 0; g < k / group; g++) {
            vf scale, low;
            vq4_pairs(tp + g * 2 * TILE_ROWS, &scale, &low);
            for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += CODES) {
                const vq4c v = vq4_load(words + k0 / CODES * tile_rows * 4, lanes);
                for (int j = 0; j < CODES; j++)
                    vf_storeu(block[j], vf_add(vf_mul(vq4_code(v, j), scale), low));
                for (int i = 0; i < lanes; i++)
                    for (int j = 0; j < CODES; j++) w[(n0 + i) * k + k0 + j] = block[j][i];
            }
        }
    }
}
