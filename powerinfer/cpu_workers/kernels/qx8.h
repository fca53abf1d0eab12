/* Q4_0 / Q4_1 repacked eight rows at a time, so one pass over a block serves eight rows: the
 * scales of eight rows are one vector, an activation block is loaded once for all eight, and the
 * integer sums of the eight rows land in one vector's lanes (one float multiply-add per block).
 *
 * Runs in: the process that loads decoder.c (included after qdot.h). SIMD builds only; the
 * portable build and rows past the last group of eight read the file's own rows (qdot.h).
 *
 * Layout of a group of 8 rows, block b (32 values per row), PI_X8_BYTES(type) bytes:
 *   d[8] float16 (and for Q4_1 m[8] float16), in lane order L = {0, 1, 4, 5, 2, 3, 6, 7}
 *   qs: four 32-byte vectors V(h, g), h = 0, 1 (bytes 8h..8h+7 of each row's 16 code bytes),
 *       g = 0, 1 (rows 4g..4g+3): [row 4g bytes | row 4g+1 | row 4g+2 | row 4g+3], 8 bytes each.
 * Low nibbles of bytes 8h..8h+7 are values 8h..8h+7, high nibbles values 16+8h..16+8h+7, so
 * V(h, g) meets the activation bytes 8h.. (low) and 16+8h.. (high), each broadcast to all four
 * rows. dpbusd's int32 lane k then sums row 4g + k/2's products; hadd of the two row groups
 * gives one lane per row, in the order L (hence the order of the scales).
 * The bytes are exactly the file's (scales and codes moved, none changed): the repack replaces
 * the mapped rows, whose pages are then dropped, so no second copy stays resident.
 */
#ifndef PI_QX8_H
#define PI_QX8_H

#include "qdot.h"

#define PI_X8_BYTES(type) ((type) == T_Q4_1 ? 32 + 128 : 16 + 128)

static const int PI_X8_LANE[8] = {0, 1, 4, 5, 2, 3, 6, 7}; /* lane i holds row PI_X8_LANE[i] */

/* Repack rows [8 g0, 8 g1) of a Q4_0 / Q4_1 matrix (row r at src + r * row_bytes) into dst. */
void pi_x8_repack(const uint8_t *src, int64_t row_bytes, int type, int K, int g0, int g1, uint8_t *dst) {
    const int nb = K / 32, bs = type == T_Q4_1 ? 20 : 18, hdr = type == T_Q4_1 ? 4 : 2, xb = PI_X8_BYTES(type);
    for (int g = g0; g < g1; g++) {
        for (int b = 0; b < nb; b++) {
            uint8_t *o = dst + ((size_t)(g - g0) * nb + b) * xb;
            for (int i = 0; i < 8; i++) {
                const uint8_t *blk = src + (size_t)(8 * g + PI_X8_LANE[i]) * row_bytes + (size_t)b * bs;
                memcpy(o + 2 * i, blk, 2);                           /* d */
                if (type == T_Q4_1) memcpy(o + 16 + 2 * i, blk + 2, 2); /* m */
            }
            uint8_t *q = o + (type == T_Q4_1 ? 32 : 16);
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

/* The eight rows' int32 sums of one block against one token: lanes in order L. */
static inline __m256i x8_isum(const uint8_t *q, const int8_t *xq) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i x0 = bcast8(xq), x1 = bcast8(xq + 8), x2 = bcast8(xq + 16), x3 = bcast8(xq + 24);
    __m256i acc[2];
    for (int g = 0; g < 2; g++) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(q + 32 * g)), v1 = _mm256_loadu_si256((const __m256i *)(q + 64 + 32 * g));
        __m256i a = _mm256_add_epi32(dot_us(_mm256_and_si256(v0, m4), x0), dot_us(_mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), x2));
        __m256i c = _mm256_add_epi32(dot_us(_mm256_and_si256(v1, m4), x1), dot_us(_mm256_and_si256(_mm256_srli_epi16(v1, 4), m4), x3));
        acc[g] = _mm256_add_epi32(a, c);
    }
    return _mm256_hadd_epi32(acc[0], acc[1]);
}

/* out[t * ldo + lane-ordered row] for nt (1..4) tokens: the eight rows of one group. */
static void x8_dot(const uint8_t *grp, int type, const pi_act *x, int nt, int K, float *out, int ldo) {
    const int xb = PI_X8_BYTES(type), q4_1 = type == T_Q4_1;
    __m256 acc[4], corr[4];
    for (int t = 0; t < nt; t++) acc[t] = corr[t] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *o = grp + (size_t)b * xb;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        const __m256 off8 = q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16))) : _mm256_mul_ps(d8, _mm256_set1_ps(-8.0f));
        const uint8_t *q = o + (q4_1 ? 32 : 16);
        for (int t = 0; t < nt; t++) {
            const float dx = x[t].d[b];
            __m256 s = _mm256_cvtepi32_ps(x8_isum(q, x[t].q + 32 * b));
            acc[t] = _mm256_fmadd_ps(s, _mm256_mul_ps(d8, _mm256_set1_ps(dx)), acc[t]);
            corr[t] = _mm256_fmadd_ps(off8, _mm256_set1_ps(dx * (float)x[t].s[b]), corr[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc[t], corr[t]));
        for (int i = 0; i < 8; i++) out[(size_t)t * ldo + PI_X8_LANE[i]] = lanes[i];
    }
}
#endif

#endif
