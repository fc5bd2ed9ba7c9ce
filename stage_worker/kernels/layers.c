/* A decode step's decoder layers in one call, where each of their products is blocks.c's: the
 * calls decode_path.py makes from Python, one layer after another, made here instead.
 *
 * Between two of a layer's nine kernel calls the step's Python checked its tensors, made the next
 * output and read its addresses: SmolLM2's lone bfloat16 row spent 2.4 ms of a 15 ms step there,
 * a 32-row float32 step 4 ms of 65 (one process, 2 cores of an Intel Xeon without AMX). Here the
 * same functions run on the same arguments in the same order, so every number is the one the
 * Python made, to the bit: RMSNorm of the input; per layer the qkv product, the rotary with the
 * keys and values stored, the attention, the o product, the residual's sum and the norm after it,
 * gate_up, SiLU of the gate times the up, down, and again the residual's sum and the next layer's
 * norm (after the last layer the stage's final norm where it holds the head, into `final_out`; else
 * the sum alone, its norm computed into scratch and unused). A lone
 * row's loop (rows.py) adds with torch and normalizes apart: the sum-and-norm call gives torch's
 * numbers to the bit (fused.py checks that before the kernels serve).
 *
 * The caller (layer_stack.py) checks every shape, dtype and address: `per_layer` holds LAYER
 * pointers a layer, in the order of the enum; the buffers are contiguous and of the step's dtype.
 */
#include <stdint.h>

int layerline_blocks_f32_linear(const float *x, const float *w, const float *bias, int64_t rows, int64_t out,
                                int64_t in, int threads, float *y);
int layerline_blocks_bf16_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t rows,
                                 int64_t out, int64_t in, int threads, uint16_t *y);
void layerline_rms_norm(const void *x, const void *w, int bf16, int64_t rows, int64_t n, float eps, int threads,
                        void *out);
void layerline_add_rms_norm(const void *x, const void *y, const void *w, int bf16, int64_t rows, int64_t n, float eps,
                            int threads, void *sum, void *out);
void layerline_rotate_and_store(const void *qkv, const void *cos, const void *sin, const int64_t *slots, int bf16,
                                int64_t n, int64_t h, int64_t kvh, int64_t d, int threads, void *q_out, void *k_pool,
                                void *v_pool);
int layerline_paged_attention(const void *q, int q_bf16, const void *k_pool, const void *v_pool, int bf16,
                              const int64_t *tables, const int64_t *lens, int64_t n, int64_t width, int64_t block,
                              int64_t h, int64_t kvh, int64_t d, float scale, int threads, void *out);
void layerline_silu_mul(const void *gate_up, int bf16, int64_t rows, int64_t width, int threads, void *out);

/* A layer's pointers in `per_layer`; a bias may be NULL. */
enum { INPUT_NORM, QKV, QKV_BIAS, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, K_POOL, V_POOL, LAYER };
/* `dims`: the step's rows and the model's widths; `step`: its rotary and where its sequences are. */
enum { ROWS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, TABLE_WIDTH, BLOCK, DIMS };
enum { COS, SIN, SLOTS, TABLES, LENS, STEP };
/* The scratch buffers, each a contiguous tensor of the step's dtype: [rows, hidden] normed, the two
 * residuals taking turns and a product's output; [rows, (h + 2 kvh) d] qkv; [rows, h d] the
 * rotated queries and the attention; [rows, 2 w] gate_up; [rows, w] its SiLU. */
enum { NORMED, RESIDUAL_A, RESIDUAL_B, PRODUCT, QKV_OUT, QUERIES, ATTENDED, GATE_UP_OUT, ACTIVATED, BUFFERS };

static int linear(int bf16, const void *x, const void *w, const void *bias, int64_t rows, int64_t out, int64_t in,
                  int threads, void *y) {
    return bf16 ? layerline_blocks_bf16_linear(x, w, bias, rows, out, in, threads, y)
                : layerline_blocks_f32_linear(x, w, bias, rows, out, in, threads, y);
}

/* x [rows, hidden] through `layers` layers into out [rows, hidden] (the residual after the last),
 * and where `final_norm` is not NULL its RMSNorm by that weight into final_out [rows, hidden]: the
 * final norm, the same call as the layers' (a lone float32 row's final norm called from Python
 * took 0.18 ms of its 26 ms step, its caches cold). Products on `product_threads`, the other
 * kernels on `threads` (as the Python binds them). 0 done; 1 the attention had no memory for its
 * scores; -1 a product had no buffer for its rows. */
int layerline_blocks_layers(int64_t layers, void *const *per_layer, const int64_t *dims, void *const *step,
                            void *const *buffers, int bf16, float eps, float scale, int product_threads,
                            int threads, const void *x, void *out, const void *final_norm, void *final_out) {
    const int64_t n = dims[ROWS], hidden = dims[HIDDEN], h = dims[HEADS], kvh = dims[KV_HEADS], d = dims[HEAD_DIM];
    const int64_t w = dims[INTERMEDIATE], qkv_width = (h + 2 * kvh) * d;
    void *normed = buffers[NORMED], *product = buffers[PRODUCT];
    const void *residual = x;
    layerline_rms_norm(x, per_layer[INPUT_NORM], bf16, n, hidden, eps, threads, normed);
    for (int64_t i = 0; i < layers; ++i) {
        void *const *p = per_layer + i * LAYER;
        /* The residual's sums go to two buffers, so that a sum never overwrites what it adds (the
         * layer's input is x or the second); the last to `out`. */
        void *after_attention = buffers[RESIDUAL_A], *after_mlp = i + 1 == layers ? out : buffers[RESIDUAL_B];
        if (linear(bf16, normed, p[QKV], p[QKV_BIAS], n, qkv_width, hidden, product_threads, buffers[QKV_OUT]))
            return -1;
        layerline_rotate_and_store(buffers[QKV_OUT], step[COS], step[SIN], step[SLOTS], bf16, n, h, kvh, d, threads,
                                   buffers[QUERIES], p[K_POOL], p[V_POOL]);
        if (layerline_paged_attention(buffers[QUERIES], bf16, p[K_POOL], p[V_POOL], bf16, step[TABLES], step[LENS], n,
                                      dims[TABLE_WIDTH], dims[BLOCK], h, kvh, d, scale, threads, buffers[ATTENDED]))
            return 1;
        if (linear(bf16, buffers[ATTENDED], p[O], p[O_BIAS], n, hidden, h * d, product_threads, product)) return -1;
        layerline_add_rms_norm(residual, product, p[POST_NORM], bf16, n, hidden, eps, threads, after_attention, normed);
        if (linear(bf16, normed, p[GATE_UP], p[GATE_UP_BIAS], n, 2 * w, hidden, product_threads, buffers[GATE_UP_OUT]))
            return -1;
        layerline_silu_mul(buffers[GATE_UP_OUT], bf16, n, w, threads, buffers[ACTIVATED]);
        if (linear(bf16, buffers[ACTIVATED], p[DOWN], p[DOWN_BIAS], n, hidden, w, product_threads, product)) return -1;
        /* The next layer's norm; after the last, the final norm, or the sum alone (its norm in scratch). */
        const int last = i + 1 == layers;
        const void *norm = !last ? per_layer[(i + 1) * LAYER + INPUT_NORM] : final_norm ? final_norm : p[POST_NORM];
        void *norm_out = last && final_norm ? final_out : normed;
        layerline_add_rms_norm(after_attention, product, norm, bf16, n, hidden, eps, threads, after_mlp, norm_out);
        residual = after_mlp;
    }
    return 0;
}
