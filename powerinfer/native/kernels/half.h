/* IEEE float16 to float32 in portable C (subnormals, infinities and NaN included), for the builds
 * without F16C: the native decoder's portable build and the sparse FFN kernel.
 *
 * Runs in: whichever process loads a kernel that includes it.
 */
#ifndef PI_HALF_H
#define PI_HALF_H

#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
