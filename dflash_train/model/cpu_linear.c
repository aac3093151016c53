/* y[M, O] = x[M, I] @ w[O, I]^T in fp32, reading w from memory once for any M (AVX2 + FMA).
 *
 * Why: verifying a block or a tree multiplies 2-65 rows by each weight matrix. With one row the
 * product is bound by streaming the weights from memory; MKL's GEMM for 2-17 rows costs 2-3x its
 * one-row GEMV on an AVX2 CPU (measured on SmolLM2-135M: 9 rows 95 ms, 1 row 43 ms per forward), so
 * a 9-token verify cost 2x a plain decoding step. Here each weight row is loaded once and multiplied
 * into up to 12 rows of x held in registers; the weights of a tile of 32 output rows stay in L2 for
 * the next 12 rows of x. Each output is the same sum in the same order whatever M is (8 lanes over
 * i, then one horizontal sum), so a token's result does not depend on how many tokens share the call.
 *
 * stream_linear_bf16 reads weights stored as bf16 (half the bytes) and widens them to fp32 in registers,
 * exactly: a bf16 value is the top half of its fp32 bits. For weights that are bf16 values (a drafter
 * exported in bf16) its outputs are stream_linear's, bit for bit, at half the memory traffic.
 *
 * Built at first use by cpu_linear.py: cc -O3 -mavx2 -mfma -fopenmp -shared -fPIC.
 */
#include <immintrin.h>
#include <stdint.h>

#define MAX_ROWS 12  /* accumulators held in the 16 ymm registers, beside one weight and one x load */
#define TILE 32      /* output rows per tile: 32 x 1536 fp32 = 192 KB, inside one core's L2 */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* 8 weights from w (fp32, or bf16 when bf16) at element i, as fp32 */
static inline __attribute__((always_inline)) __m256 load_w(const void *w, int64_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* rows [o0, o1) of y for mb (constant after inlining) rows of x; i runs over whole vectors (I % 8 == 0) */
static inline __attribute__((always_inline)) void tile_rows(const float *x, const void *w, float *y,
                                                            int64_t I, int64_t O, int64_t o0, int64_t o1,
                                                            const int mb, const int bf16) {
    for (int64_t o = o0; o < o1; ++o) {
        const int64_t wo = o * I;
        __m256 acc[MAX_ROWS];
        for (int m = 0; m < mb; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 wv = load_w(w, wo + i, bf16);
            for (int m = 0; m < mb; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * I + i), acc[m]);
        }
        for (int m = 0; m < mb; ++m) y[m * O + o] = hsum(acc[m]);
    }
}

#define CASE(n) case n: tile_rows(x, w, y, I, O, o0, o1, n, bf16); break;
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, float *y, int64_t I,
                                                       int64_t O, int64_t o0, int64_t o1, int mb,
                                                       const int bf16) {
    switch (mb) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
    }
}

static inline __attribute__((always_inline)) void run(const float *x, const void *w, float *y, int64_t M,
                                                      int64_t I, int64_t O, int threads, const int bf16) {
    const int64_t tiles = (O + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t o0 = t * TILE, o1 = o0 + TILE < O ? o0 + TILE : O;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const int mb = M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS;
            tile(x + m0 * I, w, y + m0 * O, I, O, o0, o1, mb, bf16);
        }
    }
}

/* x, w, y contiguous; I % 8 == 0; threads > 1 splits the output tiles over OpenMP threads */
void stream_linear(const float *x, const float *w, float *y, int64_t M, int64_t I, int64_t O, int threads) {
    run(x, w, y, M, I, O, threads, 0);
}

/* the same with w [O, I] stored as bf16 (uint16 bit patterns) */
void stream_linear_bf16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t I, int64_t O,
                        int threads) {
    run(x, w, y, M, I, O, threads, 1);
}
