/* hetspec's native CPU verifier; contracts in hsnative.h, design in docs/architecture.md.
 *
 * Build with -ffp-contract=off: a fused multiply-add that the compiler forms in one
 * specialization of a kernel and not in another would break width invariance. */
#include "hsnative.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HS_X86 1
#define HS_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define HS_X86 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define INLINE __attribute__((always_inline)) static inline
#define ROW_TILE 4    /* rows sharing each weight block load (tile_avx2 has a case each) */
#define COL_CHUNK 16  /* output features a thread takes at a time */

typedef struct {
    uint16_t d;
    int8_t qs[HS_BLOCK];
} block_q8_0;

typedef struct {
    uint16_t d;
    uint8_t qs[HS_BLOCK / 2]; /* element i in the low nibble of qs[i], i + 16 in the high */
} block_q4_0;

_Static_assert(sizeof(block_q8_0) == 34, "GGUF Q8_0 blocks are 34 bytes");
_Static_assert(sizeof(block_q4_0) == 18, "GGUF Q4_0 blocks are 18 bytes");

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        const float magnitude = ldexpf((float)mantissa, -24); /* zero or subnormal */
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int hs_simd_level(void) {
#if HS_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static int is_quantized(int type) { return type == HS_Q8_0 || type == HS_Q4_0; }

static size_t row_bytes(const hs_matrix *w) {
    switch (w->type) {
    case HS_F32: return (size_t)w->cols * 4;
    case HS_F16: return (size_t)w->cols * 2;
    case HS_Q8_0: return (size_t)(w->cols / HS_BLOCK) * sizeof(block_q8_0);
    case HS_Q4_0: return (size_t)(w->cols / HS_BLOCK) * sizeof(block_q4_0);
    default: return 0;
    }
}

static int matrix_ok(const hs_matrix *w, int rows, int cols) {
    return w->data && w->rows == rows && w->cols == cols && row_bytes(w) &&
           (!is_quantized(w->type) || cols % HS_BLOCK == 0);
}

/* ------------------------------------------------------------------ per-row float steps */

static void quantize_row(const float *x, int cols, int8_t *q, float *scale) {
    for (int b = 0; b < cols / HS_BLOCK; b++) {
        const float *xb = x + (size_t)b * HS_BLOCK;
        float amax = 0.0f;
        for (int k = 0; k < HS_BLOCK; k++) amax = fmaxf(amax, fabsf(xb[k]));
        const float d = amax / 127.0f;
        const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        for (int k = 0; k < HS_BLOCK; k++) q[b * HS_BLOCK + k] = (int8_t)roundf(xb[k] * inverse);
        scale[b] = d;
    }
}

void hs_quantize_rows(const float *x, int n, int cols, int8_t *q, float *scale) {
    for (int i = 0; i < n; i++)
        quantize_row(x + (size_t)i * cols, cols, q + (size_t)i * cols,
                     scale + (size_t)i * (cols / HS_BLOCK));
}

static void rms_norm(const float *x, const float *weight, int cols, float eps, float *out) {
    double squares = 0.0;
    for (int k = 0; k < cols; k++) squares += (double)x[k] * x[k];
    const float scale = 1.0f / sqrtf((float)(squares / cols) + eps);
    for (int k = 0; k < cols; k++) out[k] = x[k] * scale * weight[k];
}

static void embed_row(const hs_matrix *e, int token, float *out) {
    const char *row = (const char *)e->data + row_bytes(e) * (size_t)token;
    switch (e->type) {
    case HS_F32: memcpy(out, row, (size_t)e->cols * 4); break;
    case HS_F16:
        for (int k = 0; k < e->cols; k++) out[k] = half_to_float(((const uint16_t *)row)[k]);
        break;
    case HS_Q8_0:
        for (int b = 0; b < e->cols / HS_BLOCK; b++) {
            const block_q8_0 *blk = (const block_q8_0 *)row + b;
            const float d = half_to_float(blk->d);
            for (int k = 0; k < HS_BLOCK; k++) out[b * HS_BLOCK + k] = d * blk->qs[k];
        }
        break;
    case HS_Q4_0:
        for (int b = 0; b < e->cols / HS_BLOCK; b++) {
            const block_q4_0 *blk = (const block_q4_0 *)row + b;
            const float d = half_to_float(blk->d);
            for (int k = 0; k < HS_BLOCK / 2; k++) {
                out[b * HS_BLOCK + k] = d * ((blk->qs[k] & 0x0f) - 8);
                out[b * HS_BLOCK + k + HS_BLOCK / 2] = d * ((blk->qs[k] >> 4) - 8);
            }
        }
        break;
    }
}

/* Rotate pairs (2i, 2i+1) of each head by the angles of one position. */
static void rope_row(float *x, int heads, int head_dim, const float *cos, const float *sin) {
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < head_dim / 2; i++) {
            const float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * cos[i] - b * sin[i];
            v[2 * i + 1] = a * sin[i] + b * cos[i];
        }
    }
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* ------------------------------------------------------------------ dot products */

#if HS_X86
HS_AVX2 INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

HS_AVX2 INLINE __m256i unpack_q4(const block_q4_0 *blk) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)blk->qs);
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

HS_AVX2 INLINE __m256i load_weights(const void *wrow, const int type, int b) {
    if (type == HS_Q8_0) return _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)wrow)[b].qs);
    return unpack_q4((const block_q4_0 *)wrow + b);
}

HS_AVX2 INLINE uint16_t weight_scale(const void *wrow, const int type, int b) {
    return type == HS_Q8_0 ? ((const block_q8_0 *)wrow)[b].d : ((const block_q4_0 *)wrow)[b].d;
}

/* 8 int32 sums of 32 int8 products (w times x), exact. */
HS_AVX2 INLINE __m256i block_dot(__m256i w_abs, __m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)),
                             _mm256_set1_epi16(1));
}

/* m (<= ROW_TILE) rows of quantized activations times one quantized weight row. Each weight
 * block is loaded and made unsigned once for all m rows. Four blocks at a time, a row's four
 * 8-lane integer sums are folded by two horizontal adds into one vector (lane j holds part of
 * block j % 4), converted once and scaled by (weight scale x row scale) of its block; leftover
 * blocks go one at a time. Every row runs this same sequence, so its result never depends
 * on m. */
HS_AVX2 INLINE void tile_quantized_avx2(const void *wrow, const int type, const int blocks,
                                        const int8_t *xq, const float *xd, const int cols,
                                        const int m, float *result) {
    __m256 acc[ROW_TILE];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 4 <= blocks; b += 4) {
        __m256i w[4], w_abs[4];
        for (int k = 0; k < 4; k++) {
            w[k] = load_weights(wrow, type, b + k);
            w_abs[k] = _mm256_sign_epi8(w[k], w[k]);
        }
        const uint16_t d0 = weight_scale(wrow, type, b), d1 = weight_scale(wrow, type, b + 1),
                       d2 = weight_scale(wrow, type, b + 2), d3 = weight_scale(wrow, type, b + 3);
        const __m256 w_scales = _mm256_cvtph_ps(_mm_setr_epi16(
            (short)d0, (short)d1, (short)d2, (short)d3, (short)d0, (short)d1, (short)d2, (short)d3));
        for (int r = 0; r < m; r++) {
            const int8_t *x = xq + (size_t)r * cols + (size_t)b * HS_BLOCK;
            const __m256i s0 = block_dot(w_abs[0], w[0], _mm256_loadu_si256((const __m256i *)x));
            const __m256i s1 = block_dot(w_abs[1], w[1], _mm256_loadu_si256((const __m256i *)(x + 32)));
            const __m256i s2 = block_dot(w_abs[2], w[2], _mm256_loadu_si256((const __m256i *)(x + 64)));
            const __m256i s3 = block_dot(w_abs[3], w[3], _mm256_loadu_si256((const __m256i *)(x + 96)));
            const __m256i folded = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
            const __m256 x_scales = _mm256_broadcast_ps((const __m128 *)(xd + (size_t)r * blocks + b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), _mm256_mul_ps(w_scales, x_scales),
                                     acc[r]);
        }
    }
    for (; b < blocks; b++) {
        const __m256i w = load_weights(wrow, type, b);
        const __m256i w_abs = _mm256_sign_epi8(w, w);
        const __m256 w_scale = _mm256_set1_ps(_cvtsh_ss(weight_scale(wrow, type, b)));
        for (int r = 0; r < m; r++) {
            const __m256i x =
                _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * cols + (size_t)b * HS_BLOCK));
            const __m256 sums = _mm256_cvtepi32_ps(block_dot(w_abs, w, x));
            const __m256 x_scale = _mm256_broadcast_ss(xd + (size_t)r * blocks + b);
            acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(w_scale, x_scale), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) result[r] = hsum8(acc[r]);
}

HS_AVX2 static void tile_avx2(const hs_matrix *w, const void *wrow, const int8_t *xq,
                              const float *xd, const float *xf, int m, float *result) {
    const int cols = w->cols, blocks = cols / HS_BLOCK;
    if (is_quantized(w->type)) {
#define TILE(type, rows) tile_quantized_avx2(wrow, type, blocks, xq, xd, cols, rows, result)
#define TILES(type)                                                                          \
    switch (m) {                                                                             \
    case 4: TILE(type, 4); break;                                                            \
    case 3: TILE(type, 3); break;                                                            \
    case 2: TILE(type, 2); break;                                                            \
    default: TILE(type, 1); break;                                                           \
    }
        if (w->type == HS_Q8_0)
            TILES(HS_Q8_0)
        else
            TILES(HS_Q4_0)
#undef TILES
#undef TILE
        return;
    }
    for (int r = 0; r < m; r++) { /* float weights: 8 lanes per row, then a scalar tail */
        const float *x = xf + (size_t)r * cols;
        __m256 acc = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= cols; k += 8) {
            const __m256 wv = w->type == HS_F32
                                  ? _mm256_loadu_ps((const float *)wrow + k)
                                  : _mm256_cvtph_ps(_mm_loadu_si128(
                                        (const __m128i *)((const uint16_t *)wrow + k)));
            acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k), acc);
        }
        float sum = hsum8(acc);
        for (; k < cols; k++)
            sum += (w->type == HS_F32 ? ((const float *)wrow)[k]
                                      : half_to_float(((const uint16_t *)wrow)[k])) * x[k];
        result[r] = sum;
    }
}

HS_AVX2 static float dot_f32_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float sum = hsum8(acc);
    for (; k < n; k++) sum += a[k] * b[k];
    return sum;
}

/* e^x for x <= 0, 8 lanes: 2^n times a degree-6 polynomial of the remainder (relative error
 * about 2e-7); the same lanes give the same results whatever else is in the vector. */
HS_AVX2 INLINE __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

/* The query heads of one GQA group (sharing one KV head) over the slots they may see, in slot
 * order; one call per group keeps its keys and values hot in L1. head_dim: a multiple of 8,
 * at most 256. */
HS_AVX2 static void attend_group_avx2(const float *keys, const float *values, int hd,
                                      const float *queries, int group, int n_prefix,
                                      const int32_t *visible, int n_visible, float *scores,
                                      float *out) {
    const int total = n_prefix + n_visible, chunks = hd / 8;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int g = 0; g < group; g++) {
        const float *q = queries + (size_t)g * hd;
        float *row = scores + (size_t)g * total;
        float top = -INFINITY;
        for (int t = 0; t < total; t++) {
            const float *k = keys + (size_t)(t < n_prefix ? t : visible[t - n_prefix]) * hd;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
            for (int c = 1; c < chunks; c++)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), acc);
            row[t] = hsum8(acc) * scale;
            top = fmaxf(top, row[t]);
        }
        const __m256 highest = _mm256_set1_ps(top);
        int t = 0;
        __m256 sum = _mm256_setzero_ps();
        for (; t + 8 <= total; t += 8) {
            const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + t), highest));
            _mm256_storeu_ps(row + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        float tail[8] = {0};
        for (int i = 0; t + i < total; i++) tail[i] = row[t + i];
        _mm256_storeu_ps(tail, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(tail), highest)));
        float weight = hsum8(sum);
        for (int i = 0; t + i < total; i++) {
            row[t + i] = tail[i];
            weight += tail[i];
        }
        __m256 acc[32];
        for (int c = 0; c < chunks; c++) acc[c] = _mm256_setzero_ps();
        for (int u = 0; u < total; u++) {
            const float *v = values + (size_t)(u < n_prefix ? u : visible[u - n_prefix]) * hd;
            const __m256 p = _mm256_set1_ps(row[u]);
            for (int c = 0; c < chunks; c++)
                acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        const __m256 factor = _mm256_set1_ps(1.0f / weight);
        for (int c = 0; c < chunks; c++)
            _mm256_storeu_ps(out + (size_t)g * hd + 8 * c, _mm256_mul_ps(acc[c], factor));
    }
}
#endif

static void tile_portable(const hs_matrix *w, const void *wrow, const int8_t *xq,
                          const float *xd, const float *xf, int m, float *result) {
    const int cols = w->cols, blocks = cols / HS_BLOCK;
    for (int r = 0; r < m; r++) {
        float acc = 0.0f;
        if (w->type == HS_Q8_0 || w->type == HS_Q4_0) {
            const int8_t *x = xq + (size_t)r * cols;
            for (int b = 0; b < blocks; b++) {
                int32_t sum = 0;
                float dw;
                if (w->type == HS_Q8_0) {
                    const block_q8_0 *blk = (const block_q8_0 *)wrow + b;
                    for (int k = 0; k < HS_BLOCK; k++) sum += blk->qs[k] * x[b * HS_BLOCK + k];
                    dw = half_to_float(blk->d);
                } else {
                    const block_q4_0 *blk = (const block_q4_0 *)wrow + b;
                    for (int k = 0; k < HS_BLOCK / 2; k++)
                        sum += ((blk->qs[k] & 0x0f) - 8) * x[b * HS_BLOCK + k] +
                               ((blk->qs[k] >> 4) - 8) * x[b * HS_BLOCK + k + HS_BLOCK / 2];
                    dw = half_to_float(blk->d);
                }
                acc += (float)sum * dw * xd[(size_t)r * blocks + b];
            }
        } else {
            const float *x = xf + (size_t)r * cols;
            for (int k = 0; k < cols; k++)
                acc += (w->type == HS_F32 ? ((const float *)wrow)[k]
                                          : half_to_float(((const uint16_t *)wrow)[k])) * x[k];
        }
        result[r] = acc;
    }
}

static float dot_f32(const float *a, const float *b, int n, int simd) {
#if HS_X86
    if (simd) return dot_f32_avx2(a, b, n);
#endif
    (void)simd;
    float sum = 0.0f;
    for (int k = 0; k < n; k++) sum += a[k] * b[k];
    return sum;
}

/* ------------------------------------------------------------------ parallel steps
 * Called inside a parallel region by every thread; each work item is one thread's alone. */

static void matmul_items(const hs_matrix *w, const int8_t *xq, const float *xd, const float *xf,
                         int n, float *out, int simd, int wait) {
    const int chunks = (w->rows + COL_CHUNK - 1) / COL_CHUNK;
    const size_t stride = row_bytes(w);
#define MATMUL_BODY                                                                          \
    for (int c = 0; c < chunks; c++) {                                                       \
        const int end = c * COL_CHUNK + COL_CHUNK < w->rows ? c * COL_CHUNK + COL_CHUNK      \
                                                            : w->rows;                       \
        for (int j = c * COL_CHUNK; j < end; j++) {                                          \
            const void *wrow = (const char *)w->data + stride * (size_t)j;                   \
            for (int r0 = 0; r0 < n; r0 += ROW_TILE) {                                       \
                const int m = n - r0 < ROW_TILE ? n - r0 : ROW_TILE;                         \
                float result[ROW_TILE];                                                      \
                const int8_t *q = xq ? xq + (size_t)r0 * w->cols : NULL;                     \
                const float *d = xd ? xd + (size_t)r0 * (w->cols / HS_BLOCK) : NULL;         \
                const float *f = xf + (size_t)r0 * w->cols;                                  \
                if (simd) tile_simd(w, wrow, q, d, f, m, result);                            \
                else tile_portable(w, wrow, q, d, f, m, result);                             \
                for (int r = 0; r < m; r++) out[(size_t)(r0 + r) * w->rows + j] = result[r]; \
            }                                                                                \
        }                                                                                    \
    }
#if HS_X86
#define tile_simd tile_avx2
#else
#define tile_simd tile_portable
#endif
    if (wait) {
#pragma omp for schedule(static)
        MATMUL_BODY
    } else {
#pragma omp for schedule(static) nowait
        MATMUL_BODY
    }
#undef MATMUL_BODY
#undef tile_simd
}

int hs_matmul(const hs_matrix *w, const float *x, int n, float *out, int threads) {
    if (n < 1 || threads < 1 || !row_bytes(w) || (is_quantized(w->type) && w->cols % HS_BLOCK))
        return -1;
    const int simd = hs_simd_level();
    int8_t *q = NULL;
    float *d = NULL;
    if (is_quantized(w->type)) {
        q = malloc((size_t)n * w->cols);
        d = malloc((size_t)n * (w->cols / HS_BLOCK) * sizeof(float));
        if (!q || !d) {
            free(q);
            free(d);
            return -1;
        }
        hs_quantize_rows(x, n, w->cols, q, d);
    }
#pragma omp parallel num_threads(threads)
    matmul_items(w, q, d, x, n, out, simd, 1);
    free(q);
    free(d);
    return 0;
}

/* ------------------------------------------------------------------ the forward */

typedef struct { /* per-call scratch, one allocation */
    float *x, *normed, *q, *k, *v, *attended, *projected, *gate, *up, *scores;
    int8_t *xq;
    float *xd;
    void *base;
} scratch;

static int scratch_alloc(scratch *s, const hs_model *m, int n, int threads) {
    const size_t d = m->d_model, f = m->n_ff, qd = (size_t)m->n_heads * m->head_dim,
                 kvd = (size_t)m->n_kv_heads * m->head_dim;
    size_t widest = d > f ? d : f;
    if (qd > widest) widest = qd;
    const size_t floats[] = {n * d, n * widest, n * qd, n * kvd, n * kvd, n * qd,
                             n * d,  n * f,      n * f,
                             (size_t)threads * m->capacity * (m->n_heads / m->n_kv_heads),
                             n * (widest / HS_BLOCK)};
    float **slots[] = {&s->x,      &s->normed,    &s->q,    &s->k,  &s->v,     &s->attended,
                       &s->projected, &s->gate, &s->up, &s->scores, &s->xd};
    size_t total = n * widest; /* the int8 activations first */
    for (size_t i = 0; i < sizeof floats / sizeof *floats; i++) total += floats[i] * sizeof(float) + 64;
    char *base = malloc(total + 64);
    if (!base) return -1;
    s->base = base;
    s->xq = (int8_t *)base;
    char *cursor = base + ((n * widest + 63) & ~(size_t)63);
    for (size_t i = 0; i < sizeof floats / sizeof *floats; i++) {
        *slots[i] = (float *)cursor;
        cursor += (floats[i] * sizeof(float) + 63) & ~(size_t)63;
    }
    return 0;
}

static int forward_ok(const hs_model *m, int n, const int32_t *tokens, const int32_t *positions,
                      int start, int n_prefix, const int32_t *offsets, const int32_t *visible,
                      int first_logit, int threads) {
    if (n < 1 || threads < 1 || start < 0 || start + n > m->capacity || n_prefix < 0 ||
        n_prefix > start || first_logit < 0 || first_logit > n || m->head_dim % 2 ||
        m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads)
        return 0;
    if (!matrix_ok(&m->embed, m->vocab, m->d_model) || !matrix_ok(&m->output, m->vocab, m->d_model))
        return 0;
    const int qd = m->n_heads * m->head_dim, kvd = m->n_kv_heads * m->head_dim;
    for (int l = 0; l < m->n_layers; l++) {
        const hs_layer *y = &m->layers[l];
        if (!matrix_ok(&y->q, qd, m->d_model) || !matrix_ok(&y->k, kvd, m->d_model) ||
            !matrix_ok(&y->v, kvd, m->d_model) || !matrix_ok(&y->o, m->d_model, qd) ||
            !matrix_ok(&y->gate, m->n_ff, m->d_model) || !matrix_ok(&y->up, m->n_ff, m->d_model) ||
            !matrix_ok(&y->down, m->d_model, m->n_ff))
            return 0;
    }
    if (offsets[0] != 0) return 0;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->vocab || positions[i] < 0 ||
            positions[i] >= m->capacity || offsets[i + 1] < offsets[i] ||
            offsets[i + 1] - offsets[i] > m->capacity - n_prefix)
            return 0;
        for (int t = offsets[i]; t < offsets[i + 1]; t++)
            if (visible[t] < n_prefix || visible[t] > start + i) return 0;
    }
    return 1;
}

/* One (row, head) of attention over the slots the row may see, in slot order. */
static void attend(const hs_model *m, int layer, const float *query, int kv_head, int n_prefix,
                   const int32_t *visible, int n_visible, float *scores, float *out, int simd) {
    const int hd = m->head_dim;
    const size_t base = ((size_t)layer * m->n_kv_heads + kv_head) * m->capacity;
    const float *keys = m->k_cache + base * hd, *values = m->v_cache + base * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    const int total = n_prefix + n_visible;
    float highest = -INFINITY;
    for (int t = 0; t < total; t++) {
        const int slot = t < n_prefix ? t : visible[t - n_prefix];
        scores[t] = dot_f32(query, keys + (size_t)slot * hd, hd, simd) * scale;
        highest = fmaxf(highest, scores[t]);
    }
    float sum = 0.0f;
    for (int t = 0; t < total; t++) {
        scores[t] = expf(scores[t] - highest);
        sum += scores[t];
    }
    for (int k = 0; k < hd; k++) out[k] = 0.0f;
    for (int t = 0; t < total; t++) {
        const int slot = t < n_prefix ? t : visible[t - n_prefix];
        const float *v = values + (size_t)slot * hd;
        const float p = scores[t];
        for (int k = 0; k < hd; k++) out[k] += p * v[k];
    }
    const float inverse = 1.0f / sum;
    for (int k = 0; k < hd; k++) out[k] *= inverse;
}

int hs_forward(const hs_model *m, int n, const int32_t *tokens, const int32_t *positions,
               int start, int n_prefix, const int32_t *offsets, const int32_t *visible,
               int first_logit, float *logits, int threads) {
    if (!forward_ok(m, n, tokens, positions, start, n_prefix, offsets, visible, first_logit,
                    threads))
        return -1;
    scratch s;
    if (scratch_alloc(&s, m, n, threads)) return -1;
    const int simd = hs_simd_level();
    const int d = m->d_model, f = m->n_ff, hd = m->head_dim, heads = m->n_heads,
              kv_heads = m->n_kv_heads, qd = heads * hd, kvd = kv_heads * hd;
    const int group = heads / kv_heads, half = hd / 2;

#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        float *scores = s.scores + (size_t)omp_get_thread_num() * m->capacity * group;
#else
        float *scores = s.scores;
#endif
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) embed_row(&m->embed, tokens[i], s.x + (size_t)i * d);

        for (int l = 0; l < m->n_layers; l++) {
            const hs_layer *y = &m->layers[l];
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) {
                rms_norm(s.x + (size_t)i * d, y->attn_norm, d, m->eps, s.normed + (size_t)i * d);
                quantize_row(s.normed + (size_t)i * d, d, s.xq + (size_t)i * d,
                             s.xd + (size_t)i * (d / HS_BLOCK));
            }
            matmul_items(&y->q, s.xq, s.xd, s.normed, n, s.q, simd, 0);
            matmul_items(&y->k, s.xq, s.xd, s.normed, n, s.k, simd, 0);
            matmul_items(&y->v, s.xq, s.xd, s.normed, n, s.v, simd, 1);
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) {
                const float *cos = m->rope_cos + (size_t)positions[i] * half;
                const float *sin = m->rope_sin + (size_t)positions[i] * half;
                rope_row(s.q + (size_t)i * qd, heads, hd, cos, sin);
                rope_row(s.k + (size_t)i * kvd, kv_heads, hd, cos, sin);
                for (int h = 0; h < kv_heads; h++) {
                    const size_t slot =
                        (((size_t)l * kv_heads + h) * m->capacity + (size_t)(start + i)) * hd;
                    memcpy(m->k_cache + slot, s.k + (size_t)i * kvd + (size_t)h * hd, hd * 4);
                    memcpy(m->v_cache + slot, s.v + (size_t)i * kvd + (size_t)h * hd, hd * 4);
                }
            }
#if HS_X86
            if (simd && hd % 8 == 0 && hd <= 256) {
                const size_t layer_base = (size_t)l * kv_heads * m->capacity * hd;
#pragma omp for schedule(static)
                for (int item = 0; item < n * kv_heads; item++) {
                    const int i = item / kv_heads, h = item % kv_heads;
                    const size_t head = layer_base + (size_t)h * m->capacity * hd;
                    const size_t first = (size_t)i * qd + (size_t)h * group * hd;
                    attend_group_avx2(m->k_cache + head, m->v_cache + head, hd, s.q + first,
                                      group, n_prefix, visible + offsets[i],
                                      offsets[i + 1] - offsets[i], scores, s.attended + first);
                }
            } else
#endif
            {
#pragma omp for schedule(static)
                for (int item = 0; item < n * heads; item++) {
                    const int i = item / heads, h = item % heads;
                    attend(m, l, s.q + (size_t)i * qd + (size_t)h * hd, h / group, n_prefix,
                           visible + offsets[i], offsets[i + 1] - offsets[i], scores,
                           s.attended + (size_t)i * qd + (size_t)h * hd, simd);
                }
            }
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++)
                quantize_row(s.attended + (size_t)i * qd, qd, s.xq + (size_t)i * qd,
                             s.xd + (size_t)i * (qd / HS_BLOCK));
            matmul_items(&y->o, s.xq, s.xd, s.attended, n, s.projected, simd, 1);
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) {
                float *x = s.x + (size_t)i * d;
                for (int k = 0; k < d; k++) x[k] += s.projected[(size_t)i * d + k];
                rms_norm(x, y->ffn_norm, d, m->eps, s.normed + (size_t)i * d);
                quantize_row(s.normed + (size_t)i * d, d, s.xq + (size_t)i * d,
                             s.xd + (size_t)i * (d / HS_BLOCK));
            }
            matmul_items(&y->gate, s.xq, s.xd, s.normed, n, s.gate, simd, 0);
            matmul_items(&y->up, s.xq, s.xd, s.normed, n, s.up, simd, 1);
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) {
                float *g = s.gate + (size_t)i * f;
                const float *u = s.up + (size_t)i * f;
                for (int k = 0; k < f; k++) g[k] = silu(g[k]) * u[k];
                quantize_row(g, f, s.xq + (size_t)i * f, s.xd + (size_t)i * (f / HS_BLOCK));
            }
            matmul_items(&y->down, s.xq, s.xd, s.gate, n, s.projected, simd, 1);
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) {
                float *x = s.x + (size_t)i * d;
                for (int k = 0; k < d; k++) x[k] += s.projected[(size_t)i * d + k];
            }
        }
        const int outputs = n - first_logit;
        if (outputs > 0) {
#pragma omp for schedule(static)
            for (int i = first_logit; i < n; i++) {
                const size_t r = (size_t)(i - first_logit);
                rms_norm(s.x + (size_t)i * d, m->output_norm, d, m->eps, s.normed + r * d);
                quantize_row(s.normed + r * d, d, s.xq + r * d, s.xd + r * (d / HS_BLOCK));
            }
            matmul_items(&m->output, s.xq, s.xd, s.normed, outputs, logits, simd, 1);
        }
    }
    free(s.base);
    return 0;
}
