/* Products on float32 FMAs of weights laid out in blocks of 32 outputs: Y = X W^T (+ bias) for
 * X [rows, in], Y [rows, out], all bfloat16 or all float32 (fma_blocks.py's `layout`); and int8
 * codes with a scale an output times float32 rows (`layerline_blocks_i8_linear`: head_screen.py).
 *
 * oneDNN's products of a few rows and MKL's of many left the FMAs idle half the time on 2 cores of
 * an Intel Xeon without AMX (family 6 model 207), and in bfloat16 oneDNN multiplies on the CPU's
 * bfloat16 dot product (VDPBF16PS), which there does 32 products every 2 cycles where two float32
 * FMAs do 32 a cycle. Here each weight (bfloat16: widened to float32 in its register) is multiplied
 * by up to TILE rows' inputs broadcast, on FMAs.
 *
 * The layout: block b holds outputs 32b .. 32b + 31, input by input, 32 weights an input. float32:
 * in the outputs' order (two loads). bfloat16 (64 bytes, one load): at element 2i output 32b + i,
 * at 2i + 1 output 32b + 16 + i, so the low halves of the 16 32-bit lanes, shifted up, are outputs
 * 32b + 0..15 in float32, and the high halves, the low bits cleared, outputs 32b + 16..31: two
 * instructions widen 32 weights. bfloat16 rows are widened to float32 once a call (`widened`). A
 * tile of up to TILE rows broadcasts each row's input k onto the block's 32 weights of input k:
 * 2 TILE sums in registers, 2 TILE FMAs for each input's weights. The threads claim the blocks a
 * few at a time from a count they share, and each sweeps a block once a tile of rows (from the
 * second-level cache after the first), asking for the next block it claimed meanwhile, a share in
 * each sweep (at 32 rows and more, asking only in the first left the first sweep waiting on memory:
 * float32, 30 layers, 32 rows 44 -> 36 ms), and in the first sweep for the block's own weights
 * AHEAD_BYTES ahead; a block swept once (`tile`) asks instead for the next one's first AHEAD_BYTES
 * as it ends. Claimed, not shared out evenly: a thread the system preempts (a stage's event
 * loop shares its core with the first thread) leaves the blocks it has not claimed to the others,
 * where an even share had the team wait at the region's end for all of its own. SmolLM2's 121
 * float32 products, one process, 2 cores of an Intel Xeon (family 6 model 106), 20 interleaved
 * calls, medians, ms: alone, the same (32 rows 47.8 and 49.2, a row 27.8 and 27.8); beside a
 * process busy 0.3 ms in every 2, on the first core with the threads bound, 32 rows 148.5 -> 103.2
 * and 61.4 -> 59.4, a row 37.9 -> 34.3 and 31.6 -> 30.9; unbound, 73.0 -> 63.3 and 37.3 -> 35.2.
 *
 * Each output is its own float32 sum over the inputs in order, the same at any row count (a lone
 * row's output equals its output in any batch, to the bit), plus the bias; in bfloat16 rounded
 * once (to nearest even), as oneDNN rounds its float32 sums. So they agree with oneDNN's and MKL's
 * to rounding, not to the bit (fma_blocks.py checks that at load).
 *
 * The caller checks every shape and address: out a multiple of 32, W [out / 32, in, 32], bias [out]
 * or NULL, X and Y contiguous, not overlapping.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

int layerline_blocks(void) { return 1; }

/* The first sweep of a block reads it from memory and asks for its weights this far ahead: a lone
 * bfloat16 stream on SmolLM2, 8 interleaved rounds, 2 stages 57.3 -> 62.2 tok/s, 1 stage 65.4 ->
 * 67.8 (the hardware's prefetcher alone starts each of a step's 121 products cold). */
#define AHEAD_BYTES 4096
#define TILE 12 /* rows a sweep: 24 sums, the 2 weights' vectors and a broadcast in 32 registers */
#define F32 0 /* the weights' kinds: float32, bfloat16, int8 codes with a scale an output */
#define BF16 1
#define I8 2
#define WIDENED_FLOATS (1 << 20) /* at most 4 MiB of widened bfloat16 rows at once: longer prompts in parts */
#define EVEN(v) _mm512_castsi512_ps(_mm512_slli_epi32((v), 16))
#define ODD(v) _mm512_castsi512_ps(_mm512_and_si512((v), _mm512_set1_epi32((int)0xffff0000u)))

/* 16 float32 rounded to bfloat16, to nearest even (NaN stays a quiet NaN), as rows.c's `narrow`. */
static inline __m256i narrow16(__m512 s) {
    const __m512i u = _mm512_castps_si512(s), one = _mm512_set1_epi32(1);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 bfloat16 as float32. */
static inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* Rows x (`nx` of them, float32, `in` a row) times block `wb`, plus the bias halves, into y (`out`
 * a row), the weights and y bfloat16 where `bf16` (`nx` and `bf16` constants where it is inlined).
 * `next`, if not NULL, the next block: this sweep (`phase` of `stride` sweeps of the block) asks for
 * every stride-th of its inputs' weights, from the phase-th on, into the second-level cache, so
 * reading it spreads over the block's sweeps. A block swept once (up to TILE rows) asks instead for
 * the next block's first AHEAD_BYTES as it ends, as if it followed it: SmolLM2's 121 float32
 * products of a lone row 2-4% quicker so (2 cores of an Intel Xeon, family 6 model 106; bfloat16's
 * the same either way) than asking for all of the next block's lines meanwhile. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t in, int nx, int kind, const void *wb,
                                                       const void *next, int64_t phase, int64_t stride,
                                                       __m512 low_bias, __m512 high_bias, void *y, int64_t out) {
    const int bf16 = kind == BF16;
    const int64_t width = kind == I8 ? 32 : bf16 ? 64 : 128; /* bytes of an input's 32 weights */
    __m512 a[TILE][2];
    for (int q = 0; q < TILE; ++q) a[q][0] = a[q][1] = _mm512_setzero_ps();
    int64_t ahead = next && stride > 1 ? phase : in; /* the next input of the next block to ask for */
    for (int64_t k = 0; k < in; ++k) {
        if (phase == 0) { /* the first sweep reads this block from memory: ask ahead */
            const int64_t at = k * width + AHEAD_BYTES; /* swept once: past the block's end, into the next */
            const int past = at >= in * width && stride == 1 && next;
            const char *p = past ? (const char *)next + (at - in * width) : (const char *)wb + at;
            _mm_prefetch(p, _MM_HINT_T0);
            if (kind == F32) _mm_prefetch(p + 64, _MM_HINT_T0);
        }
        if (k == ahead) {
            _mm_prefetch((const char *)next + k * width, _MM_HINT_T1);
            if (kind == F32) _mm_prefetch((const char *)next + k * width + 64, _MM_HINT_T1);
            ahead += stride;
        }
        __m512 low, high;
        if (bf16) {
            const __m512i v = _mm512_loadu_si512((const uint16_t *)wb + k * 32);
            low = EVEN(v), high = ODD(v);
        } else if (kind == I8) { /* exact: |code| <= 128 */
            const __m256i v = _mm256_loadu_si256((const __m256i *)((const int8_t *)wb + k * 32));
            low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
            high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
        } else {
            low = _mm512_loadu_ps((const float *)wb + k * 32), high = _mm512_loadu_ps((const float *)wb + k * 32 + 16);
        }
        for (int q = 0; q < nx; ++q) {
            const __m512 xq = _mm512_set1_ps(x[q * in + k]);
            a[q][0] = _mm512_fmadd_ps(xq, low, a[q][0]);
            a[q][1] = _mm512_fmadd_ps(xq, high, a[q][1]);
        }
    }
    for (int q = 0; q < nx; ++q) {
        if (kind == I8) { /* the "bias" is each output's scale: the sum scaled once */
            _mm512_storeu_ps((float *)y + q * out, _mm512_mul_ps(a[q][0], low_bias));
            _mm512_storeu_ps((float *)y + q * out + 16, _mm512_mul_ps(a[q][1], high_bias));
            continue;
        }
        const __m512 low = _mm512_add_ps(a[q][0], low_bias), high = _mm512_add_ps(a[q][1], high_bias);
        if (bf16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + q * out), narrow16(low));
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + q * out + 16), narrow16(high));
        } else {
            _mm512_storeu_ps((float *)y + q * out, low);
            _mm512_storeu_ps((float *)y + q * out + 16, high);
        }
    }
}

/* `n` bfloat16 widened into the calling thread's buffer, grown to its largest call (at most
 * WIDENED_FLOATS, or TILE rows where they are longer) and kept for the next; NULL where it cannot
 * be had. */
static float *widened(const uint16_t *x, int64_t n) {
    static __thread float *buffer;
    static __thread int64_t held;
    if (n > held) {
        free(buffer);
        held = 0;
        if (posix_memalign((void **)&buffer, 64, (size_t)n * sizeof(float))) return buffer = NULL;
        held = n;
    }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_store_ps(buffer + i, widen16(_mm256_loadu_si256((const __m256i *)(x + i))));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(buffer + i, m, widen16(_mm256_maskz_loadu_epi16(m, x + i)));
    }
    return buffer;
}

/* The blocks a thread claims at once: an eighth of an even share, at least one. */
static inline int64_t claimed_at_once(int64_t blocks, int64_t team) {
    const int64_t c = blocks / (team * 8);
    return c > 0 ? c : 1;
}

/* Rows xs [n, in] (float32) times the blocks this thread claims from `taken` (the team's count of
 * blocks handed out, 0 at the region's start), into y's rows; called in a parallel region of each
 * exported function, so that `kind` is a constant in each (one region in here would be outlined
 * with `kind` a variable). A thread claims its next blocks as it starts the last of those it holds,
 * so that it asks for the next block's weights as it computes this one. */
static inline __attribute__((always_inline)) void linear(const float *xs, const void *w, const void *bias, int64_t n,
                                                         int64_t out, int64_t in, int kind, int64_t *taken, void *y) {
    const int64_t blocks = out / 32, width = kind == I8 ? 1 : kind == BF16 ? 2 : 4; /* bytes a weight */
    const int bf16 = kind != F32; /* bfloat16 biases, and int8's scales */
    const int64_t at_once = claimed_at_once(blocks, omp_get_num_threads());
    int64_t b = __atomic_fetch_add(taken, at_once, __ATOMIC_RELAXED);
    int64_t held = b + at_once < blocks ? b + at_once : blocks; /* this thread's claim ends before it */
    while (b < blocks) {
        int64_t after = b + 1;
        if (after == held) {
            after = __atomic_fetch_add(taken, at_once, __ATOMIC_RELAXED);
            held = after + at_once < blocks ? after + at_once : blocks;
        }
        const char *wb = (const char *)w + b * in * 32 * width;
        __m512 low_bias = _mm512_setzero_ps(), high_bias = low_bias;
        if (bias && bf16) {
            const __m512i v = _mm512_loadu_si512((const uint16_t *)bias + b * 32);
            low_bias = widen16(_mm512_castsi512_si256(v)), high_bias = widen16(_mm512_extracti64x4_epi64(v, 1));
        } else if (bias) {
            low_bias = _mm512_loadu_ps((const float *)bias + b * 32);
            high_bias = _mm512_loadu_ps((const float *)bias + b * 32 + 16);
        }
        const void *next = after < blocks ? (const char *)w + after * in * 32 * width : NULL;
        const int64_t sweeps = (n + TILE - 1) / TILE;
        for (int64_t q0 = 0; q0 < n; q0 += TILE) {
            const int nx = n - q0 < TILE ? (int)(n - q0) : TILE;
            const float *xq = xs + q0 * in;
            char *yq = (char *)y + (q0 * out + b * 32) * (kind == BF16 ? 2 : 4);
#define TILE_OF(rows_) tile(xq, in, rows_, kind, wb, next, q0 / TILE, sweeps, low_bias, high_bias, yq, out)
            switch (nx) { /* each a tile with its loops unrolled */
            case 1: TILE_OF(1); break;
            case 2: TILE_OF(2); break;
            case 3: TILE_OF(3); break;
            case 4: TILE_OF(4); break;
            case 5: TILE_OF(5); break;
            case 6: TILE_OF(6); break;
            case 7: TILE_OF(7); break;
            case 8: TILE_OF(8); break;
            case 9: TILE_OF(9); break;
            case 10: TILE_OF(10); break;
            case 11: TILE_OF(11); break;
            default: TILE_OF(TILE); break;
            }
#undef TILE_OF
        }
        b = after;
    }
}

/* float32: 0 done. */
int layerline_blocks_f32_linear(const float *restrict x, const float *restrict w, const float *restrict bias,
                                int64_t rows, int64_t out, int64_t in, int threads, float *restrict y) {
    int64_t taken = 0;
#pragma omp parallel num_threads(threads)
    linear(x, w, bias, rows, out, in, F32, &taken, y);
    return 0;
}

/* int8 codes (head_screen.py's screen), float32 X and Y: Y = (X C^T) * scales, each output's sum over
 * the inputs in order scaled once; the codes laid out as float32's weights, a byte each. 0 done. */
int layerline_blocks_i8_linear(const float *restrict x, const int8_t *restrict w, const uint16_t *restrict scales,
                               int64_t rows, int64_t out, int64_t in, int threads, float *restrict y) {
    int64_t taken = 0;
#pragma omp parallel num_threads(threads)
    linear(x, w, scales, rows, out, in, I8, &taken, y);
    return 0;
}

/* bfloat16: 0 done; -1 where the buffer for X could not be had (Y untouched, or its earlier rows done). */
int layerline_blocks_bf16_linear(const uint16_t *restrict x, const uint16_t *restrict w,
                                 const uint16_t *restrict bias, int64_t rows, int64_t out, int64_t in, int threads,
                                 uint16_t *restrict y) {
    int64_t part = WIDENED_FLOATS / in / TILE * TILE; /* rows widened at once */
    if (part < TILE) part = TILE;
    for (int64_t r0 = 0; r0 < rows; r0 += part) {
        const int64_t n = rows - r0 < part ? rows - r0 : part;
        const float *xs = widened(x + r0 * in, n * in);
        if (!xs) return -1;
        int64_t taken = 0;
#pragma omp parallel num_threads(threads)
        linear(xs, w, bias, n, out, in, BF16, &taken, y + r0 * out);
    }
    return 0;
}

/* A bfloat16 as float32, and a float32 rounded to bfloat16 (to nearest even, as `narrow16`) and back. */
static inline float bf16_float(uint16_t h) {
    const union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}
static inline float bf16_rounded(float f) {
    const union { float f; uint32_t u; } v = {.f = f};
    const union { uint32_t u; float f; } r = {.u = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u};
    return r.f;
}

#define SCREEN_CANDIDATES 512 /* outputs the screen leaves at most: past them the whole product is quicker */
#define CANDIDATES_AT_ONCE 8 /* outputs left computed together */

/* The first `n` of 16 lanes (all 16 from n = 16 on). */
static inline __mmask16 lanes(int64_t n) { return n < 16 ? (__mmask16)((1u << n) - 1) : 0xffff; }

/* Output j's weight of input k, W in this file's layout: float32's element (b, k, h, i) is output
 * 32b + 16h + i's, bfloat16's (b, k, i, h). */
static inline float weight_of(const void *w, int64_t in, int bf16, int64_t j, int64_t k) {
    if (bf16) return bf16_float(((const uint16_t *)w)[j / 32 * in * 32 + k * 32 + j % 16 * 2 + j % 32 / 16]);
    return ((const float *)w)[j / 32 * in * 32 + k * 32 + j % 32];
}

/* Greedy decoding's LM head through a screen (head_screen.py): for one row x (float32, or bfloat16
 * where `bf16`, each output then rounded to it as `linear` rounds it) and W in this file's layout
 * without a bias, the first index below `valid` of the largest output y_j = x . w_j, given `screen`
 * [valid] (x times an int8 copy of W) and `bound` [valid], such that |y_j - screen_j| <= ||x||
 * bound_j before bfloat16's rounding (and an absolute slack below float32's normal numbers): only
 * the outputs whose upper bound reaches the largest lower bound can be the largest, and only they
 * are computed, as `tile` computes them (one float32 sum over the inputs in order, plus a zero
 * bias), so to the bit the whole product's. Then `screen` becomes the row `sampler.greedy` reads:
 * -inf but at the winner, its value (`StageModel.forward`'s `argmax_only`). -1, `screen` untouched,
 * for the caller to take the whole product, where x, the screen or a computed output is not finite,
 * where more than SCREEN_CANDIDATES outputs are left, where this thread flushes subnormal numbers to
 * zero (the slack assumes it does not), or where no buffer for x could be had. */
int64_t layerline_blocks_screened_argmax(const void *x, const void *w, float *screen, const float *bound,
                                         int64_t valid, int64_t in, int bf16) {
    if (_mm_getcsr() & 0x8040) return -1; /* FTZ or DAZ */
    float *xs = malloc((size_t)in * sizeof(float));
    if (!xs) return -1;
    double norm = 0.0;
    for (int64_t k = 0; k < in; ++k) {
        xs[k] = bf16 ? bf16_float(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        norm += (double)xs[k] * xs[k];
    }
    norm = sqrt(norm);
    /* Each bound is raised by bfloat16's unit roundoff (|round(y) - y| <= it |y|) where the outputs are
     * rounded to it, and by an absolute 2^-100 for what the bound leaves out below float32's normal
     * numbers (bfloat16's least subnormal 2^-133, and 2 (in + 1) 2^-149 the two products' sums can
     * lose there): a normal number, since an operand below them costs the FMAs a microcode assist
     * (a call 0.39 ms where the work is 0.02). The bounds are made in float32, 16 outputs at a time:
     * ||x|| raised by 2^-20, and each output's margin by 2^-20 of |s| + e, far more than the rounding
     * of the few operations (2^-24 each) that make them, so that each lower bound made is below the
     * true one, each upper one above. */
    const float rounding = bf16 ? 1.0f / 256 : 0.0f, slack = rounding + 0x1p-20f;
    const __m512 nf = _mm512_set1_ps((float)norm * (1.0f + 0x1p-20f)), margin = _mm512_set1_ps(slack);
    const __m512 tiny = _mm512_set1_ps(0x1p-100f);
    __m512 least = _mm512_set1_ps(-INFINITY), nan = _mm512_setzero_ps(); /* the largest lower bound */
    for (int64_t j = 0; j < valid; j += 16) {
        const __mmask16 m = lanes(valid - j);
        const __m512 s = _mm512_maskz_loadu_ps(m, screen + j);
        const __m512 e = _mm512_fmadd_ps(nf, _mm512_maskz_loadu_ps(m, bound + j), tiny);
        const __m512 low = _mm512_sub_ps(_mm512_sub_ps(s, e), _mm512_mul_ps(margin, _mm512_add_ps(_mm512_abs_ps(s), e)));
        least = _mm512_mask_max_ps(least, m, least, low);
        nan = _mm512_add_ps(nan, _mm512_sub_ps(s, s)); /* NaN from here on where one is not finite */
    }
    const float bar = _mm512_reduce_max_ps(least); /* what an output must reach to be computed */
    int ok = isfinite(norm) && isfinite(bar) && _mm512_reduce_add_ps(nan) == 0.0f;
    int64_t left[SCREEN_CANDIDATES], count = 0; /* the outputs left, in order */
    for (int64_t j0 = 0; j0 < valid && ok; j0 += 16) {
        const __mmask16 m = lanes(valid - j0);
        const __m512 s = _mm512_maskz_loadu_ps(m, screen + j0);
        const __m512 e = _mm512_fmadd_ps(nf, _mm512_maskz_loadu_ps(m, bound + j0), tiny);
        const __m512 up = _mm512_add_ps(_mm512_add_ps(s, e), _mm512_mul_ps(margin, _mm512_add_ps(_mm512_abs_ps(s), e)));
        for (unsigned here = _mm512_mask_cmp_ps_mask(m, up, _mm512_set1_ps(bar), _CMP_GE_OQ); here && ok;
             here &= here - 1) {
            ok = count < SCREEN_CANDIDATES;
            if (ok) left[count++] = j0 + __builtin_ctz(here);
        }
    }
    /* The outputs left, CANDIDATES_AT_ONCE at a time: each its own sum, as `tile` makes it, while the
     * others' weights are on their way (each a line of its own, every input, from memory: one at a
     * time, 4 of them took 0.19 ms of a lone float32 row's 26 ms step). */
    int64_t chosen = -1;
    float top = -INFINITY;
    for (int64_t c0 = 0; c0 < count && ok; c0 += CANDIDATES_AT_ONCE) {
        const int64_t n = count - c0 < CANDIDATES_AT_ONCE ? count - c0 : CANDIDATES_AT_ONCE;
        float y[CANDIDATES_AT_ONCE] = {0.0f};
        for (int64_t k = 0; k < in; ++k)
            for (int64_t c = 0; c < n; ++c) y[c] = fmaf(xs[k], weight_of(w, in, bf16, left[c0 + c], k), y[c]);
        for (int64_t c = 0; c < n && ok; ++c) {
            const float v = bf16 ? bf16_rounded(y[c] + 0.0f) : y[c] + 0.0f;
            ok = isfinite(v);
            if (chosen < 0 || v > top) chosen = left[c0 + c], top = v;
        }
    }
    free(xs);
    if (!ok || chosen < 0) return -1; /* none left (the bounds keep the best one): never write before the row */
    for (int64_t j = 0; j < valid; j += 16) { /* the screen becomes the row `sampler.greedy` reads */
        const __mmask16 m = lanes(valid - j);
        _mm512_mask_storeu_ps(screen + j, m, _mm512_set1_ps(-INFINITY));
    }
    screen[chosen] = top;
    return chosen;
}
#else
int layerline_blocks(void) { return 0; }

int layerline_blocks_f32_linear(const float *x, const float *w, const float *bias, int64_t rows, int64_t out,
                                int64_t in, int threads, float *y) {
    (void)x, (void)w, (void)bias, (void)rows, (void)out, (void)in, (void)threads, (void)y; /* never called */
    return -2;
}

int layerline_blocks_bf16_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t rows,
                                 int64_t out, int64_t in, int threads, uint16_t *y) {
    (void)x, (void)w, (void)bias, (void)rows, (void)out, (void)in, (void)threads, (void)y; /* never called */
    return -2;
}

int layerline_blocks_i8_linear(const float *x, const int8_t *w, const uint16_t *scales, int64_t rows, int64_t out,
                               int64_t in, int threads, float *y) {
    (void)x, (void)w, (void)scales, (void)rows, (void)out, (void)in, (void)threads, (void)y; /* never called */
    return -2;
}

int64_t layerline_blocks_screened_argmax(const void *x, const void *w, float *screen, const float *bound,
                                         int64_t valid, int64_t in, int bf16) {
    (void)x, (void)w, (void)screen, (void)bound, (void)valid, (void)in, (void)bf16; /* never called */
    return -2;
}
#endif
