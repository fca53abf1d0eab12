/* A neuron predictor's last layer by sign: which of fc2's rows give fc2 . u + b2 > 0, in 8 bits
 * with one scale a row, sixteen rows to a 512-bit dpbusd (the predictor's mask, sparse_rows.h).
 *
 * Runs in: the process that loads decoder.c (included by it before sparse_rows.h; one translation
 * unit): the in-process executor's coordinator and each rank of the native pool.
 *
 * Why: fc2 [n_ff, k] is tall and narrow (k = 48 for the 1.1B file's folded low-rank predictor): as
 * Q8_0 rows its k was padded to 64, each row cost a horizontal sum, and the logits went through
 * memory before a second pass compared them. The decision needs only the sign. Here a group of 16
 * rows is 32 bytes of f16 scales then k / 4 vectors of 16 rows x 4 codes (pred_sign.py's
 * sign_layout), streamed once; u is quantized per token with one scale (u8, offset by 128: dpbusd
 * multiplies unsigned by signed bytes, and the offset's share, 128 x the row's code sum, comes
 * from a second dpbusd on ones); the 16 logits are compared in registers and the mask written.
 * The 1.1B ReGLU file's predictor (k = 48): 0.61 -> 0.40-0.46 ms a step, decode 1.03x (docs/sparsity.md). */
#ifndef PI_PRED_SIGN_H
#define PI_PRED_SIGN_H
#ifdef PI_VNNI /* other builds run fc2's Q8_0 rows (sparse_layers.py builds this layout only for these) */

/* u [kq] -> a [kq]: round(u / su) + 128 with su = max|u| / 127 (returned; 0 for a zero u). */
static float sign_quant(const float *u, int kq, uint8_t *a) {
    float amax = 0.0f;
    for (int i = 0; i < kq; i++) amax = fmaxf(amax, fabsf(u[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < kq; i++) {
        const long q = lrintf(u[i] * inv);
        a[i] = (uint8_t)(128 + (q > 127 ? 127 : q < -127 ? -127 : q));
    }
    return amax / 127.0f;
}

/* mt[l] = (fc2 row l of the group . u + b2[l] > 0) for l < lanes (<= 16): grp is the group's
 * bytes (16 f16 scales, then kq / 4 vectors of 16 rows x 4 int8 codes), a the token's codes. */
static void sign_mask_group(const uint8_t *grp, int kq, const uint8_t *a, float su, const float *b2, uint8_t *mt, int lanes) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc = _mm512_setzero_si512(), cs = _mm512_setzero_si512();
    for (int c = 0; c < kq / 4; c++) {
        const __m512i w = _mm512_loadu_si512((const void *)(grp + 32 + 64 * c));
        int32_t a4;
        memcpy(&a4, a + 4 * c, 4);
        acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(a4), w);
        cs = _mm512_dpbusd_epi32(cs, ones, w);
    }
    const __m512i isum = _mm512_sub_epi32(acc, _mm512_slli_epi32(cs, 7)); /* sum (a - 128) w: exact */
    const __mmask16 lm = lanes >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << lanes) - 1u);
    const __m512 sc = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)grp)), _mm512_set1_ps(su));
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, _mm512_maskz_loadu_ps(lm, b2));
    const __mmask16 pos = _mm512_mask_cmp_ps_mask(lm, v, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm_mask_storeu_epi8((void *)mt, lm, _mm_maskz_mov_epi8(pos, _mm_set1_epi8(1)));
}
#endif

#endif
