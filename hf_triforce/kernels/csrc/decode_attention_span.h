/* One task of decode_attention.c for head dim HEAD_DIM (defined by the includer, with SPAN_ATTENTION the function's
 * name): `rows` query rows [rows, HEAD_DIM] against keys [lo, hi); writes each row's max `m`, sum `l` and unnormalised
 * output `acc` [rows, HEAD_DIM]. `scores` holds rows * BLOCK floats. */
#define NV (HEAD_DIM / LANES)
static void SPAN_ATTENTION(const float *restrict q, const float *restrict k, const float *restrict v, long k_row,
                           long v_row, int rows, int new_rows, long kv_len, float scale, long lo, long hi,
                           float *restrict m, float *restrict l, float *restrict acc, float *restrict scores) {
    for (int r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    memset(acc, 0, sizeof(float) * rows * HEAD_DIM);
    for (long start = lo; start < hi; start += BLOCK) {
        int block = (int)(hi - start < BLOCK ? hi - start : BLOCK);
        /* scores: 16 keys' partial products with a row, reduced lane-wise into one vector of 16 dot products */
        for (int r = 0; r < rows; r++) {
            vec qr[NV];
            for (int c = 0; c < NV; c++) qr[c] = load(q + (long)r * HEAD_DIM + c * LANES);
            for (int j = 0; j < block; j += LANES) {
                int count = block - j < LANES ? block - j : LANES;
                vec x[LANES];
                for (int i = 0; i < LANES; i++) {
                    const float *key = k + (start + j + (i < count ? i : 0)) * k_row;
                    vec dot = qr[0] * load(key);
                    for (int c = 1; c < NV; c++) dot += qr[c] * load(key + c * LANES);
                    x[i] = dot;
                }
                for (int i = 0; i < 8; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO8) + SHUFFLE(x[2 * i], x[2 * i + 1], HI8);
                for (int i = 0; i < 4; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO4) + SHUFFLE(x[2 * i], x[2 * i + 1], HI4);
                for (int i = 0; i < 2; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO2) + SHUFFLE(x[2 * i], x[2 * i + 1], HI2);
                x[0] = SHUFFLE(x[0], x[1], LO1) + SHUFFLE(x[0], x[1], HI1);
                if (count == LANES) store(scores + r * BLOCK + j, x[0]);
                else for (int i = 0; i < count; i++) scores[r * BLOCK + j + i] = x[0][i];
            }
        }
        /* online softmax and the values, row by row */
        for (int r = 0; r < rows; r++) {
            long visible = kv_len - new_rows + 1 + r % new_rows; /* keys [0, visible) */
            float *s = scores + r * BLOCK;
            float top = m[r];
            for (int j = 0; j < block; j++) {
                float x = start + j < visible ? s[j] * scale : -INFINITY;
                s[j] = x;
                top = x > top ? x : top;
            }
            if (top == -INFINITY) continue; /* nothing visible to this row in the block */
            float alpha = expf(m[r] - top), sum = 0.f;
            #pragma omp simd reduction(+:sum)
            for (int j = 0; j < block; j++) { float p = expf(s[j] - top); s[j] = p; sum += p; }
            l[r] = l[r] * alpha + sum;
            m[r] = top;
            float *out = acc + (long)r * HEAD_DIM;
            vec o[NV];
            for (int c = 0; c < NV; c++) o[c] = load(out + c * LANES) * alpha;
            for (int j = 0; j < block; j++) {
                const float *value = v + (start + j) * v_row;
                float p = s[j];
                for (int c = 0; c < NV; c++) o[c] += p * load(value + c * LANES);
            }
            for (int c = 0; c < NV; c++) store(out + c * LANES, o[c]);
        }
    }
}
#undef NV
