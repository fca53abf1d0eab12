/* Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q6_K repacked eight rows at a time, so one pass over a block serves eight rows: the
 * scales of eight rows are one vector, an activation block is loaded once for all eight, and the
 * integer sums of the eight rows land in one vector's lanes (one float multiply-add per block).
 *
 * Runs in: the process that loads decoder.c (included after qdot.h). SIMD builds only; the
 * portable build and rows past the last group of eight read the file's own rows (qdot.h).
 *
 * Layout of a group of 8 rows, block b (32 values per row), PI_X8_BYTES(type) bytes:
 *   d[8] float16 (and for Q4_1 m[8] float16), in lane order L = {0, 1, 4, 5, 2, 3, 6, 7}
 *   Q5_0 only, 32 bytes: for V(h, g) in the order (0,0), (0,1), (1,0), (1,1) two 32-bit words,
 *       the fifth bits of V's low nibbles, then of its high nibbles (bit 8i + k: byte k of row
 *       4g + i), i.e. qh byte h, then byte 2 + h, of each of the four rows
 *   qs: four 32-byte vectors V(h, g), h = 0, 1 (bytes 8h..8h+7 of each row's 16 code bytes),
 *       g = 0, 1 (rows 4g..4g+3): [row 4g bytes | row 4g+1 | row 4g+2 | row 4g+3], 8 bytes each.
 * Low nibbles of bytes 8h..8h+7 are values 8h..8h+7, high nibbles values 16+8h..16+8h+7, so
 * V(h, g) meets the activation bytes 8h.. (low) and 16+8h.. (high), each broadcast to all four
 * rows. dpbusd's int32 lane k then sums row 4g + k/2's products; hadd of the two row groups
 * gives one lane per row, in the order L (hence the order of the scales).
 * Q8_0: d[8] (order L), then eight 32-byte vectors C(c, g), c = 0..3: [row 4g bytes 8c..8c+7 |
 * row 4g+1 | ...], meeting activation bytes 8c..8c+7 (signed codes: |w| against x with w's sign).
 * Q6_K, per 32 values of a super-block: d[8] (each row's super-block d, order L), the two int8
 *   sub-scales of the 32 values, lo[8] then hi[8] (order L), then the codes as signed bytes
 *   (q - 32) laid out like Q8_0's; 288 bytes for 8 x 32 values where the file has 210: the one
 *   layout here that is larger than the file, taken for prefill's sake (the codes unpacked once).
 * The bytes are the file's (scales and codes moved, none changed; Q6_K's codes widened): the
 * repack replaces the mapped rows, whose pages are then dropped, so no second copy stays resident.
 */
#ifndef PI_QX8_H
#define PI_QX8_H

#include "qdot.h"

/* per block of a group: scales, and Q4_1's mins, Q5_0's fifth bits or Q6_K's sub-scales (qtypes.h's x8_hdr), then the codes */
#define PI_X8_HDR(type) (pi_qtype_of(type)->x8_hdr)
#define PI_X8_BYTES(type) (pi_qtype_of(type)->x8_hdr + pi_qtype_of(type)->x8_codes)

static const int PI_X8_LANE[8] = {0, 1, 4, 5, 2, 3, 6, 7}; /* lane i holds row PI_X8_LANE[i] */

static void x8_repack_q6k(const uint8_t *src, int64_t row_bytes, int K, int g0, int g1, uint8_t *dst) {
    const int nb = K / 32, xb = PI_X8_BYTES(T_Q6_K);
    for (int g = g0; g < g1; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = dst + ((size_t)(g - g0) * nb + b) * xb;
            const int blk = b % 8, h = blk / 4, s4 = blk % 4;
            for (int i = 0; i < 8; i++) {
                const uint8_t *w = src + (size_t)(8 * g + PI_X8_LANE[i]) * row_bytes + (size_t)(b / 8) * 210;
                memcpy(o + 2 * i, w + 208, 2);
                o[16 + i] = w[192 + 2 * blk];
                o[24 + i] = w[192 + 2 * blk + 1];
            }
            for (int r = 0; r < 8; r++) {
                const uint8_t *w = src + (size_t)(8 * g + r) * row_bytes + (size_t)(b / 8) * 210;
                const uint8_t *l = w + 64 * h + 32 * (s4 % 2), *hh = w + 128 + 32 * h;
                for (int e = 0; e < 32; e++) {
                    const int q = ((s4 >= 2 ? l[e] >> 4 : l[e] & 0xF) | (((hh[e] >> (2 * s4)) & 3) << 4)) - 32;
                    o[32 + 64 * (e / 8) + 32 * (r / 4) + 8 * (r % 4) + e % 8] = (uint8_t)(int8_t)q;
                }
            }
        }
}

/* Repack rows [8 g0, 8 g1) of a Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q6_K matrix (row r at src + r * row_bytes) into dst. */
void pi_x8_repack(const uint8_t *src, int64_t row_bytes, int type, int K, int g0, int g1, uint8_t *dst) {
    if (type == T_Q6_K) {
        x8_repack_q6k(src, row_bytes, K, g0, g1, dst);
        return;
    }
    const pi_qtype *t = pi_qtype_of(type);
    const int nb = K / 32, bs = t->bytes, hdr = t->qs;
    const int xb = PI_X8_BYTES(type);
    for (int g = g0; g < g1; g++) {
        for (int b = 0; b < nb; b++) {
            uint8_t *o = dst + ((size_t)(g - g0) * nb + b) * xb;
            for (int i = 0; i < 8; i++) {
                const uint8_t *blk = src + (size_t)(8 * g + PI_X8_LANE[i]) * row_bytes + (size_t)b * bs;
                memcpy(o + 2 * i, blk, 2);                           /* d */
                if (t->min >= 0) memcpy(o + 16 + 2 * i, blk + t->min, 2); /* m */
            }
            if (t->qh >= 0)
                for (int k = 0; k < 4; k++) /* V(h, g), h = k / 2, g = k % 2 */
                    for (int i = 0; i < 4; i++) {
                        const uint8_t *qh = src + (size_t)(8 * g + 4 * (k % 2) + i) * row_bytes + (size_t)b * bs + t->qh;
                        o[16 + 8 * k + i] = qh[k / 2];
                        o[16 + 8 * k + 4 + i] = qh[2 + k / 2];
                    }
            uint8_t *q = o + PI_X8_HDR(type);
            if (type == T_Q8_0) {
                for (int c = 0; c < 4; c++)
                    for (int r = 0; r < 8; r++)
                        memcpy(q + 64 * c + 32 * (r / 4) + 8 * (r % 4), src + (size_t)(8 * g + r) * row_bytes + (size_t)b * bs + 2 + 8 * c, 8);
                continue;
            }
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < 8; r++) {
                    const uint8_t *qs = src + (size_t)(8 * g + r) * row_bytes + (size_t)b * bs + hdr;
                    memcpy(q + 64 * h + 32 * (r / 4) + 8 * (r % 4), qs + 8 * h, 8);
                }
        }
    }
}

#ifdef PI_SIMD
static inline __m256i bcast8(const int8_t *p) { /* 8 bytes to all four 64-bit lanes */
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}

/* acc + the 8 int32 sums of 4 products u8 * s8 each. */
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#ifdef PI_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Q8_0's and Q6_K's groups: signed codes, no offset (Q6_K: two sub-scales per 32 values). */
static void x8_dot_q8(const uint8_t *grp, const pi_act *x, int nt, int K, float *out, int ldo, int q6k);

/* Tokens per call: AVX2's 16 vector registers hold four tokens' sums, AVX-512 VL's 32 eight. */
#ifdef PI_VNNI
#define PI_X8_TOKENS 8
#else
#define PI_X8_TOKENS 4
#endif

/* out[t * ldo + row] for nt (1..PI_X8_TOKENS) tokens and the eight rows of one group. Per block the codes
 * are unpacked once, w[g][k]: g = row group, k = low / high nibbles of V(0, g), then of V(1, g);
 * each token's four broadcast 8-byte pieces of its activation block meet them. */
static void x8_dot(const uint8_t *grp, int type, const pi_act *x, int nt, int K, float *out, int ldo) {
    if (type == T_Q8_0 || type == T_Q6_K) {
        x8_dot_q8(grp, x, nt, K, out, ldo, type == T_Q6_K);
        return;
    }
    const pi_qtype *lt = pi_qtype_of(type); /* the layout's facts, read once: the block loop is the hot one */
    const int hdr = lt->x8_hdr, xb = lt->x8_hdr + lt->x8_codes, q4_1 = lt->min >= 0, q5_0 = lt->qh >= 0;
    const float zero = -(float)lt->centre; /* Q4_0: -8, Q5_0: -16 (Q4_1 carries its min) */
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    __m256 acc[PI_X8_TOKENS], corr[PI_X8_TOKENS];
    for (int t = 0; t < nt; t++) acc[t] = corr[t] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *o = grp + (size_t)b * xb;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        const __m256 off8 = q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16)))
                                 : _mm256_mul_ps(d8, _mm256_set1_ps(zero));
        const uint8_t *q = o + hdr;
        __m256i w[2][4];
        for (int g = 0; g < 2; g++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(q + 32 * g)), v1 = _mm256_loadu_si256((const __m256i *)(q + 64 + 32 * g));
            w[g][0] = _mm256_and_si256(v0, m4);
            w[g][1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
            w[g][2] = _mm256_and_si256(v1, m4);
            w[g][3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            if (q5_0) /* fifth bits: words of V(0, g) at 8 g, of V(1, g) at 16 + 8 g */
                for (int k = 0; k < 4; k++)
                    w[g][k] = _mm256_or_si256(w[g][k], _mm256_and_si256(bits32(o + 16 + 16 * (k / 2) + 8 * g + 4 * (k % 2)), b4));
        }
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = x[t].q + 32 * b;
            const __m256i x0 = bcast8(xq), x1 = bcast8(xq + 8), x2 = bcast8(xq + 16), x3 = bcast8(xq + 24);
            __m256i a[2];
            for (int g = 0; g < 2; g++)
                a[g] = dot_acc(dot_acc(dot_acc(dot_acc(_mm256_setzero_si256(), w[g][0], x0), w[g][1], x2), w[g][2], x1), w[g][3], x3);
            const float dx = x[t].d[b];
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(a[0], a[1])), _mm256_mul_ps(d8, _mm256_set1_ps(dx)), acc[t]);
            corr[t] = _mm256_fmadd_ps(off8, _mm256_set1_ps(x[t].s[b]), corr[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc[t], corr[t]));
        for (int i = 0; i < 8; i++) out[(size_t)t * ldo + PI_X8_LANE[i]] = lanes[i];
    }
}

static void x8_dot_q8(const uint8_t *grp, const pi_act *x, int nt, int K, float *out, int ldo, int q6k) {
    const int hdr = q6k ? 32 : 16, xb = q6k ? PI_X8_BYTES(T_Q6_K) : PI_X8_BYTES(T_Q8_0);
    __m256 acc[PI_X8_TOKENS];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *o = grp + (size_t)b * xb;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        /* Q6_K: values 0-15 (chunks 0, 1) and 16-31 (chunks 2, 3) have their own sub-scale */
        __m256 s_lo = d8, s_hi = d8;
        if (q6k) {
            s_lo = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + 16)))));
            s_hi = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + 24)))));
        }
        __m256i v[2][4], u[2][4];
        for (int g = 0; g < 2; g++)
            for (int c = 0; c < 4; c++) {
                v[g][c] = _mm256_loadu_si256((const __m256i *)(o + hdr + 64 * c + 32 * g));
                u[g][c] = _mm256_sign_epi8(v[g][c], v[g][c]);
            }
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = x[t].q + 32 * b;
            __m256i lo[2], hi[2];
            for (int g = 0; g < 2; g++) {
                lo[g] = dot_acc(dot_acc(_mm256_setzero_si256(), u[g][0], _mm256_sign_epi8(bcast8(xq), v[g][0])), u[g][1],
                                _mm256_sign_epi8(bcast8(xq + 8), v[g][1]));
                hi[g] = dot_acc(dot_acc(_mm256_setzero_si256(), u[g][2], _mm256_sign_epi8(bcast8(xq + 16), v[g][2])), u[g][3],
                                _mm256_sign_epi8(bcast8(xq + 24), v[g][3]));
            }
            const __m256 dx = _mm256_set1_ps(x[t].d[b]);
            if (q6k) {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[0], lo[1])), _mm256_mul_ps(s_lo, dx), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(hi[0], hi[1])), _mm256_mul_ps(s_hi, dx), acc[t]);
            } else {
                const __m256i sum = _mm256_add_epi32(_mm256_hadd_epi32(lo[0], lo[1]), _mm256_hadd_epi32(hi[0], hi[1]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d8, dx), acc[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[t]);
        for (int i = 0; i < 8; i++) out[(size_t)t * ldo + PI_X8_LANE[i]] = lanes[i];
    }
}
#endif

#endif
