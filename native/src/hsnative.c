/* hetspec's native CPU verifier; contracts in hsnative.h, design in docs/architecture.md.
 *
 * Build with -ffp-contract=off: a fused multiply-add that the compiler forms in one
 * specialization of a kernel and not in another would break width invariance. */
#include "internal.h"
#include "transposes.h"

#define COL_CHUNK 16  /* output features a thread takes at a time */
#define ATTEND_ROWS 16 /* rows one call of the attention kernel takes (attend_rows_body) */

typedef struct {
    uint16_t d;
    int8_t qs[HS_BLOCK];
} block_q8_0;

typedef struct {
    uint16_t d;
    uint8_t qs[HS_BLOCK / 2]; /* element i in the low nibble of qs[i], i + 16 in the high */
} block_q4_0;

_Static_assert(sizeof(block_q8_0) == 34, "GGUF Q8_0 blocks are 34 bytes");

/* Block b's scale (IEEE half) of a Q8_0 or Q4_0 weight row. */
INLINE uint16_t weight_scale_of(const void *wrow, int type, int b) {
    return type == HS_Q8_0 ? ((const block_q8_0 *)wrow)[b].d : ((const block_q4_0 *)wrow)[b].d;
}
_Static_assert(sizeof(block_q4_0) == 18, "GGUF Q4_0 blocks are 18 bytes");

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

#if HS_X86
/* AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4 (compilers' CPU-feature builtins name it
 * unevenly), read once when the library loads and never written again: in a VM CPUID traps to
 * the hypervisor (12 us a call measured here), too much for every forward and draft token. */
static int avx_vnni_present;

__attribute__((constructor)) static void read_avx_vnni(void) {
    unsigned eax, ebx, ecx, edx;
    avx_vnni_present = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 4 & 1);
}
#endif

int hs_simd_supported(int level) {
#if HS_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512_vnni = avx2 && __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vnni");
    switch (level) {
    case HS_SIMD_PORTABLE: return 1;
    case HS_SIMD_AVX2: return avx2;
    case HS_SIMD_AVX_VNNI: return avx2 && avx_vnni_present; /* its kernels use the VEX form */
    case HS_SIMD_VNNI: return avx512_vnni;
    default: return 0;
    }
#elif HS_ARM
    if (level == HS_SIMD_DOTPROD) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    return level == HS_SIMD_PORTABLE;
#else
    return level == HS_SIMD_PORTABLE;
#endif
}

/* The kernels a call runs: the best this CPU has, at most `cap` where cap >= 0. */
static int simd_for(int cap) {
#if HS_X86
    const int top = HS_SIMD_VNNI;
#elif HS_ARM
    const int top = HS_SIMD_DOTPROD;
#else
    const int top = HS_SIMD_PORTABLE;
#endif
    int level = cap >= 0 && cap < top ? cap : top;
    while (level > 0 && !hs_simd_supported(level)) level--;
    return level;
}

int hs_simd_level(void) { return simd_for(-1); }

static int is_quantized(int type) { return type == HS_Q8_0 || type == HS_Q4_0 || hs_unpacked_is(type); }

static size_t row_bytes(const hs_matrix *w) {
    switch (w->type) {
    case HS_F32: return (size_t)w->cols * 4;
    case HS_F16: return (size_t)w->cols * 2;
    case HS_Q8_0: return (size_t)(w->cols / HS_BLOCK) * sizeof(block_q8_0);
    case HS_Q4_0: return (size_t)(w->cols / HS_BLOCK) * sizeof(block_q4_0);
    default: return hs_unpacked_row_bytes(w->type, w->cols);
    }
}

static int matrix_ok(const hs_matrix *w, int rows, int cols) {
    return w->data && w->rows == rows && w->cols == cols && row_bytes(w) &&
           (!is_quantized(w->type) || cols % HS_BLOCK == 0);
}

/* ------------------------------------------------------------------ per-row float steps */

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

static void rms_norm(const float *x, const float *weight, int cols, float eps, float *out) {
    double squares = 0.0;
    for (int k = 0; k < cols; k++) squares += (double)x[k] * x[k];
    const float scale = 1.0f / sqrtf((float)(squares / cols) + eps);
    for (int k = 0; k < cols; k++) out[k] = x[k] * scale * weight[k];
}

static void embed_row(const hs_matrix *e, int token, float *out) {
    const char *row = (const char *)e->data + row_bytes(e) * (size_t)token;
    switch (e->type) {
    case HS_F32: memcpy(out, row, (size_t)e->cols * 4); break;
    case HS_F16:
        for (int k = 0; k < e->cols; k++) out[k] = half_to_float(((const uint16_t *)row)[k]);
        break;
    case HS_Q8_0:
        for (int b = 0; b < e->cols / HS_BLOCK; b++) {
            const block_q8_0 *blk = (const block_q8_0 *)row + b;
            const float d = half_to_float(blk->d);
            for (int k = 0; k < HS_BLOCK; k++) out[b * HS_BLOCK + k] = d * blk->qs[k];
        }
        break;
    case HS_Q4_0:
        for (int b = 0; b < e->cols / HS_BLOCK; b++) {
            const block_q4_0 *blk = (const block_q4_0 *)row + b;
            const float d = half_to_float(blk->d);
            for (int k = 0; k < HS_BLOCK / 2; k++) {
                out[b * HS_BLOCK + k] = d * ((blk->qs[k] & 0x0f) - 8);
                out[b * HS_BLOCK + k + HS_BLOCK / 2] = d * ((blk->qs[k] >> 4) - 8);
            }
        }
        break;
    default: hs_unpacked_dequantize_row(e->type, row, e->cols, out); break;
    }
}

int hs_dequantize_rows(const hs_matrix *w, int first, int count, float *out) {
    if (!row_bytes(w) || first < 0 || count < 0 || first + count > w->rows) return -1;
    for (int r = 0; r < count; r++) embed_row(w, first + r, out + (size_t)r * w->cols);
    return 0;
}

int hs_pack_q8_0(const hs_matrix *w, int packing, void *out) {
    if (w->type != HS_Q8_0 || w->cols % HS_BLOCK) return -1;
    if (packing != HS_PACKED_UNSIGNED && packing != HS_PACKED_SIGNED) return -1;
    const uint8_t bias = packing == HS_PACKED_UNSIGNED ? 0x80u : 0; /* w + 128: flip the sign bit */
    const int blocks = w->cols / HS_BLOCK;
    const block_q8_0 *rows = w->data;
    char *packed = out;
    for (int g = 0; g < w->rows / 8; g++)
        for (int b = 0; b < blocks; b++, packed += HS_PACKED_BYTES) {
            for (int f = 0; f < 8; f++) {
                const block_q8_0 *block = rows + (size_t)(8 * g + f) * blocks + b;
                const float scale = half_to_float(block->d);
                memcpy(packed + 4 * f, &scale, sizeof scale);
                for (int k = 0; k < HS_BLOCK / 4; k++)
                    for (int i = 0; i < 4; i++) /* unsigned as load_unsigned_weights makes them */
                        packed[32 + 32 * k + 4 * f + i] = (char)((uint8_t)block->qs[4 * k + i] ^ bias);
            }
        }
    return 0;
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

/* cap * tanh(x / cap) over n values in place (cap <= 0: none) */
static void soft_cap(float *x, int n, float cap) {
    if (cap > 0.0f)
        for (int k = 0; k < n; k++) x[k] = cap * tanhf(x[k] / cap);
}

static float gated(float x, int activation) { return activation == HS_GELU_TANH ? gelu_tanh(x) : silu(x); }


/* ------------------------------------------------------------------ dot products */

#if HS_X86
HS_AVX2 INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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


/* The recipe every quantized kernel follows for one (row, output feature), so that a row's
 * result never depends on which kernel computed it, how many rows shared the call, or which
 * thread ran it: for each block b in order,
 *     acc = fma((float)dot_b, x_scale_b * w_scale_b, acc)
 * where dot_b is the exact integer dot product of the block (at most 32 * 127 * 127 in
 * magnitude, so its conversion to float is exact). */

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


/* sum + the exact dot products of four int8 pairs per int32 lane (w times x); w_abs = |w|. */
HS_AVX2 INLINE __m256i dot4_add(__m256i sum, __m256i w_abs, __m256i w, __m256i x) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)),
                                                   _mm256_set1_epi16(1)));
}

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

/* One (row, feature) by the same recipe, for what the two tilings leave over. */
HS_AVX2 static float dot_quantized_avx2(const void *wrow, int type, int blocks, const int8_t *x,
                                        const float *xd) {
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

/* The rows outside whole groups from a packed Q8_0 matrix whose values are of kind KIND, in a
 * quantized_features driver (as UNGROUPED_ROWS, whose leftovers follow): PACKED(tile) features
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

/* The rows outside whole groups, in a quantized_features_* driver (w, a, n, end, grouped,
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

/* Output features [first, end) of all n rows, into out (n, w->rows). Calls of 5 or more rows
 * go features in lanes in passes (features8_passes_avx2; heavy-100m Q8_0 T(5) 11.3 -> 8.6 ms,
 * T(9) 15.4 -> 12.8), but Q4_0's whole groups, which go rows in lanes, two groups at a time
 * over every feature (their activations stay in L1; T(16) 19.0 against 20.2); up to 4 rows go
 * features in lanes, 4 rows by 8 features; leftover features one by one. */
HS_AVX2 static void quantized_features_avx2(const hs_matrix *w, const activations *a, int n,
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

/* ------------------------------------------------------------------ AVX-512 VNNI
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
 * features_in_lanes_avx2). */
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

/* Two 256-bit halves as one 512-bit vector (lo in lanes 0-7). */
HS_VNNI INLINE __m512i join256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* Rows in lanes for two whole groups (16 rows) in 512-bit vectors: lane r of each vector is
 * row r of the groups, so one broadcast of four weights and one vpdpbusd serve all 16 rows
 * (half the instructions of two 256-bit groups, and the wider vpdpbusd does more products a
 * cycle). `tile` (1 or 4) weight rows share the block's activations, held in 8 registers.
 * Each lane does exactly what rows_in_lanes_vnni's (vnni256.h) does: the same bits. */
HS_VNNI INLINE void rows16_in_lanes_vnni(const char *wrows, const size_t stride, const int type,
                                         const int blocks, const activations *a, const int group,
                                         const int tile, float *result) {
    const int shift = type == HS_Q8_0 ? Q8_BIAS_SHIFT : Q4_BIAS_SHIFT;
    const size_t block_bytes = stride / blocks;
    __m512 acc[4];
    for (int t = 0; t < tile; t++) acc[t] = _mm512_setzero_ps();
    int32_t staged[2][4][HS_BLOCK / 4] __attribute__((aligned(32)));
    stage_tile(wrows, stride, type, 0, tile, block_bytes, staged[0]);
    for (int b = 0; b < blocks; b++) {
        if (b + 1 < blocks) stage_tile(wrows, stride, type, b + 1, tile, block_bytes, staged[(b + 1) & 1]);
        const size_t at = ((size_t)group * blocks + b) * GROUP;
        const size_t next = at + (size_t)blocks * GROUP; /* the second group's block b */
        __m512i x[HS_BLOCK / 4];
        for (int k = 0; k < HS_BLOCK / 4; k++)
            x[k] = join256(a->grouped + (at + k) * 4 * GROUP, a->grouped + (next + k) * 4 * GROUP);
        const __m512i sums = join256(a->grouped_sum + at, a->grouped_sum + next);
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, shift));
        const __m512 x_scales = _mm512_castsi512_ps(join256(a->grouped_d + at, a->grouped_d + next));
        for (int t = 0; t < tile; t++) {
            const char *wrow = wrows + stride * t;
            const int32_t *weights = staged[b & 1][t];
            __m512i chains[2] = {start, _mm512_setzero_si512()}; /* vpdpbusd waits on its sum */
            for (int k = 0; k < HS_BLOCK / 4; k++)
                chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], _mm512_set1_epi32(weights[k]), x[k]);
            const __m512 w_scale = _mm512_set1_ps(_cvtsh_ss(weight_scale_of(wrow, type, b)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(chains[0], chains[1])),
                                     _mm512_mul_ps(x_scales, w_scale), acc[t]);
        }
    }
    for (int t = 0; t < tile; t++) _mm512_storeu_ps(result + t * 2 * GROUP, acc[t]);
}

/* Block b of 16 Q8_0 weight rows `stride` bytes apart, transposed in registers so that lane f
 * of w[k] holds row f's k-th four values (rows16_transposed), made unsigned (w + 128, as
 * load_unsigned_weights); their scales in *w_scales, gathered (each lane's dword starts at its
 * row's block: its low half is the scale). On even blocks it prefetches the next 16 rows'. */
HS_VNNI INLINE void transposed16_q8_0(const char *wrows, const size_t stride, const int b,
                                      const __m512i scale_at, __m512i w[8], __m512 *w_scales) {
    const size_t at = (size_t)b * sizeof(block_q8_0);
    if (!(b & 1))
        for (int f = 0; f < 16; f++) _mm_prefetch(wrows + stride * (16 + f) + at, _MM_HINT_T0);
    rows16_transposed((const char *)((const block_q8_0 *)(wrows + at))->qs, stride, w);
    for (int k = 0; k < HS_BLOCK / 4; k++) w[k] = _mm512_xor_si512(w[k], _mm512_set1_epi8((char)0x80));
    const __m512i scales = _mm512_i32gather_epi32(scale_at, wrows + at, 1);
    *w_scales = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(scales));
}

/* Features in lanes for Q8_0, 16 at a time: m (<= FEATURES16_PASS) row-major rows times 16
 * weight rows `stride` bytes apart, read in place (transposed16_q8_0), each row's four activations
 * broadcast. The same exact dot_b and float steps as features_in_lanes_vnni: the same bits,
 * at twice its products a cycle for 2-8 rows (docs/bench/native/staged-weights.md). */
HS_VNNI INLINE void features16_in_lanes_vnni(const char *wrows, const size_t stride, const int blocks,
                                             const int8_t *xq, const float *xd, const int32_t *xs,
                                             const int cols, const int m, float *result) {
    const __m512i scale_at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)stride));
    __m512 acc[FEATURES16_PASS];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512i w[8];
        __m512 w_scales;
        transposed16_q8_0(wrows, stride, b, scale_at, w, &w_scales);
        for (int r = 0; r < m; r++) {
            const int32_t *x = (const int32_t *)(xq + (size_t)r * cols + (size_t)b * HS_BLOCK);
            __m512i chains[2] = {_mm512_set1_epi32(-(xs[(size_t)r * blocks + b] << Q8_BIAS_SHIFT)),
                                 _mm512_setzero_si512()};
            for (int k = 0; k < HS_BLOCK / 4; k++)
                chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], w[k], _mm512_set1_epi32(x[k]));
            const __m512 x_scale = _mm512_set1_ps(xd[(size_t)r * blocks + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(chains[0], chains[1])),
                                     _mm512_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm512_storeu_ps(result + 16 * r, acc[r]);
}

/* rows from which Q8_0 goes 16 features in lanes; a lone row measured the same either way and
 * keeps one_row_in_lanes */
#define IN_PLACE16_FROM 2

/* All n rows against output features [j, j + 16) of a Q8_0 matrix, in passes of at most
 * FEATURES16_PASS rows of equal size; literal row counts up to 16 (each call compiled for its
 * own: their accumulators stay in registers), a counted loop beyond. */
HS_VNNI static void features16_passes_vnni(const hs_matrix *w, const activations *a, const int n, const int j,
                                           float *out) {
    const int blocks = w->cols / HS_BLOCK, passes = (n + FEATURES16_PASS - 1) / FEATURES16_PASS;
    const size_t stride = row_bytes(w);
    const char *rows16 = (const char *)w->data + stride * j;
    float result[FEATURES16_PASS * 16];
    for (int p = 0, r0 = 0; p < passes; p++) {
        const int m = pass_rows(n, r0, p, passes);
        const int8_t *q = a->q + (size_t)r0 * w->cols;
        const float *d = a->d + (size_t)r0 * blocks;
        const int32_t *sums = a->sum + (size_t)r0 * blocks;
#define FEATURES16(M) features16_in_lanes_vnni(rows16, stride, blocks, q, d, sums, w->cols, M, result)
        switch (m) {
        case 16: FEATURES16(16); break;
        case 15: FEATURES16(15); break;
        case 14: FEATURES16(14); break;
        case 13: FEATURES16(13); break;
        case 12: FEATURES16(12); break;
        case 11: FEATURES16(11); break;
        case 10: FEATURES16(10); break;
        case 9: FEATURES16(9); break;
        case 8: FEATURES16(8); break;
        case 7: FEATURES16(7); break;
        case 6: FEATURES16(6); break;
        case 5: FEATURES16(5); break;
        case 4: FEATURES16(4); break;
        case 3: FEATURES16(3); break;
        case 2: FEATURES16(2); break;
        default: FEATURES16(m); break;
        }
#undef FEATURES16
        for (int r = 0; r < m; r++)
            for (int f = 0; f < 16; f++) out[(size_t)(r0 + r) * w->rows + j + f] = result[16 * r + f];
        r0 += m;
    }
}

/* The 256-bit kernels, in vpdpbusd's EVEX form (AVX-512 VNNI with VL) */
#define V256_ATTR HS_VNNI
#define V256_DPBUSD _mm256_dpbusd_epi32
#define V256(name) name##_vnni
#include "vnni256.h"
#undef V256_ATTR
#undef V256_DPBUSD
#undef V256

/* ... and in its VEX form (AVX-VNNI), the AVX-VNNI level's kernels */
#define V256_ATTR HS_AVX_VNNI
#define V256_DPBUSD _mm256_dpbusd_avx_epi32
#define V256(name) name##_avx_vnni
#include "vnni256.h"
#undef V256_ATTR
#undef V256_DPBUSD
#undef V256

/* quantized_features_avx2's tiling with the VNNI kernels; leftover features go through the
 * AVX2 one-by-one product (the same exact dot_b, so the same bits). */
HS_VNNI static void quantized_features_vnni(const hs_matrix *w, const activations *a, int n,
                                            int first, int end, float *out) {
    /* Q8_0: calls of 2 or more rows go 16 features in lanes (one pass over the weights for up
     * to 32 rows, the transposes shared by all: it beat rows in lanes at every width from 2
     * to 128 rows); a packed copy serves up to 4 rows better (no transposes: the bundled
     * target's T(4) 0.22 against 0.25 ms). Q4_0 goes rows in lanes. */
    const int in_place16 = w->type == HS_Q8_0 && n >= IN_PLACE16_FROM && (!w->packed || n > 4);
    const int blocks = w->cols / HS_BLOCK;
    const int groups = in_place16 ? 0 : grouped_rows(n) / GROUP;
    const int grouped = groups * GROUP < n ? groups * GROUP : n;
    const size_t stride = row_bytes(w);
    const char *data = w->data;
    float result[8 * 16];
    for (int g = 0; g < groups; g += 2) {
        const int count = groups - g > 1 ? 2 : 1;
        for (int j = first; j < end;) {
            const int tile = end - j >= 4 ? 4 : 1; /* weight rows a call: the registers allow */
            /* literal counts and tiles: each call is compiled for its own */
            const char *wrows = data + stride * j;
            if (count == 2 && tile == 4) rows16_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 4, result);
            else if (count == 2) rows16_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 1, result);
            else if (tile == 4) rows_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 4, result);
            else rows_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 1, result);
            for (int t = 0; t < tile; t++)
                for (int r = 0; r < GROUP * count && g * GROUP + r < n; r++)
                    out[(size_t)(g * GROUP + r) * w->rows + j + t] = result[t * count * GROUP + r];
            j += tile;
        }
    }
    int j = first;
    if (in_place16)
        for (; j + 16 <= end; j += 16) features16_passes_vnni(w, a, n, j, out);
    PACKED_ROWS(packed_features_vnni, HS_PACKED_UNSIGNED)
    UNGROUPED_ROWS(features_in_lanes_vnni) /* Q4_0's rows outside groups; leftover features */
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

/* e^x for x <= 0, 8 lanes: 2^n times a degree-6 polynomial of the remainder (relative error
 * about 2e-7); the same lanes give the same results whatever else is in the vector. */
HS_AVX2 INLINE __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

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
HS_AVX2 static void soft_cap_avx2(float *x, int n, float cap) {
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
        soft_cap_avx2(tail, 8, cap);
        for (int i = 0; k + i < n; i++) x[k + i] = tail[i];
    }
}

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
 * queries and outputs `stride` floats apart: each row sees the prefix (slots 0..n_prefix-1) and
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
                                     int n_prefix, const int32_t *visible,
                                     const int32_t *offsets, const int32_t *firsts, float scale,
                                     float softcap, float *scores, float *out, const int chunks,
                                     const int widen) {
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
    const uint16_t *block_cache = keys;
    const int32_t *block_slots = NULL;
    BLOCKS(keys, NULL, lowest, n_prefix, {
        for (int r = 0; r < rows; r++)
            PART(r, 0, {
                for (int g = 0; g < group; g++)
                    score_keys(QUERY(r, g), &block, part, hd, chunks, scale, ROW(r, g) + at, widen);
            })
    })
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
            soft_cap_avx2(ROW(r, g) + firsts[r], n_prefix + SEEN(r) - firsts[r], softcap);
            ROW(r, g)[width - 1] = softmax_weights(ROW(r, g) + firsts[r], n_prefix + SEEN(r) - firsts[r]);
            memset(OUT(r, g), 0, (size_t)hd * sizeof(float));
        }
    block_cache = values;
    block_slots = NULL;
    BLOCKS(values, NULL, lowest, n_prefix, {
        for (int r = 0; r < rows; r++)
            PART(r, 0, {
                for (int g = 0; g < group; g++)
                    add_values(ROW(r, g) + at, &block, part, hd, chunks, OUT(r, g), widen);
            })
    })
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
                                     int n_prefix, const int32_t *visible,
                                     const int32_t *offsets, const int32_t *firsts,
                                     float scale, float softcap, float *scores, float *out) {
    const int widen = rows * group >= WIDEN_QUERIES;
#define BODY(chunks)                                                                          \
    if (widen)                                                                                \
        attend_rows_body(keys, values, hd, queries, stride, rows, group, n_prefix, visible,   \
                         offsets, firsts, scale, softcap, scores, out, chunks, 1);            \
    else                                                                                      \
        attend_rows_body(keys, values, hd, queries, stride, rows, group, n_prefix, visible,   \
                         offsets, firsts, scale, softcap, scores, out, chunks, 0);
    switch (hd / 8) {
    case 4: BODY(4); break;
    case 8: BODY(8); break;
    case 16: BODY(16); break;
    default: BODY(hd / 8); break;
    }
#undef BODY
}
#endif

/* One (row, feature) of quantized weights by the recipe above, in plain C. */
static float dot_quantized_portable(const void *wrow, int type, int blocks, const int8_t *x,
                                    const float *xd) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        int32_t sum = 0;
        float dw;
        if (type == HS_Q8_0) {
            const block_q8_0 *blk = (const block_q8_0 *)wrow + b;
            for (int k = 0; k < HS_BLOCK; k++) sum += blk->qs[k] * x[b * HS_BLOCK + k];
            dw = half_to_float(blk->d);
        } else {
            const block_q4_0 *blk = (const block_q4_0 *)wrow + b;
            for (int k = 0; k < HS_BLOCK / 2; k++)
                sum += ((blk->qs[k] & 0x0f) - 8) * x[b * HS_BLOCK + k] +
                       ((blk->qs[k] >> 4) - 8) * x[b * HS_BLOCK + k + HS_BLOCK / 2];
            dw = half_to_float(blk->d);
        }
        acc = fmaf((float)sum, xd[b] * dw, acc);
    }
    return acc;
}

/* ------------------------------------------------------------------ aarch64: NEON dot product
 * sdot multiplies signed bytes by signed bytes, so a block product needs no sign tricks: two
 * (or, rows in lanes, eight) instructions give the exact dot_b, and the float step is the
 * portable recipe's, acc = fma((float)dot_b, x_scale * w_scale, acc): the same bits as the
 * portable kernels, faster. */
#if HS_ARM
/* A block's 32 weights as signed bytes: values 0..15 in lo, 16..31 in hi. */
HS_DOTPROD INLINE void load_signed_weights(const void *wrow, const int type, int b, int8x16_t *lo,
                                          int8x16_t *hi) {
    if (type == HS_Q8_0) {
        const int8_t *qs = ((const block_q8_0 *)wrow)[b].qs;
        *lo = vld1q_s8(qs);
        *hi = vld1q_s8(qs + 16);
        return;
    }
    const uint8x16_t raw = vld1q_u8(((const block_q4_0 *)wrow)[b].qs);
    const int8x16_t eight = vdupq_n_s8(8);
    *lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0f))), eight);
    *hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight);
}

/* Rows in lanes: the 8 rows of group `group` times one weight row; run k of the interleaved
 * activations holds values 4k..4k+3 of rows 0..3 (first 16 bytes) and 4..7, and sdot by
 * lane takes the same four weights for each. */
HS_DOTPROD INLINE void rows_in_lanes_neon(const void *wrow, const int type, const int blocks,
                                          const activations *a, const int group, float *result) {
    float32x4_t acc_lo = vdupq_n_f32(0.0f), acc_hi = vdupq_n_f32(0.0f);
    for (int b = 0; b < blocks; b++) {
        int8x16_t w_lo, w_hi;
        load_signed_weights(wrow, type, b, &w_lo, &w_hi);
        const int8_t *x = a->grouped + ((size_t)group * blocks + b) * GROUP * HS_BLOCK;
        int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
#define RUN(k, w, lane)                                                                      \
    lo = vdotq_laneq_s32(lo, vld1q_s8(x + (k) * 4 * GROUP), w, lane);                         \
    hi = vdotq_laneq_s32(hi, vld1q_s8(x + (k) * 4 * GROUP + 16), w, lane);
        RUN(0, w_lo, 0) RUN(1, w_lo, 1) RUN(2, w_lo, 2) RUN(3, w_lo, 3)
        RUN(4, w_hi, 0) RUN(5, w_hi, 1) RUN(6, w_hi, 2) RUN(7, w_hi, 3)
#undef RUN
        const float32x4_t w_scale = vdupq_n_f32(half_to_float(weight_scale_of(wrow, type, b)));
        const float *x_scales = a->grouped_d + ((size_t)group * blocks + b) * GROUP;
        acc_lo = vfmaq_f32(acc_lo, vcvtq_f32_s32(lo), vmulq_f32(vld1q_f32(x_scales), w_scale));
        acc_hi = vfmaq_f32(acc_hi, vcvtq_f32_s32(hi), vmulq_f32(vld1q_f32(x_scales + 4), w_scale));
    }
    vst1q_f32(result, acc_lo);
    vst1q_f32(result + 4, acc_hi);
}

/* One (row, feature), for the rows outside whole groups. */
HS_DOTPROD static float dot_quantized_neon(const void *wrow, int type, int blocks, const int8_t *x,
                                           const float *xd) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        int8x16_t w_lo, w_hi;
        load_signed_weights(wrow, type, b, &w_lo, &w_hi);
        const int8_t *xb = x + (size_t)b * HS_BLOCK;
        const int32_t dot = vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), w_lo, vld1q_s8(xb)),
                                                 w_hi, vld1q_s8(xb + 16)));
        acc = fmaf((float)dot, xd[b] * half_to_float(weight_scale_of(wrow, type, b)), acc);
    }
    return acc;
}

/* Output features [first, end) of all n rows: whole groups rows in lanes, the rest one by one;
 * each weight row is read once for all of them (it stays in L1 between the passes). */
HS_DOTPROD static void quantized_features_neon(const hs_matrix *w, const activations *a, int n,
                                               int first, int end, float *out) {
    const int blocks = w->cols / HS_BLOCK, groups = grouped_rows(n) / GROUP;
    const int grouped = groups * GROUP < n ? groups * GROUP : n;
    const size_t stride = row_bytes(w);
    float result[GROUP];
    for (int j = first; j < end; j++) {
        const char *wrow = (const char *)w->data + stride * j;
        for (int g = 0; g < groups; g++) {
            if (w->type == HS_Q8_0) rows_in_lanes_neon(wrow, HS_Q8_0, blocks, a, g, result);
            else rows_in_lanes_neon(wrow, HS_Q4_0, blocks, a, g, result);
            for (int r = 0; r < GROUP && g * GROUP + r < n; r++)
                out[(size_t)(g * GROUP + r) * w->rows + j] = result[r];
        }
        for (int r = grouped; r < n; r++)
            out[(size_t)r * w->rows + j] = dot_quantized_neon(
                wrow, w->type, blocks, a->q + (size_t)r * w->cols, a->d + (size_t)r * blocks);
    }
}
#endif

static float dot_float_portable(const hs_matrix *w, const void *wrow, const float *x) {
    float acc = 0.0f;
    for (int k = 0; k < w->cols; k++)
        acc += (w->type == HS_F32 ? ((const float *)wrow)[k] : half_to_float(((const uint16_t *)wrow)[k])) * x[k];
    return acc;
}

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
static void quantize_activation(const activations *a, const float *x, int i, int n, int cols,
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
/* ------------------------------------------------------------------ parallel steps
 * Called inside a parallel region by every thread; each work item is one thread's alone. */

/* Output features [first, end) of all n rows: one work item. */
static void matmul_features(const hs_matrix *w, const activations *a, const float *xf, int n,
                            int first, int end, float *out, int simd) {
    const size_t stride = row_bytes(w);
    const int blocks = w->cols / HS_BLOCK;
    if (hs_unpacked_is(w->type)) {
        hs_unpacked_features(w, a, n, first, end, out, simd);
        return;
    }
#if HS_X86
    if (simd >= HS_SIMD_VNNI && is_quantized(w->type)) {
        quantized_features_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd == HS_SIMD_AVX_VNNI && is_quantized(w->type)) {
        quantized_features_256_avx_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd && is_quantized(w->type)) {
        quantized_features_avx2(w, a, n, first, end, out);
        return;
    }
#endif
#if HS_ARM
    if (simd >= HS_SIMD_DOTPROD && is_quantized(w->type)) {
        quantized_features_neon(w, a, n, first, end, out);
        return;
    }
#endif
    for (int j = first; j < end; j++) {
        const void *wrow = (const char *)w->data + stride * (size_t)j;
        for (int r = 0; r < n; r++) {
            float value;
            if (is_quantized(w->type))
                value = dot_quantized_portable(wrow, w->type, blocks, a->q + (size_t)r * w->cols,
                                               a->d + (size_t)r * blocks);
#if HS_X86
            else if (simd)
                value = dot_float_avx2(w, wrow, xf + (size_t)r * w->cols);
#endif
            else
                value = dot_float_portable(w, wrow, xf + (size_t)r * w->cols);
            out[(size_t)r * w->rows + j] = value;
        }
    }
}

static void matmul_items(const hs_matrix *w, const activations *a, const float *xf, int n,
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
    const int simd = simd_for(simd_cap);
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
            for (int i = 0; i < n; i++) quantize_activation(&a, x + (size_t)i * w->cols, i, n, w->cols, simd);
        }
        matmul_items(w, &a, x, n, out, simd, 1);
    }
    free(base);
    return 0;
}
/* ------------------------------------------------------------------ the forward */

typedef struct { /* per-call scratch, one allocation */
    float *x, *normed, *q, *k, *v, *attended, *projected, *gate, *up, *scores;
    activations acts;  /* span HS_BLOCK: every quantized type but the super-block ones */
    activations super; /* span HS_SUPER: the super-block types' (hs_unpacked_super) */
    void *base;
} scratch;

/* A thread's attention scores: attend_rows_body's for ATTEND_ROWS rows, or attend's for one
 * query. */
static size_t attention_scratch(const hs_model *m) {
    return (size_t)ATTEND_ROWS * (m->n_heads / m->n_kv_heads) * ((size_t)m->capacity + 1);
}

static int scratch_alloc(scratch *s, const hs_model *m, int n, int threads) {
    const size_t d = m->d_model, f = m->n_ff, qd = (size_t)m->n_heads * m->head_dim,
                 kvd = (size_t)m->n_kv_heads * m->head_dim;
    size_t widest = d > f ? d : f;
    if (qd > widest) widest = qd;
    const size_t padded = (size_t)n + GROUP; /* the grouped layout may hold a padded group */
    const size_t floats[] = {n * d, n * widest, n * qd, n * kvd, n * kvd, n * qd,
                             n * d,  n * f,      n * f,
                             (size_t)threads * attention_scratch(m),
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
    if (spans & 1) quantize_activation(&s->acts, x, i, n, cols, simd);
    if (spans & 2) quantize_activation(&s->super, x, i, n, cols, simd);
}

static int forward_ok(const hs_model *m, int n, const int32_t *tokens, const int32_t *positions,
                      int start, int n_prefix, const int32_t *offsets, const int32_t *visible,
                      int first_logit, int threads) {
    if (n < 1 || threads < 1 || start < 0 || start + n > m->capacity || n_prefix < 0 ||
        n_prefix > start || first_logit < 0 || first_logit > n || m->head_dim % 2 ||
        m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads)
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
    if (offsets[0] != 0 || (m->activation != HS_SILU && m->activation != HS_GELU_TANH)) return 0;
    int windows = 0;
    for (int l = 0; l < m->n_layers; l++) windows |= m->layers[l].window > 0;
    for (int i = 0; i < n; i++) {
        if (windows && positions[i] != n_prefix + offsets[i + 1] - offsets[i] - 1) return 0;
        if (tokens[i] < 0 || tokens[i] >= m->vocab || positions[i] < 0 ||
            positions[i] >= m->capacity || offsets[i + 1] < offsets[i] ||
            offsets[i + 1] - offsets[i] > m->capacity - n_prefix)
            return 0;
        for (int t = offsets[i]; t < offsets[i + 1]; t++)
            if (visible[t] < n_prefix || visible[t] > start + i) return 0;
    }
    return 1;
}

static float attention_scale(const hs_model *m) {
    return m->attn_scale > 0.0f ? m->attn_scale : 1.0f / sqrtf((float)m->head_dim);
}

/* The first key (by position) a row at `position` sees in a layer of `window` (0: all). */
static int first_key(int window, int position) {
    return window > 0 && position >= window ? position - window + 1 : 0;
}

/* One (row, head) of attention over the slots the row may see, in slot order, from its
 * `first` (first_key). */
static void attend(const hs_model *m, int layer, const float *query, int kv_head, int n_prefix,
                   const int32_t *visible, int n_visible, int first, float *scores, float *out,
                   int simd) {
    const int hd = m->head_dim;
    const size_t base = ((size_t)layer * m->n_kv_heads + kv_head) * m->capacity;
    (void)simd; /* the keys come as halves: no f32 kernel applies */
    const uint16_t *keys = m->k_cache + base * hd, *values = m->v_cache + base * hd;
    const float scale = attention_scale(m);
    const int total = n_prefix + n_visible;
    float highest = -INFINITY;
    for (int t = first; t < total; t++) {
        const int slot = t < n_prefix ? t : visible[t - n_prefix];
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
        const int slot = t < n_prefix ? t : visible[t - n_prefix];
        const uint16_t *v = values + (size_t)slot * hd;
        const float p = scores[t];
        for (int k = 0; k < hd; k++) out[k] += p * half_to_float(v[k]);
    }
    const float inverse = 1.0f / sum;
    for (int k = 0; k < hd; k++) out[k] *= inverse;
}

/* hs_forward's work, run by every thread of its team, or by the caller alone (no team). */
static void forward_rows(const hs_model *m, const scratch *s, int n, const int32_t *tokens,
                         const int32_t *positions, int start, int n_prefix,
                         const int32_t *offsets, const int32_t *visible, int first_logit,
                         float *logits, int simd) {
    const int d = m->d_model, f = m->n_ff, hd = m->head_dim, heads = m->n_heads,
              kv_heads = m->n_kv_heads, qd = heads * hd, kvd = kv_heads * hd;
    const int group = heads / kv_heads, half = hd / 2;
#ifdef _OPENMP
    float *scores = s->scores + (size_t)omp_get_thread_num() * attention_scratch(m);
#else
    float *scores = s->scores;
#endif
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
        float *x = s->x + (size_t)i * d;
        embed_row(&m->embed, tokens[i], x);
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
        matmul_items(&y->q, acts_for(s, &y->q), s->normed, n, s->q, simd, 0);
        matmul_items(&y->k, acts_for(s, &y->k), s->normed, n, s->k, simd, 0);
        matmul_items(&y->v, acts_for(s, &y->v), s->normed, n, s->v, simd, 1);
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
                    (((size_t)l * kv_heads + h) * m->capacity + (size_t)(start + i)) * hd;
                store_half(m->k_cache + slot, s->k + (size_t)i * kvd + (size_t)h * hd, hd, simd);
                store_half(m->v_cache + slot, s->v + (size_t)i * kvd + (size_t)h * hd, hd, simd);
            }
        }
#if HS_X86
        if (simd && hd % 8 == 0 && hd <= 256) {
            const size_t layer_base = (size_t)l * kv_heads * m->capacity * hd;
            const int row_sets = (n + ATTEND_ROWS - 1) / ATTEND_ROWS;
#pragma omp for schedule(static)
            for (int item = 0; item < kv_heads * row_sets; item++) { /* head-major: a
                head's keys and values stay in L2 for all rows */
                const int h = item / row_sets, i = item % row_sets * ATTEND_ROWS;
                const int rows = n - i < ATTEND_ROWS ? n - i : ATTEND_ROWS;
                const size_t head = layer_base + (size_t)h * m->capacity * hd;
                const size_t first = (size_t)i * qd + (size_t)h * group * hd;
                int32_t firsts[ATTEND_ROWS];
                for (int r = 0; r < rows; r++) firsts[r] = first_key(y->window, positions[i + r]);
                attend_rows_avx2(m->k_cache + head, m->v_cache + head, hd, s->q + first, qd,
                                 rows, group, n_prefix, visible, offsets + i, firsts,
                                 attention_scale(m), m->attn_softcap, scores, s->attended + first);
            }
        } else
#endif
        {
#pragma omp for schedule(static)
            for (int item = 0; item < n * heads; item++) {
                const int i = item / heads, h = item % heads;
                attend(m, l, s->q + (size_t)i * qd + (size_t)h * hd, h / group, n_prefix,
                       visible + offsets[i], offsets[i + 1] - offsets[i],
                       first_key(y->window, positions[i]), scores,
                       s->attended + (size_t)i * qd + (size_t)h * hd, simd);
            }
        }
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++)
            quantize_input(s, spans_of(&y->o, NULL, NULL), s->attended + (size_t)i * qd, i, n, qd, simd);
        matmul_items(&y->o, acts_for(s, &y->o), s->attended, n, s->projected, simd, 1);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            float *x = s->x + (size_t)i * d, *projected = s->projected + (size_t)i * d;
            add_bias(projected, y->o_bias, d);
            if (y->post_attn_norm) rms_norm(projected, y->post_attn_norm, d, m->eps, projected);
            for (int k = 0; k < d; k++) x[k] += projected[k];
            rms_norm(x, y->ffn_norm, d, m->eps, s->normed + (size_t)i * d);
            quantize_input(s, spans_of(&y->gate, &y->up, NULL), s->normed + (size_t)i * d, i, n, d, simd);
        }
        matmul_items(&y->gate, acts_for(s, &y->gate), s->normed, n, s->gate, simd, 0);
        matmul_items(&y->up, acts_for(s, &y->up), s->normed, n, s->up, simd, 1);
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
        matmul_items(&y->down, acts_for(s, &y->down), s->gate, n, s->projected, simd, 1);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            float *x = s->x + (size_t)i * d, *projected = s->projected + (size_t)i * d;
            add_bias(projected, y->down_bias, d);
            if (y->post_ffn_norm) rms_norm(projected, y->post_ffn_norm, d, m->eps, projected);
            for (int k = 0; k < d; k++) x[k] += projected[k];
        }
    }
    const int outputs = n - first_logit;
    if (outputs > 0) {
#pragma omp for schedule(static)
        for (int i = first_logit; i < n; i++) {
            const size_t r = (size_t)(i - first_logit);
            rms_norm(s->x + (size_t)i * d, m->output_norm, d, m->eps, s->normed + r * d);
            quantize_input(s, spans_of(&m->output, NULL, NULL), s->normed + r * d, (int)r, outputs, d, simd);
        }
        matmul_items(&m->output, acts_for(s, &m->output), s->normed, outputs, logits, simd, 1);
        if (m->final_softcap > 0.0f) {
#pragma omp for schedule(static)
            for (int r = 0; r < outputs; r++) {
                float *row = logits + (size_t)r * m->vocab;
#if HS_X86
                if (simd)
                    soft_cap_avx2(row, m->vocab, m->final_softcap);
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

int hs_forward(const hs_model *m, int n, const int32_t *tokens, const int32_t *positions,
               int start, int n_prefix, const int32_t *offsets, const int32_t *visible,
               int first_logit, float *logits, int threads) {
    if (!forward_ok(m, n, tokens, positions, start, n_prefix, offsets, visible, first_logit,
                    threads))
        return -1;
    scratch s;
    if (scratch_alloc(&s, m, n, threads)) return -1;
    const int simd = simd_for(m->simd);
    s.acts.with_sums = s.super.with_sums = simd >= HS_SIMD_AVX_VNNI || has_mins_anywhere(m);
    if (threads == 1) { /* no team: its worksharing loops are orphaned and skip their barriers,
        where a team of one still makes a futex call at each (about 26 a forward) */
        forward_rows(m, &s, n, tokens, positions, start, n_prefix, offsets, visible, first_logit,
                     logits, simd);
    } else {
#pragma omp parallel num_threads(threads)
        forward_rows(m, &s, n, tokens, positions, start, n_prefix, offsets, visible, first_logit,
                     logits, simd);
    }
    free(s.base);
    return 0;
}

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
    return n < 1 ? -1 : argmax_row(row, n, simd_for(simd_cap));
}

#if HS_X86
HS_AVX2 static float softmax_weights_avx2(float *row, int n) { return softmax_weights(row, n); }
#endif

/* softmax(row * inv_temperature) into probs (attention's softmax_weights at kernel level
 * `simd` AVX2 or above: probs are what the caller reports, whichever path computed them). */
static void softmax_row(const float *row, int n, float inv_temperature, float *probs, int simd) {
    for (int k = 0; k < n; k++) probs[k] = row[k] * inv_temperature;
    float total = 0.0f;
#if HS_X86
    if (simd >= HS_SIMD_AVX2) {
        total = softmax_weights_avx2(probs, n);
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
    const int simd = simd_for(m->simd);
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
