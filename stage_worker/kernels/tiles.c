/* bfloat16 matrix products on Intel AMX tiles: y = x W^T + b for a linear layer's weight W [n, k].
 *
 * Compiled with kernels/paged_attention.c into one library (native.py) and called through ctypes
 * from stage_worker/tiles.py, on the stage's compute thread and the OpenMP team torch's kernels use.
 * Where the compiler targets no AMX (no `-march=native` on such a CPU, or another CPU),
 * `layerline_tiles_ready` says 0 and nothing calls the product.
 *
 * A tile is 16 rows of 64 bytes. The weight is laid out once, at load (tiles.py), as its blocks of
 * 16 output columns by 32 inputs, [n / 16][k / 32][16][16][2]: the block's 16 pairs of inputs, each
 * row the 16 columns' two weights of a pair, which is how the bfloat16 dot-product instruction
 * (TDPBF16PS) takes its second operand; each block is 1 KiB, and a column block's k / 32 blocks
 * follow one another, so that a thread streams its share of the weight straight through memory.
 * The rows of x are read 32 at a time as two tiles of 16 rows (any row count; the last chunk
 * shorter). Each thread takes whole pairs of column blocks: for each chunk of rows, four tiles of
 * float32 sums (2 row halves x 2 column blocks), every input block multiplied in order, then each
 * sum plus the bias (bfloat16, widened) rounded to bfloat16, nearest even.
 *
 * Those are the instructions and the order oneDNN's packed bfloat16 products take up to 32 rows:
 * tiles.py checks the results are theirs to the bit before it trusts this code.
 *
 * The caller checks every shape, dtype and layout: n a multiple of 32, k of 32, everything
 * contiguous. Returns 0, or 1 where this build has no AMX code.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for an extended state component */
#define XFEATURE_XTILEDATA 18      /* the tiles' data */

/* 1 where the process may use the tiles (Linux grants them on request, once per process). */
int layerline_tiles_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* The 64 bytes LDTILECFG reads: palette 1, and each tile's bytes per row and rows. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Tiles 0-3 the sums (row half r, column block c: tile 2 r + c), 4-5 the row halves of x, 6-7 the
 * weight's two column blocks, for a chunk of `rows` rows (1 .. 32). */
static void configure(int rows) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const uint8_t first = rows < 16 ? (uint8_t)rows : 16, second = rows > 16 ? (uint8_t)(rows - 16) : 1;
    for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = first;
    config.rows[2] = config.rows[3] = config.rows[5] = second;
    config.rows[6] = config.rows[7] = 16;
    __asm__ volatile("" : : "m"(config) : "memory"); /* all 64 bytes stored before LDTILECFG reads them */
    _tile_loadconfig(&config);
}

/* `rows` rows of 16 float32 sums (a tile stored to `sums`) plus the bias's 16 (or none), rounded to
 * bfloat16 into y, rows `stride` elements apart. */
static inline void round_out(const float *restrict sums, const uint16_t *restrict bias, int rows,
                             uint16_t *restrict y, int64_t stride) {
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)bias)), 16));
    for (int r = 0; r < rows; ++r) {
        __m512 v = _mm512_load_ps(sums + 16 * r);
        if (bias) v = _mm512_add_ps(v, b);
        _mm256_storeu_si256((void *)(y + r * stride), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* x [m, k], tiles (the layout above) of W [n, k], bias [n] or NULL, y [m, n]: all bfloat16. */
int layerline_tile_linear(const void *restrict x, const void *restrict tiles, const void *restrict bias, int64_t m,
                          int64_t n, int64_t k, int threads, void *restrict y) {
    const int64_t pairs = n / 32, blocks = k / 32, chunks = (m + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
        float sums[16 * 16] __attribute__((aligned(64)));
        int64_t configured = 0; /* the rows the tiles are configured for (0: not yet, on this thread) */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; ++p) {
            const uint16_t *w0 = (const uint16_t *)tiles + 2 * p * blocks * 512, *w1 = w0 + blocks * 512;
            const uint16_t *b = bias ? (const uint16_t *)bias + 32 * p : NULL;
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t rows = m - 32 * c < 32 ? m - 32 * c : 32;
                const int first = rows < 16 ? (int)rows : 16, second = (int)(rows - first);
                if (configured != rows) configure((int)rows);
                configured = rows;
                const uint16_t *a = (const uint16_t *)x + 32 * c * k;
                _tile_zero(0);
                _tile_zero(1);
                if (second) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int64_t i = 0; i < blocks; ++i) {
                    _tile_loadd(6, w0 + i * 512, 64);
                    _tile_loadd(7, w1 + i * 512, 64);
                    _tile_loadd(4, a + i * 32, k * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (second) {
                        _tile_loadd(5, a + 16 * k + i * 32, k * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                uint16_t *o = (uint16_t *)y + 32 * c * n + 32 * p;
                _tile_stored(0, sums, 64);
                round_out(sums, b, first, o, n);
                _tile_stored(1, sums, 64);
                round_out(sums, b ? b + 16 : NULL, first, o + 16, n);
                if (second) {
                    _tile_stored(2, sums, 64);
                    round_out(sums, b, second, o + 16 * n, n);
                    _tile_stored(3, sums, 64);
                    round_out(sums, b ? b + 16 : NULL, second, o + 16 * n + 16, n);
                }
            }
        }
        if (configured) _tile_release();
    }
    return 0;
}

#else

int layerline_tiles_ready(void) { return 0; }

int layerline_tile_linear(const void *restrict x, const void *restrict tiles, const void *restrict bias, int64_t m,
                          int64_t n, int64_t k, int threads, void *restrict y) {
    (void)x, (void)tiles, (void)bias, (void)m, (void)n, (void)k, (void)threads, (void)y;
    return 1;
}

#endif
