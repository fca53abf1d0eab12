/* The quant type traits: one row per GGML type the native library computes, with the facts of its
 * block layout that every kernel reads here instead of keeping its own switch (llama.cpp's
 * ggml type_traits in spirit). The kernels each type has (dot products, four-row and several-token
 * tiles) are gathered per type in qtraits.h, which needs them defined first.
 *
 * Runs in: every process that loads decoder.c (included by qdot.h, after the type ids).
 */
#ifndef PI_QTYPES_H
#define PI_QTYPES_H

typedef struct {
    int type;     /* GGML id (qdot.h's T_*) */
    int qk;       /* values per block: 1 (float types), 32, 256 (K-quants' super-blocks) */
    int bytes;    /* bytes per block */
    int min;      /* 32-value types: offset of the float16 min (Q4_1, Q5_1), -1: none */
    int qh;       /* 32-value types: offset of the 32 fifth bits (Q5_0, Q5_1), -1: none */
    int qs;       /* 32-value types: offset of the codes, after the float16 scale at 0 */
    int centre;   /* the code that stands for zero: 8 (Q4_0), 16 (Q5_0); 0 where a min or int8 codes carry the sign */
    int x8_hdr;   /* repacked eight-row groups (qx8.h), per block: bytes of scales, mins, fifth bits or sub-scales; 0: not repacked */
    int x8_codes; /* ... and bytes of codes (4-bit codes 128, 8-bit codes 256) */
    int split;    /* rows may take qsplit.h's split layout (VNNI builds) */
} pi_qtype;

#define PI_QTYPE_IDS 31 /* GGML ids 0..30: the table is indexed by id (kernels look a type up per call) */

static const pi_qtype PI_QTYPES[PI_QTYPE_IDS] = {
    /*          type   qk   bytes min  qh  qs centre x8_hdr x8_codes split */
    [T_F32]  = {T_F32,    1,   4,  -1,  -1,  0,  0,     0,     0,      0},
    [T_F16]  = {T_F16,    1,   2,  -1,  -1,  0,  0,     0,     0,      0},
    [T_BF16] = {T_BF16,   1,   2,  -1,  -1,  0,  0,     0,     0,      0},
    [T_Q4_0] = {T_Q4_0,  32,  18,  -1,  -1,  2,  8,    16,   128,      1},
    [T_Q4_1] = {T_Q4_1,  32,  20,   2,  -1,  4,  0,    32,   128,      1},
    [T_Q5_0] = {T_Q5_0,  32,  22,  -1,   2,  6, 16,    48,   128,      0},
    [T_Q5_1] = {T_Q5_1,  32,  24,   2,   4,  8,  0,     0,     0,      0},
    [T_Q8_0] = {T_Q8_0,  32,  34,  -1,  -1,  2,  0,    16,   256,      0},
    [T_Q4_K] = {T_Q4_K, 256, 144,  -1,  -1,  0,  0,     0,     0,      0},
    [T_Q5_K] = {T_Q5_K, 256, 176,  -1,  -1,  0,  0,     0,     0,      0},
    [T_Q6_K] = {T_Q6_K, 256, 210,  -1,  -1,  0,  0,    32,   256,      0},
};

/* The row of type, or NULL for a type this library does not compute (an empty row: qk 0). */
static inline const pi_qtype *pi_qtype_of(int type) {
    return (unsigned)type < PI_QTYPE_IDS && PI_QTYPES[type].qk ? &PI_QTYPES[type] : 0;
}

#endif
