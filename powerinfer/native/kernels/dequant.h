/* Rows of a GGUF matrix back to float32, per type (portable C): embedding lookups and the
 * engine's float32 refinement of the best logits, without a round trip through numpy.
 *
 * Runs in: the process that loads decoder.c (included after qdot.h). The arithmetic is gguf-py's
 * dequantize_blocks, which the tests hold it to.
 */
#ifndef PI_DEQUANT_H
#define PI_DEQUANT_H

#include "qdot.h"

/* out [K] = row (K values of type). 0 on success, 1 for a type without a decoder. */
static int dequant_row(int type, const uint8_t *w, int K, float *out) {
    switch (type) {
        case T_F32: memcpy(out, w, sizeof(float) * (size_t)K); return 0;
        case T_F16: for (int i = 0; i < K; i++) out[i] = ld_h(w + 2 * i); return 0;
        case T_BF16: for (int i = 0; i < K; i++) { uint16_t h; memcpy(&h, w + 2 * i, 2); out[i] = bf2f(h); } return 0;
        default: break;
    }
    const pi_qtype *t = pi_qtype_of(type);
    if (!t) return 1;
    for (int b = 0; b < K / 32 && t->qk == 32; b++) {
        float *o = out + 32 * b;
        const uint8_t *blk = w + (size_t)t->bytes * b;
        const float d = ld_h(blk);
        if (type == T_Q8_0) { /* int8 codes */
            for (int i = 0; i < 32; i++) o[i] = d * (float)(int8_t)blk[t->qs + i];
            continue;
        }
        const float m = t->min >= 0 ? ld_h(blk + t->min) : 0.0f;
        uint32_t qh = 0;
        if (t->qh >= 0) memcpy(&qh, blk + t->qh, 4);
        const uint8_t *qs = blk + t->qs;
        const int five = t->qh >= 0, centre = t->centre;
        for (int i = 0; i < 16; i++) {
            int lo = qs[i] & 0xF, hi = qs[i] >> 4;
            if (five) { lo |= ((qh >> i) & 1) << 4; hi |= ((qh >> (i + 16)) & 1) << 4; }
            o[i] = d * (float)(lo - centre) + m;
            o[i + 16] = d * (float)(hi - centre) + m;
        }
    }
    if (t->qk == 32) return 0;
    for (int sb = 0; sb < K / 256; sb++) {
        float *o = out + 256 * sb;
        if (type == T_Q6_K) {
            const uint8_t *blk = w + (size_t)t->bytes * sb, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = ld_h(blk + 208);
            for (int e = 0; e < 256; e++) {
                const int h = e / 128, l = e % 128;
                const int lo = l < 64 ? ql[64 * h + l] & 0xF : ql[64 * h + l - 64] >> 4;
                const int hi = (qh[32 * h + l % 32] >> (2 * (l / 32))) & 3;
                o[e] = d * (float)sc[e / 16] * (float)((lo | (hi << 4)) - 32);
            }
            continue;
        }
        const int five = type == T_Q5_K;
        const uint8_t *blk = w + (size_t)t->bytes * sb, *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        const float d = ld_h(blk), dmin = ld_h(blk + 2);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            scale_min_k4(j, blk + 4, &sc, &m);
            for (int i = 0; i < 32; i++) {
                int q = (j & 1) ? qs[32 * (j / 2) + i] >> 4 : qs[32 * (j / 2) + i] & 0xF;
                if (five) q |= ((qh[i] >> j) & 1) << 4;
                o[32 * j + i] = d * (float)sc * (float)q - dmin * (float)m;
            }
        }
    }
    return 0;
}

#endif
