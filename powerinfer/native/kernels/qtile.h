/* Several tokens at a time: one weight row's blocks unpacked once and dotted with the activations
 * of four or eight tokens (prefill and batched decode), for the quantized types of qdot.h, SIMD builds only.
 *
 * Runs in: the process that loads decoder.c (included after qdot.h).
 *
 * Each type has an unpack step that turns 32-element block b of a row into 32 bytes of codes
 * (unsigned, or signed for Q8_0 and Q6_K) with the block's scale and offset (w = scale * q +
 * offset; Q6_K's two 16-element sub-scales ride as int16 lanes); the dotN body is shared. Per
 * token the arithmetic is that of qdot.h's portable one-token dot products, which SIMD builds
 * also take from here (N = 1).
 */
#ifndef PI_QTILE_H
#define PI_QTILE_H

#include "qdot.h"

#ifdef PI_SIMD

typedef struct {
    __m256i v;   /* 32 codes */
    __m256i scv; /* Q6_K: sub-scales as int16 lanes (0-7: values 0-15, 8-15: values 16-31) */
    float scale, offset;
} pi_blk;

static inline void un_q4_0(const uint8_t *row, int b, pi_blk *o) {
    const uint8_t *w = row + 18 * b;
    o->v = nibbles16(w + 2);
    o->scale = ld_h(w);
    o->offset = -8.0f * o->scale;
}

static inline void un_q4_1(const uint8_t *row, int b, pi_blk *o) {
    const uint8_t *w = row + 20 * b;
    o->v = nibbles16(w + 4);
    o->scale = ld_h(w);
    o->offset = ld_h(w + 2);
}

static inline void un_q5_0(const uint8_t *row, int b, pi_blk *o) {
    const uint8_t *w = row + 22 * b;
    o->v = _mm256_or_si256(nibbles16(w + 6), _mm256_and_si256(bits32(w + 2), _mm256_set1_epi8(0x10)));
    o->scale = ld_h(w);
    o->offset = -16.0f * o->scale;
}

static inline void un_q5_1(const uint8_t *row, int b, pi_blk *o) {
    const uint8_t *w = row + 24 * b;
    o->v = _mm256_or_si256(nibbles16(w + 8), _mm256_and_si256(bits32(w + 4), _mm256_set1_epi8(0x10)));
    o->scale = ld_h(w);
    o->offset = ld_h(w + 2);
}

static inline void un_q8_0(const uint8_t *row, int b, pi_blk *o) {
    const uint8_t *w = row + 34 * b;
    o->v = _mm256_loadu_si256((const __m256i *)(w + 2));
    o->scale = ld_h(w);
    o->offset = 0.0f;
}

static inline void un_qk45(const uint8_t *row, int b, pi_blk *o, int five) {
    const uint8_t *w = row + (five ? 176 : 144) * (b / 8);
    const int j = b % 8;
    int sc, m;
    scale_min_k4(j, w + 4, &sc, &m);
    __m256i raw = _mm256_loadu_si256((const __m256i *)(w + (five ? 48 : 16) + 32 * (j / 2)));
    o->v = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
    if (five) {
        __m256i hb = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 16)), j), _mm256_set1_epi8(1));
        o->v = _mm256_or_si256(o->v, _mm256_slli_epi16(hb, 4));
    }
    o->scale = ld_h(w) * (float)sc;
    o->offset = -ld_h(w + 2) * (float)m;
}

static inline void un_q4_k(const uint8_t *row, int b, pi_blk *o) { un_qk45(row, b, o, 0); }
static inline void un_q5_k(const uint8_t *row, int b, pi_blk *o) { un_qk45(row, b, o, 1); }

static inline void un_q6_k(const uint8_t *row, int b, pi_blk *o) {
    const uint8_t *w = row + 210 * (b / 8);
    const int blk = b % 8, h = blk / 4, s = blk % 4;
    const int8_t *sc = (const int8_t *)(w + 192);
    __m256i lo = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (s % 2)));
    lo = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(0x0F));
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)), 2 * s), _mm256_set1_epi8(3));
    o->v = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const int a = sc[2 * blk], c = sc[2 * blk + 1];
    o->scv = _mm256_set_m128i(_mm_set1_epi16((short)c), _mm_set1_epi16((short)a));
    o->scale = ld_h(w + 208);
    o->offset = 0.0f;
}

/* out[t] = row . x[t] for t < N. SIGNED: codes carry their sign (|w| against x with w's sign). */
#define PI_DOTN(NAME, N, UNPACK, SIGNED, SUBSCALES)                                                       \
    static void NAME(const uint8_t *row, const pi_act *x, int K, float *out) {                           \
        __m256 acc[N];                                                                                    \
        float corr[N];                                                                                    \
        for (int t = 0; t < N; t++) {                                                                     \
            acc[t] = _mm256_setzero_ps();                                                                 \
            corr[t] = 0.0f;                                                                               \
        }                                                                                                 \
        for (int b = 0; b < K / 32; b++) {                                                                \
            pi_blk w;                                                                                     \
            UNPACK(row, b, &w);                                                                           \
            const __m256i u = SIGNED ? _mm256_sign_epi8(w.v, w.v) : w.v;                                  \
            for (int t = 0; t < N; t++) {                                                                 \
                __m256i xq = _mm256_loadu_si256((const __m256i *)(x[t].q + 32 * b));                      \
                if (SIGNED) xq = _mm256_sign_epi8(xq, w.v);                                               \
                /* sub-scales: int16 pair sums times the scales, no int32 multiply */                      \
                __m256i p = SUBSCALES ? _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), w.scv) : dot_us(u, xq); \
                const float dx = x[t].d[b];                                                               \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(w.scale * dx), acc[t]);    \
                if (!SIGNED) corr[t] += w.offset * x[t].s[b];                                             \
            }                                                                                             \
        }                                                                                                 \
        for (int t = 0; t < N; t++) out[t] = hsum8(acc[t]) + corr[t];                                     \
    }

/* out[r] = rows[r] . x for r < N: one token against N rows (the sparse FFN's chosen rows). The
 * rows' accumulators are independent chains, so a row costs a quarter of the one-row kernel's
 * multiply-add latency; each row's arithmetic is dot1v's (the same value to the bit). */
#define PI_DOTR(NAME, N, UNPACK, SIGNED, SUBSCALES)                                                        \
    static void NAME(const uint8_t *const *rows, const pi_act *x, int K, float *out) {                     \
        __m256 acc[N];                                                                                    \
        float corr[N];                                                                                    \
        for (int r = 0; r < N; r++) {                                                                     \
            acc[r] = _mm256_setzero_ps();                                                                 \
            corr[r] = 0.0f;                                                                               \
        }                                                                                                 \
        for (int b = 0; b < K / 32; b++) {                                                                \
            const __m256i xq0 = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));                     \
            const float dx = x->d[b], sx = x->s[b];                                                       \
            for (int r = 0; r < N; r++) {                                                                 \
                pi_blk w;                                                                                 \
                UNPACK(rows[r], b, &w);                                                                   \
                const __m256i u = SIGNED ? _mm256_sign_epi8(w.v, w.v) : w.v;                              \
                const __m256i xq = SIGNED ? _mm256_sign_epi8(xq0, w.v) : xq0;                             \
                __m256i p = SUBSCALES ? _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), w.scv) : dot_us(u, xq); \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(w.scale * dx), acc[r]);    \
                if (!SIGNED) corr[r] += w.offset * sx;                                                    \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < N; r++) out[r] = hsum8(acc[r]) + corr[r];                                     \
    }

/* Four tokens fit AVX2's 16 vector registers; AVX-512 VL's 32 take eight (fewer unpacks per token).
 * One token: the decode path's dot_TYPE (qtraits.h's table), for rows that are not repacked. */
#ifdef PI_VNNI
#define PI_TILE8(T, SIGNED, SUBSCALES) PI_DOTN(dot8_##T, 8, un_##T, SIGNED, SUBSCALES)
#else
#define PI_TILE8(T, SIGNED, SUBSCALES) /* AVX2's 16 registers hold four tokens' accumulators, not eight */
#endif
#define PI_TILES(T, SIGNED, SUBSCALES)                                              \
    PI_DOTN(dot1v_##T, 1, un_##T, SIGNED, SUBSCALES)                                \
    PI_DOTN(dot4_##T, 4, un_##T, SIGNED, SUBSCALES)                                 \
    PI_TILE8(T, SIGNED, SUBSCALES)                                                   \
    PI_DOTR(dotr4_##T, 4, un_##T, SIGNED, SUBSCALES)                                \
    static float dot_##T(const uint8_t *w, const pi_act *x, int K) {                \
        float o;                                                                    \
        dot1v_##T(w, x, K, &o);                                                     \
        return o;                                                                   \
    }
PI_TILES(q4_0, 0, 0)
PI_TILES(q4_1, 0, 0)
PI_TILES(q5_0, 0, 0)
PI_TILES(q5_1, 0, 0)
PI_TILES(q8_0, 1, 0)
PI_TILES(q4_k, 0, 0)
PI_TILES(q5_k, 0, 0)
PI_TILES(q6_k, 1, 1)
#endif

typedef void (*dotn_fn)(const uint8_t *, const pi_act *, int, float *);
typedef void (*dotr_fn)(const uint8_t *const *, const pi_act *, int, float *);

/* The block types with several-token and four-row kernels, as X(type id, suffix). */
#define PI_TILED_TYPES(X) X(T_Q4_0, q4_0) X(T_Q4_1, q4_1) X(T_Q5_0, q5_0) X(T_Q5_1, q5_1) X(T_Q8_0, q8_0) \
    X(T_Q4_K, q4_k) X(T_Q5_K, q5_k) X(T_Q6_K, q6_k)

#endif
