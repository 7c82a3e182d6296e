/* Several sequences' rows in one forward (hs_forward_sequences; hs_forward is the one-sequence
 * case): each sequence owns a range of cache slots, its committed prefix and then its pending
 * rows, and each row sees only its own sequence's. Here the call's arguments are checked and
 * laid out as the forward's per-row arrays (internal.h's hs_rows); the forward itself
 * (forward.c) and attention (attention.c) read those. A row's bits never depend on the other
 * sequences in the call: every per-row step is the row's own, and attention takes a set of
 * rows of one sequence at a time (hs_attention_sets). */
#include "internal.h"

/* Whether the layers have sliding windows (the t-th key a row sees is then at position t). */
static int has_windows(const hs_model *m) {
    for (int l = 0; l < m->n_layers; l++)
        if (m->layers[l].window > 0) return 1;
    return 0;
}

/* Whether sequence q's own numbers are in range: rows, a prefix before its first new slot,
 * every slot inside the cache (compared so that no sum can overflow). */
static int sequence_ok(const hs_model *m, const hs_sequence *q) {
    return q->rows >= 1 && q->rows <= m->capacity && q->start <= m->capacity - q->rows &&
           q->prefix_start >= 0 && q->prefix_start <= q->start && q->prefix_len >= 0 &&
           q->prefix_len <= q->start - q->prefix_start && q->first_logit >= 0 &&
           q->first_logit <= q->rows;
}

/* Whether the spans (prefix_start..start+rows-1) of sequences a and b are apart. */
static int apart(const hs_sequence *a, const hs_sequence *b) {
    return a->start + a->rows <= b->prefix_start || b->start + b->rows <= a->prefix_start;
}

/* Whether row i (row j of sequence q) is in range: its token, its position, its visible
 * slots (after the prefix, up to its own, increasing, as hs_forward's contract says they are
 * given; those past the prefix's end but before the row's own are the sequence's pending
 * ones). */
static int row_ok(const hs_model *m, const hs_sequence *q, int j, int i, const int32_t *tokens,
                  const int32_t *positions, const int32_t *offsets, const int32_t *visible,
                  int windows) {
    const int seen = offsets[i + 1] - offsets[i];
    if (tokens[i] < 0 || tokens[i] >= m->vocab || positions[i] < 0 ||
        positions[i] >= m->capacity || seen < 0 || seen > m->capacity - q->prefix_len)
        return 0;
    if (windows && positions[i] != q->prefix_len + seen - 1) return 0;
    for (int t = offsets[i]; t < offsets[i + 1]; t++)
        if (visible[t] < q->prefix_start + q->prefix_len || visible[t] > q->start + j) return 0;
    return 1;
}

int hs_forward_sequences(const hs_model *m, int n_sequences, const hs_sequence *sequences,
                         const int32_t *tokens, const int32_t *positions,
                         const int32_t *offsets, const int32_t *visible, float *logits,
                         int threads) {
    if (n_sequences < 1 || offsets[0] != 0) return -1;
    long long total = 0;
    for (int s = 0; s < n_sequences; s++) {
        if (!sequence_ok(m, &sequences[s])) return -1;
        for (int other = 0; other < s; other++)
            if (!apart(&sequences[s], &sequences[other])) return -1;
        total += sequences[s].rows;
    }
    if (total > m->capacity) return -1; /* the spans are apart: more rows cannot fit */
    const int n = (int)total, windows = has_windows(m);
    for (int i = 0; i < n; i++) /* before any visible slot is read: they end at offsets[n] */
        if (offsets[i + 1] < offsets[i]) return -1;
    int32_t *arrays = malloc(sizeof(int32_t) * (5 * (size_t)n + 1));
    if (!arrays) return -1;
    int32_t *slot = arrays, *prefix_start = slot + n, *prefix_len = prefix_start + n,
            *logit_rows = prefix_len + n, *sets = logit_rows + n;
    int i = 0, outputs = 0, status = 0;
    for (int s = 0; s < n_sequences && !status; s++) {
        const hs_sequence *q = &sequences[s];
        for (int j = 0; j < q->rows; j++, i++) {
            if (!row_ok(m, q, j, i, tokens, positions, offsets, visible, windows)) {
                status = -1;
                break;
            }
            slot[i] = q->start + j;
            prefix_start[i] = q->prefix_start;
            prefix_len[i] = q->prefix_len;
            if (j >= q->first_logit) logit_rows[outputs++] = i;
        }
    }
    if (!status) {
        const hs_rows rows = {n,          tokens,       positions,  offsets,
                              visible,    slot,         prefix_start, prefix_len,
                              sets,       hs_attention_sets(n, prefix_start, prefix_len, sets),
                              logit_rows, outputs};
        status = hs_forward_rows(m, &rows, logits, threads);
    }
    free(arrays);
    return status;
}
