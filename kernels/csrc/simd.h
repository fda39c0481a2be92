/* The vector layer of the native CPU kernels (paged_decode.c, linear_i8g.c, linear_i4g.c): one
 * width per build, which kernels/cpu_native.py chooses to match torch's own CPU capability:
 *
 *     PS_VEC == 16   AVX-512F   (torch's "AVX512")
 *     PS_VEC == 8    AVX2 + FMA + F16C (torch's "AVX2": AMD Zen 1-3, Intel before Skylake-X)
 *
 * The bf16 attention follows torch's CPU flash attention step for step, and that code takes
 * its fast exponential on whole vectors of torch's width and `exp` on the rest: the same width
 * here keeps the same weights. Every function below is what the kernels need, no more.
 */
#ifndef PAGEDSERVE_SIMD_H
#define PAGEDSERVE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* inlined into its caller, so constant arguments become constants in each copy */
#define AI static inline __attribute__((always_inline))

/* Row-wise kernels (rms_norm.c, layer_ops.c) split their rows between OpenMP threads from this
 * many on: a prompt's thousands; a decode step's few stay on the calling thread. */
#define PS_PARALLEL_ROWS 128

/* Weights streamed at one row of x: ask for the cache line some bytes on. At one token per
 * step the codes' bytes are the cost, and without it the int8 kernel read 6.6 GB/s on one
 * Sapphire Rapids core (12.9 on two) where the machine reads ~27: the hardware prefetcher
 * alone did not run far enough ahead of a consumer this slow (docs/kernels.md).
 * NOTE: GCC 12 dropped _mm_prefetch inside an always-inline caller (linear_i4g.c's panel);
 * the builtin stays. */
static inline void prefetch_at(const void *p, int64_t ahead) { /* prefetcht0: into L1 */
    __builtin_prefetch((const char *)p + ahead, 0, 3);
}
/* The int8 and int4 one-row kernels': each line into L2 8 KB on (prefetcht1) and into L1 2 KB
 * on (int4 over 212 MB of codes: 16.8 -> 17.5-17.7 GB/s against 4 KB into L1 alone). Over
 * 425 MB of codes (beyond this VM's L3), two cores: 2 KB into L1 alone read 15.4-15.7 GB/s,
 * 4 KB into L2 alone 18.1-18.5; with the kernel's two rows and per-row scale, 4 KB into L2
 * 20.4-21.3 and both 22.3-22.9 in the same minutes */
static inline void prefetch_ahead(const void *p) {
    __builtin_prefetch((const char *)p + 8192, 0, 2);
    __builtin_prefetch((const char *)p + 2048, 0, 3);
}

/* Linears side by side over one x (linear_i8g.c's and linear_i4g.c's `_parts` entries: q / k /
 * v, gate / up) share one parallel region: at most this many, and task t belongs to the part
 * i with first[i] <= t < first[i + 1] (first[0] = 0, each part's tasks after the last's). */
#define PS_MAX_PARTS 8
static inline int part_of(const int64_t *first, int64_t t) {
    int i = 0;
    while (t >= first[i + 1]) i++;
    return i;
}

#if PS_VEC == 16

typedef __m512 vf;
__m512 _ZGVeN16v_expf(__m512); /* libmvec, <= 4 ulp */

static inline vf vf_load(const float *p) { return _mm512_load_ps(p); }
static inline vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_store_ps(p, a); }
static inline void vf_storeu(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a*b + c */
static inline float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
/* Lane j = vf_sum(v[j]) bit for bit: the same adding tree (lanes i + 8, then i + 4, then
 * i + 2, then i + 1), run on all 16 vectors at once; shuffles keep each vector's partial sums
 * in the lanes its next level adds. */
static inline __m512 vs_halves(__m512 a, __m512 b) { /* [a lanes i + i+8 | b lanes i + i+8] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
}
static inline __m512 vs_quarters(__m512 a, __m512 b) { /* 128-bit: [a0+a1, a2+a3, b0+b1, b2+b3] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
}
static inline vf vf_sum_lanes(const vf *v) {
    __m512 t[4], w[2];
    for (int m = 0; m < 4; m++) /* t[m], 128-bit lane k: vector 4k + m's four partial sums */
        t[m] = vs_quarters(vs_halves(v[m], v[4 + m]), vs_halves(v[8 + m], v[12 + m]));
    for (int i = 0; i < 2; i++) /* per 128-bit lane: [x0 + x2, x1 + x3] of two vectors */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
}
static inline vf vf_expf(vf a) { return _ZGVeN16v_expf(a); }

/* PS_VEC consecutive bf16 values (their bits), widened exactly */
static inline vf vf_from_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_from_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* int4 codes, one 32-bit word per output row (linear_i4g.c's layout): the words of `lanes`
 * rows (the rest zero) */
typedef __m512i vq4c;
static inline __mmask16 lanes_mask(int lanes) { return (__mmask16)((1u << lanes) - 1); }
static inline vq4c vq4_load(const uint8_t *p, int lanes) {
    return lanes == 16 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(lanes_mask(lanes), p);
}
/* code j of each word as a float: a lookup in 0 .. 15 (vpermps reads an index's low 4 bits) */
static inline vf vq4_code(vq4c v, int j) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * j), codes);
}
/* a group's 16 float16 scales, then its 16 minimums, as floats */
static inline void vq4_pairs(const uint16_t *p, vf *scale, vf *low) {
    *scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    *low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16)));
}
static inline void vf_store_lanes(float *p, vf a, int lanes) {
    _mm512_mask_storeu_ps(p, lanes_mask(lanes), a);
}
/* float8 e4m3 codes, decoded through their 256-entry table */
static inline vf vf_from_e4m3(const uint8_t *p, const float *lut) {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), lut, 4);
}

/* torch's Vectorized<float>::fexp_u20 (vec512_float.h), the same arithmetic */
static inline vf vf_exp_sdpa(vf x) {
    const __mmask16 under =
        _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50)), _CMP_LT_OS);
    const __mmask16 over =
        _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218)), _CMP_GT_OS);
    __m512 t = _mm512_mul_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b))); /* x log2 e */
    const __m512 f = _mm512_sub_ps(t, _mm512_floor_ps(t));
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(-0.079204240219773236f),
                               _mm512_set1_ps(-0.22433836478672356f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.30354260500649682f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.00010703434948458272f));
    t = _mm512_fmadd_ps(_mm512_set1_ps(8388608.0f), _mm512_sub_ps(t, p),
                        _mm512_set1_ps(8388608.0f * 127.0f));
    __m512i bits = _mm512_cvttps_epi32(t);
    bits = _mm512_mask_mov_epi32(bits, under, _mm512_setzero_si512());
    bits = _mm512_mask_mov_epi32(bits, over, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(bits);
}

#elif PS_VEC == 8

typedef __m256 vf;
__m256 _ZGVdN8v_expf(__m256); /* libmvec, <= 4 ulp */

static inline vf vf_load(const float *p) { return _mm256_load_ps(p); }
static inline vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm256_store_ps(p, a); }
static inline void vf_storeu(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
/* halves, then pairs, then neighbours: the order of torch's vec_reduce_all on AVX2 */
static inline float vf_sum(vf a) {
    a = _mm256_add_ps(a, _mm256_permute2f128_ps(a, a, 0x1));
    a = _mm256_add_ps(a, _mm256_shuffle_ps(a, a, 0x4e));
    a = _mm256_add_ps(a, _mm256_shuffle_ps(a, a, 0xb1));
    return _mm256_cvtss_f32(a);
}
/* Lane j = vf_sum(v[j]) bit for bit: the same adding tree on all 8 vectors at once */
static inline vf vf_sum_lanes(const vf *v) {
    __m256 h[4], w[2];
    for (int m = 0; m < 4; m++) /* [vector m's lanes i + i+4 | vector 4 + m's] */
        h[m] = _mm256_add_ps(_mm256_permute2f128_ps(v[m], v[4 + m], 0x20),
                             _mm256_permute2f128_ps(v[m], v[4 + m], 0x31));
    for (int i = 0; i < 2; i++) /* per 128-bit lane: [x0 + x2, x1 + x3] of two vectors */
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * i], h[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(h[2 * i], h[2 * i + 1], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88), _mm256_shuffle_ps(w[0], w[1], 0xdd));
}
static inline vf vf_expf(vf a) { return _ZGVdN8v_expf(a); }

static inline vf vf_from_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_from_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
typedef __m256i vq4c;
static inline __m256i lanes_mask(int lanes) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vq4c vq4_load(const uint8_t *p, int lanes) {
    return lanes == 8 ? _mm256_loadu_si256((const __m256i *)p)
                      : _mm256_maskload_epi32((const int *)p, lanes_mask(lanes));
}
/* AVX2 has no 16-entry lookup in one instruction: the code's bits, converted (the same value) */
static inline vf vq4_code(vq4c v, int j) {
    const __m256i q = _mm256_srli_epi32(v, 4 * j);
    return _mm256_cvtepi32_ps(j == 7 ? q : _mm256_and_si256(q, _mm256_set1_epi32(15)));
}
/* 8 of a group's float16 scales, and the same rows' minimums 16 halves on (F16C), as floats */
static inline void vq4_pairs(const uint16_t *p, vf *scale, vf *low) {
    *scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    *low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
}
static inline void vf_store_lanes(float *p, vf a, int lanes) {
    if (lanes == 8)
        _mm256_storeu_ps(p, a);
    else
        _mm256_maskstore_ps(p, lanes_mask(lanes), a);
}
static inline vf vf_from_e4m3(const uint8_t *p, const float *lut) {
    return _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), 4);
}

/* torch's Vectorized<float>::fexp_u20 (vec256_float.h), the same arithmetic */
static inline vf vf_exp_sdpa(vf x) {
    const __m256 under =
        _mm256_cmp_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0xc2aeac50)), _CMP_LT_OS);
    const __m256 over =
        _mm256_cmp_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x42b17218)), _CMP_GT_OS);
    __m256 t = _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x3fb8aa3b)));
    const __m256 f = _mm256_sub_ps(t, _mm256_floor_ps(t));
    __m256 p = _mm256_fmadd_ps(f, _mm256_set1_ps(-0.079204240219773236f),
                               _mm256_set1_ps(-0.22433836478672356f));
    p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(0.30354260500649682f));
    p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(0.00010703434948458272f));
    t = _mm256_fmadd_ps(_mm256_set1_ps(8388608.0f), _mm256_sub_ps(t, p),
                        _mm256_set1_ps(8388608.0f * 127.0f));
    __m256 bits = _mm256_castsi256_ps(_mm256_cvttps_epi32(t));
    bits = _mm256_blendv_ps(bits, _mm256_setzero_ps(), under);
    return _mm256_blendv_ps(bits, _mm256_set1_ps(__builtin_inff()), over);
}

#else
#error "PS_VEC must be 16 (AVX-512) or 8 (AVX2 + FMA); kernels/cpu_native.py sets it"
#endif

#endif /* PAGEDSERVE_SIMD_H */
