/* Each row's greedy token: the index of its largest logit, as torch.argmax answers it.
 *
 * Compiled with kernels/paged_attention.c into one library (native.py) and called through ctypes
 * from stage_worker/sampler.py on the stage's compute thread. torch's CPU `max` over a row of
 * SmolLM2's 49152 float32 logits took 80-90 us on 2 cores of an Intel Xeon (AVX-512, no AMX),
 * where reading them takes a few: a lone stream's last stage paid it every token.
 *
 * One pass over a row, of independent lanes in one vector register: each lane's largest value and
 * where it first saw it, and whether it saw a NaN. torch's answer in every case: the first of
 * equal maxima (-0 and +0 are equal), the first NaN where a row holds one, index 0 in a row of -inf
 * (tests/test_engine.py checks it against torch, and sampler.py checks this build before it trusts it).
 *
 * The caller checks every shape and address: x rows of `cols` >= 1 float32 logits, `stride`
 * floats apart; out [rows].
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16 /* one register */
#else
#define LANES 8 /* one AVX2 register (sixteen lanes there ran 8x slower: the vectors went through memory) */
#endif
typedef float floats __attribute__((vector_size(LANES * 4)));
typedef int32_t ints __attribute__((vector_size(LANES * 4)));

/* The first index of the row's maximum, or of its first NaN. Each lane keeps the largest value it
 * saw and where it first saw it (a strictly larger value replaces it); the row's is the least
 * index among the lanes holding the largest of them. */
static int64_t row_argmax(const float *x, int64_t cols) {
    const int64_t whole = cols - cols % LANES;
    floats top;
    ints at = {0}, nan = {0}, lane;
    for (int l = 0; l < LANES; ++l) top[l] = x[0], lane[l] = l;
    for (int64_t j = 0; j < whole; j += LANES) {
        floats v;
        memcpy(&v, x + j, sizeof v);
        const ints more = v > top;
        top = (floats)(((ints)v & more) | ((ints)top & ~more));
        at = ((lane + (int32_t)j) & more) | (at & ~more);
        nan |= v != v;
    }
    float best = x[0];
    int64_t first = 0;
    int any_nan = 0;
    for (int l = 0; l < LANES && whole; ++l) {
        any_nan |= nan[l] != 0;
        if (top[l] > best || (top[l] == best && at[l] < first)) best = top[l], first = at[l];
    }
    for (int64_t j = whole; j < cols; ++j) {
        any_nan |= x[j] != x[j];
        if (x[j] > best) best = x[j], first = j;
    }
    if (any_nan)
        for (int64_t j = 0; j < cols; ++j)
            if (x[j] != x[j]) return j;
    return first;
}

/* Whether this build's vectors are registers: AVX2 or AVX-512 (without, the loops ran 4x slower than torch's). */
int layerline_argmax_vectorized(void) {
#if defined(__AVX2__) || defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

void layerline_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int threads, int64_t *out) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (rows >= 4 && threads > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * stride, cols);
}
