/* Products of a single row (float32, bfloat16) or a few (int8 codes): y = x W^T + b (+ a residual),
 * streaming W from memory once.
 *
 * Compiled with kernels/paged_attention.c into one library (native.py) and called through ctypes
 * from stage_worker/row_kernel.py, on the stage's compute thread and the OpenMP team torch's
 * kernels use. A lone stream's decode step multiplies every weight of the model by one row, so
 * its products are bound by how fast the cores read the weights; this code reads each weight
 * straight through, in the order it lies in memory, and does nothing else on the way.
 *
 * Two layouts of W, as the stage keeps its weights (layouts.py):
 *  - columns: W^T's element (i, j) at w[(j / block) * block_stride + i * row_stride + j % block],
 *    which covers a [in, out] matrix (one block), its column blocks viewed as [blocks, in, block],
 *    and the LM head's contiguous column blocks. Each thread takes an even share of the output's
 *    16-column vectors and, block by block, streams the rows of its columns eight at a time,
 *    summing into its share of y (kept in the first-level cache), then adds the bias and residual.
 *  - rows: W [out, in], row j the weights of output j. Each thread takes an even share of the
 *    outputs, four at a time, each a dot product of a row with x.
 *
 * The sums' order is this code's own, not MKL's: the results agree with torch's to rounding
 * (row_kernel.py checks that before it trusts this build). The vectors are gcc's vector
 * extensions, 16 floats: one AVX-512 register, or two AVX2 ones, as `-march=native` allows.
 *
 * The caller checks every shape and address: for columns, block a multiple of 16 dividing out;
 * bias and residual [out] or NULL; y [out], not overlapping any input (int8: x, residual and y
 * [rows, out] row by row; scales [out]).
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* 16 floats, loads at any address */

/* 1 where this build's vectors are wide (AVX2 or AVX-512: `-march=native` on such a CPU), 0 where
 * they fell back to SSE2's four floats, which stream a weight slower than MKL's generic code. */
int layerline_rows_vectorized(void) {
#if defined(__AVX2__) || defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

static inline v16 splat(float a) {
    v16 v = {0};
    return v + a;
}

/* y[lo, hi) += the rows of block columns [lo, hi) (width a multiple of 16) times x. */
static void stream_columns(const float *restrict x, const float *restrict w, int64_t in, int64_t row_stride,
                           int64_t width, float *restrict y) {
    for (int64_t k = 0; k < width; k += 16) *(v16 *)(y + k) = (v16){0};
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) {
        const float *r = w + i * row_stride;
        const v16 x0 = splat(x[i]), x1 = splat(x[i + 1]), x2 = splat(x[i + 2]), x3 = splat(x[i + 3]);
        const v16 x4 = splat(x[i + 4]), x5 = splat(x[i + 5]), x6 = splat(x[i + 6]), x7 = splat(x[i + 7]);
        const int64_t s = row_stride;
        for (int64_t k = 0; k < width; k += 16) {
            const float *c = r + k;
            *(v16 *)(y + k) += x0 * *(const v16 *)c + x1 * *(const v16 *)(c + s) + x2 * *(const v16 *)(c + 2 * s) +
                               x3 * *(const v16 *)(c + 3 * s) + x4 * *(const v16 *)(c + 4 * s) +
                               x5 * *(const v16 *)(c + 5 * s) + x6 * *(const v16 *)(c + 6 * s) +
                               x7 * *(const v16 *)(c + 7 * s);
        }
    }
    for (; i < in; ++i) {
        const float *r = w + i * row_stride;
        const v16 xi = splat(x[i]);
        for (int64_t k = 0; k < width; k += 16) *(v16 *)(y + k) += xi * *(const v16 *)(r + k);
    }
}

/* y = x W^T (+ bias) (+ residual), W in the columns layout above; x [in], y [out]. */
void layerline_row_columns(const float *restrict x, const float *restrict w, const float *restrict bias,
                           const float *restrict residual, int64_t in, int64_t out, int64_t block,
                           int64_t block_stride, int64_t row_stride, int threads, float *restrict y) {
    const int64_t vectors = out / 16;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t first = vectors * t / n * 16, last = vectors * (t + 1) / n * 16;
        for (int64_t j = first; j < last;) {
            const int64_t b = j / block, end = (b + 1) * block < last ? (b + 1) * block : last;
            stream_columns(x, w + b * block_stride + j % block, in, row_stride, end - j, y + j);
            j = end;
        }
        for (int64_t j = first; j < last; ++j) {
            if (bias) y[j] += bias[j];
            if (residual) y[j] += residual[j];
        }
    }
}

/* The sum of a vector's 16 floats. */
static inline float total(v16 a) {
    float s = 0;
    for (int k = 0; k < 16; ++k) s += a[k];
    return s;
}

/* The outputs [*first, *last) the calling OpenMP thread takes: an even share of the groups of 4. */
static inline void group_share(int64_t out, int64_t *first, int64_t *last) {
    const int64_t groups = (out + 3) / 4, t = omp_get_thread_num(), n = omp_get_num_threads();
    *first = groups * t / n * 4;
    *last = groups * (t + 1) / n * 4 < out ? groups * (t + 1) / n * 4 : out;
}

/* y = x W^T (+ bias) (+ residual), W [out, in] row by row; x [in], y [out]. */
void layerline_row_rows(const float *restrict x, const float *restrict w, const float *restrict bias,
                        const float *restrict residual, int64_t in, int64_t out, int threads, float *restrict y) {
    const int64_t whole = in / 16 * 16;
#pragma omp parallel num_threads(threads)
    {
        int64_t first, last;
        group_share(out, &first, &last);
        for (int64_t j = first; j < last; j += 4) {
            const int rows = last - j < 4 ? (int)(last - j) : 4;
            v16 a[4] = {{0}};
            for (int64_t i = 0; i < whole; i += 16) {
                const v16 xv = *(const v16 *)(x + i);
                for (int r = 0; r < rows; ++r) a[r] += xv * *(const v16 *)(w + (j + r) * in + i);
            }
            for (int r = 0; r < rows; ++r) {
                float s = total(a[r]);
                for (int64_t i = whole; i < in; ++i) s += x[i] * w[(j + r) * in + i];
                if (bias) s += bias[j + r];
                if (residual) s += residual[j + r];
                y[j + r] = s;
            }
        }
    }
}

/* int8 (`--quantize int8`): Y = (X W^T) * scales (+ bias) (+ residual) for X [rows, in] float32, W
 * [out, in] int8 codes row by row, scales [out] bfloat16 (a scale per output), bias [out], residual
 * and Y [rows, out] float32: the weight quantize.Int8Linear multiplies by, W * scales[:, None], in
 * float32. Each thread takes an even share of the outputs, four at a time; each code is widened to
 * a float in the register it is read into (exact: |code| <= 128) and multiplied by up to XB rows of
 * X at once (a tile of 4 outputs x XB rows in registers), so that a code is read from memory once
 * a step and widened once per XB rows; the group's codes stay in the first-level cache for the
 * next XB rows. A row's sum is then scaled once. A token reads a byte a weight, a quarter of
 * float32's; as for bfloat16 below, each step of 16 inputs asks for the next line of the group's
 * codes this far ahead, in address order. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define I8_PREFETCH_BYTES 4096

#if defined(__AVX512F__)
#define I8_VECTORS 1
#define XB 4 /* rows of X a tile takes: 16 accumulators of 32 registers */
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(acc_t v) { return _mm512_reduce_add_ps(v); }
static inline acc_t widen16(const int8_t *c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
}
static inline acc_t fma16(const float *x, acc_t w, acc_t a) { return _mm512_fmadd_ps(_mm512_loadu_ps(x), w, a); }
#elif defined(__AVX2__) && defined(__FMA__)
#define I8_VECTORS 1
#define XB 1 /* 16 registers: 4 accumulators of two halves, a widened code's two, x's two */
typedef struct { __m256 lo, hi; } acc_t;
static inline acc_t acc_zero(void) { return (acc_t){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline float acc_sum(acc_t v) {
    const __m256 s = _mm256_add_ps(v.lo, v.hi);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline acc_t widen16(const int8_t *c) {
    const __m128i v = _mm_loadu_si128((const __m128i *)c);
    return (acc_t){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)))};
}
static inline acc_t fma16(const float *x, acc_t w, acc_t a) {
    return (acc_t){_mm256_fmadd_ps(_mm256_loadu_ps(x), w.lo, a.lo), _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w.hi, a.hi)};
}
#else
#define XB 1 /* no vectors: the scalar loop takes every input */
#endif

/* 1 where this build multiplies int8 codes in vectors (AVX-512, or AVX2 with FMA), 0 where only the
 * scalar loop below is compiled in. */
int layerline_rows_i8_vectorized(void) {
#ifdef I8_VECTORS
    return 1;
#else
    return 0;
#endif
}

#ifdef I8_VECTORS
/* sums[q][k] = the vectorized part of X row q times W row k, for the `nx` rows of X from x (a
 * constant where it is inlined: the tile's loops unrolled). Each code is widened once a step and
 * multiplied by every row of the tile before the next. */
static inline __attribute__((always_inline)) void i8_tile(const float *x, int64_t in, int64_t whole, int nx,
                                                          const int8_t *const r[4], const char *ahead,
                                                          float sums[XB][4]) {
    acc_t a[XB][4];
    for (int q = 0; q < XB; ++q)
        for (int k = 0; k < 4; ++k) a[q][k] = acc_zero();
    for (int64_t i = 0; i < whole; i += 16) {
        if (ahead) _mm_prefetch(ahead + 4 * i, _MM_HINT_T0); /* 4 rows x 16 codes: a line a step */
        for (int k = 0; k < 4; ++k) {
            const acc_t w = widen16(r[k] + i);
            for (int q = 0; q < nx; ++q) a[q][k] = fma16(x + q * in + i, w, a[q][k]);
        }
    }
    for (int q = 0; q < nx; ++q)
        for (int k = 0; k < 4; ++k) sums[q][k] = acc_sum(a[q][k]);
}
#endif

void layerline_rows_i8(const float *restrict x, const int8_t *restrict w, const uint16_t *restrict scales,
                       const float *restrict bias, const float *restrict residual, int64_t rows, int64_t in,
                       int64_t out, int threads, float *restrict y) {
#ifdef I8_VECTORS
    const int64_t whole = in / 16 * 16;
#else
    const int64_t whole = 0; /* no vectors: the scalar loop below takes every input */
#endif
#pragma omp parallel num_threads(threads)
    {
        int64_t first, last;
        group_share(out, &first, &last);
        for (int64_t j = first; j < last; j += 4) {
            const int outs = last - j < 4 ? (int)(last - j) : 4;
            const int8_t *r[4];
            for (int k = 0; k < 4; ++k) r[k] = w + (j + (k < outs ? k : 0)) * in; /* a short group rereads its first row */
            for (int64_t q0 = 0; q0 < rows; q0 += XB) {
                const int nx = rows - q0 < XB ? (int)(rows - q0) : XB;
                const float *xq = x + q0 * in;
                float sums[XB][4] = {{0}};
#ifdef I8_VECTORS
                const char *ahead = q0 == 0 ? (const char *)r[0] + I8_PREFETCH_BYTES : 0; /* the group's rows lie end to end */
                switch (nx) { /* each a tile with its loops unrolled */
                case 1: i8_tile(xq, in, whole, 1, r, ahead, sums); break;
#if XB > 1
                case 2: i8_tile(xq, in, whole, 2, r, ahead, sums); break;
#endif
#if XB > 2
                case 3: i8_tile(xq, in, whole, 3, r, ahead, sums); break;
                default: i8_tile(xq, in, whole, 4, r, ahead, sums); break;
#endif
                }
#endif
                for (int q = 0; q < nx; ++q) {
                    for (int k = 0; k < outs; ++k) {
                        float s = sums[q][k];
                        for (int64_t i = whole; i < in; ++i) s += xq[q * in + i] * (float)r[k][i];
                        const union { uint32_t u; float f; } scale = {.u = (uint32_t)scales[j + k] << 16};
                        s *= scale.f;
                        if (bias) s += bias[j + k];
                        const int64_t at = (q0 + q) * out + j + k;
                        y[at] = residual ? residual[at] + s : s;
                    }
                }
            }
        }
    }
}

/* bfloat16: y = x W^T (+ bias) (+ residual) for x [in], W [out, in] row by row, all bfloat16.
 *
 * The CPU's bfloat16 dot-product instruction (VDPBF16PS, AVX512_BF16) multiplies 16 pairs of
 * inputs by 16 pairs of a row's weights and adds each pair's two products into a float32 sum:
 * a row's weights lie in input order, pairs side by side, just as it reads them. Each thread
 * takes an even share of the outputs, four rows at a time; a row's sum (float32, in this code's
 * order) plus the bias is rounded to bfloat16 as torch rounds it (to nearest, ties to even), and
 * a residual is added to that rounded value in float32 and rounded again: the two roundings of
 * torch's `(x W^T + b) + residual`. Built only where `-march=native` has that instruction;
 * `layerline_rows_bf16` says whether this build has it. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) /* BW: the masked 16-bit loads of a tail */
#include <immintrin.h>

/* How far ahead of its reads a thread asks for its share of W. A group of four rows is four short
 * streams (a row of SmolLM2's 576 inputs is 18 cache lines), which the CPU's own prefetcher does
 * not follow far enough to keep the memory busy; so each step of 32 inputs asks for the next four
 * lines of the share in address order, this far ahead (prefetches never fault, even past W's end).
 * Measured on 2 threads of an AMD EPYC Zen 4 (AVX512_BF16; a sum reads 38 GB/s), SmolLM2's shapes,
 * weights far past the caches, interleaved: qkv 20.6 -> 25.2-35.7 GB/s, o 18.3 -> 28.3-30.5,
 * gate_up 21.5 -> 32.0-36.4, down 22.5 -> 24.3-33.7; 1 KiB ahead was slower, 2-16 KiB about the same. */
#define PREFETCH_BYTES 4096

int layerline_rows_bf16(void) { return 1; }

static inline float widen(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline uint16_t narrow(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN stays quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

void layerline_row_rows_bf16(const uint16_t *restrict x, const uint16_t *restrict w, const uint16_t *restrict bias,
                             const uint16_t *restrict residual, int64_t in, int64_t out, int threads,
                             uint16_t *restrict y) {
    const int64_t whole = in / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (in - whole)) - 1); /* the inputs past the last 32 */
#pragma omp parallel num_threads(threads)
    {
        int64_t first, last;
        group_share(out, &first, &last);
        for (int64_t j = first; j < last; j += 4) {
            const int rows = last - j < 4 ? (int)(last - j) : 4;
            const uint16_t *r[4];
            for (int k = 0; k < 4; ++k) r[k] = w + (j + (k < rows ? k : 0)) * in; /* a short group rereads its first row */
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const char *ahead = (const char *)(w + j * in) + PREFETCH_BYTES; /* the group's 4 rows lie end to end */
            for (int64_t i = 0; i < whole; i += 32) {
                const char *p = ahead + 8 * i; /* 4 rows x 32 inputs x 2 bytes: 256 bytes a step */
                _mm_prefetch(p, _MM_HINT_T0);
                _mm_prefetch(p + 64, _MM_HINT_T0);
                _mm_prefetch(p + 128, _MM_HINT_T0);
                _mm_prefetch(p + 192, _MM_HINT_T0);
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
                a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_loadu_si512(r[0] + i));
                a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_loadu_si512(r[1] + i));
                a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_loadu_si512(r[2] + i));
                a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_loadu_si512(r[3] + i));
            }
            if (tail) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + whole);
                a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, r[0] + whole));
                a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, r[1] + whole));
                a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, r[2] + whole));
                a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, r[3] + whole));
            }
            const float sums[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),
                                   _mm512_reduce_add_ps(a3)};
            for (int k = 0; k < rows; ++k) {
                float s = sums[k] + (bias ? widen(bias[j + k]) : 0.0f);
                y[j + k] = residual ? narrow(widen(narrow(s)) + widen(residual[j + k])) : narrow(s);
            }
        }
    }
}
#else
int layerline_rows_bf16(void) { return 0; }

void layerline_row_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, const uint16_t *residual,
                             int64_t in, int64_t out, int threads, uint16_t *y) {
    (void)x, (void)w, (void)bias, (void)residual, (void)in, (void)out, (void)threads, (void)y; /* never called */
}
#endif
