// A small GPT-2's forward over a few new rows in one C++ call, on a CPU with AVX-512 (decode/native loads it;
// decode/models/engine.py calls it through GPT2Engine.logits for a draft's forwards and an oracle's, up to the rows
// measured faster than torch's: decode/models/native_rows.py). A step's forward is a few rows through matrices of a few
// hundred columns: torch spends it starting some thirty operations a layer, each cold after the other model's forward
// (oneDNN took 73-140 us for a 20 x 128 x 384 product that is 10 us of arithmetic). Here the products, the output
// layer's too, run over weights packed once at load (a bfloat16 model's as AVX-512 BF16 dot products or, on a CPU with
// AMX, on its tiles; a float32 model's as AVX-512 fused multiply-adds), their column groups split over torch's threads;
// a row's sums are the same whatever the forward's other rows. Attention with the tree's mask runs its heads over those
// threads too; layer norm, softmax, GELU and the residuals run 16 floats at a time over the rows in place, in float32.
// The model's dtype (`T`: bf16 or float) is that of its weights, its cache and the products' inputs. Its logits differ
// from torch's in rounding only, as two kernels' do (a greedy output can leave another kernel's only at a near-tie:
// docs/exactness.md).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "rows.h"

// Every function that uses AVX-512; a float32 model's never reach a BF16 instruction
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
// And those that use AMX's tiles too: a compiler before GCC 11 or clang 12 lacks their intrinsics and builds the rest
#ifndef TILES_BUILD
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define TILES_BUILD 1
#else
#define TILES_BUILD 0
#endif
#endif
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")))

namespace {

using bf16 = uint16_t;

BF16_TARGET inline float to_float(bf16 value) {
    const uint32_t bits = static_cast<uint32_t>(value) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

inline float to_float(float value) { return value; }

// Round to nearest even, as torch's float32 -> bfloat16 conversion (the rows hold no NaN).
BF16_TARGET inline bf16 to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    return static_cast<bf16>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// exp(x) to float32 precision, 16 at a time: 2^(x log2 e) as 2^n 2^f, n the nearest integer, 2^f for |f| <= 1/2 by
// its Taylor polynomial of degree 7 (within 1e-8 relative).
BF16_TARGET inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, whole);
    __m512 p = _mm512_set1_ps(1.52527338e-05f);  // (ln 2)^k / k!, k = 7 down to 0
    for (const float c : {1.54035304e-04f, 1.33335581e-03f, 9.61812911e-03f, 5.55041087e-02f, 2.40226507e-01f,
                          6.93147181e-01f, 1.0f})
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Mask of the first min(count, 16) of 16 lanes.
inline __mmask16 first_lanes(int64_t count) { return count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1); }

// The first `count` of 16 floats stored in the model's dtype: rounded to bfloat16 (to nearest even, as torch's
// conversion; the rows hold no NaN), or as they are.
BF16_TARGET inline void store(bf16 *out, __m512 values, int64_t count = 16) {
    _mm256_mask_storeu_epi16(out, first_lanes(count), (__m256i)_mm512_cvtneps_pbh(values));
}

BF16_TARGET inline void store(float *out, __m512 values, int64_t count = 16) {
    _mm512_mask_storeu_ps(out, first_lanes(count), values);
}

// One linear layer, packed in blocks of 16 output columns, 64 bytes for each step along the input: bfloat16, for
// every pair of input rows (2k, 2k+1) the 16 columns' two weights side by side (_mm512_dpbf16_ps's operand); float32,
// for every input row the 16 columns' weights (decode/native's pack_for_products). The last block and the bias are
// padded with zeros to 16 columns where `out` is not a multiple of 16 (an output layer).
template <typename T>
struct Linear {
    const T *packed;
    const float *bias;
    int64_t in, out;
};

// Input rows a step along the input covers: a pair in bfloat16, one in float32.
template <typename T>
constexpr int64_t ROWS_A_STEP = std::is_same_v<T, bf16> ? 2 : 1;

// y (R rows x B blocks of 16 columns from block b0) = x @ W + bias, all in registers: each step's B weights are
// loaded once for the R rows. The last block's columns past `out` (an output layer's) are not stored.
template <typename T, int R, int B>
BF16_TARGET void tile(const T *x, const Linear<T> &w, float *y, int64_t r0, int64_t b0) {
    constexpr int64_t per_step = ROWS_A_STEP<T>, width = 16 * per_step;  // elements a step of a block
    const int64_t steps = w.in / per_step;
    const T *weights[B];
    __m512 acc[R][B];
    for (int j = 0; j < B; j++) {
        weights[j] = w.packed + (b0 + j) * steps * width;
        const __m512 bias = _mm512_loadu_ps(w.bias + (b0 + j) * 16);
        for (int r = 0; r < R; r++) acc[r][j] = bias;
    }
    for (int64_t k = 0; k < steps; k++) {
        __m512i step[B];
        for (int j = 0; j < B; j++) step[j] = _mm512_loadu_si512(weights[j] + k * width);
        for (int r = 0; r < R; r++) {
            const T *input = x + (r0 + r) * w.in + k * per_step;
            if constexpr (std::is_same_v<T, bf16>) {
                int32_t pair;
                std::memcpy(&pair, input, sizeof pair);
                const __m512bh inputs = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < B; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], inputs, (__m512bh)step[j]);
            } else {
                const __m512 inputs = _mm512_set1_ps(*input);
                for (int j = 0; j < B; j++) acc[r][j] = _mm512_fmadd_ps(inputs, _mm512_castsi512_ps(step[j]), acc[r][j]);
            }
        }
    }
    for (int j = 0; j < B; j++) {
        const int64_t column = (b0 + j) * 16;
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (r0 + r) * w.out + column, first_lanes(w.out - column), acc[r][j]);
    }
}

template <typename T>
using Tile = void (*)(const T *, const Linear<T> &, float *, int64_t, int64_t);
// TILES<T>[R - 1][B - 1]: a tile of R rows (4 but for the last rows) and B blocks (4 but for the last columns)
template <typename T>
constexpr Tile<T> TILES[4][4] = {{tile<T, 1, 1>, tile<T, 1, 2>, tile<T, 1, 3>, tile<T, 1, 4>},
                                 {tile<T, 2, 1>, tile<T, 2, 2>, tile<T, 2, 3>, tile<T, 2, 4>},
                                 {tile<T, 3, 1>, tile<T, 3, 2>, tile<T, 3, 3>, tile<T, 3, 4>},
                                 {tile<T, 4, 1>, tile<T, 4, 2>, tile<T, 4, 3>, tile<T, 4, 4>}};

// y (rows x out, float32) = x (rows x in) @ W + bias over the 64 output columns from block b0, 4 rows at a time
// over weights that stay in cache.
template <typename T>
void product_columns(const T *x, const Linear<T> &w, float *y, int64_t rows, int64_t b0) {
    const int64_t blocks = std::min<int64_t>(4, (w.out + 15) / 16 - b0);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) TILES<T>[std::min<int64_t>(4, rows - r0) - 1][blocks - 1](x, w, y, r0, b0);
}

// Multiply-adds past which a product's column groups are split among torch's threads: waking them costs a few
// microseconds, a product of this size some tens.
constexpr int64_t PARALLEL_WORK = 1 << 18;

#if TILES_BUILD
// The same products on AMX's tile unit (TDPBF16PS), for a bfloat16 model on a CPU that has it: the packed weights
// of a block of 16 columns are, 16 steps at a time, the tile B the instruction reads (16 rows of 16 column pairs),
// the input's rows 32 elements at a time the tile A (up to 16 rows), each block's sums a tile C of 16 float32
// columns. Tiles 0-3 hold the sums of 4 blocks, tile 4 the input, tiles 5 and 6 weights in turn.
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_a_row[16];
    uint8_t rows[16];
};

// Sets this thread's tiles for `rows` input rows (the sums' and the input's tiles) and 16 weight steps.
AMX_TARGET void configure_tiles(int64_t rows) {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 7; t++) {
        config.bytes_a_row[t] = 64;
        config.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 16);
    }
    _tile_loadconfig(&config);
}

// y (rows x out) = x @ W + bias over B blocks of 16 columns from block b0, 16 rows at a time (the tiles configured
// for `configured` rows; set again for fewer).
template <int B>
AMX_TARGET void tiled_columns(const bf16 *x, const Linear<bf16> &w, float *y, int64_t rows, int64_t b0,
                              int64_t &configured) {
    const int64_t steps = w.in / 2;
    const bf16 *weights = w.packed + b0 * steps * 32;
    alignas(64) float sums[B][16 * 16];
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t m = std::min<int64_t>(16, rows - r0);
        if (m != configured) configure_tiles(configured = m);
        _tile_zero(0);
        if constexpr (B > 1) _tile_zero(1);
        if constexpr (B > 2) _tile_zero(2);
        if constexpr (B > 3) _tile_zero(3);
        for (int64_t k = 0; k < w.in; k += 32) {
            _tile_loadd(4, x + r0 * w.in + k, w.in * sizeof(bf16));
            _tile_loadd(5, weights + k * 16, 64);
            _tile_dpbf16ps(0, 4, 5);
            if constexpr (B > 1) {
                _tile_loadd(6, weights + steps * 32 + k * 16, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if constexpr (B > 2) {
                _tile_loadd(5, weights + 2 * steps * 32 + k * 16, 64);
                _tile_dpbf16ps(2, 4, 5);
            }
            if constexpr (B > 3) {
                _tile_loadd(6, weights + 3 * steps * 32 + k * 16, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        _tile_stored(0, sums[0], 64);
        if constexpr (B > 1) _tile_stored(1, sums[1], 64);
        if constexpr (B > 2) _tile_stored(2, sums[2], 64);
        if constexpr (B > 3) _tile_stored(3, sums[3], 64);
        for (int j = 0; j < B; j++) {
            const int64_t column = (b0 + j) * 16;
            const __m512 bias = _mm512_loadu_ps(w.bias + column);
            for (int64_t r = 0; r < m; r++)
                _mm512_mask_storeu_ps(y + (r0 + r) * w.out + column, first_lanes(w.out - column),
                                      _mm512_add_ps(_mm512_load_ps(sums[j] + 16 * r), bias));
        }
    }
}

AMX_TARGET void release_tiles() { _tile_release(); }

using TiledColumns = void (*)(const bf16 *, const Linear<bf16> &, float *, int64_t, int64_t, int64_t &);
constexpr TiledColumns TILED[4] = {tiled_columns<1>, tiled_columns<2>, tiled_columns<3>, tiled_columns<4>};
#endif

// Whether this process may use AMX's tiles: the CPU has them and Linux granted their state (asked once).
bool tiles_granted() {
#if TILES_BUILD
    static const bool granted = [] {
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
        constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return granted;
#else
    return false;
#endif
}

// y (rows x out, float32) = x (rows x in) @ W + bias; on AMX's tiles with `tiles` (a bfloat16 model, `in` a multiple
// of 32, tiles_granted()).
template <typename T>
void product(const T *x, const Linear<T> &w, float *y, int64_t rows, bool tiles) {
    const int64_t groups = (w.out + 63) / 64;
    const int64_t grain = rows * w.in * w.out >= PARALLEL_WORK ? 1 : groups;  // a chunk this big runs in this thread
    at::parallel_for(0, groups, grain, [&](int64_t first, int64_t last) {
#if TILES_BUILD
        if constexpr (std::is_same_v<T, bf16>) {
            if (tiles) {
                int64_t configured = 0;
                for (int64_t g = first; g < last; g++)
                    TILED[std::min<int64_t>(4, (w.out + 15) / 16 - 4 * g) - 1](x, w, y, rows, 4 * g, configured);
                release_tiles();
                return;
            }
        }
#endif
        for (int64_t g = first; g < last; g++) product_columns(x, w, y, rows, 4 * g);
    });
}

// Layer norm of each row of x (rows x n, n a multiple of 16) into out in the model's dtype, the next product's input.
template <typename T>
BF16_TARGET void layer_norm(const float *x, const float *weight, const float *bias, T *out, int64_t rows, int64_t n,
                            float epsilon) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) sum = _mm512_add_ps(sum, _mm512_loadu_ps(row + i));
        const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(sum) / n);
        __m512 square = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 centred = _mm512_sub_ps(_mm512_loadu_ps(row + i), mean);
            square = _mm512_fmadd_ps(centred, centred, square);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(square) / n + epsilon));
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 normal = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), mean), scale);
            store(out + r * n + i, _mm512_fmadd_ps(normal, _mm512_loadu_ps(weight + i), _mm512_loadu_ps(bias + i)));
        }
    }
}

template <typename T>
struct Layer {
    const float *ln_1_weight, *ln_1_bias, *ln_2_weight, *ln_2_bias;
    Linear<T> attention, projection, up, down;
};

template <typename T>
struct Cache {  // GPT2Engine.kv_cache: (2, layers, heads, capacity, head_dim), keys at [0], values at [1]
    T *data;
    int64_t layers, heads, capacity, head_dim;
    T *at(int64_t kind, int64_t layer, int64_t head, int64_t slot) const {
        return data + (((kind * layers + layer) * heads + head) * capacity + slot) * head_dim;
    }
};

// Which slots row r sees: every slot before `end - columns`, then the mask's row over the last `columns` (a
// chain without a mask: every slot up to its own, start + r).
struct Visibility {
    const uint8_t *mask;
    int64_t columns, start, end;
    int64_t open(int64_t r) const { return mask ? end - columns : start + r + 1; }  // slots 0..open(r) all seen
    bool sees(int64_t r, int64_t slot) const { return slot < open(r) || (mask && mask[r * columns + slot - (end - columns)]); }
};

// Scores (rows x end) of each row's query against every cached key of one head, times `scale`, in float32 one by
// one: for head sizes the vector code below does not take.
template <typename T>
BF16_TARGET void scores_one_by_one(const float *queries, int64_t stride, const T *keys, int64_t rows, int64_t end,
                                   int64_t dim, float scale, float *scores) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t slot = 0; slot < end; slot++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < dim; d++) dot += queries[r * stride + d] * to_float(keys[slot * dim + d]);
            scores[r * end + slot] = dot * scale;
        }
}

// Sixteen rows of 16 32-bit elements (16 slots' keys, 16 of their elements each) transposed in place: row j then
// holds element j of every slot, what a dot product across the slots reads. Shuffles within 128-bit lanes, then of
// whole lanes: 64 of them, where gathering each element across the slots took several times as long.
BF16_TARGET inline void transpose16(__m512i rows[16]) {
    __m512i pairs[16];
    for (int i = 0; i < 16; i += 2) {  // elements 4k + c of rows i, i + 1 side by side
        pairs[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        pairs[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    __m512i fours[16];  // fours[4g + c], lane k: element 4k + c of rows 4g..4g + 3
    for (int g = 0; g < 16; g += 4)
        for (int h = 0; h < 2; h++) {
            fours[g + 2 * h] = _mm512_unpacklo_epi64(pairs[g + h], pairs[g + 2 + h]);
            fours[g + 2 * h + 1] = _mm512_unpackhi_epi64(pairs[g + h], pairs[g + 2 + h]);
        }
    for (int c = 0; c < 4; c++) {  // element 4k + c: lane k of fours[c], fours[4 + c], fours[8 + c], fours[12 + c]
        const __m512i even_low = _mm512_shuffle_i32x4(fours[c], fours[4 + c], 0x88),
                      odd_low = _mm512_shuffle_i32x4(fours[c], fours[4 + c], 0xdd),
                      even_high = _mm512_shuffle_i32x4(fours[8 + c], fours[12 + c], 0x88),
                      odd_high = _mm512_shuffle_i32x4(fours[8 + c], fours[12 + c], 0xdd);
        rows[c] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
        rows[8 + c] = _mm512_shuffle_i32x4(even_low, even_high, 0xdd);
        rows[4 + c] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
        rows[12 + c] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xdd);
    }
}

// Up to 16 consecutive slots' elements (`count` slots of `width` 32-bit elements each, width a multiple of 16) across
// the slots: out[t], lane s: element t of slot s (0 past `count`).
BF16_TARGET inline void across_slots(const void *slots, int64_t count, int64_t width, __m512i *out) {
    const auto *elements = static_cast<const int32_t *>(slots);
    for (int64_t t0 = 0; t0 < width; t0 += 16) {
        __m512i *rows = out + t0;
        for (int64_t s = 0; s < 16; s++)
            rows[s] = s < count ? _mm512_loadu_si512(elements + s * width + t0) : _mm512_setzero_si512();
        transpose16(rows);
    }
}

// R rows' scores against C chunks of 16 slots' keys, over `width` steps: a key column (float32) or column pair
// (bfloat16) a step, one vector each (chunk c's at keys[c * KEY_WIDTH]), and the rows' query elements (or element
// pairs, as int32) `stride` apart; `count` slots from the first are stored. Every row sums its terms in the same order
// whatever R and C, so a row's scores do not depend on the rows beside it; the R x C chains of multiply-adds overlap
// where one would wait on each step.
constexpr int64_t KEY_WIDTH = 128;  // the most steps: a head of 128 float32 elements

template <typename T, int R, int C>
BF16_TARGET void key_dots(const void *queries, int64_t stride, const __m512i *keys, int64_t width, float *scores,
                          int64_t end, int64_t count, float scale) {
    __m512 dots[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) dots[r][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < width; t++)
        for (int r = 0; r < R; r++) {
            if constexpr (std::is_same_v<T, bf16>) {
                const auto query = (__m512bh)_mm512_set1_epi32(static_cast<const int32_t *>(queries)[r * stride + t]);
                for (int c = 0; c < C; c++) dots[r][c] = _mm512_dpbf16_ps(dots[r][c], query, (__m512bh)keys[c * KEY_WIDTH + t]);
            } else {
                const __m512 query = _mm512_set1_ps(static_cast<const float *>(queries)[r * stride + t]);
                for (int c = 0; c < C; c++)
                    dots[r][c] = _mm512_fmadd_ps(query, _mm512_castsi512_ps(keys[c * KEY_WIDTH + t]), dots[r][c]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C && 16 * c < count; c++) {
            const __mmask16 present = first_lanes(count - 16 * c);
            if constexpr (std::is_same_v<T, bf16>)  // the bfloat16 queries carry the scale already
                _mm512_mask_storeu_ps(scores + r * end + 16 * c, present, dots[r][c]);
            else
                _mm512_mask_storeu_ps(scores + r * end + 16 * c, present, _mm512_mul_ps(dots[r][c], _mm512_set1_ps(scale)));
        }
}

using KeyDots = void (*)(const void *, int64_t, const __m512i *, int64_t, float *, int64_t, int64_t, float);
// KEY_DOTS<T>[R - 1]: R rows at a time against the chunks that make four chains with them (a row alone: four chunks)
template <typename T>
constexpr KeyDots KEY_DOTS[4] = {key_dots<T, 1, 4>, key_dots<T, 2, 2>, key_dots<T, 3, 1>, key_dots<T, 4, 1>};
constexpr int64_t KEY_CHUNKS[4] = {4, 2, 1, 1};

// Scores (rows x end) of each row's query (`stride` apart) against every cached key of one head, `width` 32-bit
// steps a key (head_dim float32 elements, or head_dim / 2 bfloat16 pairs: a multiple of 16), 64 slots at a time laid
// across the slots (`across_slots`) for `key_dots`.
template <typename T>
BF16_TARGET void scores_across_slots(const void *queries, int64_t stride, const T *keys, int64_t rows, int64_t end,
                                     int64_t dim, int64_t width, float scale, float *scores) {
    __m512i key_vectors[4 * KEY_WIDTH];
    for (int64_t first = 0; first < end; first += 64) {
        const int64_t count = end - first, chunks = std::min<int64_t>(4, (count + 15) / 16);
        for (int64_t c = 0; c < 4; c++)  // chunks past the last slot: zeros, never stored
            if (c < chunks)
                across_slots(keys + (first + 16 * c) * dim, count - 16 * c, width, key_vectors + c * KEY_WIDTH);
            else
                std::fill(key_vectors + c * KEY_WIDTH, key_vectors + c * KEY_WIDTH + width, _mm512_setzero_si512());
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t r = std::min<int64_t>(4, rows - r0);
            for (int64_t c = 0; c < chunks; c += KEY_CHUNKS[r - 1])
                KEY_DOTS<T>[r - 1](static_cast<const int32_t *>(queries) + r0 * stride, stride,
                                   key_vectors + c * KEY_WIDTH, width, scores + r0 * end + first + 16 * c, end,
                                   count - 16 * c, scale);
        }
    }
}

// The same with head_dim a multiple of 32: AVX-512 BF16 dot products over the query rounded to bfloat16.
BF16_TARGET void scores_of(const float *queries, int64_t stride, const bf16 *keys, int64_t rows, int64_t end, int64_t dim,
                           float scale, float *scores) {
    if (dim % 32 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    std::vector<bf16> rounded(rows * dim);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d++) rounded[r * dim + d] = to_bf16(queries[r * stride + d] * scale);
    scores_across_slots(rounded.data(), dim / 2, keys, rows, end, dim, dim / 2, scale, scores);
}

// The same over float32 keys with head_dim a multiple of 16: fused multiply-adds.
BF16_TARGET void scores_of(const float *queries, int64_t stride, const float *keys, int64_t rows, int64_t end,
                           int64_t dim, float scale, float *scores) {
    if (dim % 16 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    scores_across_slots(queries, stride, keys, rows, end, dim, dim, scale, scores);
}

// sums (rows x dim) = weights (rows x end) @ values (end x dim) of one head, in float32 one by one: for head sizes
// the vector code below does not take.
template <typename T>
BF16_TARGET void weighted_one_by_one(const float *weights, const T *values, int64_t rows, int64_t end, int64_t dim,
                                     float *sums) {
    std::fill(sums, sums + rows * dim, 0.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t slot = 0; slot < end; slot++)
            for (int64_t d = 0; d < dim; d++) sums[r * dim + d] += weights[r * end + slot] * to_float(values[slot * dim + d]);
}

// The same with dim a multiple of 32: AVX-512 BF16 dot products over pairs of slots, the weights rounded to bfloat16.
// A pair's values are two slots' rows of 32 elements interleaved within each 128-bit lane (unpacklo/hi_epi16): the
// low vector then holds elements 8k..8k + 3 of lane k, the high one 8k + 4..8k + 7, put back in order once at the end.
BF16_TARGET void weighted_values(const float *weights, const bf16 *values, int64_t rows, int64_t end, int64_t dim,
                                 float *sums) {
    if (dim % 32 || dim > 128) return weighted_one_by_one(weights, values, rows, end, dim, sums);
    const int64_t slot_pairs = (end + 1) / 2, halves = dim / 16;  // halves: a low and a high vector each 32 elements
    std::vector<bf16> rounded(rows * 2 * slot_pairs, 0);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t slot = 0; slot < end; slot++) rounded[r * 2 * slot_pairs + slot] = to_bf16(weights[r * end + slot]);
    const auto *weight_pairs = reinterpret_cast<const int32_t *>(rounded.data());
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                  second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t rn = std::min<int64_t>(4, rows - r0);
        __m512 acc[4][8];
        for (int64_t r = 0; r < 4; r++)
            for (int64_t h = 0; h < halves; h++) acc[r][h] = _mm512_setzero_ps();
        for (int64_t u = 0; u < slot_pairs; u++) {
            const bf16 *even = values + 2 * u * dim, *odd = 2 * u + 1 < end ? even + dim : nullptr;
            for (int64_t h = 0; h < halves; h += 2) {
                const __m512i low = _mm512_loadu_si512(even + 16 * h),
                              high = odd ? _mm512_loadu_si512(odd + 16 * h) : _mm512_setzero_si512();
                const auto first = (__m512bh)_mm512_unpacklo_epi16(low, high),
                           second = (__m512bh)_mm512_unpackhi_epi16(low, high);
                for (int64_t r = 0; r < rn; r++) {
                    const auto weight = (__m512bh)_mm512_set1_epi32(weight_pairs[(r0 + r) * slot_pairs + u]);
                    acc[r][h] = _mm512_dpbf16_ps(acc[r][h], weight, first);
                    acc[r][h + 1] = _mm512_dpbf16_ps(acc[r][h + 1], weight, second);
                }
            }
        }
        for (int64_t r = 0; r < rn; r++)
            for (int64_t h = 0; h < halves; h += 2) {
                float *out = sums + (r0 + r) * dim + 16 * h;
                _mm512_storeu_ps(out, _mm512_permutex2var_ps(acc[r][h], first_half, acc[r][h + 1]));
                _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(acc[r][h], second_half, acc[r][h + 1]));
            }
    }
}

// The same over float32 values with dim a multiple of 16: fused multiply-adds, slot by slot.
BF16_TARGET void weighted_values(const float *weights, const float *values, int64_t rows, int64_t end, int64_t dim,
                                 float *sums) {
    if (dim % 16 || dim > 128) return weighted_one_by_one(weights, values, rows, end, dim, sums);
    const int64_t chunks = dim / 16;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t rn = std::min<int64_t>(4, rows - r0);
        __m512 acc[4][8];
        for (int64_t r = 0; r < 4; r++)
            for (int64_t c = 0; c < chunks; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t slot = 0; slot < end; slot++)
            for (int64_t c = 0; c < chunks; c++) {
                const __m512 value = _mm512_loadu_ps(values + slot * dim + 16 * c);
                for (int64_t r = 0; r < rn; r++)
                    acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[(r0 + r) * end + slot]), value, acc[r][c]);
            }
        for (int64_t r = 0; r < rn; r++)
            for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(sums + (r0 + r) * dim + 16 * c, acc[r][c]);
    }
}

// The softmax of a row of scores over the slots it sees (the others set to -inf), in place.
BF16_TARGET void softmax(float *row, int64_t end) {
    const __m512 minus_infinity = _mm512_set1_ps(-INFINITY);
    __m512 best = minus_infinity;
    for (int64_t slot = 0; slot < end; slot += 16)
        best = _mm512_max_ps(best, _mm512_mask_loadu_ps(minus_infinity, first_lanes(end - slot), row + slot));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 total = _mm512_setzero_ps();
    for (int64_t slot = 0; slot < end; slot += 16) {
        const __mmask16 present = first_lanes(end - slot);
        const __m512 score = _mm512_maskz_loadu_ps(present, row + slot);
        const __mmask16 seen = _mm512_mask_cmp_ps_mask(present, score, minus_infinity, _CMP_NEQ_OQ);
        const __m512 weight = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(score, most)));
        total = _mm512_add_ps(total, weight);
        _mm512_mask_storeu_ps(row + slot, present, weight);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t slot = 0; slot < end; slot += 16) {  // masked both ways: the row may end at the end of its memory
        const __mmask16 present = first_lanes(end - slot);
        _mm512_mask_storeu_ps(row + slot, present, _mm512_mul_ps(_mm512_maskz_loadu_ps(present, row + slot), inverse));
    }
}

// Attention of each row's query over the slots it sees through one head, into its columns of out (rows x n_embd) in
// the model's dtype; scores (rows x end) and sums (rows x head_dim) are room to work in.
template <typename T>
BF16_TARGET void head_attention(const float *qkv, const Cache<T> &cache, int64_t layer, int64_t head,
                                const Visibility &visible, T *out, int64_t rows, int64_t n_embd, float *scores,
                                float *sums) {
    const int64_t dim = cache.head_dim, end = visible.end;
    scores_of(qkv + head * dim, 3 * n_embd, cache.at(0, layer, head, 0), rows, end, dim,
              1.0f / std::sqrt(static_cast<float>(dim)), scores);
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * end;
        for (int64_t slot = visible.open(r); slot < end; slot++)
            if (!visible.sees(r, slot)) row[slot] = -INFINITY;
        softmax(row, end);
    }
    weighted_values(scores, cache.at(1, layer, head, 0), rows, end, dim, sums);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d += 16)
            store(out + r * n_embd + head * dim + d, _mm512_maskz_loadu_ps(first_lanes(dim - d), sums + r * dim + d),
                       dim - d);
}

// Attention over every head, the heads split among torch's threads where the work pays for waking them.
template <typename T>
void attention(const float *qkv, const Cache<T> &cache, int64_t layer, const Visibility &visible, T *out, int64_t rows,
               int64_t n_embd) {
    const int64_t heads = cache.heads, grain = 2 * rows * visible.end * n_embd >= PARALLEL_WORK ? 1 : heads;
    at::parallel_for(0, heads, grain, [&](int64_t first, int64_t last) {
        std::vector<float> scores(rows * visible.end), sums(rows * cache.head_dim);
        for (int64_t h = first; h < last; h++)
            head_attention(qkv, cache, layer, h, visible, out, rows, n_embd, scores.data(), sums.data());
    });
}

// GPT-2's tanh GELU: x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)), in the model's dtype for the next product (n a
// multiple of 16).
template <typename T>
BF16_TARGET void gelu(const float *x, T *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 cubic = _mm512_mul_ps(_mm512_mul_ps(v, v), _mm512_set1_ps(0.044715f));
        const __m512 inner = _mm512_mul_ps(_mm512_fmadd_ps(cubic, v, v), _mm512_set1_ps(-1.5957691216f));
        store(out + i, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(inner))));
    }
}

bool read_addresses(PyObject *list, std::vector<uintptr_t> &out) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "expected a list of addresses");
        return false;
    }
    out.resize(PyList_GET_SIZE(list));
    for (size_t i = 0; i < out.size(); i++)
        out[i] = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(PyList_GET_ITEM(list, static_cast<Py_ssize_t>(i))));
    return !PyErr_Occurred();
}

// A forward's arguments as blocks() reads them (below).
struct Arguments {
    std::vector<int64_t> ids, positions;
    std::vector<uintptr_t> embeddings, parameters, shape;
    float epsilon;
    void *cache;
    int64_t start, end;
    Visibility visible;
    int64_t last;
    float *out;
};

// The forward, in a model of dtype T.
template <typename T>
BF16_TARGET void forward(const Arguments &a) {
    const auto &shape = a.shape;
    const auto rows = static_cast<int64_t>(a.ids.size());
    const int64_t n_embd = shape[0], heads = shape[1], head_dim = shape[2], n_layer = shape[3];
    const Cache<T> cache{static_cast<T *>(a.cache), n_layer, heads, static_cast<int64_t>(shape[4]), head_dim};
    const auto *wte = reinterpret_cast<const T *>(a.embeddings[0]), *wpe = reinterpret_cast<const T *>(a.embeddings[1]);
    std::vector<float> x(rows * n_embd), wide(rows * 4 * n_embd);
    std::vector<T> normed(rows * n_embd), activated(rows * 4 * n_embd);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n_embd; i++)
            x[r * n_embd + i] = to_float(wte[a.ids[r] * n_embd + i]) + to_float(wpe[a.positions[r] * n_embd + i]);
    // AMX's tiles where asked for and granted (every product's input a multiple of 32 elements: n_embd's)
    const bool tiles = shape[9] && std::is_same_v<T, bf16> && n_embd % 32 == 0 && tiles_granted();
    auto linear = [&](const uintptr_t *at, int64_t in, int64_t out_features) {
        return Linear<T>{reinterpret_cast<const T *>(at[0]), reinterpret_cast<const float *>(at[1]), in, out_features};
    };
    for (int64_t l = 0; l < n_layer; l++) {
        const uintptr_t *p = a.parameters.data() + 12 * l;
        const auto *f = reinterpret_cast<const float *const *>(p);
        const Layer<T> layer{f[0], f[1], f[10], f[11], linear(p + 2, n_embd, 3 * n_embd), linear(p + 4, n_embd, n_embd),
                             linear(p + 6, n_embd, 4 * n_embd), linear(p + 8, 4 * n_embd, n_embd)};
        layer_norm(x.data(), layer.ln_1_weight, layer.ln_1_bias, normed.data(), rows, n_embd, a.epsilon);
        product(normed.data(), layer.attention, wide.data(), rows, tiles);  // q, k, v: 3 x n_embd a row
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < heads; h++)
                for (int64_t d = 0; d < head_dim; d += 16) {
                    const float *row = wide.data() + r * 3 * n_embd + h * head_dim + d;
                    const __mmask16 present = first_lanes(head_dim - d);
                    for (int64_t kind = 0; kind < 2; kind++)  // the key, then the value
                        store(cache.at(kind, l, h, a.start + r) + d,
                              _mm512_maskz_loadu_ps(present, row + (kind + 1) * n_embd), head_dim - d);
                }
        attention(wide.data(), cache, l, a.visible, normed.data(), rows, n_embd);
        std::vector<float> &projected = wide;  // the attention read its queries already
        product(normed.data(), layer.projection, projected.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += projected[i];
        layer_norm(x.data(), layer.ln_2_weight, layer.ln_2_bias, normed.data(), rows, n_embd, a.epsilon);
        product(normed.data(), layer.up, wide.data(), rows, tiles);
        gelu(wide.data(), activated.data(), rows * 4 * n_embd);
        product(activated.data(), layer.down, wide.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += wide[i];
    }
    const auto *final_norm = reinterpret_cast<const float *const *>(a.parameters.data() + 12 * n_layer);
    const int64_t first = rows - a.last;  // the rows whose logits are asked for
    layer_norm(x.data() + first * n_embd, final_norm[0], final_norm[1], normed.data(), a.last, n_embd, a.epsilon);
    product(normed.data(), linear(a.parameters.data() + 12 * n_layer + 2, n_embd, static_cast<int64_t>(shape[7])), a.out,
            a.last, tiles);
}

// A model and its new rows from a call's first arguments: (ids, positions, embeddings, parameters, shape, epsilon,
// cache), as blocks() below takes them.
bool read_model(PyObject *const *args, Arguments &a, const char *function) {
    if (!read_ints(args[0], a.ids, "ids") || !read_ints(args[1], a.positions, "positions")
        || !read_addresses(args[2], a.embeddings) || !read_addresses(args[3], a.parameters)
        || !read_addresses(args[4], a.shape))
        return false;
    const auto &shape = a.shape;
    if (shape.size() != 10 || (shape[8] != 2 && shape[8] != 4)) {
        PyErr_Format(PyExc_ValueError, "%s: shape is [n_embd, heads, head_dim, layers, capacity, vocabulary, positions, "
                                       "logit columns, bytes an element (2 or 4), tiles (0 or 1)]", function);
        return false;
    }
    a.epsilon = static_cast<float>(PyFloat_AsDouble(args[5]));
    a.cache = PyLong_AsVoidPtr(args[6]);
    if (PyErr_Occurred()) return false;
    if (a.parameters.size() != 12 * shape[3] + 4 || a.embeddings.size() != 2) {
        PyErr_Format(PyExc_ValueError, "%s: the parameters do not match the shape", function);
        return false;
    }
    return true;
}

// The forward of a's rows, once they are checked against the model: their slots, the logits asked for, their
// tokens and positions (refused as torch's embedding lookups would refuse them).
bool forward_checked(const Arguments &a, const char *function) {
    const auto rows = static_cast<int64_t>(a.ids.size());
    const auto &shape = a.shape;
    if (a.end != a.start + rows || a.positions.size() != a.ids.size() || a.last < 0 || a.last > rows || a.start < 0
        || a.end > static_cast<int64_t>(shape[4])) {
        PyErr_Format(PyExc_ValueError, "%s: the rows do not match the cache's slots", function);
        return false;
    }
    for (int64_t r = 0; r < rows; r++)
        if (a.ids[r] < 0 || a.ids[r] >= static_cast<int64_t>(shape[5]) || a.positions[r] < 0
            || a.positions[r] >= static_cast<int64_t>(shape[6])) {
            PyErr_Format(PyExc_IndexError, "%s: token %lld or position %lld out of range", function,
                         static_cast<long long>(a.ids[r]), static_cast<long long>(a.positions[r]));
            return false;
        }
    if (shape[8] == 2)
        forward<bf16>(a);
    else
        forward<float>(a);
    return true;
}

// blocks(ids, positions, embeddings, parameters, shape, epsilon, cache, start, end, mask, columns, last, out)
//   ids, positions: lists of the new rows' tokens and positions (a list costs less to make than a tensor);
//   embeddings: [wte, wpe] (the model's dtype, n_embd columns); parameters: 12 addresses a layer (ln_1's float32
//   weight and bias; attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj, each its packed weight and float32 bias;
//   ln_2's weight and bias), then ln_f's weight and bias, then the output layer's packed weight and (zero) bias;
//   shape: [n_embd, heads, head_dim, layers, capacity, vocabulary, positions, logit columns, bytes an element (2:
//   bfloat16, 4: float32), products on AMX's tiles (1, where tiles() says so) or not (0)]; cache: GPT2Engine.kv_cache's
//   address; mask: a bool (rows x columns) address, or 0 for a chain; out: float32 logits (last x logit columns)
//   of the last `last` rows.
// The new nodes' keys and values go to cache slots start..end.
PyObject *blocks(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes_arguments("blocks", nargs, 13)) return nullptr;
    Arguments a;
    if (!read_model(args, a, "blocks")) return nullptr;
    a.start = PyLong_AsLongLong(args[7]);
    a.end = PyLong_AsLongLong(args[8]);
    a.visible = Visibility{static_cast<const uint8_t *>(PyLong_AsVoidPtr(args[9])), PyLong_AsLongLong(args[10]), a.start,
                           a.end};
    a.last = PyLong_AsLongLong(args[11]);
    a.out = static_cast<float *>(PyLong_AsVoidPtr(args[12]));
    if (PyErr_Occurred() || !forward_checked(a, "blocks")) return nullptr;
    Py_RETURN_NONE;
}

// chain(ids, positions, embeddings, parameters, shape, epsilon, cache, start, steps, top_k, temperature, top_p,
//       shortlist_tokens, uniforms, mapping) -> (tokens, distributions or None)
// A chain drafter's `steps` draft forwards as one call (ChainDrafter.propose): the first over the new rows (from
// slot `start`, the last of them the tree's root), each later one over the token drawn after the row before, one
// position further; after each, the token that follows: the argmax when greedy (temperature 0; as row_argmax), else
// under the top-k setting a draw at the next of `uniforms` from the processed distribution (TopK.read, draw_at), each
// distribution made as `mapping()`. shortlist_tokens: the logits' column -> token array, or None.
PyObject *chain(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes_arguments("chain", nargs, 15)) return nullptr;
    Arguments a;
    if (!read_model(args, a, "chain")) return nullptr;
    a.start = PyLong_AsLongLong(args[7]);
    const int64_t steps = PyLong_AsLongLong(args[8]);
    TopK setting;
    setting.k = PyLong_AsLongLong(args[9]);
    setting.temperature = PyFloat_AsDouble(args[10]);
    setting.top_p = PyFloat_AsDouble(args[11]);
    Int64Array column_token;
    PyObject *uniforms = args[13], *mapping = args[14];
    const bool greedy = setting.temperature == 0;
    const auto columns = static_cast<int64_t>(a.shape[7]);
    if (PyErr_Occurred() || !column_token.open(args[12], "shortlist tokens") || (!greedy && !setting.check("chain")))
        return nullptr;
    if ((column_token.data && column_token.size != columns) || a.ids.empty() || steps < 0
        || !PyList_Check(uniforms) || PyList_GET_SIZE(uniforms) != (greedy ? 0 : steps)) {
        PyErr_SetString(PyExc_ValueError, "chain: a shortlist of the logits' columns, at least one row, and a uniform "
                                          "draw a step when sampling");
        return nullptr;
    }
    std::vector<float> logits(columns);
    std::vector<std::pair<int64_t, double>> distribution;
    std::vector<int64_t> tokens;
    PyObject *distributions = greedy ? Py_None : PyList_New(0);
    if (greedy) Py_INCREF(Py_None);
    for (int64_t step = 0; distributions && step < steps; step++) {
        a.end = a.start + static_cast<int64_t>(a.ids.size());
        a.visible = Visibility{nullptr, 0, a.start, a.end};
        a.last = 1;
        a.out = logits.data();
        if (!forward_checked(a, "chain")) {
            Py_CLEAR(distributions);
            break;
        }
        int64_t token;
        if (greedy) {
            float largest;
            const int64_t column = row_argmax(logits.data(), columns, &largest);
            token = column_token.data ? column_token.data[column] : column;
        } else {
            setting.read(logits.data(), columns, column_token.data, distribution);
            token = draw_at(distribution, PyFloat_AsDouble(PyList_GET_ITEM(uniforms, step)));
            PyObject *made = distribution_dict(distribution, mapping);
            if (!made || PyList_Append(distributions, made) < 0) Py_CLEAR(distributions);
            Py_XDECREF(made);
        }
        tokens.push_back(token);
        a.start = a.end;
        a.ids.assign(1, token);
        a.positions.assign(1, a.positions.back() + 1);
    }
    if (!distributions) return nullptr;
    return Py_BuildValue("(NN)", int_list(tokens), distributions);
}

// supported(bytes an element): whether this CPU runs the forward of a model in bfloat16 (2: AVX-512 BF16's dot
// products) or float32 (4: AVX-512).
PyObject *supported(PyObject *, PyObject *bytes) {
    const long element = PyLong_AsLong(bytes);
    if (PyErr_Occurred()) return nullptr;
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                        && __builtin_cpu_supports("avx512vl");
    return PyBool_FromLong(avx512 && (element == 4 || (element == 2 && __builtin_cpu_supports("avx512bf16"))));
}

// tiles(): whether this CPU and process run a bfloat16 model's products on AMX's tiles.
PyObject *tiles(PyObject *, PyObject *) { return PyBool_FromLong(tiles_granted()); }

PyMethodDef methods[] = {
    {"blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(blocks)), METH_FASTCALL,
     "A small GPT-2's transformer blocks over a few new rows."},
    {"chain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(chain)), METH_FASTCALL,
     "A chain drafter's draft forwards and the tokens each chooses, as one call."},
    {"supported", supported, METH_O, "Whether this CPU runs the blocks of a model with elements of this many bytes."},
    {"tiles", tiles, METH_NOARGS, "Whether this CPU runs a bfloat16 model's products on AMX's tiles."},
    {nullptr, nullptr, 0, nullptr}};

#define STRINGIFY_(name) #name
#define STRINGIFY(name) STRINGIFY_(name)
#define CONCATENATE_(a, b) a##b
#define CONCATENATE(a, b) CONCATENATE_(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(TORCH_EXTENSION_NAME), "A small GPT-2's blocks.", -1, methods};

}  // namespace

PyMODINIT_FUNC CONCATENATE(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
