/* One task of decode_attention.c for head dim HEAD_DIM over keys and values of type ELEMENT, widened to fp32 by
 * LOAD_KV (all defined by the includer, with SPAN_ATTENTION the function's name; undefined again at the end):
 * `rows` fp32 query rows [rows, HEAD_DIM] against keys [lo, hi); writes each row's max `m`, sum `l` and unnormalised
 * output `acc` [rows, HEAD_DIM]. `scores` holds rows * BLOCK floats. Rows go in pairs, so that each key and value
 * loaded serves two rows; with AVX-512, more than `narrow_rows` rows go in fours against the block's keys transposed
 * (`kt`, [HEAD_DIM, BLOCK]), so that each key column and value vector loaded serves four rows and no reduction is
 * taken. */
#define NV (HEAD_DIM / LANES)
/* value columns per pass: two rows' accumulators of VALUE_NV vectors each, 16 of AVX-512's 32 registers or 8 of
 * AVX2's 16 */
#define VALUE_NV (NV < LANES / 2 ? NV : LANES / 2)

/* a key's dot products with the query rows: QUERY_NV vectors a row. bf16 keys where the target has AVX512-BF16
 * (SCORE_PAIRS, defined by the includer): pairs of bf16 by vdpbf16ps (vectors.h), the rows packed back to bf16
 * (exactly: they are bf16 values); else the keys widened to fp32 and multiplied lane by lane */
#ifdef SCORE_PAIRS
#define QUERY_NV (NV / 2)
#define QUERY_VECTOR(row, c) pack_pairs((row) + 2 * (c) * LANES)
#define KEY_VECTOR(key, c) load_pairs((key) + 2 * (c) * LANES)
#define KEY_PRODUCT(sum, a, kc) dot_pairs(sum, a, kc)
#else
#define QUERY_NV NV
#define QUERY_VECTOR(row, c) load_f32((row) + (c) * LANES)
#define KEY_VECTOR(key, c) LOAD_KV((key) + (c) * LANES)
#define KEY_PRODUCT(sum, a, kc) fmadd(a, kc, sum)
#endif

static void SPAN_ATTENTION(const float *restrict q, const void *restrict k_, const void *restrict v_, long k_row,
                           long v_row, int rows, int new_rows, int narrow_rows, long kv_len, float scale, long lo,
                           long hi, float *restrict m, float *restrict l, float *restrict acc, float *restrict scores) {
    const ELEMENT *restrict k = k_, *restrict v = v_;
    float rescale[rows];
#if LANES == 16 && !defined(SCORE_PAIRS)
    float kt[HEAD_DIM * BLOCK] __attribute__((aligned(64)));
#endif
    for (int r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    memset(acc, 0, sizeof(float) * rows * HEAD_DIM);
    for (long start = lo; start < hi; start += BLOCK) {
        int block = (int)(hi - start < BLOCK ? hi - start : BLOCK);
        /* scores: two rows' partial products with LANES / 2 keys (one row's with LANES), reduced lane-wise into one
         * vector. With AVX-512 the two rows' query vectors stay in registers (8 or 16 of 32) and each key's dot
         * products run to their end; with AVX2 they do not fit (16 or 32 of 16), so the LANES partial sums stay in
         * registers instead and are advanced one column vector at a time, each query vector loaded once for the
         * group of keys. */
#if LANES == 16 && !defined(SCORE_PAIRS)
        if (rows > narrow_rows) {
            /* the block's keys transposed once, [HEAD_DIM, BLOCK] (past its end, copies of its last key), then four
             * rows at a time against all of them: each key column loaded once for four rows, no reduction */
            for (int t = 0; t < BLOCK; t += LANES) {
                for (int c = 0; c < NV; c++) {
                    vec x[LANES];
                    const ELEMENT *key = k + (start + t) * k_row + c * LANES;
                    if (start + BLOCK < hi)  /* the next block's keys on their way while this one computes */
                        for (int i = 0; i < LANES; i++) __builtin_prefetch(key + (BLOCK + i) * k_row, 0, 2);
                    if (t + LANES <= block) for (int i = 0; i < LANES; i++) x[i] = LOAD_KV(key + i * k_row);
                    else for (int i = 0; i < LANES; i++) x[i] = LOAD_KV(key + (t + i < block ? i : block - 1 - t) * k_row);
                    transpose(x);
                    for (int i = 0; i < LANES; i++) store_f32(kt + (long)(c * LANES + i) * BLOCK + t, x[i]);
                }
            }
            for (int r = 0; r < rows; r += 4) {
                const float *qr[4];
                for (int g = 0; g < 4; g++) qr[g] = q + (long)(r + g < rows ? r + g : rows - 1) * HEAD_DIM;
                /* each dot product summed in chunks of LANES columns, the chunks' sums added in turn (as many
                 * roundings deep as the pairs' lane-wise sums and their reduction) */
                vec sum[4][4];
                for (int c = 0; c < NV; c++) {
                    vec s0[4] = {{0}}, s1[4] = {{0}}, s2[4] = {{0}}, s3[4] = {{0}};
                    for (int d = c * LANES; d < (c + 1) * LANES; d++) {
                        const float *column = kt + (long)d * BLOCK;
                        vec k0 = load_f32(column), k1 = load_f32(column + LANES), k2 = load_f32(column + 2 * LANES),
                            k3 = load_f32(column + 3 * LANES);
                        IN_REGISTERS(k0, k1, k2, k3);
                        for (int g = 0; g < 4; g++) {
                            vec a = splat(qr[g][d]);
                            s0[g] = fmadd(a, k0, s0[g]); s1[g] = fmadd(a, k1, s1[g]);
                            s2[g] = fmadd(a, k2, s2[g]); s3[g] = fmadd(a, k3, s3[g]);
                        }
                    }
                    for (int g = 0; g < 4; g++) {
                        if (c == 0) { sum[g][0] = s0[g]; sum[g][1] = s1[g]; sum[g][2] = s2[g]; sum[g][3] = s3[g]; }
                        else { sum[g][0] += s0[g]; sum[g][1] += s1[g]; sum[g][2] += s2[g]; sum[g][3] += s3[g]; }
                    }
                }
                for (int g = 0; g < 4 && r + g < rows; g++) {
                    float *out = scores + (r + g) * BLOCK;
                    if (block == BLOCK) {
                        for (int t = 0; t < 4; t++) store_f32(out + t * LANES, sum[g][t]);
                    } else {
                        for (int j = 0; j < block; j++) out[j] = sum[g][j / LANES][j % LANES];
                    }
                }
            }
        } else
#endif
#if LANES == 16
        for (int r = 0; r < rows; r += 2) {
            vec a[QUERY_NV], b[QUERY_NV], x[LANES];
            for (int c = 0; c < QUERY_NV; c++) a[c] = QUERY_VECTOR(q + (long)r * HEAD_DIM, c);
            if (r + 1 < rows) {
                for (int c = 0; c < QUERY_NV; c++) b[c] = QUERY_VECTOR(q + (long)(r + 1) * HEAD_DIM, c);
                for (int j = 0; j < block; j += LANES / 2) {
                    int count = block - j < LANES / 2 ? block - j : LANES / 2;
                    for (int i = 0; i < LANES / 2; i++) {
                        const ELEMENT *key = k + (start + j + (i < count ? i : 0)) * k_row;
                        vec da = {0}, db = {0};
                        for (int c = 0; c < QUERY_NV; c++) {
                            vec kc = KEY_VECTOR(key, c);
                            da = KEY_PRODUCT(da, a[c], kc);
                            db = KEY_PRODUCT(db, b[c], kc);
                        }
                        x[i] = da;
                        x[i + LANES / 2] = db;
                    }
                    reduce(x);
                    for (int i = 0; i < count; i++) {
                        scores[r * BLOCK + j + i] = x[0][i];
                        scores[(r + 1) * BLOCK + j + i] = x[0][i + LANES / 2];
                    }
                }
            } else {
                for (int j = 0; j < block; j += LANES) {
                    int count = block - j < LANES ? block - j : LANES;
                    for (int i = 0; i < LANES; i++) {
                        const ELEMENT *key = k + (start + j + (i < count ? i : 0)) * k_row;
                        vec da = {0};
                        for (int c = 0; c < QUERY_NV; c++) da = KEY_PRODUCT(da, a[c], KEY_VECTOR(key, c));
                        x[i] = da;
                    }
                    reduce(x);
                    if (count == LANES) store_f32(scores + r * BLOCK + j, x[0]);
                    else for (int i = 0; i < count; i++) scores[r * BLOCK + j + i] = x[0][i];
                }
            }
        }
#else
        for (int r = 0; r < rows; r += 2) {
            const float *qa = q + (long)r * HEAD_DIM, *qb = qa + HEAD_DIM;
            vec x[LANES];
            if (r + 1 < rows) {
                for (int j = 0; j < block; j += LANES / 2) {
                    int count = block - j < LANES / 2 ? block - j : LANES / 2;
                    const ELEMENT *key = k + (start + j) * k_row;
                    for (int i = 0; i < LANES; i++) x[i] = (vec){0};
                    for (int c = 0; c < NV; c++) {
                        vec a = load_f32(qa + c * LANES), b = load_f32(qb + c * LANES);
                        for (int i = 0; i < LANES / 2; i++) {
                            vec kc = LOAD_KV(key + (i < count ? i : 0) * k_row + c * LANES);
                            x[i] = fmadd(a, kc, x[i]);
                            x[i + LANES / 2] = fmadd(b, kc, x[i + LANES / 2]);
                        }
                    }
                    reduce(x);
                    for (int i = 0; i < count; i++) {
                        scores[r * BLOCK + j + i] = x[0][i];
                        scores[(r + 1) * BLOCK + j + i] = x[0][i + LANES / 2];
                    }
                }
            } else {
                for (int j = 0; j < block; j += LANES) {
                    int count = block - j < LANES ? block - j : LANES;
                    const ELEMENT *key = k + (start + j) * k_row;
                    for (int i = 0; i < LANES; i++) x[i] = (vec){0};
                    for (int c = 0; c < NV; c++) {
                        vec a = load_f32(qa + c * LANES);
                        for (int i = 0; i < LANES; i++)
                            x[i] = fmadd(a, LOAD_KV(key + (i < count ? i : 0) * k_row + c * LANES), x[i]);
                    }
                    reduce(x);
                    if (count == LANES) store_f32(scores + r * BLOCK + j, x[0]);
                    else for (int i = 0; i < count; i++) scores[r * BLOCK + j + i] = x[0][i];
                }
            }
        }
#endif
        /* online softmax, row by row: weights in `scores`, the factor the row's output is rescaled by in `rescale` */
        for (int r = 0; r < rows; r++) {
            long visible = kv_len - new_rows + 1 + r % new_rows; /* keys [0, visible) */
            float *s = scores + r * BLOCK;
            float top = m[r];
            #pragma omp simd reduction(max:top)
            for (int j = 0; j < block; j++) {
                float x = start + j < visible ? s[j] * scale : -INFINITY;
                s[j] = x;
                top = x > top ? x : top;
            }
            if (top == -INFINITY) { /* nothing visible to this row yet: weights 0 */
                memset(s, 0, sizeof(float) * block);
                rescale[r] = 1.f;
                continue;
            }
            float alpha = expf(m[r] - top), sum = 0.f;
            #pragma omp simd reduction(+:sum)
            for (int j = 0; j < block; j++) { float p = expf(s[j] - top); s[j] = p; sum += p; }
            l[r] = l[r] * alpha + sum;
            m[r] = top;
            rescale[r] = alpha;
        }
#if LANES == 16
        if (rows > narrow_rows) {
            /* the values, four rows at a time, 64 columns a pass: each value vector loaded once for four rows */
            for (int r = 0; r < rows; r += 4) {
                const float *p[4];
                for (int g = 0; g < 4; g++) p[g] = scores + (r + g < rows ? r + g : rows - 1) * BLOCK;
                for (int c0 = 0; c0 < NV; c0 += 4) {
                    vec o[4][4];
                    for (int g = 0; g < 4; g++) {
                        int row = r + g < rows ? r + g : rows - 1;
                        for (int c = 0; c < 4; c++) o[g][c] = load_f32(acc + (long)row * HEAD_DIM + (c0 + c) * LANES) * rescale[row];
                    }
                    for (int j = 0; j < block; j++) {
                        const ELEMENT *value = v + (start + j) * v_row + c0 * LANES;
                        if (r == 0 && start + BLOCK < hi)  /* and its values */
                            for (int c = 0; c < 4; c++) __builtin_prefetch(value + BLOCK * v_row + c * LANES, 0, 2);
                        vec v0 = LOAD_KV(value), v1 = LOAD_KV(value + LANES), v2 = LOAD_KV(value + 2 * LANES),
                            v3 = LOAD_KV(value + 3 * LANES);
                        IN_REGISTERS(v0, v1, v2, v3);
                        for (int g = 0; g < 4; g++) {
                            vec w = splat(p[g][j]);
                            o[g][0] = fmadd(w, v0, o[g][0]); o[g][1] = fmadd(w, v1, o[g][1]);
                            o[g][2] = fmadd(w, v2, o[g][2]); o[g][3] = fmadd(w, v3, o[g][3]);
                        }
                    }
                    for (int g = 0; g < 4 && r + g < rows; g++)
                        for (int c = 0; c < 4; c++) store_f32(acc + (long)(r + g) * HEAD_DIM + (c0 + c) * LANES, o[g][c]);
                }
            }
            continue;
        }
#endif
        /* the values, two rows at a time, VALUE_NV vectors of columns a pass */
        for (int r = 0; r < rows; r += 2) {
            int other = r + 1 < rows ? r + 1 : r;
            const float *s0 = scores + r * BLOCK, *s1 = scores + other * BLOCK;
            for (int c0 = 0; c0 < NV; c0 += VALUE_NV) {
                float *out0 = acc + (long)r * HEAD_DIM + c0 * LANES, *out1 = acc + (long)other * HEAD_DIM + c0 * LANES;
                vec o0[VALUE_NV], o1[VALUE_NV];
                for (int c = 0; c < VALUE_NV; c++) {
                    o0[c] = load_f32(out0 + c * LANES) * rescale[r];
                    o1[c] = load_f32(out1 + c * LANES) * rescale[other];
                }
                for (int j = 0; j < block; j++) {
                    const ELEMENT *value = v + (start + j) * v_row + c0 * LANES;
                    vec p0 = splat(s0[j]), p1 = splat(s1[j]);
                    for (int c = 0; c < VALUE_NV; c++) {
                        vec vc = LOAD_KV(value + c * LANES);
                        o0[c] = fmadd(p0, vc, o0[c]);
                        o1[c] = fmadd(p1, vc, o1[c]);
                    }
                }
                for (int c = 0; c < VALUE_NV; c++) store_f32(out0 + c * LANES, o0[c]);
                if (other != r) for (int c = 0; c < VALUE_NV; c++) store_f32(out1 + c * LANES, o1[c]);
            }
        }
    }
}
#undef VALUE_NV
#undef QUERY_NV
#undef QUERY_VECTOR
#undef KEY_VECTOR
#undef KEY_PRODUCT
#undef SCORE_PAIRS
#undef NV
#undef SPAN_ATTENTION
#undef LOAD_KV
#undef ELEMENT
#undef HEAD_DIM
