/* Choosing tokens from logits: the argmax (hs_argmax; AVX2 finds the same index as the
 * scalar loop), a row's softmax, a race of probabilities against noise, an inverse-CDF draw;
 * and the draft loops that choose as they go (hs_draft_chain, hs_draft_branches), each step
 * one forward of every chain's row and a choice for each. */
#include "internal.h"

/* The index of the largest value, the lowest of equal ones. */
static int argmax_scalar(const float *row, int n) {
    int best = 0;
    for (int k = 1; k < n; k++)
        if (row[k] > row[best]) best = k;
    return best;
}

#if HS_X86
/* The largest value 8 lanes at a time, then the first index holding it: the scalar loop's
 * answer (the lowest of equal ones) without its chain of dependent compares; a row with a
 * NaN, where the two could differ, goes the scalar way. */
HS_AVX2 static int argmax_avx2(const float *row, int n) {
    if (n < 16) return argmax_scalar(row, n);
    __m256 top = _mm256_loadu_ps(row), unordered = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
    int k = 8;
    for (; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_loadu_ps(row + k);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    float best = lanes[0];
    for (int i = 1; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    for (int i = k; i < n; i++) {
        if (row[i] != row[i]) return argmax_scalar(row, n);
        best = row[i] > best ? row[i] : best;
    }
    if (_mm256_movemask_ps(unordered)) return argmax_scalar(row, n);
    const __m256 wanted = _mm256_set1_ps(best);
    for (k = 0; k + 8 <= n; k += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + k), wanted, _CMP_EQ_OQ));
        if (hits) return k + __builtin_ctz((unsigned)hits);
    }
    for (; k < n; k++)
        if (row[k] == best) return k;
    return argmax_scalar(row, n);
}
#endif

/* The index of the largest logit, the lowest of equal ones. */
static int argmax_row(const float *row, int n, int simd) {
#if HS_X86
    if (simd >= HS_SIMD_AVX2) return argmax_avx2(row, n);
#else
    (void)simd;
#endif
    return argmax_scalar(row, n);
}

int hs_argmax(const float *row, int n, int simd_cap) {
    return n < 1 ? -1 : argmax_row(row, n, hs_simd_for(simd_cap));
}

/* softmax(row * inv_temperature) into probs (attention.c's softmax_weights at kernel level
 * `simd` AVX2 or above: probs are what the caller reports, whichever path computed them). */
static void softmax_row(const float *row, int n, float inv_temperature, float *probs, int simd) {
    for (int k = 0; k < n; k++) probs[k] = row[k] * inv_temperature;
    float total = 0.0f;
#if HS_X86
    if (simd >= HS_SIMD_AVX2) {
        total = hs_softmax_weights_avx2(probs, n);
    } else
#else
    (void)simd;
#endif
    {
        float top = probs[0];
        for (int k = 1; k < n; k++)
            if (probs[k] > top) top = probs[k];
        for (int k = 0; k < n; k++) {
            probs[k] = expf(probs[k] - top);
            total += probs[k];
        }
    }
    const float scale = 1.0f / total;
    for (int k = 0; k < n; k++) probs[k] *= scale;
}

/* The index of the largest probs[k] / noise[k], the lowest of equal ones. */
static int race_row(const float *probs, const float *noise, int n) {
    int best = 0;
    float best_score = probs[0] / noise[0];
    for (int k = 1; k < n; k++) {
        const float score = probs[k] / noise[k];
        if (score > best_score) {
            best_score = score;
            best = k;
        }
    }
    return best;
}

/* The first index whose cumulative probability (in double) exceeds u times the total: a draw
 * from probs for a uniform u in [0, 1); never past the last index. */
static int inverse_cdf_row(const float *probs, double u, int n) {
    double total = 0.0;
    for (int k = 0; k < n; k++) total += probs[k];
    const double target = u * total;
    double cumulative = 0.0;
    for (int k = 0; k < n; k++) {
        cumulative += probs[k];
        if (cumulative > target) return k;
    }
    return n - 1;
}

/* hs_draft_chain's and hs_draft_branches' loop: `branches` chains side by side, row j of step
 * i in slot start + i * branches + j, its probability row at probs + j * branch_stride +
 * i * vocab, its noise row or uniform the (i * branches + j)-th. */
static int draft_side_by_side(const hs_model *m, int branches, int count, int32_t *tokens,
                              int position, int start, int n_prefix, const int32_t *base,
                              int n_base, float *logits, const float *noise,
                              const double *uniforms, float inv_temperature, float *probs,
                              long long branch_stride, int threads) {
    if (branches < 1 || count < 1 || n_base < 0 || start + count * branches > m->capacity) return -1;
    const int sampled = noise || uniforms;
    if ((noise && uniforms) || (sampled && !probs) || (probs && !(inv_temperature > 0.0f))) return -1;
    if (probs && branch_stride < (long long)count * m->vocab) return -1;
    const size_t longest = (size_t)n_base + (size_t)count; /* a row's visible slots at the end */
    int32_t *visible = malloc(sizeof(int32_t) * longest * (size_t)branches);
    int32_t *offsets = malloc(sizeof(int32_t) * (size_t)(branches + 1));
    int32_t *positions = malloc(sizeof(int32_t) * (size_t)branches);
    int status = visible && offsets && positions ? 0 : -1;
    const int simd = hs_simd_for(m->simd);
    for (int i = 0; i < count && !status; i++) {
        const int seen = n_base + i + 1; /* base, then the branch's nodes up to this one */
        offsets[0] = 0;
        for (int j = 0; j < branches; j++) {
            int32_t *row = visible + (size_t)j * (size_t)seen;
            memcpy(row, base, sizeof(int32_t) * (size_t)n_base);
            for (int k = 0; k <= i; k++) row[n_base + k] = start + k * branches + j;
            offsets[j + 1] = offsets[j] + seen;
            positions[j] = position + i;
        }
        float *rows = logits + (size_t)i * (size_t)branches * m->vocab;
        status = hs_forward(m, branches, tokens + (size_t)i * branches, positions,
                            start + i * branches, n_prefix, offsets, visible, 0, rows, threads);
        for (int j = 0; j < branches && !status; j++) {
            const size_t at = (size_t)i * branches + j; /* the row, in step order */
            const float *row = rows + (size_t)j * m->vocab;
            float *p = probs ? probs + j * branch_stride + (size_t)i * m->vocab : NULL;
            if (p) softmax_row(row, m->vocab, inv_temperature, p, simd);
            tokens[at + branches] = !sampled ? argmax_row(row, m->vocab, simd)
                                    : noise  ? race_row(p, noise + at * m->vocab, m->vocab)
                                             : inverse_cdf_row(p, uniforms[at], m->vocab);
        }
    }
    free(visible);
    free(offsets);
    free(positions);
    return status;
}

int hs_draft_chain(const hs_model *m, int count, int32_t *tokens, int position, int start,
                   int n_prefix, const int32_t *base, int n_base, float *logits,
                   const float *noise, const double *uniforms, float inv_temperature,
                   float *probs, int threads) {
    return draft_side_by_side(m, 1, count, tokens, position, start, n_prefix, base, n_base,
                              logits, noise, uniforms, inv_temperature, probs,
                              (long long)count * m->vocab, threads);
}

int hs_draft_branches(const hs_model *m, int branches, int count, int32_t *tokens, int position,
                      int start, int n_prefix, const int32_t *base, int n_base, float *logits,
                      float *probs, long long branch_stride, int threads) {
    return draft_side_by_side(m, branches, count, tokens, position, start, n_prefix, base,
                              n_base, logits, NULL, NULL, 1.0f, probs, branch_stride, threads);
}
