/* Paged decode attention for fp32, bf16 and 8-bit caches on x86-64 CPUs with AVX-512 or AVX2 +
 * FMA (simd.h; kernels/cpu_native.py builds and loads it; docs/kernels.md has the measurements).
 *
 * One query token per sequence, read straight from the paged cache: no gather into a
 * workspace, K and V read once. One OpenMP task per sequence (torch's libgomp: one runtime in
 * the process). Per sequence, for its attended positions [first, end):
 *
 *     scores[r][p] = scale * q[r] . K[p][r / groups]       (r: query head, groups = hq / hkv)
 *     scores[r][p] = tanh(scores[r][p] / cap) * cap        (only with a soft cap: Gemma 2)
 *     w[r][p]      = exp(scores[r][p] - max_p scores[r])    (glibc's vector expf, <= 4 ulp)
 *     out[r]       = sum_p w[r][p] * V[p][r / groups] / sum_p w[r][p]
 *
 * Positions outside [first, end) are never read, so stale bytes of the pool (even NaN) never
 * reach an output. fp32 throughout; ~1e-6 relative from SDPA (another summation order).
 *
 * bf16 (paged_decode_bf16) computes what torch's CPU flash attention computes, step for step,
 * so that it stays within fp32 summation-order noise of the SDPA transformers runs (see there).
 * It has no soft cap (transformers runs Gemma 2's capped attention eagerly, not as SDPA: bf16
 * with a cap takes the torch path).
 *
 * A soft cap of 0 means none: then the kernel is what it was without one (one test per
 * sequence, none per score); with one, a pass over each sequence's score rows caps them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* Each query head's row of scores [hq][padded] (len used) -> exp(score - row max) in place,
 * the padding -> 0; sums[r] = the row's total. */
static void softmax_rows(float *scores, int hq, int64_t len, int64_t padded, float *sums) {
    for (int r = 0; r < hq; r++) {
        float *sr = scores + r * padded, m = -INFINITY;
        for (int64_t j = 0; j < len; j++) m = sr[j] > m ? sr[j] : m;
        for (int64_t j = len; j < padded; j++) sr[j] = -INFINITY; /* exp -> 0 */
        vf mv = vf_set1(m), total = vf_zero();
        for (int64_t j = 0; j < padded; j += PS_VEC) {
            vf e = vf_expf(vf_sub(vf_load(sr + j), mv));
            vf_store(sr + j, e);
            total = vf_add(total, e);
        }
        sums[r] = vf_sum(total);
    }
}

/* Each query head's row of scores [hq][padded] (len used) capped as transformers' eager
 * attention caps them (Gemma 2): tanh(score / cap) * cap, each step rounded to fp32. */
static void softcap_rows(float *scores, int hq, int64_t len, int64_t padded, float cap) {
    for (int r = 0; r < hq; r++)
        for (int64_t j = 0; j < len; j++)
            scores[r * padded + j] = tanhf(scores[r * padded + j] / cap) * cap;
}

/* out[r] = acc[r] / sums[r] for each query head. */
static void normalize(float *os, const float *acc, const float *sums, int hq, int d) {
    for (int r = 0; r < hq; r++)
        for (int i = 0; i < d; i++) os[r * d + i] = acc[r * d + i] / sums[r];
}

enum { F32 = 0, I8 = 1, E4M3 = 2, BF16 = 3 }; /* what K and V hold */

/* float -> bf16 bits, to nearest even (a NaN stays a quiet NaN), as torch rounds */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_round(float f) {
    uint32_t u = (uint32_t)bf16_bits(f) << 16;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

/* PS_VEC consecutive elements of K or V, as floats: fp32 values, bf16 bits, or int8 / e4m3 codes
 * (e4m3 decoded through the 256-entry table lut). `at` counts elements (bytes for codes). */
AI vf loadv(const void *base, int64_t at, int kind, const float *lut) {
    if (kind == F32) return vf_loadu((const float *)base + at);
    if (kind == BF16) return vf_from_bf16((const uint16_t *)base + at);
    if (kind == E4M3) return vf_from_e4m3((const uint8_t *)base + at, lut);
    return vf_from_i8((const int8_t *)base + at);
}

/* What one fp32 or 8-bit call attends: the arguments its sequences share. */
typedef struct {
    const float *q;
    int64_t q_tok;
    const void *k, *v;
    int64_t blk, pos;
    const float *ks, *vs; /* 8-bit caches: scales [block][kv head] */
    int64_t sblk;
    const int64_t *tables;
    int64_t tstride;
    const int64_t *qrow, *trow, *first, *end;
    float *out;
    int64_t o_tok;
    int hq, hkv, d, bs;
    float scale, cap;
    const float *lut;
} attn;


/* q . K at element `at`, C vectors: the one product every score is (lane-wise FMAs in order) */
AI vf dot_lanes(const float *qr, const void *k, int64_t at, int kind, const float *lut, int C) {
    vf a = vf_mul(vf_loadu(qr), loadv(k, at, kind, lut));
    for (int c = 1; c < C; c++) a = vf_fmadd(vf_loadu(qr + PS_VEC * c), loadv(k, at + PS_VEC * c, kind, lut), a);
    return a;
}

/* One score: scale * q . K (times the block's K scale for codes) */
AI float score(const attn *a, float dot, int64_t b, int h, int kind) {
    return kind == F32 ? dot * a->scale : dot * a->ks[b * a->sblk + h] * a->scale;
}

/* Where a sequence's attended positions lie, j = p - first: at[j] is the element offset of
 * position p's K (and V) row, blocks[j] its block (8-bit caches' scales). Walked once per
 * sequence: NOTE a division and a modulo by the block size per position and use cost more than
 * the scores' arithmetic (they were ~10 a position). */
typedef struct {
    int64_t *at, *blocks;
} places;

static void place(const attn *a, const int64_t *table, int64_t lo, int64_t len, places *w) {
    int64_t b = lo / a->bs, slot = lo % a->bs;
    for (int64_t j = 0; j < len; j++) {
        w->blocks[j] = table[b];
        w->at[j] = table[b] * a->blk + slot * a->pos;
        if (++slot == a->bs) slot = 0, b++;
    }
}

/* Every query head's scores against PS_VEC positions from j0, into column j0 of its row.
 * NOTE: vf_sum_lanes reduces the PS_VEC products with vf_sum's own adding tree, so each score
 * is bit for bit what one vf_sum per position gives (the tail positions' path). */
AI void score_tile(const attn *a, const float *qs, const places *w, int64_t j0, float *scores,
                   int64_t padded, int kind, int C) {
    const int groups = a->hq / a->hkv;
    for (int r = 0; r < a->hq; r++) {
        const int h = r / groups;
        vf dots[PS_VEC];
        for (int t = 0; t < PS_VEC; t++)
            dots[t] = dot_lanes(qs + r * a->d, a->k, w->at[j0 + t] + h * a->d, kind, a->lut, C);
        const vf sums = vf_sum_lanes(dots);
        float *row = scores + r * padded + j0;
        if (kind == F32) {
            vf_storeu(row, vf_mul(sums, vf_set1(a->scale)));
            continue;
        }
        float each[PS_VEC];
        vf_storeu(each, sums);
        for (int t = 0; t < PS_VEC; t++) row[t] = score(a, each[t], w->blocks[j0 + t], h, kind);
    }
}

/* Ask for the cache lines of `width` bytes at element offset `at` of `base` ahead of their use:
 * a table's blocks lie anywhere in the pool, beyond what the hardware prefetcher follows */
AI void fetch(const void *base, int64_t at, int64_t width, int kind) {
    const char *row = (const char *)base + at * (kind == F32 ? 4 : 1);
    for (int64_t off = 0; off < width; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
}

/* scores[r][j] for every query head r and attended position j < len */
AI void scores_of(const attn *a, const float *qs, const places *w, int64_t len, float *scores,
                  int64_t padded, int kind, int C) {
    const int groups = a->hq / a->hkv;
    const int64_t width = (int64_t)a->hkv * a->d * (kind == F32 ? 4 : 1);
    int64_t j = 0;
    for (; j + PS_VEC <= len; j += PS_VEC) {
        if (j + 2 * PS_VEC <= len)
            for (int t = 0; t < PS_VEC; t++) fetch(a->k, w->at[j + PS_VEC + t], width, kind);
        score_tile(a, qs, w, j, scores, padded, kind, C);
    }
    for (; j < len; j++)
        for (int r = 0; r < a->hq; r++) {
            const int h = r / groups;
            const vf dot = dot_lanes(qs + r * a->d, a->k, w->at[j] + h * a->d, kind, a->lut, C);
            scores[r * padded + j] = score(a, vf_sum(dot), w->blocks[j], h, kind);
        }
}

enum { PV_REGS = PS_VEC == 16 ? 16 : 8 }; /* accumulators held in registers */

enum { PV_AHEAD = 16 }; /* positions between a V row's prefetch and its use */

/* acc[r][c0 ..] += sum_j w[r][j] * V[j][h][c0 ..] for NR query heads r0.. of KV head h, C
 * vectors each from vector c0, held in registers across the positions (in position order) */
AI void weigh_rows(const attn *a, const places *w, int64_t len, const float *scores,
                   int64_t padded, int r0, int NR, int h, float *acc, int kind, int c0, int C) {
    const int64_t width = (int64_t)C * PS_VEC * (kind == F32 ? 4 : 1), col = h * a->d + PS_VEC * c0;
    vf x[PV_REGS];
    for (int i = 0; i < NR * C; i++) x[i] = vf_zero();
    for (int64_t j = 0; j < len; j++) {
        const int64_t vh = w->at[j] + col;
        const float vscale = kind == F32 ? 1.0f : a->vs[w->blocks[j] * a->sblk + h];
        if (j + PV_AHEAD < len) fetch(a->v, w->at[j + PV_AHEAD] + col, width, kind);
        vf vrow[PV_REGS];
        for (int c = 0; c < C; c++) vrow[c] = loadv(a->v, vh + PS_VEC * c, kind, a->lut);
        for (int i = 0; i < NR; i++) {
            const float weight = scores[(r0 + i) * padded + j];
            const vf wv = vf_set1(kind == F32 ? weight : weight * vscale);
            for (int c = 0; c < C; c++) x[i * C + c] = vf_fmadd(wv, vrow[c], x[i * C + c]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int c = 0; c < C; c++)
            vf_storeu(acc + (r0 + i) * a->d + PS_VEC * (c0 + c), x[i * C + c]);
}

/* weigh_rows for nr (1 to 4) heads, nr a constant in each call (registers) */
AI void weigh_heads(const attn *a, const places *w, int64_t len, const float *scores,
                    int64_t padded, int r, int nr, int h, float *acc, int kind, int c0, int C) {
    /* NOTE: nr * C <= PV_REGS always; the tests drop, in each compiled copy, the cases that
     * cannot fit (GCC warned of their arrays' bounds) */
    switch (nr) {
    case 1: weigh_rows(a, w, len, scores, padded, r, 1, h, acc, kind, c0, C); break;
    case 2:
        if (2 * C <= PV_REGS) weigh_rows(a, w, len, scores, padded, r, 2, h, acc, kind, c0, C);
        break;
    case 3:
        if (3 * C <= PV_REGS) weigh_rows(a, w, len, scores, padded, r, 3, h, acc, kind, c0, C);
        break;
    default:
        if (4 * C <= PV_REGS) weigh_rows(a, w, len, scores, padded, r, 4, h, acc, kind, c0, C);
        break;
    }
}

/* acc[r] = sum_j w[r][j] * V[j][r / groups] for every query head: the heads of one KV head
 * side by side, as many as registers hold (C vectors each, at most 4 heads); a head wider than
 * the registers (AVX2 with head_dim 128 and more) in column slices, PV_REGS / nr vectors of
 * nr heads a pass, so each V row is still read once per KV head */
AI void weigh(const attn *a, const places *w, int64_t len, const float *scores, int64_t padded,
              float *acc, int kind, int C) {
    const int groups = a->hq / a->hkv;
    for (int r = 0; r < a->hq;) {
        const int h = r / groups, left = (h + 1) * groups - r;
        if (C <= PV_REGS) {
            const int fit = PV_REGS / C < 4 ? PV_REGS / C : 4, nr = left < fit ? left : fit;
            weigh_heads(a, w, len, scores, padded, r, nr, h, acc, kind, 0, C);
            r += nr;
            continue;
        }
        const int nr = left < 4 ? left : 4, slice = PV_REGS / nr;
        for (int c0 = 0; c0 < C; c0 += slice)
            weigh_heads(a, w, len, scores, padded, r, nr, h, acc, kind, c0,
                        C - c0 < slice ? C - c0 : slice);
        r += nr;
    }
}

/* Sequence s: its scores, their softmax, the weighted values into its output row. Returns 1
 * when its scratch allocation failed. `kind` and C are constants in each compiled copy
 * (sequence_fn): NOTE an OpenMP body is outlined before inlining, so a constant passed into
 * one would stay a run-time test in every load. */
AI int one_sequence(const attn *a, int s, int kind, int C) {
    const int64_t lo = a->first[s], hi = a->end[s], len = hi - lo;
    const int64_t padded = (len + PS_VEC - 1) & ~(int64_t)(PS_VEC - 1);
    if (len <= 0) return 0;
    /* scratch: scores [hq][padded], acc [hq][d], then the places (2 x padded int64) */
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(a->hq * padded + a->hq * a->d) +
                                          sizeof(int64_t) * (size_t)(2 * padded));
    if (scores == NULL) return 1;
    float *acc = scores + a->hq * padded;
    places w = {(int64_t *)(acc + a->hq * a->d), NULL};
    w.blocks = w.at + padded;
    place(a, a->tables + a->trow[s] * a->tstride, lo, len, &w);
    scores_of(a, a->q + a->qrow[s] * a->q_tok, &w, len, scores, padded, kind, C);
    if (a->cap > 0.0f) softcap_rows(scores, a->hq, len, padded, a->cap);
    float sums[64]; /* hq <= 64: checked by the caller */
    softmax_rows(scores, a->hq, len, padded, sums);
    weigh(a, &w, len, scores, padded, acc, kind, C);
    normalize(a->out + a->qrow[s] * a->o_tok, acc, sums, a->hq, a->d);
    free(scores);
    return 0;
}

typedef int (*sequence_fn)(const attn *, int);

#define SEQUENCE(KIND, C)                                                                        \
    static int seq_##KIND##_##C(const attn *a, int s) { return one_sequence(a, s, KIND, C); }
#define SEQUENCES(KIND)                                                                          \
    SEQUENCE(KIND, 1)                                                                            \
    SEQUENCE(KIND, 2)                                                                            \
    SEQUENCE(KIND, 4)                                                                            \
    SEQUENCE(KIND, 8)                                                                            \
    static int seq_##KIND##_any(const attn *a, int s) { return one_sequence(a, s, KIND, a->d / PS_VEC); }
SEQUENCES(F32)
SEQUENCES(I8)
SEQUENCES(E4M3)

/* The copy compiled for this cache kind and head width (vectors per head) */
static sequence_fn sequence_for(int kind, int chunks) {
    static const sequence_fn fns[3][5] = {
        {seq_F32_1, seq_F32_2, seq_F32_4, seq_F32_8, seq_F32_any},
        {seq_I8_1, seq_I8_2, seq_I8_4, seq_I8_8, seq_I8_any},
        {seq_E4M3_1, seq_E4M3_2, seq_E4M3_4, seq_E4M3_8, seq_E4M3_any},
    };
    const int at = chunks == 1 ? 0 : chunks == 2 ? 1 : chunks == 4 ? 2 : chunks == 8 ? 3 : 4;
    return fns[kind][at];
}

/* The part of `a` that is KV head h alone: its query heads, its K/V columns (`kind`'s
 * element size), its scales and its output heads. A head's outputs are computed by the same
 * operations whichever heads share the call (per query head: scores, softmax, weights). */
static attn one_head(const attn *a, int h, int kind) {
    const int groups = a->hq / a->hkv;
    const int64_t bytes = (int64_t)h * a->d * (kind == F32 ? 4 : 1);
    attn part = *a;
    part.q = a->q + (int64_t)h * groups * a->d;
    part.out = a->out + (int64_t)h * groups * a->d;
    part.k = (const char *)a->k + bytes;
    part.v = (const char *)a->v + bytes;
    if (a->ks) part.ks = a->ks + h, part.vs = a->vs + h;
    part.hq = groups, part.hkv = 1;
    return part;
}

/* Every sequence of the call, one OpenMP task each; with fewer sequences than threads (a
 * decode step of one sequence), one task per (sequence, KV head), so that no thread only
 * waits: the outputs are bit for bit the same either way. Returns 1 when a scratch allocation
 * failed. */
static int attend(const attn *a, int n, int threads, int kind) {
    const sequence_fn fn = sequence_for(kind, a->d / PS_VEC);
    const int split = n < threads ? a->hkv : 1, tasks = n * split;
    int failed = 0;
    if (tasks == 0) return 0; /* NOTE: num_threads(0) is not allowed */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads < tasks ? threads : tasks)
    for (int t = 0; t < tasks; t++) {
        const attn part = split == 1 ? *a : one_head(a, t % split, kind);
        if (fn(&part, t / split)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}

/* Returns 0, or 1 when a scratch allocation failed (the caller falls back). */
int paged_decode_f32(
    const float *q, int64_t q_tok,        /* query [rows, hq, d], row stride q_tok */
    const float *k, const float *v,       /* the layer's K and V views */
    int64_t blk, int64_t pos,             /* their block and position strides (head: d) */
    const int64_t *tables, int64_t tstride, /* block tables, row stride */
    const int64_t *qrow, const int64_t *trow, /* per sequence: its query row, its table row */
    const int64_t *first, const int64_t *end, /* per sequence: attended positions */
    float *out, int64_t o_tok,            /* output [rows, hq, d], row stride o_tok */
    int n, int hq, int hkv, int d, int bs, float scale,
    float softcap,                        /* > 0: scores soft-capped; 0: none */
    int threads) {
    const attn a = {q, q_tok, k, v, blk, pos, NULL, NULL, 0, tables, tstride, qrow, trow,
                    first, end, out, o_tok, hq, hkv, d, bs, scale, softcap, NULL};
    return attend(&a, n, threads, F32);
}

enum { KV_SPLIT = 512 }; /* torch's CPU flash attention: keys in blocks of 512, online softmax */

/* One bf16 sequence as torch's CPU flash attention computes one query row: per block of up to
 * KV_SPLIT keys, scores = (q . k) * scale in fp32 (bf16 products are exact), the running max
 * m' = max(m, block max), weights exp(score - m') (vf_exp_sdpa, torch's fexp_u20, on whole
 * vectors of PS_VEC, expf on the rest), the row sum s' = s * expf(m - m') + block sum (of
 * unrounded weights, the tail added in order), acc' = acc * expf(m - m') + sum_p bf16(weight) * V (the weights rounded to bf16, as
 * SDPA stores them before its P.V GEMM); at the end bf16(acc * (1 / s)). */
static void decode_bf16_seq(const float *qs, const uint16_t *k, const uint16_t *v, int64_t blk,
                            int64_t pos, const int64_t *table, int64_t lo, int64_t hi,
                            uint16_t *os, int hq, int hkv, int d, int bs, float scale,
                            float *scores, float *acc, float *maxes, float *sums) {
    const int groups = hq / hkv, chunks = d / PS_VEC;
    for (int r = 0; r < hq; r++) maxes[r] = -INFINITY, sums[r] = 0.0f;
    memset(acc, 0, sizeof(float) * hq * d);
    for (int64_t a = lo; a < hi; a += KV_SPLIT) {
        const int64_t len = hi - a < KV_SPLIT ? hi - a : KV_SPLIT, whole = len & ~(int64_t)(PS_VEC - 1);
        for (int64_t p = a; p < a + len; p++) {
            const int64_t kp = table[p / bs] * blk + (p % bs) * pos;
            for (int r = 0; r < hq; r++) {
                const float *qr = qs + r * d;
                const int64_t kh = kp + (r / groups) * d;
                vf dot = vf_mul(vf_loadu(qr), loadv(k, kh, BF16, NULL));
                for (int c = 1; c < chunks; c++)
                    dot = vf_fmadd(vf_loadu(qr + PS_VEC * c), loadv(k, kh + PS_VEC * c, BF16, NULL), dot);
                scores[r * KV_SPLIT + (p - a)] = vf_sum(dot) * scale;
            }
        }
        for (int r = 0; r < hq; r++) {
            float *sr = scores + r * KV_SPLIT, m = maxes[r];
            for (int64_t j = 0; j < len; j++) m = sr[j] > m ? sr[j] : m;
            const vf mv = vf_set1(m);
            vf total = vf_zero();
            for (int64_t j = 0; j < whole; j += PS_VEC) {
                const vf e = vf_exp_sdpa(vf_sub(vf_loadu(sr + j), mv));
                vf_storeu(sr + j, e);
                total = vf_add(total, e);
            }
            float block_sum = vf_sum(total);
            for (int64_t j = whole; j < len; j++) {
                sr[j] = expf(sr[j] - m);
                block_sum += sr[j];
            }
            const float shrink = expf(maxes[r] - m);
            sums[r] = block_sum + shrink * sums[r];
            maxes[r] = m;
            if (a > lo) {
                const vf sv = vf_set1(shrink);
                for (int c = 0; c < chunks; c++)
                    vf_storeu(acc + r * d + PS_VEC * c, vf_mul(vf_loadu(acc + r * d + PS_VEC * c), sv));
            }
            for (int64_t j = 0; j < len; j++) sr[j] = bf16_round(sr[j]);
        }
        for (int64_t p = a; p < a + len; p++) {
            const int64_t vp = table[p / bs] * blk + (p % bs) * pos;
            for (int r = 0; r < hq; r++) {
                const int64_t vh = vp + (r / groups) * d;
                float *ar = acc + r * d;
                const vf w = vf_set1(scores[r * KV_SPLIT + (p - a)]);
                for (int c = 0; c < chunks; c++)
                    vf_storeu(ar + PS_VEC * c,
                              vf_fmadd(w, loadv(v, vh + PS_VEC * c, BF16, NULL), vf_loadu(ar + PS_VEC * c)));
            }
        }
    }
    for (int r = 0; r < hq; r++) {
        const float inv = 1.0f / sums[r];
        for (int i = 0; i < d; i++) os[r * d + i] = bf16_bits(acc[r * d + i] * inv);
    }
}

/* The same attention over a bf16 cache, into a bf16 output; the query comes as fp32 (its bf16
 * values widened, exactly). Returns 0, or 1 when a scratch allocation failed. */
int paged_decode_bf16(
    const float *q, int64_t q_tok,
    const uint16_t *k, const uint16_t *v, /* the layer's K and V views (bf16 bits) */
    int64_t blk, int64_t pos,             /* their block and position strides, in elements */
    const int64_t *tables, int64_t tstride,
    const int64_t *qrow, const int64_t *trow,
    const int64_t *first, const int64_t *end,
    uint16_t *out, int64_t o_tok,         /* output [rows, hq, d] (bf16 bits) */
    int n, int hq, int hkv, int d, int bs, float scale, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: scores [hq][KV_SPLIT], acc [hq][d], maxes and sums [hq] */
        float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(hq * (KV_SPLIT + d + 32)));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < n; s++) {
            if (scratch == NULL || end[s] <= first[s]) continue;
            float *acc = scratch + hq * KV_SPLIT, *maxes = acc + hq * d, *sums = maxes + hq;
            decode_bf16_seq(q + qrow[s] * q_tok, k, v, blk, pos, tables + trow[s] * tstride,
                            first[s], end[s], out + qrow[s] * o_tok, hq, hkv, d, bs, scale,
                            scratch, acc, maxes, sums);
        }
        free(scratch);
    }
    return failed;
}

/* The same attention over an 8-bit cache (kernels/kv_quant.py): K and V hold codes, int8
 * (fp8 == 0) or float8 e4m3 (fp8 == 1, decoded through the table lut), and each (block, KV
 * head) has a float32 scale: value = code * scale. ~1e-7 relative from dequantizing first.
 * `softcap` as paged_decode_f32's. */
int paged_decode_q8(
    const float *q, int64_t q_tok,
    const uint8_t *k, const uint8_t *v,   /* the layer's K and V code views (1 byte each) */
    int64_t blk, int64_t pos,             /* their block and position strides, in bytes */
    const float *ks, const float *vs, int64_t sblk, /* scales [block][kv head], block stride */
    const int64_t *tables, int64_t tstride,
    const int64_t *qrow, const int64_t *trow,
    const int64_t *first, const int64_t *end,
    float *out, int64_t o_tok,
    int n, int hq, int hkv, int d, int bs, float scale, float softcap, int threads, int fp8,
    const float *lut) {
    const attn a = {q, q_tok, k, v, blk, pos, ks, vs, sblk, tables, tstride, qrow, trow,
                    first, end, out, o_tok, hq, hkv, d, bs, scale, softcap, lut};
    return attend(&a, n, threads, fp8 ? E4M3 : I8);
}

/* A decode step's int8 KV write (kernels/kv_quant.py's rule, bit for bit): token t goes to slot
 * offs[t] of block blocks[t] (one token per block). Per KV head: the block's scale grows to
 * absmax / 127 when the token is larger (a block's first slot starts from 0), the block's
 * earlier codes are re-encoded to it (round(code * old / new)), then the token is encoded.
 * Rounding is to nearest, ties to even (nearbyintf), as torch.round. */
void kv_append_i8(
    int8_t *codes, int64_t blk, int64_t pos,  /* the layer's code view: block and slot strides */
    float *scales, int64_t sblk,              /* its scales [block][kv head] */
    const float *x,                           /* [T, H, D] contiguous */
    const int64_t *blocks, const int64_t *offs, int t_count, int h_count, int d, int bs) {
    for (int t = 0; t < t_count; t++) {
        const int64_t b = blocks[t], off = offs[t];
        int8_t *block = codes + b * blk;
        for (int h = 0; h < h_count; h++) {
            const float *xh = x + ((int64_t)t * h_count + h) * d;
            float amax = 0.0f;
            for (int i = 0; i < d; i++) amax = fmaxf(amax, fabsf(xh[i]));
            const float old = off == 0 ? 0.0f : scales[b * sblk + h];
            const float grown = amax / 127.0f, now = grown > old ? grown : old;
            if (off > 0 && now > old) {
                const float ratio = old / now;
                for (int p = 0; p < bs; p++) {
                    int8_t *c = block + p * pos + h * d;
                    for (int i = 0; i < d; i++)
                        c[i] = (int8_t)fminf(127.0f, fmaxf(-127.0f, nearbyintf((float)c[i] * ratio)));
                }
            }
            scales[b * sblk + h] = now;
            const float divisor = now > 0.0f ? now : 1.0f;
            int8_t *c = block + off * pos + h * d;
            for (int i = 0; i < d; i++)
                c[i] = (int8_t)fminf(127.0f, fmaxf(-127.0f, nearbyintf(xh[i] / divisor)));
        }
    }
}

/* For the tests: the PS_VEC vectors of v [PS_VEC][PS_VEC] summed both ways, tiled[j] by
 * vf_sum_lanes, single[j] by vf_sum (the scores' two paths; they must agree bit for bit). */
int sum_lanes_check(const float *v, float *tiled, float *single) {
    vf vs[PS_VEC];
    for (int j = 0; j < PS_VEC; j++) vs[j] = vf_loadu(v + PS_VEC * j);
    vf_storeu(tiled, vf_sum_lanes(vs));
    for (int j = 0; j < PS_VEC; j++) single[j] = vf_sum(vs[j]);
    return PS_VEC;
}
