/* The forward (hs_forward): n new tokens through every layer in one OpenMP parallel region,
 * their keys and values written to the cache, the logits of the rows asked for; and its
 * per-row float steps (norms, rotations, biases, the gated activation, soft caps, the cache's
 * halves), each run per row in a fixed order, so that a row's bits never depend on the rows
 * beside it. The matrix products are matmul.c's, attention attention.c's. */
#include "internal.h"

/* ------------------------------------------------------------------ per-row float steps */

/* IEEE binary16, rounded to nearest even (as F16C's vcvtps2ph): the KV cache's format. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, magnitude = x & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) /* infinity, NaN (quieted) */
        return (uint16_t)(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0));
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
    if (magnitude < 0x38800000u) { /* below 2^-14: a subnormal half (exact scaling by 2^24) */
        float value;
        memcpy(&value, &magnitude, sizeof value);
        return (uint16_t)(sign | (uint32_t)lrintf(value * 16777216.0f));
    }
    uint32_t h = (magnitude - 0x38000000u) >> 13, rest = magnitude & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry moves the exponent */
    return (uint16_t)(sign | h);
}

#if HS_X86
HS_AVX2 static void store_half_avx2(uint16_t *out, const float *x, int n) {
    int k = 0;
    for (; k + 8 <= n; k += 8)
        _mm_storeu_si128((__m128i *)(out + k),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + k), _MM_FROUND_TO_NEAREST_INT));
    for (; k < n; k++) out[k] = float_to_half(x[k]);
}
#endif

/* n floats into the half-precision KV cache: the same bits with or without F16C. */
static void store_half(uint16_t *out, const float *x, int n, int simd) {
#if HS_X86
    if (simd) {
        store_half_avx2(out, x, n);
        return;
    }
#endif
    (void)simd;
    for (int k = 0; k < n; k++) out[k] = float_to_half(x[k]);
}

static void rms_norm(const float *x, const float *weight, int cols, float eps, float *out) {
    double squares = 0.0;
    for (int k = 0; k < cols; k++) squares += (double)x[k] * x[k];
    const float scale = 1.0f / sqrtf((float)(squares / cols) + eps);
    for (int k = 0; k < cols; k++) out[k] = x[k] * scale * weight[k];
}

/* Rotate pair i of each head by the angles of one position: values (2i, 2i+1), or with
 * `halves` (i, i + head_dim/2). */
static void rope_row(float *x, int heads, int head_dim, int halves, const float *cos,
                     const float *sin) {
    const int stride = halves ? 1 : 2, partner = halves ? head_dim / 2 : 1;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < head_dim / 2; i++) {
            float *first = v + i * stride, *second = first + partner;
            const float a = *first, b = *second;
            *first = a * cos[i] - b * sin[i];
            *second = a * sin[i] + b * cos[i];
        }
    }
}

/* x (n) += bias (n), unless there is no bias. */
static void add_bias(float *x, const float *bias, int n) {
    if (bias)
        for (int k = 0; k < n; k++) x[k] += bias[k];
}

/* RMSNorm of each head of x in place, unless there is no norm. */
static void norm_heads(float *x, const float *weight, int heads, int head_dim, float eps) {
    if (weight)
        for (int h = 0; h < heads; h++)
            rms_norm(x + (size_t)h * head_dim, weight, head_dim, eps, x + (size_t)h * head_dim);
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* GELU's tanh form, x (1 + tanh(u)) / 2 with u = sqrt(2/pi) (x + 0.044715 x^3), written as
 * x sigmoid(2u) (the same sigmoid as silu's) */
static float gelu_tanh(float x) {
    return x / (1.0f + expf(-1.5957691216057308f * (x + 0.044715f * (x * x * x))));
}

static float gated(float x, int activation) { return activation == HS_GELU_TANH ? gelu_tanh(x) : silu(x); }

#if HS_X86
/* x sigmoid(z), 8 lanes at a time: sigmoid(z) = 1 / (1 + e^-z) for z >= 0 and e^z / (1 + e^z)
 * below, the forms whose exponent is not positive, so no lane overflows. */
HS_AVX2 INLINE __m256 times_sigmoid(const __m256 x, const __m256 z) {
    const __m256 e = exp_nonpositive(_mm256_or_ps(z, _mm256_set1_ps(-0.0f))); /* e^-|z| */
    const __m256 numerator =
        _mm256_blendv_ps(_mm256_mul_ps(x, e), x, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* g = act(g) * u, 8 lanes at a time: silu(x) = x sigmoid(x); GELU's tanh form x sigmoid(2u),
 * u = sqrt(2/pi) (x + 0.044715 x^3). The tail as silu and gelu_tanh compute it. */
HS_AVX2 static void gated_mul_avx2(float *g, const float *u, int n, int activation) {
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 x = _mm256_loadu_ps(g + k);
        __m256 z = x;
        if (activation == HS_GELU_TANH) {
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),
                              _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
        }
        _mm256_storeu_ps(g + k, _mm256_mul_ps(times_sigmoid(x, z), _mm256_loadu_ps(u + k)));
    }
    for (; k < n; k++) g[k] = gated(g[k], activation) * u[k];
}

/* cap * tanh(x / cap) over n values in place, 8 lanes at a time (cap <= 0: none): tanh(a) =
 * sign(a) (1 - e) / (1 + e) with e = e^-2|a|, whose exponent is never positive */
HS_AVX2 void hs_soft_cap_avx2(float *x, int n, float cap) {
    if (!(cap > 0.0f)) return;
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f),
                 caps = _mm256_set1_ps(cap), inverse = _mm256_set1_ps(1.0f / cap);
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + k), inverse);
        const __m256 magnitude = _mm256_andnot_ps(sign_bit, a);
        const __m256 e = exp_nonpositive(_mm256_mul_ps(magnitude, _mm256_set1_ps(-2.0f)));
        const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(x + k, _mm256_mul_ps(caps, _mm256_or_ps(t, _mm256_and_ps(sign_bit, a))));
    }
    float tail[8] = {0};
    for (int i = 0; k + i < n; i++) tail[i] = x[k + i];
    if (k < n) {
        hs_soft_cap_avx2(tail, 8, cap);
        for (int i = 0; k + i < n; i++) x[k + i] = tail[i];
    }
}
#endif

/* ------------------------------------------------------------------ the forward */

typedef struct { /* per-call scratch, one allocation */
    float *x, *normed, *q, *k, *v, *attended, *projected, *gate, *up, *scores;
    activations acts;  /* span HS_BLOCK: every quantized type but the super-block ones */
    activations super; /* span HS_SUPER: the super-block types' (hs_unpacked_super) */
    void *base;
} scratch;

static int scratch_alloc(scratch *s, const hs_model *m, int n, int threads) {
    const size_t d = m->d_model, f = m->n_ff, qd = (size_t)m->n_heads * m->head_dim,
                 kvd = (size_t)m->n_kv_heads * m->head_dim;
    size_t widest = d > f ? d : f;
    if (qd > widest) widest = qd;
    const size_t padded = (size_t)n + GROUP; /* the grouped layout may hold a padded group */
    const size_t floats[] = {n * d, n * widest, n * qd, n * kvd, n * kvd, n * qd,
                             n * d,  n * f,      n * f,
                             (size_t)threads * hs_attention_scratch(m),
                             n * (widest / HS_BLOCK), padded * (widest / HS_BLOCK),
                             n * (widest / HS_BLOCK), n * (widest / HS_BLOCK),
                             padded * (widest / HS_BLOCK), padded * (widest / HS_BLOCK),
                             n * (widest / HS_BLOCK), padded * (widest / HS_BLOCK),
                             n * (widest / HS_BLOCK), n * (widest / HS_BLOCK),
                             padded * (widest / HS_BLOCK), padded * (widest / HS_BLOCK)};
    _Static_assert(sizeof(float) == sizeof(int32_t), "the block sums share the float slots");
    _Static_assert(sizeof floats / sizeof *floats == 22, "a size for each slot below");
    float **slots[] = {&s->x,      &s->normed,    &s->q,    &s->k,  &s->v,     &s->attended,
                       &s->projected, &s->gate, &s->up, &s->scores, &s->acts.d,
                       &s->acts.grouped_d, (float **)&s->acts.sum, (float **)&s->acts.half_sum,
                       (float **)&s->acts.grouped_sum, (float **)&s->acts.grouped_half_sum,
                       &s->super.d, &s->super.grouped_d, (float **)&s->super.sum,
                       (float **)&s->super.half_sum, (float **)&s->super.grouped_sum,
                       (float **)&s->super.grouped_half_sum};
    const size_t int8s = (padded * widest + 63) & ~(size_t)63; /* each of the four int8 layouts */
    size_t total = 4 * int8s;
    for (size_t i = 0; i < sizeof floats / sizeof *floats; i++) total += floats[i] * sizeof(float) + 64;
    char *base = malloc(total + 64);
    if (!base) return -1;
    s->base = base;
    s->acts.q = (int8_t *)base;
    s->acts.grouped = (int8_t *)base + int8s;
    s->super.q = (int8_t *)base + 2 * int8s;
    s->super.grouped = (int8_t *)base + 3 * int8s;
    s->acts.span = HS_BLOCK;
    s->super.span = HS_SUPER;
    char *cursor = base + 4 * int8s;
    for (size_t i = 0; i < sizeof floats / sizeof *floats; i++) {
        *slots[i] = (float *)cursor;
        cursor += (floats[i] * sizeof(float) + 63) & ~(size_t)63;
    }
    return 0;
}

/* The activations a matrix reads. */
static const activations *acts_for(const scratch *s, const hs_matrix *w) {
    return hs_unpacked_super(w->type) ? &s->super : &s->acts;
}

/* Which spans the matrices reading one input need: bit 0 HS_BLOCK's, bit 1 HS_SUPER's. */
static int spans_of(const hs_matrix *a, const hs_matrix *b, const hs_matrix *c) {
    const hs_matrix *readers[] = {a, b, c};
    int spans = 0;
    for (int i = 0; i < 3; i++)
        if (readers[i] && is_quantized(readers[i]->type)) spans |= hs_unpacked_super(readers[i]->type) ? 2 : 1;
    return spans;
}

/* Row i of an input, quantized for each span its readers need. */
static void quantize_input(const scratch *s, int spans, const float *x, int i, int n, int cols, int simd) {
    if (spans & 1) hs_quantize_activation(&s->acts, x, i, n, cols, simd);
    if (spans & 2) hs_quantize_activation(&s->super, x, i, n, cols, simd);
}

static int matrix_ok(const hs_matrix *w, int rows, int cols) {
    return w->data && w->rows == rows && w->cols == cols && row_bytes(w) &&
           (!is_quantized(w->type) || cols % HS_BLOCK == 0);
}

/* Whether the kernels can run the model: its matrices' shapes and types, its heads. */
static int model_ok(const hs_model *m) {
    if (m->head_dim % 2 || m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads ||
        (m->activation != HS_SILU && m->activation != HS_GELU_TANH))
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
    return 1;
}

/* The forward's work, run by every thread of its team, or by the caller alone (no team). */
static void forward_rows(const hs_model *m, const scratch *s, const hs_rows *rows, float *logits,
                         int simd) {
    const int n = rows->n;
    const int32_t *tokens = rows->tokens, *positions = rows->positions;
    const int d = m->d_model, f = m->n_ff, hd = m->head_dim, heads = m->n_heads,
              kv_heads = m->n_kv_heads, qd = heads * hd, kvd = kv_heads * hd;
    const int half = hd / 2;
#ifdef _OPENMP
    float *scores = s->scores + (size_t)omp_get_thread_num() * hs_attention_scratch(m);
#else
    float *scores = s->scores;
#endif
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
        float *x = s->x + (size_t)i * d;
        hs_embed_row(&m->embed, tokens[i], x);
        if (m->embed_scale > 0.0f)
            for (int k = 0; k < d; k++) x[k] *= m->embed_scale;
    }

    for (int l = 0; l < m->n_layers; l++) {
        const hs_layer *y = &m->layers[l];
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            rms_norm(s->x + (size_t)i * d, y->attn_norm, d, m->eps, s->normed + (size_t)i * d);
            quantize_input(s, spans_of(&y->q, &y->k, &y->v), s->normed + (size_t)i * d, i, n, d, simd);
        }
        hs_matmul_items(&y->q, acts_for(s, &y->q), s->normed, n, s->q, simd, 0);
        hs_matmul_items(&y->k, acts_for(s, &y->k), s->normed, n, s->k, simd, 0);
        hs_matmul_items(&y->v, acts_for(s, &y->v), s->normed, n, s->v, simd, 1);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            const float *cos = (y->rope_cos ? y->rope_cos : m->rope_cos) + (size_t)positions[i] * half;
            const float *sin = (y->rope_sin ? y->rope_sin : m->rope_sin) + (size_t)positions[i] * half;
            float *q = s->q + (size_t)i * qd, *k = s->k + (size_t)i * kvd;
            add_bias(q, y->q_bias, qd);
            add_bias(k, y->k_bias, kvd);
            add_bias(s->v + (size_t)i * kvd, y->v_bias, kvd);
            norm_heads(q, y->q_norm, heads, hd, m->eps);
            norm_heads(k, y->k_norm, kv_heads, hd, m->eps);
            rope_row(q, heads, hd, m->rope_halves, cos, sin);
            rope_row(k, kv_heads, hd, m->rope_halves, cos, sin);
            for (int h = 0; h < kv_heads; h++) {
                const size_t slot =
                    (((size_t)l * kv_heads + h) * m->capacity + (size_t)rows->slot[i]) * hd;
                store_half(m->k_cache + slot, s->k + (size_t)i * kvd + (size_t)h * hd, hd, simd);
                store_half(m->v_cache + slot, s->v + (size_t)i * kvd + (size_t)h * hd, hd, simd);
            }
        }
        hs_attention(m, l, rows, s->q, s->attended, scores, simd);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++)
            quantize_input(s, spans_of(&y->o, NULL, NULL), s->attended + (size_t)i * qd, i, n, qd, simd);
        hs_matmul_items(&y->o, acts_for(s, &y->o), s->attended, n, s->projected, simd, 1);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            float *x = s->x + (size_t)i * d, *projected = s->projected + (size_t)i * d;
            add_bias(projected, y->o_bias, d);
            if (y->post_attn_norm) rms_norm(projected, y->post_attn_norm, d, m->eps, projected);
            for (int k = 0; k < d; k++) x[k] += projected[k];
            rms_norm(x, y->ffn_norm, d, m->eps, s->normed + (size_t)i * d);
            quantize_input(s, spans_of(&y->gate, &y->up, NULL), s->normed + (size_t)i * d, i, n, d, simd);
        }
        hs_matmul_items(&y->gate, acts_for(s, &y->gate), s->normed, n, s->gate, simd, 0);
        hs_matmul_items(&y->up, acts_for(s, &y->up), s->normed, n, s->up, simd, 1);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            float *g = s->gate + (size_t)i * f, *u = s->up + (size_t)i * f;
            add_bias(g, y->gate_bias, f);
            add_bias(u, y->up_bias, f);
#if HS_X86
            if (simd)
                gated_mul_avx2(g, u, f, m->activation);
            else
#endif
                for (int k = 0; k < f; k++) g[k] = gated(g[k], m->activation) * u[k];
            quantize_input(s, spans_of(&y->down, NULL, NULL), g, i, n, f, simd);
        }
        hs_matmul_items(&y->down, acts_for(s, &y->down), s->gate, n, s->projected, simd, 1);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            float *x = s->x + (size_t)i * d, *projected = s->projected + (size_t)i * d;
            add_bias(projected, y->down_bias, d);
            if (y->post_ffn_norm) rms_norm(projected, y->post_ffn_norm, d, m->eps, projected);
            for (int k = 0; k < d; k++) x[k] += projected[k];
        }
    }
    const int outputs = rows->outputs;
    if (outputs > 0) {
#pragma omp for schedule(static)
        for (int r = 0; r < outputs; r++) {
            const size_t i = (size_t)rows->logit_rows[r];
            rms_norm(s->x + i * d, m->output_norm, d, m->eps, s->normed + (size_t)r * d);
            quantize_input(s, spans_of(&m->output, NULL, NULL), s->normed + (size_t)r * d, r, outputs, d, simd);
        }
        hs_matmul_items(&m->output, acts_for(s, &m->output), s->normed, outputs, logits, simd, 1);
        if (m->final_softcap > 0.0f) {
#pragma omp for schedule(static)
            for (int r = 0; r < outputs; r++) {
                float *row = logits + (size_t)r * m->vocab;
#if HS_X86
                if (simd)
                    hs_soft_cap_avx2(row, m->vocab, m->final_softcap);
                else
#endif
                    soft_cap(row, m->vocab, m->final_softcap);
            }
        }
    }
}

/* Whether a matrix of the model has Q4_K's or Q5_K's mins (its kernels need block sums). */
static int has_mins_anywhere(const hs_model *m) {
    int found = hs_unpacked_has_mins(m->output.type);
    for (int l = 0; l < m->n_layers; l++) {
        const hs_layer *y = &m->layers[l];
        const hs_matrix *matrices[] = {&y->q, &y->k, &y->v, &y->o, &y->gate, &y->up, &y->down};
        for (int i = 0; i < 7; i++) found |= hs_unpacked_has_mins(matrices[i]->type);
    }
    return found;
}

int hs_forward_rows(const hs_model *m, const hs_rows *rows, float *logits, int threads) {
    if (threads < 1 || !model_ok(m)) return -1;
    scratch s;
    if (scratch_alloc(&s, m, rows->n, threads)) return -1;
    const int simd = hs_simd_for(m->simd);
    s.acts.with_sums = s.super.with_sums = simd >= HS_SIMD_AVX_VNNI || has_mins_anywhere(m);
    if (threads == 1) { /* no team: its worksharing loops are orphaned and skip their barriers,
        where a team of one still makes a futex call at each (about 26 a forward) */
        forward_rows(m, &s, rows, logits, simd);
    } else {
#pragma omp parallel num_threads(threads)
        forward_rows(m, &s, rows, logits, simd);
    }
    free(s.base);
    return 0;
}

int hs_forward(const hs_model *m, int n, const int32_t *tokens, const int32_t *positions,
               int start, int n_prefix, const int32_t *offsets, const int32_t *visible,
               int first_logit, float *logits, int threads) {
    const hs_sequence one = {n, 0, n_prefix, start, first_logit};
    return hs_forward_sequences(m, 1, &one, tokens, positions, offsets, visible, logits, threads);
}
