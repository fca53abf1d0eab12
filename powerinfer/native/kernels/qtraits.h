/* Each type's kernels in one table: the one-token dot product every build has, and the SIMD
 * builds' four-row and four- or eight-token tiles (qtile.h), beside the type's layout facts
 * (qtypes.h). Callers ask here; no kernel switches on a type to find its siblings.
 *
 * Runs in: the process that loads decoder.c (included by it, after the kernels it names).
 */
#ifndef PI_QTRAITS_H
#define PI_QTRAITS_H

#include "qdot_k.h"

typedef struct {
    int type;
    dot_fn dot;    /* one row . one token */
    dotr_fn dotr4; /* four rows . one token, or NULL: one row at a time */
    dotn_fn dot4;  /* one row . four tokens, or NULL: fewer tokens at a time */
    dotn_fn dot8;  /* one row . eight tokens (AVX-512 VL's 32 registers), or NULL */
} pi_qkernels;

#ifdef PI_SIMD
#ifdef PI_VNNI
#define PI_DOT8(T) dot8_##T
#else
#define PI_DOT8(T) 0
#endif
#define PI_TILED(ID, T) [ID] = {ID, dot_##T, dotr4_##T, dot4_##T, PI_DOT8(T)},
#else
#define PI_TILED(ID, T) [ID] = {ID, dot_##T, 0, 0, 0},
#endif

static const pi_qkernels PI_QKERNELS[PI_QTYPE_IDS] = { /* indexed by GGML id, as qtypes.h's table */
    [T_F32] = {T_F32, dot_f32, 0, 0, 0},
    [T_F16] = {T_F16, dot_f16, 0, 0, 0},
    [T_BF16] = {T_BF16, dot_bf16, 0, 0, 0},
    PI_TILED_TYPES(PI_TILED)
};
#undef PI_TILED
#undef PI_DOT8

/* The kernels of type, or NULL for a type this library does not compute (an empty row: no dot). */
static inline const pi_qkernels *pi_kernels_of(int type) {
    return (unsigned)type < PI_QTYPE_IDS && PI_QKERNELS[type].dot ? &PI_QKERNELS[type] : 0;
}

/* A type's one-token dot product and the row length its blocks need (0 and NULL: unsupported). */
static inline dot_fn dot_for(int type, int *align) {
    const pi_qkernels *k = pi_kernels_of(type);
    const pi_qtype *l = pi_qtype_of(type);
    *align = k && l ? l->qk : 0;
    return k && l ? k->dot : 0;
}

/* The n-token kernel (n = 4 or 8) of a type, or NULL: then fewer tokens at a time. */
static inline dotn_fn dotn_for(int type, int n) {
    const pi_qkernels *k = pi_kernels_of(type);
    return !k ? 0 : n == 4 ? k->dot4 : n == 8 ? k->dot8 : 0;
}

/* The four-row kernel of a type (one token), or NULL: one row at a time. */
static inline dotr_fn dotr4_for(int type) {
    const pi_qkernels *k = pi_kernels_of(type);
    return k ? k->dotr4 : 0;
}

#endif
