/* What the x86 levels' Q8_0 / Q4_0 kernels share (kernels_avx2.c, kernels_vnni.c,
 * kernels_avx_vnni.c and the vnni256.h they include): a block's weights loaded and transposed,
 * the one (row, feature) product that every level's leftovers take, the drivers' passes over
 * rows as macros each level instantiates with its own kernels, and vpdpbusd's unsigned weights.
 * Included only by those files, after internal.h and transposes.h. */
#ifndef HS_KERNELS_X86_H
#define HS_KERNELS_X86_H

#if HS_X86
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

/* sum + the exact dot products of four int8 pairs per int32 lane (w times x); w_abs = |w|. */
HS_AVX2 INLINE __m256i dot4_add(__m256i sum, __m256i w_abs, __m256i w, __m256i x) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)),
                                                   _mm256_set1_epi16(1)));
}

/* Block b of 8 weight rows `stride` bytes apart, as signed bytes, transposed in registers so
 * that w[k] holds the k-th four weights of every row (row f in lane f); their scales in
 * *w_scales. On even blocks it prefetches the next 8 rows': each 8 rows are short streams the
 * hardware's prefetchers barely learn (a row of GEMV ran at half the memory's speed without
 * this). */
HS_AVX2 INLINE void transposed_block(const char *wrows, const size_t stride, const int type,
                                     const int b, const size_t block_bytes, __m256i w[8],
                                     __m256 *w_scales) {
    uint16_t scales[8];
    if (!(b & 1))
        for (int f = 0; f < 8; f++) _mm_prefetch(wrows + stride * (8 + f) + block_bytes * b, _MM_HINT_T0);
    for (int f = 0; f < 8; f++) {
        w[f] = load_weights(wrows + stride * f, type, b);
        scales[f] = weight_scale_of(wrows + stride * f, type, b);
    }
    transpose_8x8_epi32(w);
    *w_scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales));
}

/* All n rows against features [j, j + 8), in passes of up to FEATURES16_PASS rows of equal
 * size, by KERNEL (a features8_in_lanes, with literal types and row counts up to 8). */
#define FEATURES8_PASSES(ATTR, NAME, KERNEL)                                                 \
    ATTR static void NAME(const hs_matrix *w, const activations *a, const int n, const int j, float *out) { \
        const int blocks = w->cols / HS_BLOCK, passes = (n + FEATURES16_PASS - 1) / FEATURES16_PASS; \
        const size_t stride = row_bytes(w);                                                  \
        const char *rows8 = (const char *)w->data + stride * j;                              \
        float result[FEATURES16_PASS * 8];                                                   \
        for (int p = 0, r0 = 0; p < passes; p++) {                                           \
            const int m = pass_rows(n, r0, p, passes);                                       \
            const int8_t *q = a->q + (size_t)r0 * w->cols;                                   \
            const float *d = a->d + (size_t)r0 * blocks;                                     \
            const int32_t *sums = a->sum + (size_t)r0 * blocks;                              \
            if (w->type == HS_Q8_0) {                                                        \
                FEATURES8_ROWS(KERNEL, HS_Q8_0)                                              \
            } else {                                                                         \
                FEATURES8_ROWS(KERNEL, HS_Q4_0)                                              \
            }                                                                                \
            for (int r = 0; r < m; r++)                                                      \
                for (int f = 0; f < 8; f++) out[(size_t)(r0 + r) * w->rows + j + f] = result[8 * r + f]; \
            r0 += m;                                                                         \
        }                                                                                    \
    }
#define FEATURES8_ROWS(KERNEL, type)                                                         \
    switch (m) {                                                                             \
    case 8: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, 8, result); break;      \
    case 7: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, 7, result); break;      \
    case 6: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, 6, result); break;      \
    case 5: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, 5, result); break;      \
    case 4: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, 4, result); break;      \
    case 3: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, 3, result); break;      \
    case 2: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, 2, result); break;      \
    default: KERNEL(rows8, stride, type, blocks, q, d, sums, w->cols, m, result); break;     \
    }

/* One (row, feature) by the same recipe, for what the two tilings leave over (every level's
 * leftovers: UNGROUPED_ROWS). Kept out of line, as the compiler left it when one copy served
 * all three levels: inlined into each file's one driver, it changed the drivers' registers. */
HS_AVX2 __attribute__((noinline)) static float dot_quantized_avx2(const void *wrow, int type, int blocks,
                                                                  const int8_t *x, const float *xd) {
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256i w = load_weights(wrow, type, b);
        const __m256i sums = dot4_add(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), w,
                                      _mm256_loadu_si256((const __m256i *)(x + (size_t)b * HS_BLOCK)));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        const float scale = xd[b] * _cvtsh_ss(weight_scale_of(wrow, type, b));
        acc = _mm_fmadd_ss(_mm_cvtepi32_ps(s), _mm_set_ss(scale), acc);
    }
    return _mm_cvtss_f32(acc);
}

/* The rows outside whole groups from a packed Q8_0 matrix whose values are of kind KIND, in an
 * hs_quantized_features_* driver (as UNGROUPED_ROWS, whose leftovers follow): PACKED(tile) features
 * in lanes. */
#define PACKED_ROWS(PACKED, KIND)                                                            \
    if (w->packed && w->packing == (KIND) && w->type == HS_Q8_0 && !(j % 8))                 \
        for (; j + 8 <= end && grouped < n; j += 8)                                          \
            for (int r0 = grouped; r0 < n; r0 += 4) {                                        \
                const int m = n - r0 < 4 ? n - r0 : 4;                                       \
                const char *tile = (const char *)w->packed + (size_t)(j / 8) * blocks * HS_PACKED_BYTES; \
                const int8_t *q = a->q + (size_t)r0 * w->cols;                               \
                const float *d = a->d + (size_t)r0 * blocks;                                 \
                const int32_t *sums = a->sum + (size_t)r0 * blocks;                          \
                switch (m) {                                                                 \
                case 4: PACKED(tile, blocks, q, d, sums, w->cols, 4, result); break;         \
                case 3: PACKED(tile, blocks, q, d, sums, w->cols, 3, result); break;         \
                case 2: PACKED(tile, blocks, q, d, sums, w->cols, 2, result); break;         \
                default: PACKED(tile, blocks, q, d, sums, w->cols, 1, result); break;        \
                }                                                                            \
                for (int r = 0; r < m; r++)                                                  \
                    for (int f = 0; f < 8; f++)                                              \
                        out[(size_t)(r0 + r) * w->rows + j + f] = result[8 * r + f];         \
            }

/* The rows outside whole groups, in an hs_quantized_features_* driver (w, a, n, end, grouped,
 * blocks, stride, data and result in scope; j the first feature not done): features in lanes,
 * up to 4 rows by 8 features a TILE call (literal types and row counts: each call is compiled
 * for its own), then the leftover features one (row, feature) at a time. */
#define UNGROUPED_ROWS(TILE)                                                                 \
    for (; j + 8 <= end && grouped < n; j += 8)                                              \
        for (int r0 = grouped; r0 < n; r0 += 4) {                                            \
            const int m = n - r0 < 4 ? n - r0 : 4;                                           \
            const int8_t *q = a->q + (size_t)r0 * w->cols;                                   \
            const float *d = a->d + (size_t)r0 * blocks;                                     \
            const int32_t *sums = a->sum + (size_t)r0 * blocks;                              \
            const char *rows8 = data + stride * j;                                           \
            switch (w->type == HS_Q8_0 ? m : -m) {                                           \
            case 4: TILE(rows8, stride, HS_Q8_0, blocks, q, d, sums, w->cols, 4, result); break; \
            case 3: TILE(rows8, stride, HS_Q8_0, blocks, q, d, sums, w->cols, 3, result); break; \
            case 2: TILE(rows8, stride, HS_Q8_0, blocks, q, d, sums, w->cols, 2, result); break; \
            case 1: TILE(rows8, stride, HS_Q8_0, blocks, q, d, sums, w->cols, 1, result); break; \
            case -4: TILE(rows8, stride, HS_Q4_0, blocks, q, d, sums, w->cols, 4, result); break; \
            case -3: TILE(rows8, stride, HS_Q4_0, blocks, q, d, sums, w->cols, 3, result); break; \
            case -2: TILE(rows8, stride, HS_Q4_0, blocks, q, d, sums, w->cols, 2, result); break; \
            default: TILE(rows8, stride, HS_Q4_0, blocks, q, d, sums, w->cols, 1, result); break; \
            }                                                                                \
            for (int r = 0; r < m; r++)                                                      \
                for (int f = 0; f < 8; f++)                                                  \
                    out[(size_t)(r0 + r) * w->rows + j + f] = result[8 * r + f];             \
        }                                                                                    \
    for (; j < end; j++)                                                                     \
        for (int r = grouped; r < n; r++)                                                    \
            out[(size_t)r * w->rows + j] = dot_quantized_avx2(                               \
                data + stride * j, w->type, blocks, a->q + (size_t)r * w->cols,              \
                a->d + (size_t)r * blocks);

/* ------------------------------------------------------------------ vpdpbusd (both VNNI levels)
 * vpdpbusd multiplies unsigned bytes by signed bytes and adds each four products to an int32
 * lane, exactly. The weights are made the unsigned side: Q8_0's w + 128 (the sign bit
 * flipped), Q4_0's nibbles as stored (w + 8). So a block's products sum to dot_b + bias * S,
 * where S is the block's sum of activations (computed once, when they are quantized); starting
 * the accumulator at -bias * S leaves exactly the AVX2 recipe's dot_b, and the float steps
 * that follow are the same: both paths give the same bits. One instruction per four products
 * and row, where AVX2 needs vpsignb, vpmaddubsw, vpmaddwd and vpaddd. */

#define Q8_BIAS_SHIFT 7 /* w + 128 */
#define Q4_BIAS_SHIFT 3 /* w + 8 */

/* -(sum << shift) in every lane of v's shape: the accumulator's start. */
HS_AVX2 INLINE __m256i vnni_start(const __m256i sums, const int shift) {
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, shift));
}

HS_AVX2 INLINE __m256i load_unsigned_weights(const void *wrow, const int type, int b) {
    if (type == HS_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)((const block_q8_0 *)wrow)[b].qs),
                                _mm256_set1_epi8((char)0x80));
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const block_q4_0 *)wrow)[b].qs);
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

/* Weight row wrow's block b made unsigned, into weights (four values a lane, to broadcast),
 * with the row `ahead` bytes on prefetched at even blocks (the next tile's: see
 * transposed_block). */
HS_AVX2 INLINE void unsigned_block(const char *wrow, const int type, const int b, const size_t ahead,
                                   int32_t weights[HS_BLOCK / 4]) {
    if (!(b & 1)) _mm_prefetch(wrow + ahead, _MM_HINT_T0);
    _mm256_store_si256((__m256i *)weights, load_unsigned_weights(wrow, type, b));
}

/* Block b of `tile` weight rows `stride` bytes apart, made unsigned into staged[t] (the next
 * tile's rows prefetched, as unsigned_block does). The rows-in-lanes kernels stage block b + 1
 * while they multiply block b, so that each four weights are broadcast from memory, a load:
 * made unsigned and used at once, the block stayed in a register (the compiler's choice) and
 * each broadcast was a shuffle on vpdpbusd's port, which halved the kernels' rate
 * (docs/bench/native/staged-weights.md). */
HS_AVX2 INLINE void stage_tile(const char *wrows, const size_t stride, const int type, const int b,
                               const int tile, const size_t block_bytes, int32_t staged[][HS_BLOCK / 4]) {
    for (int t = 0; t < tile; t++)
        unsigned_block(wrows + stride * t, type, b, stride * tile + block_bytes * b, staged[t]);
}

#endif

#endif
