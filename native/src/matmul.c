/* A matrix product (hs_matmul, and the forward's through hs_matmul_items): the output
 * features split into work items across the threads, each item's kernel chosen by the weights'
 * type and the call's kernel level: the unpacked types' in unpacked*.c, Q8_0's, Q4_0's, F32's
 * and F16's in kernels_*.c. A feature is computed whole by one thread, so its bits never
 * depend on the thread count. */
#include "internal.h"

#define COL_CHUNK 16  /* output features a thread takes at a time */

/* Output features [first, end) of all n rows: one work item, one thread's alone. */
static void matmul_features(const hs_matrix *w, const activations *a, const float *xf, int n,
                            int first, int end, float *out, int simd) {
    if (hs_unpacked_is(w->type)) {
        hs_unpacked_features(w, a, n, first, end, out, simd);
        return;
    }
#if HS_X86
    if (simd >= HS_SIMD_VNNI && is_quantized(w->type)) {
        hs_quantized_features_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd == HS_SIMD_AVX_VNNI && is_quantized(w->type)) {
        hs_quantized_features_avx_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd && is_quantized(w->type)) {
        hs_quantized_features_avx2(w, a, n, first, end, out);
        return;
    }
    if (simd) { /* F32, F16 */
        hs_float_features_avx2(w, xf, n, first, end, out);
        return;
    }
#endif
#if HS_ARM
    if (simd >= HS_SIMD_DOTPROD && is_quantized(w->type)) {
        hs_quantized_features_neon(w, a, n, first, end, out);
        return;
    }
#endif
    hs_features_portable(w, a, xf, n, first, end, out);
}

/* Called inside a parallel region by every thread (or outside one by the caller alone). */
void hs_matmul_items(const hs_matrix *w, const activations *a, const float *xf, int n,
                     float *out, int simd, int wait) {
#ifdef _OPENMP
    const int size = omp_get_num_threads() > 1 ? COL_CHUNK : w->rows; /* alone: one call */
#else
    const int size = w->rows;
#endif
    const int chunks = (w->rows + size - 1) / size;
#define MATMUL_BODY                                                                          \
    for (int c = 0; c < chunks; c++) {                                                       \
        const int end = c * size + size < w->rows ? c * size + size : w->rows;               \
        matmul_features(w, a, xf, n, c * size, end, out, simd);                              \
    }
    if (wait) {
#pragma omp for schedule(static)
        MATMUL_BODY
    } else {
#pragma omp for schedule(static) nowait
        MATMUL_BODY
    }
#undef MATMUL_BODY
}

int hs_matmul(const hs_matrix *w, const float *x, int n, float *out, int threads, int simd_cap) {
    if (n < 1 || threads < 1 || !row_bytes(w) || (is_quantized(w->type) && w->cols % HS_BLOCK))
        return -1;
    const int simd = hs_simd_for(simd_cap);
    const size_t padded = (size_t)(n + GROUP), blocks = padded * (w->cols / HS_BLOCK);
    activations a = {.with_sums = simd >= HS_SIMD_AVX_VNNI || hs_unpacked_has_mins(w->type),
                     .span = hs_unpacked_super(w->type) ? HS_SUPER : HS_BLOCK};
    void *base = NULL;
    if (is_quantized(w->type)) { /* room for a padded group (see grouped_rows) */
        base = malloc(2 * padded * w->cols + 2 * blocks * sizeof(float) + 4 * blocks * sizeof(int32_t));
        if (!base) return -1;
        a.d = base;
        a.grouped_d = a.d + blocks;
        a.sum = (int32_t *)(a.grouped_d + blocks);
        a.half_sum = a.sum + blocks;
        a.grouped_sum = a.half_sum + blocks;
        a.grouped_half_sum = a.grouped_sum + blocks;
        a.q = (int8_t *)(a.grouped_half_sum + blocks);
        a.grouped = a.q + padded * w->cols;
    }
#pragma omp parallel num_threads(threads)
    {
        if (base) {
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) hs_quantize_activation(&a, x + (size_t)i * w->cols, i, n, w->cols, simd);
        }
        hs_matmul_items(w, &a, x, n, out, simd, 1);
    }
    free(base);
    return 0;
}
