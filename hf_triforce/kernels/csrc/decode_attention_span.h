/* One task of decode_attention.c for head dim HEAD_DIM (defined by the includer, with SPAN_ATTENTION the function's
 * name): `rows` query rows [rows, HEAD_DIM] against keys [lo, hi); writes each row's max `m`, sum `l` and unnormalised
 * output `acc` [rows, HEAD_DIM]. `scores` holds rows * BLOCK floats. Rows go in pairs, so that each key and value
 * loaded serves two rows. */
#define NV (HEAD_DIM / LANES)

/* lane-wise sums of x[0..16) */
static inline void REDUCE(vec *x) {
    for (int i = 0; i < 8; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO8) + SHUFFLE(x[2 * i], x[2 * i + 1], HI8);
    for (int i = 0; i < 4; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO4) + SHUFFLE(x[2 * i], x[2 * i + 1], HI4);
    for (int i = 0; i < 2; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO2) + SHUFFLE(x[2 * i], x[2 * i + 1], HI2);
    x[0] = SHUFFLE(x[0], x[1], LO1) + SHUFFLE(x[0], x[1], HI1);
}

static void SPAN_ATTENTION(const float *restrict q, const float *restrict k, const float *restrict v, long k_row,
                           long v_row, int rows, int new_rows, long kv_len, float scale, long lo, long hi,
                           float *restrict m, float *restrict l, float *restrict acc, float *restrict scores) {
    float rescale[rows];
    for (int r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    memset(acc, 0, sizeof(float) * rows * HEAD_DIM);
    for (long start = lo; start < hi; start += BLOCK) {
        int block = (int)(hi - start < BLOCK ? hi - start : BLOCK);
        /* scores: two rows' partial products with 8 keys (one row's with 16), reduced lane-wise into one vector */
        for (int r = 0; r < rows; r += 2) {
            vec a[NV], b[NV], x[LANES];
            for (int c = 0; c < NV; c++) a[c] = load(q + (long)r * HEAD_DIM + c * LANES);
            if (r + 1 < rows) {
                for (int c = 0; c < NV; c++) b[c] = load(q + (long)(r + 1) * HEAD_DIM + c * LANES);
                for (int j = 0; j < block; j += LANES / 2) {
                    int count = block - j < LANES / 2 ? block - j : LANES / 2;
                    for (int i = 0; i < LANES / 2; i++) {
                        const float *key = k + (start + j + (i < count ? i : 0)) * k_row;
                        vec kc = load(key), da = a[0] * kc, db = b[0] * kc;
                        for (int c = 1; c < NV; c++) { kc = load(key + c * LANES); da += a[c] * kc; db += b[c] * kc; }
                        x[i] = da;
                        x[i + LANES / 2] = db;
                    }
                    REDUCE(x);
                    for (int i = 0; i < count; i++) {
                        scores[r * BLOCK + j + i] = x[0][i];
                        scores[(r + 1) * BLOCK + j + i] = x[0][i + LANES / 2];
                    }
                }
            } else {
                for (int j = 0; j < block; j += LANES) {
                    int count = block - j < LANES ? block - j : LANES;
                    for (int i = 0; i < LANES; i++) {
                        const float *key = k + (start + j + (i < count ? i : 0)) * k_row;
                        vec da = a[0] * load(key);
                        for (int c = 1; c < NV; c++) da += a[c] * load(key + c * LANES);
                        x[i] = da;
                    }
                    REDUCE(x);
                    if (count == LANES) store(scores + r * BLOCK + j, x[0]);
                    else for (int i = 0; i < count; i++) scores[r * BLOCK + j + i] = x[0][i];
                }
            }
        }
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
        /* the values, two rows at a time */
        for (int r = 0; r < rows; r += 2) {
            int other = r + 1 < rows ? r + 1 : r;
            float *out0 = acc + (long)r * HEAD_DIM, *out1 = acc + (long)other * HEAD_DIM;
            const float *s0 = scores + r * BLOCK, *s1 = scores + other * BLOCK;
            vec o0[NV], o1[NV];
            for (int c = 0; c < NV; c++) {
                o0[c] = load(out0 + c * LANES) * rescale[r];
                o1[c] = load(out1 + c * LANES) * rescale[other];
            }
            for (int j = 0; j < block; j++) {
                const float *value = v + (start + j) * v_row;
                float p0 = s0[j], p1 = s1[j];
                for (int c = 0; c < NV; c++) { vec vc = load(value + c * LANES); o0[c] += p0 * vc; o1[c] += p1 * vc; }
            }
            for (int c = 0; c < NV; c++) store(out0 + c * LANES, o0[c]);
            if (other != r) for (int c = 0; c < NV; c++) store(out1 + c * LANES, o1[c]);
        }
    }
}
#undef NV
