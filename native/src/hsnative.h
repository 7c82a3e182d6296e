/* hetspec's native CPU verifier: a Llama-family (Llama, Qwen2/3, Gemma 2/3) forward over
 * GGUF-quantized weights, built for the verification shape (a few rows at once).
 *
 * Contracts every entry point keeps:
 * - Width invariance: a row's results depend only on that row's inputs and the cache contents
 *   it attends to, never on how many other rows share the call or which thread computes it.
 *   Integer dot products are exact; every float step runs per row in a fixed order.
 * - Weights are read in place (the caller maps the GGUF file); nothing here copies them,
 *   though a caller may hand a small model's Q8_0 matrices in a second, packed layout too
 *   (hs_matrix.packed): the same values, the same bits out.
 * - Nothing here allocates state that outlives a call; the caller owns every buffer.
 */
#ifndef HSNATIVE_H
#define HSNATIVE_H

#include <stdint.h>

/* ggml's type ids, as GGUF stores them */
enum { HS_F32 = 0, HS_F16 = 1, HS_Q4_0 = 2, HS_Q4_1 = 3, HS_Q5_0 = 6, HS_Q5_1 = 7, HS_Q8_0 = 8,
       HS_Q4_K = 12, HS_Q5_K = 13, HS_Q6_K = 14, HS_IQ4_NL = 20, HS_IQ4_XS = 23 };
#define HS_BLOCK 32  /* Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL blocks; the activations' blocks for every quantized type */
#define HS_SUPER 256 /* the K-quants' (Q4_K, Q5_K, Q6_K) and IQ4_XS's super-blocks: 8 activation blocks */

typedef struct {
    int32_t type;
    int32_t rows; /* output features */
    int32_t cols; /* input features (a multiple of 32 for the 32-value blocks; of 256 for K-quants, IQ4_XS) */
    int32_t packing; /* packed's values: HS_PACKED_UNSIGNED or HS_PACKED_SIGNED (0: no packed) */
    const void *data; /* rows x cols in the type's row layout */
    /* optional (NULL: none): a Q8_0 matrix's whole groups of 8 rows again, packed for calls of
     * few rows (HS_PACKED_BYTES a group and block: the 8 block scales as floats, then 8 runs of
     * 32 bytes, run k holding values 4k..4k+3 of the 8 rows, as they are or plus 128), as
     * hs_pack_q8_0 writes them; a level reads it where it would transpose blocks in registers
     * and the values are its kind (the VNNI levels unsigned, AVX2 signed) */
    const void *packed;
} hs_matrix;

enum { HS_PACKED_UNSIGNED = 1, HS_PACKED_SIGNED = 2 };

#define HS_PACKED_BYTES (8 * 4 + 8 * HS_BLOCK) /* one group of 8 rows, one block, packed */

typedef struct {
    const float *attn_norm, *ffn_norm; /* (d_model,) */
    hs_matrix q, k, v, o, gate, up, down;
    /* optional (NULL: none): each matrix's bias (rows,), added to its output (Qwen2's q, k, v) */
    const float *q_bias, *k_bias, *v_bias, *o_bias, *gate_bias, *up_bias, *down_bias;
    /* optional (NULL: none): RMSNorms (head_dim,) of each query and key head before the
     * rotation (Qwen3) */
    const float *q_norm, *k_norm;
    /* optional (NULL: none): RMSNorms (d_model,) of the attention's and the feed-forward's
     * outputs before each joins the residual stream (Gemma's sandwich norms) */
    const float *post_attn_norm, *post_ffn_norm;
    /* optional (NULL: the model's): this layer's rotary tables, as hs_model's (Gemma 3's
     * local layers rotate with another base than its global ones) */
    const float *rope_cos, *rope_sin;
    /* > 0: a row at position p attends only to keys at positions p - window + 1 .. p (a
     * sliding window; keys are then assumed at the positions of their order, see hs_forward) */
    int32_t window;
    int32_t reserved;
} hs_layer;

typedef struct {
    int32_t n_layers, d_model, n_ff, n_heads, n_kv_heads, head_dim, vocab, capacity;
    float eps;
    int32_t simd; /* the most capable kernels a call may use (HS_SIMD_*); -1: the best here */
    const hs_layer *layers;
    const float *output_norm; /* (d_model,) */
    hs_matrix embed, output;
    /* rotary tables (capacity, head_dim / 2): pair i rotates by column i (see rope_halves) */
    const float *rope_cos, *rope_sin;
    /* (n_layers, n_kv_heads, capacity, head_dim) IEEE half floats (as llama.cpp's default
     * cache: half the memory traffic of attention), written by hs_forward at the new rows' slots */
    uint16_t *k_cache, *v_cache;
    /* which values of a head rotate together: 0, pairs (2i, 2i+1) (llama.cpp's llama layout);
     * 1, (i, i + head_dim/2) (its "NEOX" layout: Qwen2, Qwen3) */
    int32_t rope_halves;
    /* the gated feed-forward's activation: HS_SILU (SwiGLU) or HS_GELU_TANH (GeGLU, Gemma) */
    int32_t activation;
    float embed_scale; /* > 0: embeddings are multiplied by it (Gemma: sqrt(d_model)) */
    float attn_scale;  /* > 0: scores are q.k times it; else 1 / sqrt(head_dim) */
    /* > 0: scores, then the logits, become cap * tanh(x / cap) (Gemma 2's soft caps) */
    float attn_softcap, final_softcap;
} hs_model;

enum { HS_SILU = 0, HS_GELU_TANH = 1 };

/* Kernel levels. Every level computes the same exact integer block products. On x86-64, AVX2
 * and both VNNI levels give the same bits, and the portable C rounds its other float steps its
 * own way (libm's expf, unfused norms); on aarch64 the dot-product kernels give the portable
 * bits. A CPU need not run every level below its best (AVX-512 VNNI without AVX-VNNI: Ice
 * Lake, Zen 4); a cap runs the best level it has at or below the cap. */
enum {
    HS_SIMD_PORTABLE = 0,
    HS_SIMD_AVX2 = 1,     /* x86-64 */
    HS_SIMD_AVX_VNNI = 2, /* x86-64: vpdpbusd on 256-bit vectors, AVX-VNNI's VEX form: Intel's
                           * client cores since Alder Lake, which lack AVX-512 */
    HS_SIMD_VNNI = 3,     /* x86-64: AVX-512 VNNI with VL, on 512-bit vectors where it pays */
    HS_SIMD_DOTPROD = 1,  /* aarch64: NEON with the dot product (the portable bits, faster) */
};

/* The most capable level this build runs on this CPU */
int hs_simd_level(void);

/* 1 if this build runs kernel level `level` on this CPU, else 0. */
int hs_simd_supported(int level);

/* Quantize rows of x (n, cols) to int8 blocks of 32 with one float scale per block. */
void hs_quantize_rows(const float *x, int n, int cols, int8_t *q, float *scale);

/* out (n, w->rows) = x (n, w->cols) times w's transpose, on `threads` threads, with kernels
 * of at most level `simd_cap` (-1: the best here). Quantized weights multiply the rows
 * quantized by hs_quantize_rows. Returns 0, or -1 for a type this build does not know. */
int hs_matmul(const hs_matrix *w, const float *x, int n, float *out, int threads, int simd_cap);

/* Rows first..first+count-1 of w as floats, into out (count, w->cols), as ggml dequantizes
 * them. Returns 0, or -1 for a type this build does not know or rows outside w. */
int hs_dequantize_rows(const hs_matrix *w, int first, int count, float *out);

/* Evaluate n new tokens and write their keys/values to slots start..start+n-1.
 * Row i sees cached slots 0..n_prefix-1, then the slots visible[offsets[i]..offsets[i+1]) in
 * increasing order (its pending ancestors, ending with its own slot). Where a layer has a
 * window, the t-th key a row sees must be at position t (positions[i] = n_prefix + the
 * row's visible count - 1), as the committed prefix and a path's ancestors are. Logits of rows
 * first_logit..n-1 go to logits ((n - first_logit), vocab). Returns 0, or -1 for bad input. */
int hs_forward(const hs_model *m, int n, const int32_t *tokens, const int32_t *positions,
               int start, int n_prefix, const int32_t *offsets, const int32_t *visible,
               int first_logit, float *logits, int threads);

/* One sequence of a several-sequence forward (hs_forward_sequences): `rows` consecutive rows
 * of the call, written to cache slots start..start+rows-1, each seeing the sequence's committed
 * prefix, slots prefix_start..prefix_start+prefix_len-1, as the t-th keys; its rows from
 * first_logit on have logits. hs_forward is the one sequence {n, 0, n_prefix, start,
 * first_logit}. (An (n_sequences, 5) int32 array has this layout.) */
typedef struct {
    int32_t rows, prefix_start, prefix_len, start, first_logit;
} hs_sequence;

/* hs_forward for the rows of several sequences in one call: sequence s's rows follow those
 * of sequences 0..s-1 (tokens, positions and offsets hold sum of rows entries, + 1 for
 * offsets). Row j of a sequence sees its prefix, then visible[offsets[i]..offsets[i+1]) (i:
 * the row's index in the call), slots between its prefix's end and its own slot start + j, in
 * increasing order; positions as hs_forward's, counted within the sequence. Each sequence's
 * span, prefix_start..start+rows-1, must not overlap another's (a row never reads what another
 * sequence writes). Logits: each sequence's rows first_logit..rows-1, sequence after sequence.
 * A row's results are bit for bit those of the same row in a call of its own (hs_forward
 * with the sequence's slots), whatever other sequences share the call. Returns 0, or -1 for
 * bad input. */
int hs_forward_sequences(const hs_model *m, int n_sequences, const hs_sequence *sequences,
                         const int32_t *tokens, const int32_t *positions,
                         const int32_t *offsets, const int32_t *visible, float *logits,
                         int threads);

/* The index of the largest of row[0..n) (the lowest of equal ones: a greedy chain's choice),
 * at kernel level `simd_cap` (as hs_matmul's); -1 for n < 1. */
int hs_argmax(const float *row, int n, int simd_cap);

/* Write `w`'s (Q8_0) whole groups of 8 rows into `out` (rows / 8 * blocks * HS_PACKED_BYTES
 * bytes) in hs_matrix.packed's layout, values of kind `packing` (HS_PACKED_*). Returns 0, or
 * -1 if `w` is not Q8_0 or the kind is not one. */
int hs_pack_q8_0(const hs_matrix *w, int packing, void *out);

/* A draft chain: `count` forwards of one token each, the first of tokens[0] at slot `start`
 * and `position`, each next token chosen from the last one's logits and evaluated one slot
 * and one position further, written to tokens[i + 1] (tokens holds count + 1). Node i sees
 * slots 0..n_prefix-1, then base[0..n_base) (the pending ancestors of the first,
 * increasing), then the chain's slots start..start+i. Logits (count, vocab). Drafting in one
 * call spares a call per token of the caller's own work.
 *
 * The choice: with neither `noise` nor `uniforms` the argmax (ties: the lowest id), and
 * p = softmax(logits * inv_temperature) goes to `probs` (count, vocab) where given (a greedy
 * drafter's confidence, inv_temperature 1). Else p goes to `probs` and the token is, with
 * (count, vocab) `noise` rows > 0, the argmax of p / noise (ties: the lowest id; with
 * exponential noise keyed by position, a keyed Gumbel-max choice), or with one uniform in
 * [0, 1) a token in `uniforms`, the first token whose cumulative probability (summed in
 * double) exceeds u times the row's total: a draw from p, which `probs` reports. Returns 0,
 * or -1 for bad input (as hs_forward; both noise and uniforms; either without probs; probs
 * with a temperature's inverse not > 0). */
int hs_draft_chain(const hs_model *m, int count, int32_t *tokens, int position, int start,
                   int n_prefix, const int32_t *base, int n_base, float *logits,
                   const float *noise, const double *uniforms, float inv_temperature,
                   float *probs, int threads);

/* hs_draft_chain's greedy choice for `branches` chains side by side below one node, one
 * forward of all their rows a step (the chains of a branched draft): tokens[0..branches)
 * are the first tokens, at `position`; row j of step i sits in slot start + i * branches + j
 * and sees slots 0..n_prefix-1, `base` and its own branch's nodes up to itself; its argmax
 * becomes tokens[(i + 1) * branches + j]. `logits`: count x branches rows, step by step;
 * `probs` (or NULL): each row's softmax, row j of step i at probs + j * branch_stride +
 * i * vocab (a branches x steps x vocab array's rows from step 1 on). Returns 0, or -1 for
 * bad input. */
int hs_draft_branches(const hs_model *m, int branches, int count, int32_t *tokens, int position,
                      int start, int n_prefix, const int32_t *base, int n_base, float *logits,
                      float *probs, long long branch_stride, int threads);

#endif
