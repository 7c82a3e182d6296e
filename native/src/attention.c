/* Attention over the half-precision KV cache: each new row of a forward attends to its
 * sequence's committed prefix (dense) and to the slots it lists (its pending ancestors), in
 * slot order.
 * On x86 one call takes a KV head's query heads for up to ATTEND_ROWS rows, widening each
 * block of prefix keys and values to floats once for all of them; each (row, head) still runs
 * the same float steps in the same order whatever rows share the call, so its bits depend on
 * neither the width nor the split. The portable C does one (row, head) at a time. */
#include "internal.h"

#define ATTEND_ROWS 16 /* rows one call of the attention kernel takes (attend_rows_body) */

#if HS_X86
/* hsum8 of eight vectors at once, lane j = hsum8(v[j]) bit for bit: the same pairs are added
 * in the same order ((0+4)+(2+6)) + ((1+5)+(3+7)), by transposing adds instead of one
 * horizontal sum (a chain of dependent shuffles) per vector. */
HS_AVX2 INLINE __m256 hsum8_each(const __m256 v[8]) {
    __m256 u[4], w[2];
    for (int j = 0; j < 4; j++) /* lane i: v[j] lanes i + (i + 4), then v[j + 4]'s */
        u[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20),
                             _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
    for (int j = 0; j < 2; j++) /* per half: (0+2), (1+3) of u[2j], then of u[2j + 1] */
        w[j] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The largest of 8 lanes (max is exact: any order gives the same value). */
HS_AVX2 INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

HS_AVX2 static inline __m256 load_half8(const uint16_t *h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* `count` cached keys (or values) as floats, rows of hd: slots first.., or slots[first..]. */
HS_AVX2 INLINE void widen_slots(const uint16_t *cache, const int32_t *slots, int first, int count,
                                int hd, float *wide) {
    for (int j = 0; j < count; j++) {
        const uint16_t *h = cache + (size_t)(slots ? slots[first + j] : first + j) * hd;
        for (int c = 0; c < hd; c += 8) _mm256_storeu_ps(wide + (size_t)j * hd + c, load_half8(h + c));
    }
}

/* A block of keys (or values): slots first.. (or slots[first..]) of the cache's halves, and
 * `wide`, where the caller widened them to floats in L1 (rows of hd). */
typedef struct {
    const uint16_t *cache;
    const int32_t *slots;
    int first;
    const float *wide;
} kv_block;

/* Dimensions 8c..8c+7 of the block's key (or value) j, from the floats where `widened`. Both
 * give the same floats: widening a half is exact. */
HS_AVX2 INLINE __m256 kv_chunk(const kv_block *block, int j, int hd, int c, const int widened) {
    if (widened) return _mm256_loadu_ps(block->wide + (size_t)j * hd + 8 * c);
    const int slot = block->slots ? block->slots[block->first + j] : block->first + j;
    return load_half8(block->cache + (size_t)slot * hd + 8 * c);
}

/* One query's scaled scores against the block's `count` keys: each key's dot product in chunk
 * order, summed across lanes as hsum8 does (eight keys at a time by hsum8_each). */
HS_AVX2 INLINE void score_keys(const float *q, const kv_block *keys, int count, int hd,
                               const int chunks, float scale, float *row, const int widened) {
    int j = 0;
    for (; j + 8 <= count; j += 8) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) {
            acc[i] = _mm256_mul_ps(_mm256_loadu_ps(q), kv_chunk(keys, j + i, hd, 0, widened));
            for (int c = 1; c < chunks; c++)
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), kv_chunk(keys, j + i, hd, c, widened), acc[i]);
        }
        _mm256_storeu_ps(row + j, _mm256_mul_ps(hsum8_each(acc), _mm256_set1_ps(scale)));
    }
    for (; j < count; j++) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), kv_chunk(keys, j, hd, 0, widened));
        for (int c = 1; c < chunks; c++)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), kv_chunk(keys, j, hd, c, widened), acc);
        row[j] = hsum8(acc) * scale;
    }
}

/* Scores -> exp(score - the largest), in place; returns their sum (8 lanes, then the tail). */
HS_AVX2 INLINE float softmax_weights(float *row, int total) {
    __m256 tops = _mm256_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 8 <= total; t += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(row + t));
    float top = hmax8(tops);
    for (; t < total; t++)
        if (row[t] > top) top = row[t]; /* not fmaxf: a libm call without -ffast-math */
    const __m256 highest = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= total; t += 8) {
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
    return weight;
}

/* out += sum over the block's `count` values of weight * value, value by value in order. */
HS_AVX2 INLINE void add_values(const float *weights, const kv_block *values, int count, int hd,
                               const int chunks, float *out, const int widened) {
    __m256 acc[32];
    for (int c = 0; c < chunks; c++) acc[c] = _mm256_loadu_ps(out + 8 * c);
    for (int u = 0; u < count; u++) {
        const __m256 p = _mm256_set1_ps(weights[u]);
        for (int c = 0; c < chunks; c++) acc[c] = _mm256_fmadd_ps(p, kv_chunk(values, u, hd, c, widened), acc[c]);
    }
    for (int c = 0; c < chunks; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

#define KEY_BLOCK 32    /* cached keys or values widened to floats at a time (<= 32 KB) */
#define WIDEN_QUERIES 8 /* queries of a call from which widening a block once pays */

/* The query heads of one GQA group (sharing one KV head) for `rows` rows of a forward, their
 * queries and outputs `stride` floats apart: each row sees the prefix (slots
 * prefix_first..prefix_first+n_prefix-1, its t-th keys for t < n_prefix) and
 * its own slots visible[offsets[r]..offsets[r + 1]), in that order, from its t-th key on where
 * firsts[r] = t > 0 (a sliding window). Dense prefix once for all rows, sparse rest per row
 * (Ghidorah's split); where `widen`, each block of keys and values is widened to floats once,
 * in L1, for every row and head that reads it (a few queries read the halves directly: for
 * them the widening costs more than it saves). Each (row, head) gets the same arithmetic in the
 * same order whatever the rows beside it, and whatever part of its keys is prefix: the bits
 * depend on neither the width nor the split. scores: rows * group * (n_prefix + the most
 * visible + 1) floats. head_dim: a multiple of 8, at most 256. */
HS_AVX2 INLINE void attend_rows_body(const uint16_t *keys, const uint16_t *values, int hd,
                                     const float *queries, size_t stride, int rows, int group,
                                     int prefix_first, int n_prefix, const int32_t *visible,
                                     const int32_t *offsets, const int32_t *firsts, float scale,
                                     float softcap, float *scores, float *out, const int chunks,
                                     const int widen) {
    const uint16_t *prefix_keys = keys + (size_t)prefix_first * hd,
                   *prefix_values = values + (size_t)prefix_first * hd;
    int widest = 0, lowest = n_prefix;
    for (int r = 0; r < rows; r++) {
        if (offsets[r + 1] - offsets[r] > widest) widest = offsets[r + 1] - offsets[r];
        if (firsts[r] < lowest) lowest = firsts[r];
    }
    const size_t width = (size_t)n_prefix + widest + 1; /* the +1: each query's weight sum */
    float wide[KEY_BLOCK * 256] __attribute__((aligned(32)));
#define QUERY(r, g) (queries + (size_t)(r) * stride + (size_t)(g) * hd)
#define OUT(r, g) (out + (size_t)(r) * stride + (size_t)(g) * hd)
#define ROW(r, g) (scores + ((size_t)(r) * group + (g)) * width)
#define OWN(r) (visible + offsets[r])
#define SEEN(r) (offsets[(r) + 1] - offsets[r])
/* for each block of `total` slots from block `from` (the prefix: slots NULL; a row's own: its
 * list), widened first where `widen` */
#define BLOCKS(cache, slot_list, from, total, body)                                          \
    for (int t = (from) / KEY_BLOCK * KEY_BLOCK; t < (total); t += KEY_BLOCK) {              \
        const int count = (total) - t < KEY_BLOCK ? (total) - t : KEY_BLOCK;                 \
        if (widen) widen_slots(cache, slot_list, t, count, hd, wide);                        \
        body                                                                                 \
    }
/* row r's part of that block: its keys from its first on (`skip` of the block's are not), as
 * `block` of `part` keys; `first` is where the block starts in the row's list of keys */
#define PART(r, first, body)                                                                 \
    {                                                                                        \
        const int skip = firsts[r] > (first) + t ? firsts[r] - (first) - t : 0;              \
        if (skip < count) {                                                                  \
            const kv_block block = {block_cache, block_slots, t + skip, wide + (size_t)skip * hd}; \
            const int part = count - skip, at = (first) + t + skip;                          \
            body                                                                             \
        }                                                                                    \
    }
    const uint16_t *block_cache = prefix_keys;
    const int32_t *block_slots = NULL;
    BLOCKS(prefix_keys, NULL, lowest, n_prefix, {
        for (int r = 0; r < rows; r++)
            PART(r, 0, {
                for (int g = 0; g < group; g++)
                    score_keys(QUERY(r, g), &block, part, hd, chunks, scale, ROW(r, g) + at, widen);
            })
    })
    block_cache = keys;
    for (int r = 0; r < rows; r++) {
        block_slots = OWN(r);
        const int from = firsts[r] > n_prefix ? firsts[r] - n_prefix : 0;
        BLOCKS(keys, OWN(r), from, SEEN(r), {
            PART(r, n_prefix, {
                for (int g = 0; g < group; g++)
                    score_keys(QUERY(r, g), &block, part, hd, chunks, scale, ROW(r, g) + at, widen);
            })
        })
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < group; g++) {
            hs_soft_cap_avx2(ROW(r, g) + firsts[r], n_prefix + SEEN(r) - firsts[r], softcap);
            ROW(r, g)[width - 1] = softmax_weights(ROW(r, g) + firsts[r], n_prefix + SEEN(r) - firsts[r]);
            memset(OUT(r, g), 0, (size_t)hd * sizeof(float));
        }
    block_cache = prefix_values;
    block_slots = NULL;
    BLOCKS(prefix_values, NULL, lowest, n_prefix, {
        for (int r = 0; r < rows; r++)
            PART(r, 0, {
                for (int g = 0; g < group; g++)
                    add_values(ROW(r, g) + at, &block, part, hd, chunks, OUT(r, g), widen);
            })
    })
    block_cache = values;
    for (int r = 0; r < rows; r++) {
        block_slots = OWN(r);
        const int from = firsts[r] > n_prefix ? firsts[r] - n_prefix : 0;
        BLOCKS(values, OWN(r), from, SEEN(r), {
            PART(r, n_prefix, {
                for (int g = 0; g < group; g++)
                    add_values(ROW(r, g) + at, &block, part, hd, chunks, OUT(r, g), widen);
            })
        })
        for (int g = 0; g < group; g++) {
            const __m256 factor = _mm256_set1_ps(1.0f / ROW(r, g)[width - 1]);
            for (int c = 0; c < chunks; c++)
                _mm256_storeu_ps(OUT(r, g) + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(OUT(r, g) + 8 * c), factor));
        }
    }
#undef PART
#undef BLOCKS
#undef QUERY
#undef OUT
#undef ROW
#undef OWN
#undef SEEN
}

/* The body with its chunk count known at compile time for the usual head sizes, so that
 * the accumulators stay in registers (a loop bound read at run time kept them in memory:
 * a store-to-load round trip per value and chunk), and whether it widens. */
HS_AVX2 static void attend_rows_avx2(const uint16_t *keys, const uint16_t *values, int hd,
                                     const float *queries, size_t stride, int rows, int group,
                                     int prefix_first, int n_prefix, const int32_t *visible,
                                     const int32_t *offsets, const int32_t *firsts,
                                     float scale, float softcap, float *scores, float *out) {
    const int widen = rows * group >= WIDEN_QUERIES;
#define BODY(chunks)                                                                          \
    if (widen)                                                                                \
        attend_rows_body(keys, values, hd, queries, stride, rows, group, prefix_first,        \
                         n_prefix, visible, offsets, firsts, scale, softcap, scores, out,     \
                         chunks, 1);                                                          \
    else                                                                                      \
        attend_rows_body(keys, values, hd, queries, stride, rows, group, prefix_first,        \
                         n_prefix, visible, offsets, firsts, scale, softcap, scores, out,     \
                         chunks, 0);
    switch (hd / 8) {
    case 4: BODY(4); break;
    case 8: BODY(8); break;
    case 16: BODY(16); break;
    default: BODY(hd / 8); break;
    }
#undef BODY
}

/* softmax_weights, for sampling.c's probabilities */
HS_AVX2 float hs_softmax_weights_avx2(float *row, int n) { return softmax_weights(row, n); }
#endif

/* A thread's attention scores: attend_rows_body's for ATTEND_ROWS rows, or attend's for one
 * query. */
size_t hs_attention_scratch(const hs_model *m) {
    return (size_t)ATTEND_ROWS * (m->n_heads / m->n_kv_heads) * ((size_t)m->capacity + 1);
}

static float attention_scale(const hs_model *m) {
    return m->attn_scale > 0.0f ? m->attn_scale : 1.0f / sqrtf((float)m->head_dim);
}

/* The first key (by position) a row at `position` sees in a layer of `window` (0: all). */
static int first_key(int window, int position) {
    return window > 0 && position >= window ? position - window + 1 : 0;
}

/* One (row, head) of attention over the slots the row may see (its prefix, slots
 * prefix_first.., then `visible`), in slot order, from its `first` (first_key). */
static void attend(const hs_model *m, int layer, const float *query, int kv_head,
                   int prefix_first, int n_prefix, const int32_t *visible, int n_visible,
                   int first, float *scores, float *out, int simd) {
    const int hd = m->head_dim;
    const size_t base = ((size_t)layer * m->n_kv_heads + kv_head) * m->capacity;
    (void)simd; /* the keys come as halves: no f32 kernel applies */
    const uint16_t *keys = m->k_cache + base * hd, *values = m->v_cache + base * hd;
    const float scale = attention_scale(m);
    const int total = n_prefix + n_visible;
    float highest = -INFINITY;
    for (int t = first; t < total; t++) {
        const int slot = t < n_prefix ? prefix_first + t : visible[t - n_prefix];
        const uint16_t *key = keys + (size_t)slot * hd;
        float dot = 0.0f;
        for (int k = 0; k < hd; k++) dot += query[k] * half_to_float(key[k]);
        scores[t] = dot * scale;
        soft_cap(scores + t, 1, m->attn_softcap);
        highest = fmaxf(highest, scores[t]);
    }
    float sum = 0.0f;
    for (int t = first; t < total; t++) {
        scores[t] = expf(scores[t] - highest);
        sum += scores[t];
    }
    for (int k = 0; k < hd; k++) out[k] = 0.0f;
    for (int t = first; t < total; t++) {
        const int slot = t < n_prefix ? prefix_first + t : visible[t - n_prefix];
        const uint16_t *v = values + (size_t)slot * hd;
        const float p = scores[t];
        for (int k = 0; k < hd; k++) out[k] += p * half_to_float(v[k]);
    }
    const float inverse = 1.0f / sum;
    for (int k = 0; k < hd; k++) out[k] *= inverse;
}

int hs_attention_sets(int n, const int32_t *prefix_start, const int32_t *prefix_len,
                      int32_t *sets) {
    int count = 0;
    for (int i = 0; i < n; i++) /* a set starts at a new prefix, or where the last one is full */
        if (!count || i - sets[count - 1] == ATTEND_ROWS || prefix_start[i] != prefix_start[i - 1] ||
            prefix_len[i] != prefix_len[i - 1])
            sets[count++] = i;
    sets[count] = n;
    return count;
}

void hs_attention(const hs_model *m, int layer, const hs_rows *rows, const float *queries,
                  float *attended, float *scores, int simd) {
    const int hd = m->head_dim, heads = m->n_heads, kv_heads = m->n_kv_heads, qd = heads * hd;
    const int group = heads / kv_heads;
    const hs_layer *y = &m->layers[layer];
    const int32_t *positions = rows->positions, *offsets = rows->offsets, *visible = rows->visible;
#if HS_X86
    if (simd && hd % 8 == 0 && hd <= 256) {
        const size_t layer_base = (size_t)layer * kv_heads * m->capacity * hd;
        const int sets = rows->n_sets;
#pragma omp for schedule(static)
        for (int item = 0; item < kv_heads * sets; item++) { /* head-major: a head's keys
            and values stay in L2 for all rows */
            const int h = item / sets, set = item % sets, i = rows->sets[set];
            const int count = rows->sets[set + 1] - i;
            const size_t head = layer_base + (size_t)h * m->capacity * hd;
            const size_t first = (size_t)i * qd + (size_t)h * group * hd;
            int32_t firsts[ATTEND_ROWS];
            for (int r = 0; r < count; r++) firsts[r] = first_key(y->window, positions[i + r]);
            attend_rows_avx2(m->k_cache + head, m->v_cache + head, hd, queries + first, qd,
                             count, group, rows->prefix_start[i], rows->prefix_len[i], visible,
                             offsets + i, firsts, attention_scale(m), m->attn_softcap, scores,
                             attended + first);
        }
    } else
#endif
    {
#pragma omp for schedule(static)
        for (int item = 0; item < rows->n * heads; item++) {
            const int i = item / heads, h = item % heads;
            attend(m, layer, queries + (size_t)i * qd + (size_t)h * hd, h / group,
                   rows->prefix_start[i], rows->prefix_len[i], visible + offsets[i],
                   offsets[i + 1] - offsets[i], first_key(y->window, positions[i]), scores,
                   attended + (size_t)i * qd + (size_t)h * hd, simd);
        }
    }
}
