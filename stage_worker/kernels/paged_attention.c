/* Attention of a batch of decoding sequences straight off the paged KV pools, on CPU.
 *
 * Compiled by stage_worker/native.py for the CPU it runs on and called through ctypes, on the
 * stage's compute thread. Loaded after torch, its libgomp.so.1 is the copy torch loaded where
 * torch's wheel ships it under that name (native.py refuses the kernel where a second libgomp
 * came with it), so its team is the one torch's kernels use on that thread.
 *
 * One run of a sequence's consecutive rows per iteration (a decoding sequence's one row, a prompt's
 * rows, a token and its drafts: `attend_rows`, each row to the bit as alone; a lone run's query
 * heads in as many parts as threads, each head to the bit as in one part): its keys and values
 * are read block by block where the pools hold them (a block's rows of every kv head are
 * contiguous), never gathered into a copy. For each
 * query head: scores = q . k * scale over the sequence's own length, a softmax (max subtracted,
 * normalized by one reciprocal), and the weighted sum of the value rows. A sequence's blocks lie
 * anywhere in the pools, so while one block is read the next one's lines are asked for ahead
 * (`fetch`): between two layers' calls the weights' products have pushed the pools out of the caches.
 *
 * The pools hold float32 or bfloat16 (`bf16`); the queries, the scores, the softmax and the sums
 * are float32 either way: a bfloat16 block of keys or values is widened (exactly) into a buffer of
 * the thread's once, and read from there by each of the query heads that share a kv head.
 *
 * `layerline_rotate_and_store`, at the end, is the step before: rotary on the decode batch's
 * queries and keys and its new keys and values written to the pools, rounded as torch rounds.
 *
 * The caller (native.py) checks every shape, dtype, stride and index before the call: this code
 * trusts them. Returns 0, or 1 when a thread's buffer (scores, widened rows) could not be
 * allocated (`out` is then incomplete).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The loops left to the vectorizer (the softmax's, the widening's, the elementwise ones) in 512-bit
 * vectors where the CPU has them: gcc tunes AVX-512 CPUs for 256-bit ones by default, for the clock
 * the wider ones may cost, which the explicit 16-float vectors below pay anyway. A prompt's attention
 * (512 rows over 1500 or 4000 positions) took 0.85-0.89 of the time, a decode batch's 0.92-1.02, on
 * 2 cores of an Intel Xeon (family 6 model 106). Each row still sums in one order whatever comes with it. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8 && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

/* A function whose every product and sum is rounded apart, as torch's elementwise kernels round:
 * gcc fuses a multiply and an add into one rounding at -O3 -march=native unless told not to
 * (UNFUSED before the function; clang: CONTRACT_OFF at the top of its body). */
#if defined(__clang__)
#define UNFUSED
#define CONTRACT_OFF _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define UNFUSED __attribute__((optimize("fp-contract=off")))
#define CONTRACT_OFF
#else
#define UNFUSED
#define CONTRACT_OFF
#endif

/* e^x for x <= 0 (a score minus its row's maximum), vectorizable: 2^n p(r), r = x - n ln 2 in
 * [-ln 2 / 2, ln 2 / 2], a degree-6 polynomial (Cephes' expf), within 2 ulp of expf. The argument
 * is clamped at -87.3, where e^x is 1.2e-38, just above the smallest normal float: such a weight
 * is nothing beside the row's largest, whose is 1. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } u = { .f = p };
    u.i += (int32_t)((uint32_t)(int32_t)n << 23); /* n >= -126: the exponent stays normal */
    return u.f;
}

/* Asks for the cache lines of `bytes` from `p` ahead of their use: the next block of a sequence
 * lies anywhere in its pool, where the hardware's prefetcher cannot guess it. */
static inline void fetch(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

/* A bfloat16's float32 value: its 16 bits are the float's upper half. */
static inline float widen(uint16_t b) {
    union { uint32_t u; float f; } x = { .u = (uint32_t)b << 16 };
    return x.f;
}

/* A float32's nearest bfloat16, ties to even (NaN stays a quiet NaN), as torch rounds. */
static inline uint16_t narrow(float f) {
    union { float f; uint32_t u; } x = { .f = f };
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* Sixteen floats as one vector (GNU C's vector extension: one AVX-512 register, two AVX ones, four
 * SSE or NEON ones), loaded from any alignment by memcpy, which the compiler makes plain loads. */
typedef float lanes16 __attribute__((vector_size(64)));
typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes4 __attribute__((vector_size(16)));

static inline lanes16 load16(const float *p) {
    lanes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sum of a vector's sixteen lanes, pairwise: its halves added, their halves, then the four.
 * An `omp simd` reduction leaves this to the compiler, and gcc 12 added the lanes one by one, a
 * chain of sixteen dependent adds after every dot product: 32 sequences of 75 positions through
 * SmolLM2's 30 layers took 8.4 ms that way and 7.5 ms this way with the pools out of the caches
 * (5.5 and 4.2 in them), on 2 cores of an Intel Xeon (family 6 model 207). */
static inline float lane_sum(lanes16 v) {
    lanes8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    lo += hi;
    lanes4 a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (const char *)&lo + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* q . k over d: for d a (nonzero) multiple of 16, a running sum per lane, the lanes added pairwise
 * at the end; otherwise element by element. */
static inline lanes16 dot_lanes(const float *restrict q, const float *restrict k, int64_t d) {
    lanes16 acc = load16(q) * load16(k);
    for (int64_t i = 16; i < d; i += 16) acc += load16(q + i) * load16(k + i);
    return acc;
}

static inline float dot(const float *restrict q, const float *restrict k, int64_t d) {
    if (d >= 16 && d % 16 == 0) return lane_sum(dot_lanes(q, k, d));
    float acc = 0.f; /* in order: no vector reduction, whose order could follow the rows' alignment */
    for (int64_t i = 0; i < d; ++i) acc += q[i] * k[i];
    return acc;
}

/* o += w * v over d. */
static inline void axpy(float *restrict o, float w, const float *restrict v, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
}

/* Lanes of two vectors picked into one: lane i is lane m[i] of a, or of b from 16 on. */
typedef int32_t picks16 __attribute__((vector_size(64)));
#if defined(__clang__)
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK(a, b, ...) __builtin_shuffle(a, b, (picks16){__VA_ARGS__})
#endif

/* q . k[t * stride ..] for 16 keys t, into out[t]: each summed as `dot` sums it (`dot_lanes`, then
 * `lane_sum`'s tree: halves, quarters, then (a0 + a2) + (a1 + a3)), the sixteen trees taken a level
 * at a time across vectors instead of one vector's lanes after another's. For d a multiple of 16. */
static inline void dots16(const float *restrict q, const float *restrict k, int64_t stride, int64_t d,
                          float *restrict out) {
    lanes16 acc[16], half[8], quarter[4], pairs[2];
    for (int t = 0; t < 16; ++t) acc[t] = dot_lanes(q, k + t * stride, d);
    for (int m = 0; m < 8; ++m) /* lanes 0-7 + 8-15 of dot 2m, then of dot 2m + 1 */
        half[m] = PICK(acc[2 * m], acc[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  PICK(acc[2 * m], acc[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; ++m) /* then 0-3 + 4-7 of each: four lanes for each of dots 4m .. 4m + 3 */
        quarter[m] = PICK(half[2 * m], half[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                     PICK(half[2 * m], half[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int m = 0; m < 2; ++m) /* then a0 + a2 and a1 + a3 of each of dots 8m .. 8m + 7 */
        pairs[m] = PICK(quarter[2 * m], quarter[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                   PICK(quarter[2 * m], quarter[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const lanes16 sums = PICK(pairs[0], pairs[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                         PICK(pairs[0], pairs[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    memcpy(out, &sums, sizeof sums);
}
#undef PICK

/* `count` elements of a pool from `rows` as float32: the pool's own memory where it holds float32,
 * else widened into `wide` once, for every query head that reads them (a group of them reads each
 * kv head's row). */
static inline const float *as_float(const char *restrict rows, int64_t count, int bf16, float *restrict wide) {
    if (!bf16) return (const float *)rows;
    const uint16_t *b = (const uint16_t *)rows;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) wide[i] = widen(b[i]);
    return wide;
}

/* Kv heads g0 .. g1 - 1 of a block's `n` positions (rows of kvh heads of d elements) as float32, at
 * their places in the block: the pool's own memory where it holds float32, else those heads
 * widened into `wide`. */
static inline const float *heads_as_float(const char *restrict rows, int64_t n, int64_t kvh, int64_t d, int64_t g0,
                                          int64_t g1, int bf16, float *restrict wide) {
    if (!bf16 || (g0 == 0 && g1 == kvh)) return as_float(rows, n * kvh * d, bf16, wide);
    for (int64_t t = 0; t < n; ++t)
        as_float(rows + 2 * (t * kvh + g0) * d, (g1 - g0) * d, 1, wide + (t * kvh + g0) * d);
    return wide;
}

/* Each of the h rows of `len` scores (row j at scores + j * len) made its softmax in place: its
 * maximum subtracted, e^ of each, each times one reciprocal of their sum. */
static inline __attribute__((always_inline)) void softmax(float *restrict scores, int64_t h, int64_t len) {
    for (int64_t j = 0; j < h; ++j) {
        float *s = scores + j * len, top = -FLT_MAX, sum = 0.f;
#pragma omp simd reduction(max : top)
        for (int64_t p = 0; p < len; ++p) top = s[p] > top ? s[p] : top;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; ++p) {
            s[p] = exp_nonpositive(s[p] - top);
            sum += s[p];
        }
        const float inverse = 1.f / sum;
        for (int64_t p = 0; p < len; ++p) s[p] *= inverse;
    }
}

/* For each of `heads` (1 to 4) query heads i: o[i * d ..] += w[i * len + t] * v[t * stride ..] for
 * t < n, in that order: `axpy` n times a head, each element's sums rounded as axpy rounds them.
 * Where d is 64 the heads' sums are held in registers across the n keys, side by side (one head's
 * are a chain of dependent multiply-adds, as long as its keys). */
static inline __attribute__((always_inline)) void weigh(float *restrict o, const float *restrict w, int64_t len,
                                                        const float *restrict v, int64_t stride, int64_t n,
                                                        int64_t heads, const int64_t d) {
    if (d != 64) {
        for (int64_t i = 0; i < heads; ++i)
            for (int64_t t = 0; t < n; ++t) axpy(o + i * d, w[i * len + t], v + t * stride, d);
        return;
    }
    lanes16 a[4][4];
    for (int64_t i = 0; i < heads; ++i)
        for (int c = 0; c < 4; ++c) a[i][c] = load16(o + i * d + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
        const float *x = v + t * stride;
        const lanes16 x0 = load16(x), x1 = load16(x + 16), x2 = load16(x + 32), x3 = load16(x + 48);
        for (int64_t i = 0; i < heads; ++i) {
            const float wt = w[i * len + t];
            a[i][0] += wt * x0;
            a[i][1] += wt * x1;
            a[i][2] += wt * x2;
            a[i][3] += wt * x3;
        }
    }
    for (int64_t i = 0; i < heads; ++i)
        for (int c = 0; c < 4; ++c) memcpy(o + i * d + 16 * c, &a[i][c], sizeof a[i][c]);
}

/* `count` rows of one sequence at consecutive positions (a decoding sequence's one row, or a
 * prompt's, or a token and its drafts): row r attends over the first `first + r` positions of
 * `table`, q [count, h, d] -> out [count, h, d], in query heads `from` .. `to` - 1 (the others'
 * outputs untouched: another thread may be computing them). `scores` holds a row's h lines of
 * scores every `stride` floats (a multiple of 16, from a 64-byte line), head j's at j * its length;
 * `wide` a block's kvh * d * block. Query heads g * group .. g * group + group - 1 read kv head g,
 * and only the kv heads the query heads read are asked for ahead and widened.
 *
 * A row's arithmetic is the same whatever rows come with it: its dot products (16 keys at a time,
 * `dots16`, the rest `dot`, as far as its own length reaches into a block), its softmax over its
 * own length, its weighted sums key after key (`weigh`), its scores at the same offsets from a
 * line. So each row comes out to the bit as it would alone, and a token's attention is the same
 * in a prompt, a chunk of one, a decode step or a verify step. What the rows share is the reading:
 * each block of keys and values is read (and widened) once for all of them, not once a row. */
static inline __attribute__((always_inline)) void attend_rows(const float *restrict q, const char *restrict k_pool,
                                                              const char *restrict v_pool, const int bf16,
                                                              const int64_t *restrict table, int64_t first,
                                                              int64_t count, int64_t block, int64_t h, int64_t kvh,
                                                              const int64_t d, float scale, int64_t from, int64_t to,
                                                              float *restrict scores, int64_t stride,
                                                              float *restrict wide, float *restrict out) {
    const int64_t group = h / kvh, size = bf16 ? 2 : 4, row = kvh * d * size, last = first + count - 1;
    const int64_t g0 = from / group, g1 = (to + group - 1) / group; /* the kv heads these query heads read */
    const int64_t skip = g0 * d * size, span = (g1 - g0) * d * size; /* their part of a position's row */
    for (int64_t b = 0, p0 = 0; p0 < last; ++b, p0 += block) {
        const int64_t n = last - p0 < block ? last - p0 : block;
        const float *keys = heads_as_float(k_pool + table[b] * block * row, n, kvh, d, g0, g1, bf16, wide);
        const char *next = p0 + block < last ? k_pool + table[b + 1] * block * row : v_pool + table[0] * block * row;
        int64_t ahead = 0; /* the next block's rows asked for a few at a time, as the dot products go */
        for (int64_t r = p0 < first ? 0 : p0 - first + 1; r < count; ++r) { /* the rows that reach p0 */
            const int64_t len = first + r, reach = len - p0 < n ? len - p0 : n;
            const float *qr = q + r * h * d;
            float *sr = scores + r * stride + p0;
            for (int64_t g = g0; g < g1; ++g) {
                if (ahead < n) fetch(next + ahead++ * row + skip, span);
                const int64_t j1 = (g + 1) * group < to ? (g + 1) * group : to;
                for (int64_t j = g * group < from ? from : g * group; j < j1; ++j) {
                    float *sj = sr + j * len;
                    int64_t t = 0;
                    if (d >= 16 && d % 16 == 0)
                        for (; t + 16 <= reach; t += 16) {
                            float sums[16];
                            dots16(qr + j * d, keys + (t * kvh + g) * d, kvh * d, d, sums);
                            for (int i = 0; i < 16; ++i) sj[t + i] = sums[i] * scale;
                        }
                    for (; t < reach; ++t) sj[t] = dot(qr + j * d, keys + (t * kvh + g) * d, d) * scale;
                }
            }
        }
        for (; ahead < n; ++ahead) fetch(next + ahead * row + skip, span);
    }
    for (int64_t r = 0; r < count; ++r) {
        softmax(scores + r * stride + from * (first + r), to - from, first + r);
        memset(out + (r * h + from) * d, 0, sizeof(float) * (size_t)((to - from) * d));
    }
    for (int64_t b = 0, p0 = 0; p0 < last; ++b, p0 += block) {
        const int64_t n = last - p0 < block ? last - p0 : block;
        const float *values = heads_as_float(v_pool + table[b] * block * row, n, kvh, d, g0, g1, bf16, wide);
        const char *next = p0 + block < last ? v_pool + table[b + 1] * block * row : NULL;
        int64_t ahead = next ? 0 : n; /* the next block's rows asked for a few at a time, as the sums go */
        for (int64_t r = p0 < first ? 0 : p0 - first + 1; r < count; ++r) { /* the rows that reach p0 */
            const int64_t len = first + r, reach = len - p0 < n ? len - p0 : n;
            const float *sr = scores + r * stride + p0;
            float *orow = out + r * h * d;
            for (int64_t g = g0; g < g1; ++g) {
                if (ahead < n) fetch(next + ahead++ * row + skip, span);
                const int64_t j1 = (g + 1) * group < to ? (g + 1) * group : to;
                for (int64_t j = g * group < from ? from : g * group; j < j1; j += 4) {
                    const int64_t heads = j1 - j < 4 ? j1 - j : 4;
                    float *o = orow + j * d;
                    const float *w = sr + j * len, *v = values + g * d;
                    if (heads == 4) /* on constants: the sums stay in registers */
                        weigh(o, w, len, v, kvh * d, reach, 4, d);
                    else if (heads == 3)
                        weigh(o, w, len, v, kvh * d, reach, 3, d);
                    else if (heads == 2)
                        weigh(o, w, len, v, kvh * d, reach, 2, d);
                    else
                        weigh(o, w, len, v, kvh * d, reach, 1, d);
                }
            }
        }
        for (; ahead < n; ++ahead) fetch(next + ahead * row + skip, span);
    }
}

/* `attend_rows` on constants where it can: head sizes 64 and 128, each pool dtype (no remainder
 * loops, no dtype test per row). */
static void attend_run(const float *restrict q, const char *restrict k_pool, const char *restrict v_pool, int bf16,
                       const int64_t *restrict table, int64_t first, int64_t count, int64_t block, int64_t h,
                       int64_t kvh, int64_t d, float scale, int64_t from, int64_t to, float *restrict scores,
                       int64_t stride, float *restrict wide, float *restrict out) {
#define ATTEND(BF16, D)                                                                                               \
    attend_rows(q, k_pool, v_pool, BF16, table, first, count, block, h, kvh, D, scale, from, to, scores, stride, wide, \
                out)
    if (d == 64)
        bf16 ? ATTEND(1, 64) : ATTEND(0, 64);
    else if (d == 128)
        bf16 ? ATTEND(1, 128) : ATTEND(0, 128);
    else
        bf16 ? ATTEND(1, d) : ATTEND(0, d);
#undef ATTEND
}

/* Runs: consecutive rows of one sequence (the rows of a prompt, or a token and its drafts), each
 * one position further than the last and reading the same blocks, at most `most` to a run.
 * `starts` gets each run's first row and, after the last, n; returns how many runs. */
static int64_t find_runs(const int64_t *restrict tables, const int64_t *restrict lens, int64_t n, int64_t width,
                         int64_t block, int64_t most, int64_t *restrict starts) {
    int64_t runs = 0;
    for (int64_t s = 0; s < n;) {
        int64_t e = s + 1;
        while (e < n && e - s < most && lens[e] == lens[e - 1] + 1 &&
               memcmp(tables + e * width, tables + (e - 1) * width,
                      sizeof(int64_t) * (size_t)((lens[e - 1] + block - 1) / block)) == 0)
            ++e;
        starts[runs++] = s;
        s = e;
    }
    starts[runs] = n;
    return runs;
}

/* At most this many floats of one run's scores in a thread's buffer (1 MiB): 8 rows of SmolLM2's 9
 * heads up to 3640 positions, fewer rows past that. */
enum { RUN_SCORES = 262144, RUN_ROWS = 8 };

/* Rows s .. s + count - 1 of the call (a run), query heads `from` .. `to` - 1, into out: a
 * bfloat16 query's rows widened (exactly) into `qw` first and those heads' output rounded from `ow`
 * after, as `layerline_paged_attention` says. */
static inline void run(const void *restrict q, int q_bf16, const char *restrict k_pool, const char *restrict v_pool,
                       int bf16, const int64_t *restrict table, const int64_t *restrict lens, int64_t s, int64_t count,
                       int64_t block, int64_t h, int64_t kvh, int64_t d, float scale, int64_t from, int64_t to,
                       float *restrict scores, int64_t scored, float *restrict wide, float *restrict qw,
                       float *restrict ow, void *restrict out) {
    const int64_t at = s * h * d, size = count * h * d;
    if (!q_bf16) {
        attend_run((const float *)q + at, k_pool, v_pool, bf16, table, lens[s], count, block, h, kvh, d, scale, from,
                   to, scores, scored, wide, (float *)out + at);
        return;
    }
    attend_run(as_float((const char *)q + 2 * at, size, 1, qw), k_pool, v_pool, bf16, table, lens[s], count, block, h,
               kvh, d, scale, from, to, scores, scored, wide, ow);
    for (int64_t r = 0; r < count; ++r) {
        uint16_t *o = (uint16_t *)out + at + r * h * d;
        const float *w = ow + r * h * d;
#pragma omp simd
        for (int64_t i = from * d; i < to * d; ++i) o[i] = narrow(w[i]);
    }
}

/* q [n, h, d], bfloat16 if `q_bf16` else float32; k_pool, v_pool [slots, kvh, d], bfloat16 if
 * `bf16` else float32; tables [n, width] block ids; lens [n] (each at least 1, at most width *
 * block); out [n, h, d] in q's dtype. All contiguous. A bfloat16 query is widened (exactly) as the
 * call begins and its output rounded once at the end, as torch's conversions around it would.
 * The runs (`find_runs`) are handed out one at a time to whichever thread is free: a decode batch's
 * rows (each a run of one), whose contexts differ, and a prompt's runs, the later ones longer. A
 * thread preempted by another process then delays the rest by the run it holds, not by its share.
 * Where there are fewer runs than threads (a lone stream's row), each run's query heads are cut
 * into as many parts as threads, one part an item: a head's numbers are its own whoever computes
 * it, and a long context's keys and values are read by every thread, not one. */
int layerline_paged_attention(const void *restrict q, int q_bf16, const void *restrict k_pool,
                              const void *restrict v_pool, int bf16, const int64_t *restrict tables,
                              const int64_t *restrict lens, int64_t n, int64_t width, int64_t block, int64_t h,
                              int64_t kvh, int64_t d, float scale, int threads, void *restrict out) {
    if (n == 0) return 0;
    int64_t longest = 0;
    for (int64_t s = 0; s < n; ++s) longest = lens[s] > longest ? lens[s] : longest;
    /* Each thread's buffer, in whole 64-byte lines: the scores of a run's rows; then, for bfloat16
     * pools, a block of them widened; and for a bfloat16 query, its rows widened and their output
     * before rounding. */
    const int64_t scored = (h * longest + 15) / 16 * 16, widened = bf16 ? (block * kvh * d + 15) / 16 * 16 : 0,
                  head = (h * d + 15) / 16 * 16;
    int64_t most = RUN_SCORES / scored;
    most = most < 1 ? 1 : most > RUN_ROWS ? RUN_ROWS : most;
    int64_t lone[2], *starts = n == 1 ? lone : malloc(sizeof(int64_t) * (size_t)(n + 1)); /* a lone row's: no call */
    if (starts == NULL) return 1;
    const int64_t runs = find_runs(tables, lens, n, width, block, most, starts);
    const int64_t rows = runs == n ? 1 : most, query = q_bf16 ? 2 * rows * head : 0;
    const int64_t parts = runs >= threads ? 1 : threads < h ? threads : h; /* each run's query heads cut in parts */
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(rows * scored + widened + query));
        failed = scores == NULL;
        /* Offsets into the buffer only once it exists: arithmetic on a null pointer is undefined. */
        float *wide = failed ? NULL : scores + rows * scored, *qw = failed ? NULL : wide + widened,
              *ow = failed ? NULL : qw + rows * head;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < runs * parts; ++item) {
            const int64_t u = item / parts, part = item % parts; /* the longest row's table holds all the blocks */
            if (scores) run(q, q_bf16, k_pool, v_pool, bf16, tables + (starts[u + 1] - 1) * width, lens, starts[u],
                            starts[u + 1] - starts[u], block, h, kvh, d, scale, h * part / parts,
                            h * (part + 1) / parts, scores, scored, wide, qw, ow, out);
        }
        free(scores);
    }
    if (starts != lone) free(starts);
    return failed;
}

/* Rotary on the queries and keys of a step's rows, and the keys and values stored in the pools.
 * qkv [n, h + 2 kvh, d]; cos and the signed sin [n, d]; q_out [n, h, d]; pools [slots, kvh, d];
 * all float32, or all bfloat16 if `bf16`, contiguous. Row r's rotated keys and its values go to
 * pool row slots[r]. Each rotated element is x * cos + x' * sin, x' the element half a head away,
 * rounded as torch's elementwise kernels round: each product, then the sum, to the dtype. No
 * multiply-add is fused (UNFUSED, CONTRACT_OFF): that would round once, not three times. */
UNFUSED
void layerline_rotate_and_store(const void *restrict qkv, const void *restrict cos, const void *restrict sin,
                                const int64_t *restrict slots, int bf16, int64_t n, int64_t h, int64_t kvh,
                                int64_t d, int threads, void *restrict q_out, void *restrict k_pool,
                                void *restrict v_pool) {
    CONTRACT_OFF
    const int64_t half = d / 2, width = (h + 2 * kvh) * d;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1 && n * width >= 16384)
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < h + kvh; ++j) {
            const int64_t at = r * width + j * d; /* this head's row in qkv */
            const int64_t to = j < h ? (r * h + j) * d : (slots[r] * kvh + j - h) * d;
            if (bf16) {
                const uint16_t *x = (const uint16_t *)qkv + at, *c = (const uint16_t *)cos + r * d,
                               *s = (const uint16_t *)sin + r * d;
                uint16_t *o = (uint16_t *)(j < h ? q_out : k_pool) + to;
                for (int64_t i = 0; i < d; ++i) {
                    const float a = widen(narrow(widen(x[i]) * widen(c[i])));
                    const float b = widen(narrow(widen(x[i < half ? i + half : i - half]) * widen(s[i])));
                    o[i] = narrow(a + b);
                }
            } else {
                const float *x = (const float *)qkv + at, *c = (const float *)cos + r * d,
                            *s = (const float *)sin + r * d;
                float *o = (float *)(j < h ? q_out : k_pool) + to;
                for (int64_t i = 0; i < half; ++i) o[i] = x[i] * c[i] + x[i + half] * s[i];
                for (int64_t i = half; i < d; ++i) o[i] = x[i] * c[i] + x[i - half] * s[i];
            }
        }
        const int64_t size = bf16 ? 2 : 4;
        memcpy((char *)v_pool + slots[r] * kvh * d * size, (const char *)qkv + (r * width + (h + kvh) * d) * size,
               (size_t)(kvh * d * size));
    }
}

/* Element i of a row of float32, or of bfloat16 widened (`bf16`). */
static inline float element(const void *restrict x, int64_t i, int bf16) {
    return bf16 ? widen(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* The sum of the squares of a row of n >= 8 elements, in the order torch's CPU sum reduces a
 * contiguous row of squares (aten's SumKernel.cpp with vectors of 8: `vectorized_inner_sum`,
 * `row_sum`, `multi_row_sum`): the vectors 4 at a time into 4 accumulators, cascaded through levels
 * of 16 steps; any whole vector left into the first; the accumulators added in order; then the
 * elements past the last whole vector and the 8 lanes, one after another. Each square is rounded
 * before it is added (torch computes x.pow(2) first): no multiply-add fused, whoever inlines this. */
UNFUSED
static inline float torch_sum_of_squares(const void *restrict x, int64_t n, int bf16) {
    CONTRACT_OFF
    enum { LANES = 8, ILP = 4, LEVELS = 4 };
    const int64_t vectors = n / LANES, steps = vectors / ILP;
    int64_t ceil_log2 = 1; /* c10's CeilLog2(steps) */
    while (((int64_t)1 << ceil_log2) < steps) ++ceil_log2;
    const int64_t power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4, step = (int64_t)1 << power;
    float acc[LEVELS][ILP][LANES] = {{{0}}};
    int64_t i = 0;
    while (i < steps) {
        const int64_t end = i + step <= steps ? i + step : steps; /* a whole level's steps, else the rest */
        const int whole = i + step <= steps;
        for (; i < end; ++i)
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < LANES; ++l) {
                    const float v = element(x, (i * ILP + k) * LANES + l, bf16);
                    acc[0][k][l] += v * v;
                }
        for (int level = 1; whole && level < LEVELS; ++level) {
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < LANES; ++l) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if (i & ((step - 1) << (level * power))) break;
        }
    }
    for (int level = 1; level < LEVELS; ++level)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < LANES; ++l) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = steps * ILP; v < vectors; ++v)
        for (int l = 0; l < LANES; ++l) {
            const float e = element(x, v * LANES + l, bf16);
            acc[0][0][l] += e * e;
        }
    for (int k = 1; k < ILP; ++k)
        for (int l = 0; l < LANES; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vectors * LANES; e < n; ++e) {
        const float v = element(x, e, bf16);
        total += v * v;
    }
    for (int l = 0; l < LANES; ++l) total += acc[0][0][l];
    return total;
}

/* RMSNorm of one row x [n >= 8] by w [n] into o [n], as llama.py's `rms_norm` gives it through
 * torch: r = 1 / sqrt(sum(x^2) / n + eps) in float32, then w * (x * r), each product rounded; in
 * bfloat16 (`bf16`: x, w and o) x widened, x * r rounded to bfloat16, and w times that rounded
 * again. No multiply-add fused. */
UNFUSED
static inline void norm_row(const void *restrict x, const void *restrict w, int bf16, int64_t n, float eps,
                            void *restrict out) {
    CONTRACT_OFF
    const float scale = 1.0f / sqrtf(torch_sum_of_squares(x, n, bf16) / (float)n + eps);
    if (bf16) {
        const uint16_t *xr = (const uint16_t *)x, *wr = (const uint16_t *)w;
        uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < n; ++i) o[i] = narrow(widen(wr[i]) * widen(narrow(widen(xr[i]) * scale)));
    } else {
        const float *xr = (const float *)x, *wr = (const float *)w;
        float *o = (float *)out;
        for (int64_t i = 0; i < n; ++i) o[i] = wr[i] * (xr[i] * scale);
    }
}

/* RMSNorm of rows x [rows, n >= 8] with weight w [n] into out [rows, n] (`norm_row`). */
UNFUSED
void layerline_rms_norm(const void *restrict x, const void *restrict w, int bf16, int64_t rows, int64_t n, float eps,
                        int threads, void *restrict out) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r) norm_row((const char *)x + r * n * size, w, bf16, n, eps, (char *)out + r * n * size);
}

/* The residual's sum and its RMSNorm at once, as a layer's `x = x + y` then the next norm give them
 * through torch: sum [rows, n] = x + y as torch's add rounds it (bfloat16 widened, added in float32,
 * rounded to nearest even), then out = RMSNorm(sum) by w (`norm_row`). */
UNFUSED
void layerline_add_rms_norm(const void *restrict x, const void *restrict y, const void *restrict w, int bf16,
                            int64_t rows, int64_t n, float eps, int threads, void *restrict sum, void *restrict out) {
    CONTRACT_OFF
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * n >= 8192)
    for (int64_t r = 0; r < rows; ++r) {
        if (bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * n, *yr = (const uint16_t *)y + r * n;
            uint16_t *s = (uint16_t *)sum + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) s[i] = narrow(widen(xr[i]) + widen(yr[i]));
        } else {
            const float *xr = (const float *)x + r * n, *yr = (const float *)y + r * n;
            float *s = (float *)sum + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) s[i] = xr[i] + yr[i];
        }
        norm_row((const char *)sum + r * n * size, w, bf16, n, eps, (char *)out + r * n * size);
    }
}

/* 2^q for a float's exponent range, from its bits. */
static inline float pow2i(int32_t q) {
    union { uint32_t u; float f; } x = { .u = (uint32_t)(q + 0x7f) << 23 };
    return x.f;
}

/* e^d as torch's vectorized CPU kernels compute it for SiLU (SLEEF's expf, within 1 ulp): d = q ln 2
 * + s, a degree-6 polynomial in s with fused multiply-adds where SLEEF fuses them (`fmaf`, one
 * rounding each) and separate roundings elsewhere, then 2^q in two halves; 0 below -104, inf above 100
 * (q rounded to nearest even, as SLEEF's conversion under the default rounding mode). */
UNFUSED
static inline float sleef_expf(float d) {
    CONTRACT_OFF
    const int32_t q = (int32_t)rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = fmaf((float)q, -0.693145751953125f, d);
    s = fmaf((float)q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    union { float f; uint32_t u; } x = { .f = u * pow2i(q >> 1) * pow2i(q - (q >> 1)) };
    const uint32_t low = 0u - (uint32_t)(d < -104.0f), high = 0u - (uint32_t)(100.0f < d); /* masks, not branches: */
    x.u = (x.u & ~(low | high)) | (high & 0x7f800000u);                                      /* the loop vectorizes */
    return x.f;
}

/* SiLU of the gate times the up projection: gate_up [rows, 2 width] (each row gate | up) into
 * out [rows, width], as llama.py's `F.silu(gate) * up` gives it on the CPU: g / (1 + e^-g), then
 * the product, each rounded (in bfloat16, `bf16`, the SiLU rounded to bfloat16 before the product,
 * and the product too). */
UNFUSED
void layerline_silu_mul(const void *restrict gate_up, int bf16, int64_t rows, int64_t width, int threads,
                        void *restrict out) {
    CONTRACT_OFF
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * width >= 8192)
    for (int64_t r = 0; r < rows; ++r) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + r * 2 * width, *up = g + width;
            uint16_t *o = (uint16_t *)out + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; ++i) {
                const float x = widen(g[i]);
                o[i] = narrow(widen(narrow(x / (1.0f + sleef_expf(-x)))) * widen(up[i]));
            }
        } else {
            const float *g = (const float *)gate_up + r * 2 * width, *up = g + width;
            float *o = (float *)out + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; ++i) o[i] = g[i] / (1.0f + sleef_expf(-g[i])) * up[i];
        }
    }
}
