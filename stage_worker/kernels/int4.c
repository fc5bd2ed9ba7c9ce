/* int4: y = x W^T (+ bias) (+ residual) for float32 rows x [rows, in] and a `--quantize int4`
 * layer's weight as torch's CPU int4 kernel keeps it, read where it lies (no copy of our own).
 *
 * torch 2.13's `_convert_weight_to_int4pack_for_cpu` lays [padded, in] 4-bit codes out by blocks
 * of 64 outputs, input by input: for input k, 32 bytes, byte b's low half the code of output b,
 * its high half that of output 32 + b; outputs past the last 64 (16, 32 or 48 of them) the same
 * way, byte b holding outputs 2b and 2b + 1. Each group of 32 inputs of an output has a bfloat16
 * scale s and offset z (`scales_and_zeros`, [in / 32, padded, 2]): w = (q - 8) s + z, so a
 * group's share of a sum is s * sum(x q) + (z - 8 s) * sum(x), computed so.
 *
 * Each thread takes an even share of the 64-output blocks; a code is widened to float32 once a
 * step and multiplied by up to I4_ROWS rows, 16 outputs a register, so no sums cross lanes. The
 * last block of fewer than 64 outputs goes through a scalar loop. int4_rows.py checks this code
 * against the dequantized weight's product before it trusts a build (and so a torch whose layout
 * differs: torch packs blocks of 32 under ATEN_CPU_CAPABILITY=avx2, for one). The caller checks every shape and address: in a multiple of 32, padded a multiple of
 * 16 and at least out; bias and residual [out] or [rows, out] or NULL; y [rows, out]. */
#include <stdint.h>
#include <omp.h>

/* 1 where this build multiplies int4 codes in vectors (AVX-512), 0 where it has no kernel. */
int layerline_rows_i4_vectorized(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define I4_ROWS 2 /* rows a tile takes: 8 partial sums and 8 totals of 32 registers */

static inline float bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* y[q][o] for the tile's `nx` rows (a constant where it is inlined) and the 64 outputs of the block
 * at `codes` (outputs n0 to n0 + 63), before the bias. */
static inline __attribute__((always_inline)) void i4_tile(const float *x, int64_t in, int nx, const uint8_t *codes,
                                                          const uint16_t *sz, int64_t padded, int64_t n0,
                                                          float y[I4_ROWS][64]) {
    __m512 total[I4_ROWS][4];
    for (int q = 0; q < I4_ROWS; ++q)
        for (int v = 0; v < 4; ++v) total[q][v] = _mm512_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t g = 0; g < in / 32; ++g) {
        __m512 part[I4_ROWS][4];
        for (int q = 0; q < I4_ROWS; ++q)
            for (int v = 0; v < 4; ++v) part[q][v] = _mm512_setzero_ps();
        for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(codes + k * 32));
            const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
            const __m512 w[4] = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))),
                                 _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))),
                                 _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))),
                                 _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)))};
            for (int q = 0; q < nx; ++q) {
                const __m512 xk = _mm512_set1_ps(x[q * in + k]);
                for (int v = 0; v < 4; ++v) part[q][v] = _mm512_fmadd_ps(xk, w[v], part[q][v]);
            }
        }
        float sums[I4_ROWS];
        for (int q = 0; q < nx; ++q)
            sums[q] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_loadu_ps(x + q * in + g * 32), _mm512_loadu_ps(x + q * in + g * 32 + 16)));
        for (int v = 0; v < 4; ++v) {
            /* 16 outputs' (s, z) pairs: s the low half of each 32 bits, z the high half */
            const __m512i pairs = _mm512_loadu_si512(sz + (g * padded + n0 + 16 * v) * 2);
            const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
            const __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z); /* z - 8 s: the weight of code 0 */
            for (int q = 0; q < nx; ++q)
                total[q][v] = _mm512_fmadd_ps(c, _mm512_set1_ps(sums[q]), _mm512_fmadd_ps(part[q][v], s, total[q][v]));
        }
    }
    for (int q = 0; q < nx; ++q)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(y[q] + 16 * v, total[q][v]);
}

/* The outputs of the last block (fewer than 64: byte b of an input's holds outputs 2b and 2b + 1). */
static void i4_rest(const float *x, const uint8_t *codes, const uint16_t *sz, int64_t rows, int64_t in,
                    int64_t padded, int64_t n0, int64_t out, float *y) {
    const int64_t width = padded - n0;
    for (int64_t q = 0; q < rows; ++q)
        for (int64_t o = n0; o < out; ++o) {
            const int64_t b = (o - n0) / 2, shift = 4 * ((o - n0) % 2);
            float s = 0;
            for (int64_t g = 0; g < in / 32; ++g) {
                const float scale = bf16(sz[(g * padded + o) * 2]), c = bf16(sz[(g * padded + o) * 2 + 1]) - 8 * scale;
                float part = 0, sum = 0;
                for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
                    part += x[q * in + k] * (float)((codes[k * (width / 2) + b] >> shift) & 15);
                    sum += x[q * in + k];
                }
                s += part * scale + c * sum;
            }
            y[q * out + o] = s;
        }
}

void layerline_rows_i4(const float *restrict x, const uint8_t *restrict w, const uint16_t *restrict sz,
                       const float *restrict bias, const float *restrict residual, int64_t rows, int64_t in,
                       int64_t out, int64_t padded, int threads, float *restrict y) {
    const int64_t blocks = padded / 64;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        for (int64_t block = blocks * t / n; block < blocks * (t + 1) / n; ++block) {
            const int64_t n0 = block * 64, outs = out - n0 < 64 ? out - n0 : 64;
            const uint8_t *codes = w + n0 * in / 2;
            for (int64_t q0 = 0; q0 < rows; q0 += I4_ROWS) {
                const int nx = rows - q0 < I4_ROWS ? (int)(rows - q0) : I4_ROWS;
                float sums[I4_ROWS][64];
                if (nx == 1)
                    i4_tile(x + q0 * in, in, 1, codes, sz, padded, n0, sums);
                else
                    i4_tile(x + q0 * in, in, I4_ROWS, codes, sz, padded, n0, sums);
                for (int q = 0; q < nx; ++q)
                    for (int64_t o = 0; o < outs; ++o) {
                        const int64_t at = (q0 + q) * out + n0 + o;
                        const float s = sums[q][o] + (bias ? bias[n0 + o] : 0.0f);
                        y[at] = residual ? residual[at] + s : s;
                    }
            }
        }
        if (t == n - 1 && blocks * 64 < out) { /* the outputs past the last 64, on the last thread */
            i4_rest(x, w + blocks * 64 * in / 2, sz, rows, in, padded, blocks * 64, out, y);
            for (int64_t q = 0; q < rows; ++q)
                for (int64_t o = blocks * 64; o < out; ++o) {
                    const int64_t at = q * out + o;
                    y[at] += (bias ? bias[o] : 0.0f) + (residual ? residual[at] : 0.0f);
                }
        }
    }
}
#else
void layerline_rows_i4(const float *x, const uint8_t *w, const uint16_t *sz, const float *bias, const float *residual,
                       int64_t rows, int64_t in, int64_t out, int64_t padded, int threads, float *y) {
    (void)x, (void)w, (void)sz, (void)bias, (void)residual, (void)rows, (void)in, (void)out, (void)padded;
    (void)threads, (void)y; /* never called: layerline_rows_i4_vectorized says so */
}
#endif
