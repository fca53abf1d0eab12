/* The sparse FFN's down projection in decode: the active neurons' rows of a neuron-major copy.
 *
 * Runs in: the process that loads decoder.c (included by it after sparse_rows.h, whose hidden
 * state it sums; one translation unit): the in-process executor's coordinator and each rank of
 * the native pool.
 *
 * down_t is the file's down projection [d, n_ff] transposed and requantized per neuron and 32
 * outputs (sparse_layers.py's down_t_rows): Q8_0, or for a 4-bit file Q4_0, half the bytes of the
 * step's largest scattered read. A neuron's row is one contiguous read, so the sum skips whole rows.
 */
#ifndef PI_SPARSE_DOWN_H
#define PI_SPARSE_DOWN_H

/* acc [32 nb] += h * row, row nb Q8_0 blocks (34 bytes: f16 scale, 32 int8 codes): the scalar
 * build's sum (SIMD builds run down_axpy_group's, the same arithmetic a lane). */
static inline void down_axpy_q8(const uint8_t *row, float h, float *acc, int nb) {
    for (int b = 0; b < nb; b++) {
        const int8_t *qb = (const int8_t *)(row + 34 * b + 2);
        float *ab = acc + 32 * b;
        const float sc = h * ld_h(row + 34 * b);
        for (int e = 0; e < 32; e++) ab[e] += sc * (float)qb[e];
    }
}

/* acc [32 nb] += h * row, row nb Q4_0 blocks (18 bytes: f16 scale, 16 bytes of codes: value e
 * is the low nibble of byte e, value 16 + e its high nibble, each minus 8): the scalar build's. */
static inline void down_axpy_q4(const uint8_t *row, float h, float *acc, int nb) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *qb = row + 18 * b + 2;
        float *ab = acc + 32 * b;
        const float sc = h * ld_h(row + 18 * b);
        for (int e = 0; e < 16; e++) {
            ab[e] += sc * (float)((qb[e] & 0x0F) - 8);
            ab[16 + e] += sc * (float)((qb[e] >> 4) - 8);
        }
    }
}

/* acc [32 nb] += h[0] rows[0] + ... + h[nr - 1] rows[nr - 1] (nr <= PI_DT_GROUP rows of q4 ? Q4_0 :
 * Q8_0 blocks), the neurons one after another into each output, each step one fused multiply-add
 * (the same numbers as one neuron a pass): a block's sums stay in registers across the group, one
 * load and one store of acc a group instead of a neuron. */
#define PI_DT_GROUP 4
#if defined(PI_VNNI)
static inline void blk_fma(const uint8_t *row, int q4, int b, float h, __m512 *a0, __m512 *a1) {
    if (q4) { /* a nibble's value (q - 8) as a float from a 16-entry table: vpermps reads an index's low 4 bits, so no
               * mask, subtraction or conversion (the same floats; down phase 0.945x and 0.957x, docs/sparsity.md) */
        const uint8_t *qb = row + 18 * b + 2;
        const __m512 sc = _mm512_set1_ps(h * ld_h(row + 18 * b));
        const __m512 lut = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qb));
        *a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(c, lut), sc, *a0);
        *a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut), sc, *a1);
    } else {
        const int8_t *qb = (const int8_t *)(row + 34 * b + 2);
        const __m512 sc = _mm512_set1_ps(h * ld_h(row + 34 * b));
        *a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb))), sc, *a0);
        *a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16)))), sc, *a1);
    }
}
static inline void group_blocks(const uint8_t *const *rows, const float *h, int nr, int q4, float *acc, int nb) {
    for (int b = 0; b < nb; b++) {
        __m512 a0 = _mm512_loadu_ps(acc + 32 * b), a1 = _mm512_loadu_ps(acc + 32 * b + 16);
        for (int r = 0; r < nr; r++) blk_fma(rows[r], q4, b, h[r], &a0, &a1);
        _mm512_storeu_ps(acc + 32 * b, a0);
        _mm512_storeu_ps(acc + 32 * b + 16, a1);
    }
}
#elif defined(PI_SIMD)
static inline void blk_fma(const uint8_t *row, int q4, int b, float h, __m256 *a) {
    if (q4) {
        const uint8_t *qb = row + 18 * b + 2;
        const __m256 sc = _mm256_set1_ps(h * ld_h(row + 18 * b));
        const __m256i eight = _mm256_set1_epi32(8), m0f = _mm256_set1_epi32(0x0F);
        for (int e = 0; e < 2; e++) {
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * e)));
            a[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(c, m0f), eight)), sc, a[e]);
            a[2 + e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(c, 4), eight)), sc, a[2 + e]);
        }
    } else {
        const int8_t *qb = (const int8_t *)(row + 34 * b + 2);
        const __m256 sc = _mm256_set1_ps(h * ld_h(row + 34 * b));
        for (int e = 0; e < 4; e++) a[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * e)))), sc, a[e]);
    }
}
static inline void group_blocks(const uint8_t *const *rows, const float *h, int nr, int q4, float *acc, int nb) {
    for (int b = 0; b < nb; b++) {
        __m256 a[4];
        for (int e = 0; e < 4; e++) a[e] = _mm256_loadu_ps(acc + 32 * b + 8 * e);
        for (int r = 0; r < nr; r++) blk_fma(rows[r], q4, b, h[r], a);
        for (int e = 0; e < 4; e++) _mm256_storeu_ps(acc + 32 * b + 8 * e, a[e]);
    }
}
#endif
static void down_axpy_group(const uint8_t *const *rows, const float *h, int nr, int q4, float *acc, int nb) {
#if defined(PI_VNNI) || defined(PI_SIMD)
    if (q4) /* two copies, each with its row type fixed */
        group_blocks(rows, h, nr, 1, acc, nb);
    else
        group_blocks(rows, h, nr, 0, acc, nb);
#else
    for (int r = 0; r < nr; r++) {
        if (q4)
            down_axpy_q4(rows[r], h[r], acc, nb);
        else
            down_axpy_q8(rows[r], h[r], acc, nb);
    }
#endif
}

/* The active neurons of h [nA] (h != 0, NaN included) among down_t's rows [c0, c1), row p being
 * neuron pj[p] (pj NULL: p): their count, then (list_active) their rows and values from it[k],
 * hv[k] on, in row order. AVX-512: 16 rows a step, gathered through pj, the chosen lanes
 * compressed in a register and stored under a mask (nothing written past the list's end: the
 * next chunk's entries belong to another thread). */
static int count_active(const float *h, const int32_t *pj, int c0, int c1) {
    int k = 0, p = c0;
#ifdef PI_VNNI
    for (; p + 16 <= c1; p += 16) {
        const __m512 v = pj ? _mm512_i32gather_ps(_mm512_loadu_si512((const void *)(pj + p)), h, 4) : _mm512_loadu_ps(h + p);
        k += __builtin_popcount((unsigned)_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ));
    }
#endif
    for (; p < c1; p++) k += h[pj ? pj[p] : p] != 0.0f;
    return k;
}

static void list_active(const float *h, const int32_t *pj, int c0, int c1, int32_t *it, float *hv, int k) {
    int p = c0;
#ifdef PI_VNNI
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; p + 16 <= c1; p += 16) {
        const __m512 v = pj ? _mm512_i32gather_ps(_mm512_loadu_si512((const void *)(pj + p)), h, 4) : _mm512_loadu_ps(h + p);
        const __mmask16 sel = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        if (!sel) continue;
        const int c = __builtin_popcount((unsigned)sel);
        const __mmask16 first = (__mmask16)((1u << c) - 1u);
        _mm512_mask_storeu_epi32((void *)(it + k), first, _mm512_maskz_compress_epi32(sel, _mm512_add_epi32(iota, _mm512_set1_epi32(p))));
        _mm512_mask_storeu_ps(hv + k, first, _mm512_maskz_compress_ps(sel, v));
        k += c;
    }
#endif
    for (; p < c1; p++) {
        const float hj = h[pj ? pj[p] : p];
        if (hj != 0.0f) {
            it[k] = p;
            hv[k++] = hj;
        }
    }
}

/* Decode's down projection over the active neurons: y [T, D] (row stride d; this rank's output
 * rows) = sum over token t's neurons j with h_j != 0, in down_t's row order (hot first: dperm), of
 * h_j * down_t[row of j][0..D), from the gathered hidden state g [T, nffA]. down_t is the file's
 * down values requantized per neuron and 32 outputs: Q8_0 (within 1/254 of each block's largest
 * value) or, for a 4-bit file, Q4_0 (1/16: half the bytes of the step's largest scattered read;
 * sparse_layers.py's down_t_type). An output's sum runs over the neurons in that order whatever the split, so ranks and
 * threads give the same numbers. */
#define PI_DT_AHEAD 8 /* neurons asked for ahead in the sparse down projection (two groups) */
#ifndef PI_DT_MAX
#define PI_DT_MAX 0.15f /* the largest share of neurons the sparse down projection takes (crossover: ~12% on a Zen 4, ~15% on a Sapphire Rapids VM: scripts/membench/down.c, Q8_0 rows; Q4_0's not measured) */
#endif
static int down_sparse(const pi_model *m, const pi_sparse *S, int T, const pi_scratch *s, float *y, int D) {
    const int nA = pi_ff_all(m), nb = S->down_t.cols / 32, nchunk = (nA + 511) / 512;
    if (32 * nb > nA) return 0; /* the sums live in hu [T, nA]: a model wider than its FFN runs the dense down */
    const int64_t rb = S->down_t.row_bytes;
    const int q4 = S->down_t.type == T_Q4_0, bb = q4 ? 18 : 34; /* else Q8_0; bytes a block */
    int32_t *cc = s->cnt + 3 * T + 2; /* [T, nchunk + 1]: chunk counts, then offsets */
    /* the active lists in two passes (count, then write) so that every thread shares the work */
#pragma omp for schedule(static)
    for (int i = 0; i < T * nchunk; i++) {
        const int t = i / nchunk, c0 = (i % nchunk) * 512, c1 = c0 + 512 < nA ? c0 + 512 : nA;
        cc[(size_t)t * (nchunk + 1) + i % nchunk + 1] = count_active(s->g + (size_t)t * nA, S->dperm, c0, c1);
    }
#pragma omp single
    for (int t = 0; t < T; t++) {
        int32_t *ct = cc + (size_t)t * (nchunk + 1);
        ct[0] = 0;
        for (int c = 0; c < nchunk; c++) ct[c + 1] += ct[c];
    }
    /* scattered rows read at a fraction of a stream's bandwidth: past PI_DT_MAX of the neurons the
     * dense kernel is faster (the same decision on every rank: they hold the same hidden state) */
    for (int t = 0; t < T; t++)
        if (cc[(size_t)t * (nchunk + 1) + nchunk] > (int)(PI_DT_MAX * nA)) return 0;
#pragma omp for schedule(static)
    for (int i = 0; i < T * nchunk; i++) {
        const int t = i / nchunk, c0 = (i % nchunk) * 512, c1 = c0 + 512 < nA ? c0 + 512 : nA;
        list_active(s->g + (size_t)t * nA, S->dperm, c0, c1, s->idx + (size_t)t * nA, s->ha + (size_t)t * nA, cc[(size_t)t * (nchunk + 1) + i % nchunk]);
    }
    /* work items: (token, slice of output blocks), one slice per thread; within a slice the
     * neurons pass in order, PI_DT_GROUP at a time, each neuron's piece of the slice one contiguous
     * read (asked for PI_DT_AHEAD neurons ahead), the sums kept in acc (in L1: a slice of 2048
     * outputs is 8 KiB) */
    const int nth = omp_get_num_threads(), slices = nth < nb ? nth : nb;
#pragma omp for schedule(static)
    for (int i = 0; i < T * slices; i++) {
        const int t = i / slices, b0 = (int)((int64_t)nb * (i % slices) / slices), b1 = (int)((int64_t)nb * (i % slices + 1) / slices);
        const int k = cc[(size_t)t * (nchunk + 1) + nchunk];
        const int32_t *it = s->idx + (size_t)t * nA;
        const float *hv = s->ha + (size_t)t * nA;
        float *acc = s->hu + (size_t)t * nA + 32 * b0; /* hu is free now: [T, nffA] >= [T, D padded] */
        memset(acc, 0, sizeof(float) * 32 * (size_t)(b1 - b0));
        for (int q = 0; q < k; q += PI_DT_GROUP) {
            const int nr = k - q < PI_DT_GROUP ? k - q : PI_DT_GROUP;
            const uint8_t *rows[PI_DT_GROUP];
            for (int r = 0; r < nr; r++) {
                rows[r] = S->down_t.data + (size_t)it[q + r] * rb + (size_t)b0 * bb;
                if (q + r + PI_DT_AHEAD < k) prefetch_row_bytes(S->down_t.data + (size_t)it[q + r + PI_DT_AHEAD] * rb + (size_t)b0 * bb, bb * (b1 - b0));
            }
            down_axpy_group(rows, hv + q, nr, q4, acc, b1 - b0);
        }
        const int o1 = 32 * b1 < D ? 32 * b1 : D; /* the last block's padding is not an output */
        float *yt = y + (size_t)t * m->d;
        for (int o = 32 * b0; o < o1; o++) yt[o] = acc[o - 32 * b0];
    }
    return 1;
}

#endif
