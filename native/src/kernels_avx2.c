/* The AVX2 kernels of Q8_0 / Q4_0 weights (with FMA and F16C: every x86 level's base), and of
 * F32 / F16 weights: whole groups of 8 rows in lanes, or 8 weight rows' blocks transposed so
 * that features sit in lanes, as the call's shape makes faster; every product an exact integer
 * (vpmaddubsw, vpmaddwd) and every float step internal.h's recipe, so the same bits either way.
 * What the VNNI levels share with these is in kernels_x86.h. */
#include "internal.h"
#include "transposes.h"
#include "kernels_x86.h"

#if HS_X86
/* Rows in lanes, Q8_0: the rows of `count` (1 or 2) whole groups from `group` on, times one
 * weight row. Each four weights are broadcast to every lane and made unsigned once for all
 * groups, so a group of 8 rows costs one multiply chain per 4 weights, with no horizontal sums. */
HS_AVX2 INLINE void rows_in_lanes_avx2(const void *wrow, const int blocks, const activations *a,
                                       const int group, const int count, float *result) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < blocks; b++) {
        const int8_t *values = ((const block_q8_0 *)wrow)[b].qs;
        __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int k = 0; k < HS_BLOCK / 4; k++) {
            const __m256i w = broadcast4(values + 4 * k), w_abs = _mm256_sign_epi8(w, w);
            for (int g = 0; g < count; g++) {
                const int8_t *x = a->grouped + (((size_t)(group + g) * blocks + b) * GROUP + k) * 4 * GROUP;
                sums[g] = dot4_add(sums[g], w_abs, w, _mm256_loadu_si256((const __m256i *)x));
            }
        }
        const __m256 w_scale = _mm256_set1_ps(_cvtsh_ss(((const block_q8_0 *)wrow)[b].d));
        for (int g = 0; g < count; g++) {
            const __m256 x_scales = _mm256_loadu_ps(a->grouped_d + ((size_t)(group + g) * blocks + b) * GROUP);
            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[g]), _mm256_mul_ps(x_scales, w_scale), acc[g]);
        }
    }
    for (int g = 0; g < count; g++) _mm256_storeu_ps(result + GROUP * g, acc[g]);
}

/* Rows in lanes for Q4_0 weights: the activations are made unsigned (x + 128, by flipping the
 * sign bit) and the weights (-8..7) stay signed, so one maddubs makes each lane's pair sums
 * with no sign fix-up, and a block's eight of them add up in 16 bits (|each| <= 2 * 255 * 8,
 * eight <= 32640) before one madd widens them; the offset comes off as 128 times the block's
 * weight sum. Every step is exact integer arithmetic: the same dot_b as the Q8_0 recipe. */
HS_AVX2 INLINE void rows_in_lanes_q4_avx2(const void *wrow, const int blocks, const activations *a,
                                          const int group, const int count, float *result) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < blocks; b++) {
        int32_t unpacked[8] __attribute__((aligned(32)));
        const __m256i weights = unpack_q4((const block_q4_0 *)wrow + b);
        _mm256_store_si256((__m256i *)unpacked, weights);
        /* the block's weight sum, in every lane: sad against zero sums |bytes|, so sum w + 8 */
        const __m256i biased = _mm256_add_epi8(weights, _mm256_set1_epi8(8));
        const __m256i sad = _mm256_sad_epu8(biased, _mm256_setzero_si256());
        __m128i total = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
        total = _mm_add_epi64(total, _mm_unpackhi_epi64(total, total));
        const int weight_sum = _mm_cvtsi128_si32(total) - 8 * HS_BLOCK;
        const __m256i offset = _mm256_set1_epi32(128 * weight_sum);
        __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int k = 0; k < HS_BLOCK / 4; k++) {
            const __m256i w = broadcast4((const char *)unpacked + 4 * k);
            for (int g = 0; g < count; g++) {
                const int8_t *x = a->grouped + (((size_t)(group + g) * blocks + b) * GROUP + k) * 4 * GROUP;
                const __m256i xu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)x), flip);
                pairs[g] = _mm256_add_epi16(pairs[g], _mm256_maddubs_epi16(xu, w));
            }
        }
        const __m256 w_scale = _mm256_set1_ps(_cvtsh_ss(((const block_q4_0 *)wrow)[b].d));
        for (int g = 0; g < count; g++) {
            const __m256i sums = _mm256_sub_epi32(_mm256_madd_epi16(pairs[g], ones), offset);
            const __m256 x_scales = _mm256_loadu_ps(a->grouped_d + ((size_t)(group + g) * blocks + b) * GROUP);
            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(x_scales, w_scale), acc[g]);
        }
    }
    for (int g = 0; g < count; g++) _mm256_storeu_ps(result + GROUP * g, acc[g]);
}

/* Features in lanes: m (<= 4) row-major rows times 8 weight rows `stride` bytes apart. The 8
 * rows' blocks are transposed in registers so that lane f holds feature f's values and each
 * row's four activations are broadcast: the weights are read in place, in their GGUF layout. */
HS_AVX2 INLINE void features_in_lanes_avx2(const char *wrows, const size_t stride, const int type,
                                           const int blocks, const int8_t *xq, const float *xd,
                                           const int32_t *xs, const int cols, const int m,
                                           float *result) {
    (void)xs; /* the VNNI kernel's activation sums: one signature for UNGROUPED_ROWS */
    __m256 acc[4];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const size_t block_bytes = stride / blocks;
    for (int b = 0; b < blocks; b++) {
        __m256i w[8];
        __m256 w_scales;
        transposed_block(wrows, stride, type, b, block_bytes, w, &w_scales);
        __m256i sums[4];
        for (int r = 0; r < m; r++) sums[r] = _mm256_setzero_si256();
        for (int k = 0; k < HS_BLOCK / 4; k++) {
            const __m256i w_abs = _mm256_sign_epi8(w[k], w[k]);
            for (int r = 0; r < m; r++) {
                const int8_t *x = xq + (size_t)r * cols + (size_t)b * HS_BLOCK + 4 * k;
                sums[r] = dot4_add(sums[r], w_abs, w[k], broadcast4(x));
            }
        }
        for (int r = 0; r < m; r++) {
            const __m256 x_scale = _mm256_set1_ps(xd[(size_t)r * blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(result + 8 * r, acc[r]);
}

/* Features in lanes for m (2 <= m <= FEATURES16_PASS) rows against 8 weight rows: each block
 * transposed once for all m rows (features_in_lanes_avx2 transposes it again for every 4
 * rows); its integers and float steps, the same bits. */
HS_AVX2 INLINE void features8_in_lanes_avx2(const char *wrows, const size_t stride, const int type,
                                            const int blocks, const int8_t *xq, const float *xd,
                                            const int32_t *xs, const int cols, const int m, float *result) {
    (void)xs; /* the VNNI kernel's activation sums: one signature for FEATURES8_PASSES */
    __m256 acc[FEATURES16_PASS];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const size_t block_bytes = stride / blocks;
    for (int b = 0; b < blocks; b++) {
        __m256i w[8], w_abs[8];
        __m256 w_scales;
        transposed_block(wrows, stride, type, b, block_bytes, w, &w_scales);
        for (int k = 0; k < HS_BLOCK / 4; k++) w_abs[k] = _mm256_sign_epi8(w[k], w[k]);
        for (int r = 0; r < m; r++) {
            const int8_t *x = xq + (size_t)r * cols + (size_t)b * HS_BLOCK;
            __m256i sum = _mm256_setzero_si256();
            for (int k = 0; k < HS_BLOCK / 4; k++) sum = dot4_add(sum, w_abs[k], w[k], broadcast4(x + 4 * k));
            const __m256 x_scale = _mm256_set1_ps(xd[(size_t)r * blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(result + 8 * r, acc[r]);
}

FEATURES8_PASSES(HS_AVX2, features8_passes_avx2, features8_in_lanes_avx2)

/* Features in lanes from a packed tile of signed Q8_0 values (hs_matrix.packed): the blocks
 * as transposed_block leaves them, read with nine loads; the same products and float steps as
 * features_in_lanes_avx2, so the same bits. */
HS_AVX2 INLINE void packed_features_avx2(const char *tile, const int blocks, const int8_t *xq,
                                         const float *xd, const int32_t *xs, const int cols,
                                         const int m, float *result) {
    (void)xs;
    __m256 acc[4];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const char *block = tile + (size_t)b * HS_PACKED_BYTES;
        const __m256 w_scales = _mm256_loadu_ps((const float *)block);
        __m256i sums[4];
        for (int r = 0; r < m; r++) sums[r] = _mm256_setzero_si256();
        for (int k = 0; k < HS_BLOCK / 4; k++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * k));
            const __m256i w_abs = _mm256_sign_epi8(w, w);
            for (int r = 0; r < m; r++) {
                const int8_t *x = xq + (size_t)r * cols + (size_t)b * HS_BLOCK + 4 * k;
                sums[r] = dot4_add(sums[r], w_abs, w, broadcast4(x));
            }
        }
        for (int r = 0; r < m; r++) {
            const __m256 x_scale = _mm256_set1_ps(xd[(size_t)r * blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(result + 8 * r, acc[r]);
}

/* Output features [first, end) of all n rows, into out (n, w->rows). Calls of 5 or more rows
 * go features in lanes in passes (features8_passes_avx2; heavy-100m Q8_0 T(5) 11.3 -> 8.6 ms,
 * T(9) 15.4 -> 12.8), but Q4_0's whole groups, which go rows in lanes, two groups at a time
 * over every feature (their activations stay in L1; T(16) 19.0 against 20.2); up to 4 rows go
 * features in lanes, 4 rows by 8 features; leftover features one by one. */
HS_AVX2 void hs_quantized_features_avx2(const hs_matrix *w, const activations *a, int n,
                                        int first, int end, float *out) {
    const int blocks = w->cols / HS_BLOCK;
    const int in_lanes8 = n > 4 && (w->type == HS_Q8_0 || n % GROUP);
    const int groups = in_lanes8 ? 0 : grouped_rows(n) / GROUP;
    const int grouped = groups * GROUP < n ? groups * GROUP : n;
    const size_t stride = row_bytes(w);
    const char *data = w->data;
    float result[4 * 8];
    for (int g = 0; g < groups; g += 2) {
        const int count = groups - g > 1 ? 2 : 1;
        for (int j = first; j < end; j++) {
            /* literal counts: each call is compiled for its count */
            const char *wrow = data + stride * j;
            if (w->type == HS_Q8_0) {
                if (count == 2) rows_in_lanes_avx2(wrow, blocks, a, g, 2, result);
                else rows_in_lanes_avx2(wrow, blocks, a, g, 1, result);
            } else if (count == 2) {
                rows_in_lanes_q4_avx2(wrow, blocks, a, g, 2, result);
            } else {
                rows_in_lanes_q4_avx2(wrow, blocks, a, g, 1, result);
            }
            for (int r = 0; r < GROUP * count && g * GROUP + r < n; r++)
                out[(size_t)(g * GROUP + r) * w->rows + j] = result[r];
        }
    }
    int j = first;
    if (in_lanes8)
        for (; j + 8 <= end; j += 8) features8_passes_avx2(w, a, n, j, out);
    PACKED_ROWS(packed_features_avx2, HS_PACKED_SIGNED)
    UNGROUPED_ROWS(features_in_lanes_avx2)
}

/* One row times one f32 or f16 weight row: 8 lanes, then a scalar tail. */
HS_AVX2 static float dot_float_avx2(const hs_matrix *w, const void *wrow, const float *x) {
    const int cols = w->cols;
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= cols; k += 8) {
        const __m256 wv = w->type == HS_F32
                              ? _mm256_loadu_ps((const float *)wrow + k)
                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)wrow + k)));
        acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k), acc);
    }
    float sum = hsum8(acc);
    for (; k < cols; k++)
        sum += (w->type == HS_F32 ? ((const float *)wrow)[k] : half_to_float(((const uint16_t *)wrow)[k])) * x[k];
    return sum;
}

/* F32 / F16 weights: output features [first, end) of all n rows, a (row, feature) at a time. */
HS_AVX2 void hs_float_features_avx2(const hs_matrix *w, const float *xf, int n, int first,
                                    int end, float *out) {
    const size_t stride = row_bytes(w);
    for (int j = first; j < end; j++) {
        const void *wrow = (const char *)w->data + stride * (size_t)j;
        for (int r = 0; r < n; r++)
            out[(size_t)r * w->rows + j] = dot_float_avx2(w, wrow, xf + (size_t)r * w->cols);
    }
}
#endif
