/* A matrix's input rows quantized to int8 blocks (internal.h's activations): row-major for
 * the kernels that put features in lanes, interleaved by groups of 8 rows for those that put
 * rows in lanes, with the block sums the VNNI kernels and the types with mins need. AVX2
 * quantizes a row to the portable C's bits (C's roundf exactly), so every kernel level reads
 * the same integers. */
#include "internal.h"

/* x's int8 values and a scale per block of 32 (scale[b] * q ~ x), the blocks of each span of
 * `span` values (32 or 256) sharing the span's scale, largest magnitude / 127; rounded half
 * away from zero. */
static void quantize_row(const float *x, int cols, int8_t *q, float *scale, int span) {
    for (int first = 0; first < cols; first += span) {
        float amax = 0.0f;
        for (int k = 0; k < span; k++) amax = fmaxf(amax, fabsf(x[first + k]));
        const float d = amax / 127.0f;
        const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        for (int k = 0; k < span; k++) q[first + k] = (int8_t)roundf(x[first + k] * inverse);
        for (int b = 0; b < span / HS_BLOCK; b++) scale[first / HS_BLOCK + b] = d;
    }
}

#if HS_X86
/* quantize_row's result, 8 lanes at a time: the same largest magnitude, scale and products,
 * and C's roundf (half away from zero) done exactly, as truncation plus a carry. */
HS_AVX2 static void quantize_row_avx2(const float *x, int cols, int8_t *q, float *scale, int span) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lanes */
    for (int first = 0; first < cols; first += span) {
        __m256 amax = _mm256_setzero_ps();
        for (int k = 0; k < span; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + first + k)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.0f;
        const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        for (int b = first / HS_BLOCK; b < (first + span) / HS_BLOCK; b++) {
            __m256i ints[4];
            for (int k = 0; k < 4; k++) {
                const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(x + (size_t)b * HS_BLOCK + 8 * k), inverse);
                const __m256 whole = _mm256_round_ps(scaled, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                const __m256 fraction = _mm256_andnot_ps(sign_bit, _mm256_sub_ps(scaled, whole));
                const __m256 away = _mm256_or_ps(_mm256_and_ps(scaled, sign_bit), one);
                const __m256 carry = _mm256_and_ps(_mm256_cmp_ps(fraction, half, _CMP_GE_OQ), away);
                ints[k] = _mm256_cvttps_epi32(_mm256_add_ps(whole, carry));
            }
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                                     _mm256_packs_epi32(ints[2], ints[3]));
            _mm256_storeu_si256((__m256i *)(q + (size_t)b * HS_BLOCK), _mm256_permutevar8x32_epi32(bytes, order));
            scale[b] = d;
        }
    }
}

#endif

static void quantize_row_simd(const float *x, int cols, int8_t *q, float *scale, int span, int simd) {
#if HS_X86
    if (simd) {
        quantize_row_avx2(x, cols, q, scale, span);
        return;
    }
#endif
    (void)simd;
    quantize_row(x, cols, q, scale, span);
}

void hs_quantize_rows(const float *x, int n, int cols, int8_t *q, float *scale) {
    const int simd = hs_simd_level();
    for (int i = 0; i < n; i++)
        quantize_row_simd(x + (size_t)i * cols, cols, q + (size_t)i * cols,
                          scale + (size_t)i * (cols / HS_BLOCK), HS_BLOCK, simd);
}

/* Row i (of n rows of width cols) into both layouts. */
void hs_quantize_activation(const activations *a, const float *x, int i, int n, int cols,
                            int simd) {
    const int blocks = cols / HS_BLOCK;
    int8_t *q = a->q + (size_t)i * cols;
    float *d = a->d + (size_t)i * blocks;
    quantize_row_simd(x, cols, q, d, a->span, simd);
    int32_t *sum = a->sum + (size_t)i * blocks, *half_sum = a->half_sum + (size_t)i * blocks;
    for (int b = 0; a->with_sums && b < blocks; b++) {
        int32_t half = 0, rest = 0;
        for (int k = 0; k < HS_BLOCK / 2; k++) half += q[b * HS_BLOCK + k];
        for (int k = HS_BLOCK / 2; k < HS_BLOCK; k++) rest += q[b * HS_BLOCK + k];
        half_sum[b] = half;
        sum[b] = half + rest;
    }
    if (i >= grouped_rows(n)) return;
    const int lane = i % GROUP;
    const size_t first = (size_t)(i / GROUP) * blocks;
    for (int b = 0; b < blocks; b++) {
        int8_t *runs = a->grouped + (first + b) * GROUP * HS_BLOCK;
        for (int k = 0; k < HS_BLOCK / 4; k++)
            memcpy(runs + k * HS_BLOCK + 4 * lane, q + b * HS_BLOCK + 4 * k, 4);
        a->grouped_d[(first + b) * GROUP + lane] = d[b];
        if (a->with_sums) {
            a->grouped_sum[(first + b) * GROUP + lane] = sum[b];
            a->grouped_half_sum[(first + b) * GROUP + lane] = half_sum[b];
        }
    }
    if (i != n - 1) return;
    for (int pad = lane + 1; pad < GROUP && i / GROUP * GROUP + pad < grouped_rows(n); pad++)
        for (int b = 0; b < blocks; b++) { /* the padding rows: zeros, whose results go nowhere */
            int8_t *runs = a->grouped + (first + b) * GROUP * HS_BLOCK;
            for (int k = 0; k < HS_BLOCK / 4; k++) memset(runs + k * HS_BLOCK + 4 * pad, 0, 4);
            a->grouped_d[(first + b) * GROUP + pad] = 0.0f;
            if (a->with_sums) a->grouped_sum[(first + b) * GROUP + pad] = a->grouped_half_sum[(first + b) * GROUP + pad] = 0;
        }
}
