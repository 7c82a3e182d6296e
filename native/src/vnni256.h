/* The 256-bit vpdpbusd kernels for Q8_0 and Q4_0, written once for both of the instruction's
 * encodings. kernels_vnni.c and kernels_avx_vnni.c include this file, each once, with
 *   V256_ATTR    the functions' target attribute (HS_VNNI, HS_AVX_VNNI),
 *   V256_DPBUSD  the intrinsic (_mm256_dpbusd_epi32, _mm256_dpbusd_avx_epi32),
 *   V256(name)   a function's name at that level,
 * and vnni_start, load_unsigned_weights, weight_scale_of, transposed_block, UNGROUPED_ROWS
 * and FEATURES8_PASSES in scope (internal.h, kernels_x86.h). No include guard: one copy per
 * level, on purpose. The AVX-VNNI level runs them all (quantized_features_256); the AVX-512
 * VNNI level takes the one-row, features-in-lanes and one-group kernels (for Q4_0's groups and
 * small leftovers) and puts 16 features or two groups at a time in 512-bit vectors instead. (A lone group as
 * 8 rows against two weight rows in a 512-bit vector, placed by a permute per four weights,
 * measured 8% slower a forward than these 256-bit broadcasts.) */

#define V256_TILE 4 /* weight rows rows_in_lanes takes at once (2 measured the same) */

/* Rows in lanes for one group (8 rows) against `tile` (1, 2 or 4) weight rows `stride`
 * bytes apart, into result[t * GROUP ..]: each weight row's four weights broadcast to the 8
 * rows' lanes, one vpdpbusd per four products and row, a block's activations loaded once for
 * the tile. Each lane's dot_b is the AVX2 kernels' exact integer and the float steps are
 * theirs: the same bits. */
V256_ATTR INLINE void V256(rows_in_lanes)(const char *wrows, const size_t stride, const int type,
                                          const int blocks, const activations *a, const int group,
                                          const int tile, float *result) {
    const int shift = type == HS_Q8_0 ? Q8_BIAS_SHIFT : Q4_BIAS_SHIFT;
    const size_t block_bytes = stride / blocks;
    __m256 acc[4];
    for (int t = 0; t < tile; t++) acc[t] = _mm256_setzero_ps();
    int32_t staged[2][4][HS_BLOCK / 4] __attribute__((aligned(32))); /* see stage_tile */
    stage_tile(wrows, stride, type, 0, tile, block_bytes, staged[0]);
    for (int b = 0; b < blocks; b++) {
        if (b + 1 < blocks) stage_tile(wrows, stride, type, b + 1, tile, block_bytes, staged[(b + 1) & 1]);
        const size_t at = ((size_t)group * blocks + b) * GROUP;
        __m256i x[HS_BLOCK / 4];
        for (int k = 0; k < HS_BLOCK / 4; k++)
            x[k] = _mm256_loadu_si256((const __m256i *)(a->grouped + (at + k) * 4 * GROUP));
        const __m256i start = vnni_start(_mm256_loadu_si256((const __m256i *)(a->grouped_sum + at)), shift);
        const __m256 x_scales = _mm256_loadu_ps(a->grouped_d + at);
        for (int t = 0; t < tile; t++) {
            const char *wrow = wrows + stride * t;
            const int32_t *weights = staged[b & 1][t];
            /* two chains: vpdpbusd waits several cycles for its accumulator */
            __m256i chains[2] = {start, _mm256_setzero_si256()};
            for (int k = 0; k < HS_BLOCK / 4; k++)
                chains[k & 1] = V256_DPBUSD(chains[k & 1], _mm256_set1_epi32(weights[k]), x[k]);
            const __m256 w_scale = _mm256_set1_ps(_cvtsh_ss(weight_scale_of(wrow, type, b)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(chains[0], chains[1])),
                                     _mm256_mul_ps(x_scales, w_scale), acc[t]);
        }
    }
    for (int t = 0; t < tile; t++) _mm256_storeu_ps(result + t * GROUP, acc[t]);
}

/* Rows in lanes for two whole groups against `tile` (1 or 2) weight rows: each four weights
 * broadcast once for both groups, the activations vpdpbusd's memory operand (16 vector
 * registers hold no more). Each lane does exactly what rows_in_lanes' does: the same bits. */
V256_ATTR INLINE void V256(two_groups_in_lanes)(const char *wrows, const size_t stride, const int type,
                                                const int blocks, const activations *a, const int group,
                                                const int tile, float *result) {
    const int shift = type == HS_Q8_0 ? Q8_BIAS_SHIFT : Q4_BIAS_SHIFT;
    const size_t block_bytes = stride / blocks;
    __m256 acc[2][2];
    for (int t = 0; t < tile; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    int32_t staged[2][2][HS_BLOCK / 4] __attribute__((aligned(32))); /* see stage_tile */
    stage_tile(wrows, stride, type, 0, tile, block_bytes, staged[0]);
    for (int b = 0; b < blocks; b++) {
        if (b + 1 < blocks) stage_tile(wrows, stride, type, b + 1, tile, block_bytes, staged[(b + 1) & 1]);
        const size_t at[2] = {((size_t)group * blocks + b) * GROUP, ((size_t)(group + 1) * blocks + b) * GROUP};
        for (int t = 0; t < tile; t++) {
            const char *wrow = wrows + stride * t;
            const int32_t *weights = staged[b & 1][t];
            __m256i chains[2][2];
            for (int g = 0; g < 2; g++) {
                chains[g][0] = vnni_start(_mm256_loadu_si256((const __m256i *)(a->grouped_sum + at[g])), shift);
                chains[g][1] = _mm256_setzero_si256();
            }
            for (int k = 0; k < HS_BLOCK / 4; k++) {
                const __m256i w = _mm256_set1_epi32(weights[k]);
                for (int g = 0; g < 2; g++)
                    chains[g][k & 1] = V256_DPBUSD(chains[g][k & 1], w,
                                                   _mm256_loadu_si256((const __m256i *)(a->grouped + (at[g] + k) * 4 * GROUP)));
            }
            const __m256 w_scale = _mm256_set1_ps(_cvtsh_ss(weight_scale_of(wrow, type, b)));
            for (int g = 0; g < 2; g++)
                acc[t][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(chains[g][0], chains[g][1])),
                                            _mm256_mul_ps(_mm256_loadu_ps(a->grouped_d + at[g]), w_scale), acc[t][g]);
        }
    }
    for (int t = 0; t < tile; t++)
        for (int g = 0; g < 2; g++) _mm256_storeu_ps(result + (2 * t + g) * GROUP, acc[t][g]);
}

/* One row times 8 weight rows `stride` bytes apart, without the transpose: each weight row's
 * block meets the row's 32 activations in one vpdpbusd, and a tree of horizontal adds (exact
 * integers) puts the 8 block sums in lanes, where features_in_lanes' float steps follow:
 * the same bits, in about half the instructions (a drafter's and a target-alone token). */
V256_ATTR INLINE void V256(one_row_in_lanes)(const char *wrows, const size_t stride, const int type,
                                             const int blocks, const int8_t *xq, const float *xd,
                                             const int32_t *xs, float *result) {
    const int shift = type == HS_Q8_0 ? Q8_BIAS_SHIFT : Q4_BIAS_SHIFT;
    const size_t block_bytes = stride / blocks;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        if (!(b & 1)) /* the next 8 rows, as transposed_block does */
            for (int f = 0; f < 8; f++) _mm_prefetch(wrows + stride * (8 + f) + block_bytes * b, _MM_HINT_T0);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (size_t)b * HS_BLOCK));
        __m256i d[8];
        uint16_t scales[8];
        for (int f = 0; f < 8; f++) {
            d[f] = V256_DPBUSD(_mm256_setzero_si256(),
                               load_unsigned_weights(wrows + stride * f, type, b), x);
            scales[f] = weight_scale_of(wrows + stride * f, type, b);
        }
        /* lanes [f0..f3 | f0..f3] of the low and high 128-bit halves, then joined */
        const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
        const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
        const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                                              _mm256_permute2x128_si256(low, high, 0x31));
        const __m256i total = _mm256_add_epi32(sums, vnni_start(_mm256_set1_epi32(xs[b]), shift));
        const __m256 w_scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(_mm256_set1_ps(xd[b]), w_scales), acc);
    }
    _mm256_storeu_ps(result, acc);
}

/* transposed_block's block, biased to vpdpbusd's unsigned side as load_unsigned_weights
 * biases it (Q8_0 w + 128, Q4_0 w + 8). */
V256_ATTR INLINE void V256(unsigned_transposed_block)(const char *wrows, const size_t stride, const int type,
                                                      const int b, const size_t block_bytes, __m256i w[8],
                                                      __m256 *w_scales) {
    transposed_block(wrows, stride, type, b, block_bytes, w, w_scales);
    for (int k = 0; k < HS_BLOCK / 4; k++)
        w[k] = type == HS_Q8_0 ? _mm256_xor_si256(w[k], _mm256_set1_epi8((char)0x80))
                               : _mm256_add_epi8(w[k], _mm256_set1_epi8(8));
}

/* Features in lanes: m (<= 4) row-major rows times 8 weight rows `stride` bytes apart, as
 * features_in_lanes_avx2 lays them out. */
V256_ATTR INLINE void V256(features_in_lanes)(const char *wrows, const size_t stride, const int type,
                                              const int blocks, const int8_t *xq, const float *xd,
                                              const int32_t *xs, const int cols, const int m,
                                              float *result) {
    if (m == 1) {
        V256(one_row_in_lanes)(wrows, stride, type, blocks, xq, xd, xs, result);
        return;
    }
    const int shift = type == HS_Q8_0 ? Q8_BIAS_SHIFT : Q4_BIAS_SHIFT;
    __m256 acc[4];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const size_t block_bytes = stride / blocks;
    for (int b = 0; b < blocks; b++) {
        __m256i w[8];
        __m256 w_scales;
        V256(unsigned_transposed_block)(wrows, stride, type, b, block_bytes, w, &w_scales);
        __m256i sums[4][2]; /* two chains a row (see rows_in_lanes) */
        for (int r = 0; r < m; r++) {
            sums[r][0] = vnni_start(_mm256_set1_epi32(xs[(size_t)r * blocks + b]), shift);
            sums[r][1] = _mm256_setzero_si256();
        }
        for (int k = 0; k < HS_BLOCK / 4; k++)
            for (int r = 0; r < m; r++) {
                const int8_t *x = xq + (size_t)r * cols + (size_t)b * HS_BLOCK + 4 * k;
                sums[r][k & 1] = V256_DPBUSD(sums[r][k & 1], w[k], broadcast4(x));
            }
        for (int r = 0; r < m; r++) {
            const __m256 x_scale = _mm256_set1_ps(xd[(size_t)r * blocks + b]);
            const __m256i total = _mm256_add_epi32(sums[r][0], sums[r][1]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(result + 8 * r, acc[r]);
}

/* Features in lanes for m (2 <= m <= FEATURES16_PASS) rows against 8 weight rows: each block
 * transposed once for all m rows (features_in_lanes transposes it again for every 4 rows), a
 * row's two chains in registers; features_in_lanes' integers and float steps, the same bits. */
V256_ATTR INLINE void V256(features8_in_lanes)(const char *wrows, const size_t stride, const int type,
                                               const int blocks, const int8_t *xq, const float *xd,
                                               const int32_t *xs, const int cols, const int m,
                                               float *result) {
    const int shift = type == HS_Q8_0 ? Q8_BIAS_SHIFT : Q4_BIAS_SHIFT;
    __m256 acc[FEATURES16_PASS];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const size_t block_bytes = stride / blocks;
    for (int b = 0; b < blocks; b++) {
        __m256i w[8];
        __m256 w_scales;
        V256(unsigned_transposed_block)(wrows, stride, type, b, block_bytes, w, &w_scales);
        for (int r = 0; r < m; r++) {
            const int8_t *x = xq + (size_t)r * cols + (size_t)b * HS_BLOCK;
            __m256i chains[2] = {vnni_start(_mm256_set1_epi32(xs[(size_t)r * blocks + b]), shift),
                                 _mm256_setzero_si256()};
            for (int k = 0; k < HS_BLOCK / 4; k++)
                chains[k & 1] = V256_DPBUSD(chains[k & 1], w[k], broadcast4(x + 4 * k));
            const __m256 x_scale = _mm256_set1_ps(xd[(size_t)r * blocks + b]);
            const __m256i total = _mm256_add_epi32(chains[0], chains[1]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(result + 8 * r, acc[r]);
}

FEATURES8_PASSES(V256_ATTR, V256(features8_passes), V256(features8_in_lanes))

/* Features in lanes from a packed Q8_0 tile (hs_matrix.packed: 8 weight rows, every block):
 * features_in_lanes with the transpose and the bias done once at load, so a block is nine
 * loads; the same products and float steps, so the same bits. */
V256_ATTR INLINE void V256(packed_features)(const char *tile, const int blocks, const int8_t *xq,
                                            const float *xd, const int32_t *xs, const int cols,
                                            const int m, float *result) {
    __m256 acc[4];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const char *block = tile + (size_t)b * HS_PACKED_BYTES;
        const __m256 w_scales = _mm256_loadu_ps((const float *)block);
        __m256i sums[4][2]; /* two chains a row (see rows_in_lanes) */
        for (int r = 0; r < m; r++) {
            sums[r][0] = vnni_start(_mm256_set1_epi32(xs[(size_t)r * blocks + b]), Q8_BIAS_SHIFT);
            sums[r][1] = _mm256_setzero_si256();
        }
        for (int k = 0; k < HS_BLOCK / 4; k++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * k));
            for (int r = 0; r < m; r++) {
                const int8_t *x = xq + (size_t)r * cols + (size_t)b * HS_BLOCK + 4 * k;
                sums[r][k & 1] = V256_DPBUSD(sums[r][k & 1], w, broadcast4(x));
            }
        }
        for (int r = 0; r < m; r++) {
            const __m256 x_scale = _mm256_set1_ps(xd[(size_t)r * blocks + b]);
            const __m256i total = _mm256_add_epi32(sums[r][0], sums[r][1]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(result + 8 * r, acc[r]);
}

/* Output features [first, end) of all n rows, into out (n, w->rows): whole groups of 8 rows
 * rows in lanes, a tile of weight rows at a time, every group against the tile while its
 * rows are in L1; the other rows features in lanes (all of them, for most row counts). */
V256_ATTR static inline void V256(quantized_features_256)(const hs_matrix *w, const activations *a,
                                                          int n, int first, int end, float *out) {
    /* calls of 2 or more rows 8 features in lanes (heavy-100m Q8_0 at AVX-VNNI T(5) 6.34 ->
     * 5.78 ms, T(12) 10.80 -> 9.57, T(17) 14.19 -> 12.47), but for one whole group, which rows
     * in lanes serve 4-10% faster; a small model's packed copy serves 2-4 rows */
    const int in_lanes8 = n >= 2 && n != GROUP && (!w->packed || n > 4);
    const int blocks = w->cols / HS_BLOCK, groups = in_lanes8 ? 0 : grouped_rows(n) / GROUP;
    const int grouped = groups * GROUP < n ? groups * GROUP : n;
    const size_t stride = row_bytes(w);
    const char *data = w->data;
    float result[4 * GROUP];
/* a kernel's call with the type and the weight-row count as literals: each is compiled for its
 * own */
#define TYPED(kernel, rows, count)                                                           \
    if (w->type == HS_Q8_0) V256(kernel)(rows, stride, HS_Q8_0, blocks, a, g, count, result); \
    else V256(kernel)(rows, stride, HS_Q4_0, blocks, a, g, count, result);
    for (int j = first; j < end && groups > 0;) {
        const int tile = end - j >= V256_TILE ? V256_TILE : 1;
        const char *wrows = data + stride * j;
        for (int g = 0; g < groups;) {
            if (groups - g >= 2) { /* two weight rows a call (four rows' sums would spill) */
                for (int t0 = 0; t0 < tile; t0 += 2) {
                    const char *rows = wrows + stride * t0;
                    if (tile == V256_TILE) {
                        TYPED(two_groups_in_lanes, rows, 2)
                    } else {
                        TYPED(two_groups_in_lanes, rows, 1)
                    }
                    /* result: (weight row, group) runs of GROUP */
                    for (int t = 0; t < 2 && t0 + t < tile; t++)
                        for (int h = 0; h < 2; h++)
                            for (int r = 0; r < GROUP && (g + h) * GROUP + r < n; r++)
                                out[(size_t)((g + h) * GROUP + r) * w->rows + j + t0 + t] =
                                    result[(2 * t + h) * GROUP + r];
                }
                g += 2;
                continue;
            }
            if (tile == V256_TILE) {
                TYPED(rows_in_lanes, wrows, V256_TILE)
            } else {
                TYPED(rows_in_lanes, wrows, 1)
            }
            for (int t = 0; t < tile; t++)
                for (int r = 0; r < GROUP && g * GROUP + r < n; r++)
                    out[(size_t)(g * GROUP + r) * w->rows + j + t] = result[t * GROUP + r];
            g += 1;
        }
        j += tile;
    }
#undef TYPED
    int j = first;
    if (in_lanes8)
        for (; j + 8 <= end; j += 8) V256(features8_passes)(w, a, n, j, out);
    PACKED_ROWS(V256(packed_features), HS_PACKED_UNSIGNED)
    UNGROUPED_ROWS(V256(features_in_lanes))
}
