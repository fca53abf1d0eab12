/* The decoder's attention over one kv head's cached keys and values (attend_group).
 *
 * Runs in: the process that loads decoder.c (included by it after vecmath.h and exp8.h; one
 * translation unit).
 */
#ifndef PI_ATTEND_H
#define PI_ATTEND_H

/* g query heads of one kv head (q [g, D], consecutive): out [g, Dv] = softmax(scale * q . k[lo..p])
 * . v[lo..p] over kc, vc [n_ctx, D / Dv]; each key and value row is loaded once for the g heads.
 * sc: g * ld scratch floats. A head's numbers do not depend on g (same order of operations). */
static void attend_group(const float *q, int g, const float *kc, const float *vc, int lo, int p, int D, int Dv, float scale, float *sc,
                         int ld, float *out) {
    const int n = p - lo + 1;
    for (int j = 0; j < n; j++) {
        const float *kj = kc + (size_t)(lo + j) * D;
        for (int h = 0; h < g; h++) sc[(size_t)h * ld + j] = dotf(q + (size_t)h * D, kj, D) * scale;
    }
    float inv[64]; /* g <= 64: native/decoder.py supports() */
    for (int h = 0; h < g; h++) {
        float *row = sc + (size_t)h * ld, mx = -INFINITY;
        for (int j = 0; j < n; j++) mx = row[j] > mx ? row[j] : mx;
        inv[h] = 1.0f / exp_sub_sum(row, n, mx);
        for (int j = 0; j < n; j++) row[j] *= inv[h];
    }
    /* out_h = sum_j p_hj v_j, 64 output values at a time held in registers while the keys pass */
    for (int h = 0; h < g; h++) {
        const float *p = sc + (size_t)h * ld;
        float *o = out + (size_t)h * Dv;
        int i = 0;
#ifdef PI_SIMD
        for (; i + 64 <= Dv; i += 64) {
            __m256 a[8];
            for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
            for (int j = 0; j < n; j++) {
                const __m256 pj = _mm256_set1_ps(p[j]);
                const float *vj = vc + (size_t)(lo + j) * Dv + i;
                for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), a[c]);
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + i + 8 * c, a[c]);
        }
#endif
        for (; i < Dv; i++) {
            float acc = 0.0f;
            for (int j = 0; j < n; j++) acc += p[j] * vc[(size_t)(lo + j) * Dv + i];
            o[i] = acc;
        }
    }
}

#endif
