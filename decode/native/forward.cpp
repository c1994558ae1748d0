// A GPT-2's forward over a few new rows in one C++ call, and a chain of a draft's forwards (decode/native loads it;
// decode/models/engine.py calls it through GPT2Engine.logits for a draft's forwards and an oracle's). A step's forward is
// a few rows through every weight of the model: torch spends it starting some thirty operations a layer, each cold after
// the other model's forward, and its products read a weight again for every few rows. Here each product runs over
// weights packed once at load, in groups of 64 columns split over torch's threads: every row of the call uses a group's
// weights while they are in cache, so a forward of 1 to 64 rows reads each weight from memory once. The products are a
// bfloat16 model's AVX-512 BF16 dot products or, on a CPU with AMX, its tiles; a float32 model's AVX-512 fused
// multiply-adds; or, in the AVX2 build (no FORWARD_AVX512), fused multiply-adds of 8 floats for either dtype, a
// bfloat16 weight widened to float32 as it is read. Attention with the tree's mask runs its heads over the same
// threads; layer norm, softmax, GELU and the residuals run a vector at a time over the rows in place, in float32.
// The model's dtype (`T`: bf16 or float) is that of its weights, its cache and the products' inputs. Every row adds
// its terms in the same order whatever the call's other rows: a row's logits are bit for bit the same alone or beside
// others. They differ from torch's in rounding only, as two kernels' do (docs/exactness.md).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "rows.h"
#include "vectors.h"

// The AVX-512 build's products on AMX's tiles: a compiler before GCC 11 or clang 12 lacks their intrinsics and builds
// the rest
#ifndef TILES_BUILD
#if defined(FORWARD_AVX512) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TILES_BUILD 1
#else
#define TILES_BUILD 0
#endif
#endif
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")))

namespace {

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

// Asks for step k's share of the weights `ahead` (B blocks' worth, a 64-byte line a block a step), so that the
// blocks a product reads next come from memory while this tile computes; none where ahead is null.
template <typename T, int B>
inline void prefetch_step(const T *ahead, int64_t k, int64_t width) {
    if (ahead)
        for (int i = 0; i < B; i++) _mm_prefetch(reinterpret_cast<const char *>(ahead + (k * B + i) * width), _MM_HINT_T0);
}

#ifdef FORWARD_AVX512
// y (R rows x B blocks of 16 columns from block b0) = x @ W + bias, all in registers: each step's B weights are
// loaded once for the R rows. The last block's columns past `out` (an output layer's) are not stored.
template <typename T, int R, int B>
VECTOR_TARGET void tile(const T *x, const Linear<T> &w, float *y, int64_t r0, int64_t b0, const T *ahead) {
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
        prefetch_step<T, B>(ahead, k, width);
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
using Input = T;
// The rows a tile takes and BLOCKS_A_TILE<T>[R - 1], the blocks a tile of R rows covers: their sums in 16 of the 32
// registers
template <typename T>
constexpr int64_t ROWS_A_TILE = 4;
// Whether a tile fetches the weights a product reads next (not measured on AVX-512: there the hardware's own
// prefetching is left to it)
constexpr bool PREFETCH = false;
template <typename T>
constexpr int64_t BLOCKS_A_TILE[6] = {4, 4, 4, 4, 4, 4};
#else
// y (R rows x B blocks of 16 columns from block b0) = x @ W + bias, all in registers, two vectors of 8 a block: each
// step's weights are loaded once for the R rows, whose inputs the caller widened to float32. A bfloat16 step holds, in
// each 32-bit lane, a column's weights for input rows 2k (low half) and 2k + 1 (high half): a shift and a mask make
// them float32. Every sum adds its terms in input order whatever R and B. Columns past `out` are not stored.
template <typename T, int R, int B>
VECTOR_TARGET void tile(const float *x, const Linear<T> &w, float *y, int64_t r0, int64_t b0, const T *ahead) {
    constexpr int64_t per_step = ROWS_A_STEP<T>, width = 16 * per_step;  // elements a step of a block
    const int64_t steps = w.in / per_step;
    const T *weights[B];
    __m256 acc[R][2 * B];
    for (int j = 0; j < B; j++) {
        weights[j] = w.packed + (b0 + j) * steps * width;
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) acc[r][2 * j + h] = _mm256_loadu_ps(w.bias + (b0 + j) * 16 + 8 * h);
    }
    for (int64_t k = 0; k < steps; k++) {
        prefetch_step<T, B>(ahead, k, width);
        for (int j = 0; j < B; j++) {
            const T *step = weights[j] + k * width;
            const float *input = x + r0 * w.in + k * per_step;
            if constexpr (std::is_same_v<T, bf16>) {  // each half's weights for rows 2k and 2k + 1, then each row's sums
                const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(step)),
                              high = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(step + 16)),
                              top = _mm256_set1_epi32(-65536);
                const __m256 even[2] = {_mm256_castsi256_ps(_mm256_slli_epi32(low, 16)),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(high, 16))},
                             odd[2] = {_mm256_castsi256_ps(_mm256_and_si256(low, top)),
                                       _mm256_castsi256_ps(_mm256_and_si256(high, top))};
                for (int r = 0; r < R; r++) {
                    const __m256 first = _mm256_broadcast_ss(input + r * w.in), second = _mm256_broadcast_ss(input + r * w.in + 1);
                    for (int h = 0; h < 2; h++)
                        acc[r][2 * j + h] = _mm256_fmadd_ps(second, odd[h], _mm256_fmadd_ps(first, even[h], acc[r][2 * j + h]));
                }
            } else {
                const __m256 weight[2] = {_mm256_loadu_ps(step), _mm256_loadu_ps(step + 8)};
                for (int r = 0; r < R; r++) {
                    const __m256 value = _mm256_broadcast_ss(input + r * w.in);
                    for (int h = 0; h < 2; h++) acc[r][2 * j + h] = _mm256_fmadd_ps(value, weight[h], acc[r][2 * j + h]);
                }
            }
        }
    }
    for (int j = 0; j < B; j++)
        for (int h = 0; h < 2; h++) {
            const int64_t column = (b0 + j) * 16 + 8 * h;
            for (int r = 0; r < R; r++) store(y + (r0 + r) * w.out + column, acc[r][2 * j + h], w.out - column);
        }
}

// The products' input: the AVX2 build reads it as float32
template <typename T>
using Input = float;
// The rows a tile takes (a bfloat16 step holds four widened weight vectors) and BLOCKS_A_TILE<T>[R - 1], the blocks a
// tile of R rows covers: their sums in up to 12 of the 16 registers, with room for a step's weights and an input
template <typename T>
constexpr int64_t ROWS_A_TILE = std::is_same_v<T, bf16> ? 4 : 6;
// Whether a tile fetches the weights a product reads next, while it computes
constexpr bool PREFETCH = true;
template <typename T>
constexpr int64_t BLOCKS_A_TILE[6] = {4, 2, std::is_same_v<T, bf16> ? 1 : 2, 1, 1, 1};
#endif

template <typename T>
using Tile = void (*)(const Input<T> *, const Linear<T> &, float *, int64_t, int64_t, const T *);
// TILES<T>[R - 1][B - 1]: a tile of R rows (ROWS_A_TILE<T> but for the last rows) and B blocks (BLOCKS_A_TILE<T>[R -
// 1] but for the last columns)
template <typename T, int R>
constexpr Tile<T> TILE_ROW[4] = {tile<T, R, 1>, tile<T, R, 2>, tile<T, R, 3>, tile<T, R, 4>};
template <typename T>
constexpr const Tile<T> *TILES[6] = {TILE_ROW<T, 1>, TILE_ROW<T, 2>, TILE_ROW<T, 3>, TILE_ROW<T, 4>, TILE_ROW<T, 5>,
                                     TILE_ROW<T, 6>};

// y (rows x out, float32) = x (rows x in) @ W + bias over the (up to) 64 output columns from block b0: every row, a
// tile's rows at a time, over the group's weights while they stay in cache.
template <typename T>
void product_columns(const Input<T> *x, const Linear<T> &w, float *y, int64_t rows, int64_t b0) {
    const int64_t all = (w.out + 15) / 16, blocks = std::min<int64_t>(4, all - b0), steps = w.in / ROWS_A_STEP<T>;
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS_A_TILE<T>) {
        const int64_t r = std::min<int64_t>(ROWS_A_TILE<T>, rows - r0), step = BLOCKS_A_TILE<T>[r - 1];
        // the last pass over the group's rows fetches the weights read next: the next tile's blocks where one pass
        // takes every row, else the same blocks of the next group
        const int64_t next = r0 + r < rows ? all : r0 == 0 ? step : 4;
        for (int64_t b = 0; b < blocks; b += step) {
            const int64_t ahead = b0 + b + next;
            TILES<T>[r - 1][std::min(step, blocks - b) - 1](
                x, w, y, r0, b0 + b, PREFETCH && ahead + std::min(step, blocks - b) <= all ? w.packed + ahead * steps * 16 * ROWS_A_STEP<T> : nullptr);
        }
    }
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

// The products' input as their tiles read it: the rows as they are, or (the AVX2 build, a bfloat16 model) widened
// to float32 in `room`.
template <typename T>
VECTOR_TARGET const Input<T> *as_input(const T *x, int64_t elements, std::vector<float> &room) {
    if constexpr (std::is_same_v<Input<T>, T>) {
        return x;
    } else {
        room.resize(elements);
        widen(x, room.data(), elements);
        return room.data();
    }
}

// y (rows x out, float32) = x (rows x in) @ W + bias; on AMX's tiles with `tiles` (a bfloat16 model, `in` a multiple
// of 32, tiles_granted()).
template <typename T>
void product(const T *rows_in, const Linear<T> &w, float *y, int64_t rows, bool tiles) {
    static thread_local std::vector<float> room;
    const Input<T> *x = as_input(rows_in, rows * w.in, room);
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
VECTOR_TARGET void layer_norm(const float *x, const float *weight, const float *bias, T *out, int64_t rows, int64_t n,
                              float epsilon) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        Vec total = zeros();
        for (int64_t i = 0; i < n; i += LANES) total = add(total, load(row + i));
        const Vec mean = splat(sum(total) / n);
        Vec square = zeros();
        for (int64_t i = 0; i < n; i += LANES) {
            const Vec centred = sub(load(row + i), mean);
            square = fma(centred, centred, square);
        }
        const Vec scale = splat(1.0f / std::sqrt(sum(square) / n + epsilon));
        for (int64_t i = 0; i < n; i += LANES) {
            const Vec normal = mul(sub(load(row + i), mean), scale);
            store(out + r * n + i, fma(normal, load(weight + i), load(bias + i)));
        }
    }
}

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
VECTOR_TARGET void scores_one_by_one(const float *queries, int64_t stride, const T *keys, int64_t rows, int64_t end,
                                   int64_t dim, float scale, float *scores) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t slot = 0; slot < end; slot++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < dim; d++) dot += queries[r * stride + d] * to_float(keys[slot * dim + d]);
            scores[r * end + slot] = dot * scale;
        }
}

// sums (rows x dim) = weights (rows x end) @ values (end x dim) of one head, in float32 one by one: for head sizes
// the vector code below does not take.
template <typename T>
VECTOR_TARGET void weighted_one_by_one(const float *weights, const T *values, int64_t rows, int64_t end, int64_t dim,
                                     float *sums) {
    std::fill(sums, sums + rows * dim, 0.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t slot = 0; slot < end; slot++)
            for (int64_t d = 0; d < dim; d++) sums[r * dim + d] += weights[r * end + slot] * to_float(values[slot * dim + d]);
}

#ifdef FORWARD_AVX512
// Sixteen rows of 16 32-bit elements (16 slots' keys, 16 of their elements each) transposed in place: row j then
// holds element j of every slot, what a dot product across the slots reads. Shuffles within 128-bit lanes, then of
// whole lanes: 64 of them, where gathering each element across the slots took several times as long.
VECTOR_TARGET inline void transpose16(__m512i rows[16]) {
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
VECTOR_TARGET inline void across_slots(const void *slots, int64_t count, int64_t width, __m512i *out) {
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
VECTOR_TARGET void key_dots(const void *queries, int64_t stride, const __m512i *keys, int64_t width, float *scores,
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
VECTOR_TARGET void scores_across_slots(const void *queries, int64_t stride, const T *keys, int64_t rows, int64_t end,
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
VECTOR_TARGET void scores_of(const float *queries, int64_t stride, const bf16 *keys, int64_t rows, int64_t end, int64_t dim,
                           float scale, float *scores) {
    if (dim % 32 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    std::vector<bf16> rounded(rows * dim);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d++) rounded[r * dim + d] = to_bf16(queries[r * stride + d] * scale);
    scores_across_slots(rounded.data(), dim / 2, keys, rows, end, dim, dim / 2, scale, scores);
}

// The same over float32 keys with head_dim a multiple of 16: fused multiply-adds.
VECTOR_TARGET void scores_of(const float *queries, int64_t stride, const float *keys, int64_t rows, int64_t end,
                           int64_t dim, float scale, float *scores) {
    if (dim % 16 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    scores_across_slots(queries, stride, keys, rows, end, dim, dim, scale, scores);
}

#else
// Eight vectors' sums: lane s holds the sum of v[s]'s lanes.
VECTOR_TARGET inline __m256 sums_of_eight(const __m256 v[8]) {
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3])),
                 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // low: v[0..3]'s first four lanes' sums, then their last four's; high the same for v[4..7]
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// Scores (rows x end) of each row's query (`stride` apart) against every cached float32 key of one head (head_dim a
// multiple of 8), times `scale`: 8 slots at a time, each row's 8 dot products summed across their lanes at once.
VECTOR_TARGET void scores_of(const float *queries, int64_t stride, const float *keys, int64_t rows, int64_t end,
                             int64_t dim, float scale, float *scores) {
    if (dim % 8 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    for (int64_t first = 0; first < end; first += 8) {
        const float *slots[8];  // past the last slot: the last one again, never stored
        for (int64_t s = 0; s < 8; s++) slots[s] = keys + std::min(first + s, end - 1) * dim;
        for (int64_t r = 0; r < rows; r++) {
            const float *query = queries + r * stride;
            __m256 dots[8];
            for (int s = 0; s < 8; s++) dots[s] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 q = _mm256_loadu_ps(query + d);
                for (int s = 0; s < 8; s++) dots[s] = _mm256_fmadd_ps(q, _mm256_loadu_ps(slots[s] + d), dots[s]);
            }
            store(scores + r * end + first, _mm256_mul_ps(sums_of_eight(dots), _mm256_set1_ps(scale)), end - first);
        }
    }
}

// The same over bfloat16 keys: widened to float32 first.
VECTOR_TARGET void scores_of(const float *queries, int64_t stride, const bf16 *keys, int64_t rows, int64_t end,
                             int64_t dim, float scale, float *scores) {
    if (dim % 8 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    static thread_local std::vector<float> widened;
    widened.resize(end * dim);
    widen(keys, widened.data(), end * dim);
    scores_of(queries, stride, widened.data(), rows, end, dim, scale, scores);
}
#endif

// Rows a pass of weighted_values takes, their sums in registers: AVX-512 4 x up to 8 of 32, AVX2 up to 16 of 16
constexpr int64_t VALUE_ROWS = LANES == 16 ? 4 : 1;

// The same over float32 values with dim a multiple of LANES: fused multiply-adds, slot by slot.
VECTOR_TARGET void weighted_values(const float *weights, const float *values, int64_t rows, int64_t end, int64_t dim,
                                   float *sums) {
    if (dim % LANES || dim > 128) return weighted_one_by_one(weights, values, rows, end, dim, sums);
    const int64_t chunks = dim / LANES;
    for (int64_t r0 = 0; r0 < rows; r0 += VALUE_ROWS) {
        const int64_t rn = std::min<int64_t>(VALUE_ROWS, rows - r0);
        Vec acc[VALUE_ROWS][128 / LANES];
        for (int64_t r = 0; r < VALUE_ROWS; r++)
            for (int64_t c = 0; c < chunks; c++) acc[r][c] = zeros();
        for (int64_t slot = 0; slot < end; slot++)
            for (int64_t c = 0; c < chunks; c++) {
                const Vec value = load(values + slot * dim + LANES * c);
                for (int64_t r = 0; r < rn; r++) acc[r][c] = fma(splat(weights[(r0 + r) * end + slot]), value, acc[r][c]);
            }
        for (int64_t r = 0; r < rn; r++)
            for (int64_t c = 0; c < chunks; c++) store(sums + (r0 + r) * dim + LANES * c, acc[r][c]);
    }
}

// The same over bfloat16 values: widened to float32 first, so that a row's sums add its slots one at a time in order
// (dot products over pairs of slots would pair a slot with whichever comes next in the cache, which differs between a
// tree and the same tokens decoded one by one).
VECTOR_TARGET void weighted_values(const float *weights, const bf16 *values, int64_t rows, int64_t end, int64_t dim,
                                   float *sums) {
    if (dim % LANES || dim > 128) return weighted_one_by_one(weights, values, rows, end, dim, sums);
    static thread_local std::vector<float> widened;
    widened.resize(end * dim);
    widen(values, widened.data(), end * dim);
    weighted_values(weights, widened.data(), rows, end, dim, sums);
}

// The softmax of row r's scores over the slots it sees (the others set to -inf), in place. Its sum adds the weights
// in lanes by their rank among the slots the row sees, not by their slots: the same sum, bit for bit, for a node of a
// tree (its ancestors scattered among other nodes' slots) and for the same token decoded after its ancestors.
VECTOR_TARGET void softmax(float *row, const Visibility &visible, int64_t r) {
    const int64_t end = visible.end, open = visible.open(r);  // slots 0..open all seen, past it those the mask shows
    const Vec minus_infinity = splat(-INFINITY);
    Vec best = minus_infinity;
    for (int64_t slot = 0; slot < end; slot += LANES) best = max(best, load(row + slot, end - slot, minus_infinity));
    const Vec most = splat(largest(best));
    Vec total = zeros();  // the weights of slots 0..open, lane by slot (their rank)
    for (int64_t slot = 0; slot < end; slot += LANES) {  // masked both ways: the row may end at the end of its memory
        const Vec score = load(row + slot, end - slot);
        store(row + slot, where_seen(score, exp(sub(score, most)), end - slot), end - slot);
        if (slot < open) total = add(total, load(row + slot, open - slot));
    }
    if (open < end) {
        alignas(64) float lanes[LANES];
        store(lanes, total);
        for (int64_t slot = open, rank = open; slot < end; slot++)
            if (visible.sees(r, slot)) lanes[rank++ % LANES] += row[slot];
        total = load(lanes);
    }
    const Vec inverse = splat(1.0f / sum(total));
    for (int64_t slot = 0; slot < end; slot += LANES) store(row + slot, mul(load(row + slot, end - slot), inverse), end - slot);
}

// Attention of each row's query over the slots it sees through one head, into its columns of out (rows x n_embd) in
// the model's dtype; scores (rows x end) and sums (rows x head_dim) are room to work in.
template <typename T>
VECTOR_TARGET void head_attention(const float *qkv, const Cache<T> &cache, int64_t layer, int64_t head,
                                  const Visibility &visible, T *out, int64_t rows, int64_t n_embd, float *scores,
                                  float *sums) {
    const int64_t dim = cache.head_dim, end = visible.end;
    scores_of(qkv + head * dim, 3 * n_embd, cache.at(0, layer, head, 0), rows, end, dim,
              1.0f / std::sqrt(static_cast<float>(dim)), scores);
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * end;
        for (int64_t slot = visible.open(r); slot < end; slot++)
            if (!visible.sees(r, slot)) row[slot] = -INFINITY;
        softmax(row, visible, r);
    }
    weighted_values(scores, cache.at(1, layer, head, 0), rows, end, dim, sums);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d += LANES)
            store(out + r * n_embd + head * dim + d, load(sums + r * dim + d, dim - d), dim - d);
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
VECTOR_TARGET void gelu(const float *x, T *out, int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) {
        const Vec v = load(x + i);
        const Vec cubic = mul(mul(v, v), splat(0.044715f));
        const Vec inner = mul(fma(cubic, v, v), splat(-1.5957691216f));
        store(out + i, div(v, add(splat(1.0f), exp(inner))));
    }
}

// A model as forward() reads it: its shape and the addresses of its tensors, read and checked once by model() from
// named fields and kept in a capsule that the Python object holding the tensors owns.
struct Model {
    int64_t n_embd, heads, head_dim, layers, capacity, vocabulary, positions, logit_columns, element_bytes;
    float epsilon;
    bool tiles = false;  // a bfloat16 model's products on AMX's tiles
    const void *wte, *wpe;
    void *cache;  // GPT2Engine.kv_cache: (2, layers, heads, capacity, head_dim)
    struct Block {
        const float *ln_1[2], *ln_2[2];         // weight, bias
        const void *packed[4];                  // attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
        const float *bias[4];
    };
    std::vector<Block> blocks;
    const float *ln_f[2];
    const void *output;  // the output layer's packed weight, its bias zeros
    const float *output_bias;
};

template <typename T>
Linear<T> linear(const void *packed, const float *bias, int64_t in, int64_t out) {
    return Linear<T>{static_cast<const T *>(packed), bias, in, out};
}

// A forward's new rows: their tokens, positions, cache slots start..end and what each sees, and the logits asked for.
struct Rows {
    std::vector<int64_t> ids, positions;
    int64_t start, end;
    Visibility visible;
    int64_t last;  // the last `last` rows' logits, into out (last x logit columns)
    float *out;
};

// The forward, in a model of dtype T.
template <typename T>
VECTOR_TARGET void forward(const Model &m, const Rows &a) {
    const auto rows = static_cast<int64_t>(a.ids.size());
    const int64_t n_embd = m.n_embd;
    const Cache<T> cache{static_cast<T *>(m.cache), m.layers, m.heads, m.capacity, m.head_dim};
    const auto *wte = static_cast<const T *>(m.wte), *wpe = static_cast<const T *>(m.wpe);
    std::vector<float> x(rows * n_embd), wide(rows * 4 * n_embd);
    std::vector<T> normed(rows * n_embd), activated(rows * 4 * n_embd);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n_embd; i++)
            x[r * n_embd + i] = to_float(wte[a.ids[r] * n_embd + i]) + to_float(wpe[a.positions[r] * n_embd + i]);
    // AMX's tiles where asked for and granted (every product's input a multiple of 32 elements: n_embd's)
    const bool tiles = m.tiles && std::is_same_v<T, bf16> && n_embd % 32 == 0 && tiles_granted();
    for (int64_t l = 0; l < m.layers; l++) {
        const Model::Block &b = m.blocks[l];
        layer_norm(x.data(), b.ln_1[0], b.ln_1[1], normed.data(), rows, n_embd, m.epsilon);
        product(normed.data(), linear<T>(b.packed[0], b.bias[0], n_embd, 3 * n_embd), wide.data(), rows, tiles);  // q, k, v
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < m.heads; h++)
                for (int64_t d = 0; d < m.head_dim; d += LANES) {
                    const float *row = wide.data() + r * 3 * n_embd + h * m.head_dim + d;
                    for (int64_t kind = 0; kind < 2; kind++)  // the key, then the value
                        store(cache.at(kind, l, h, a.start + r) + d, load(row + (kind + 1) * n_embd, m.head_dim - d),
                              m.head_dim - d);
                }
        attention(wide.data(), cache, l, a.visible, normed.data(), rows, n_embd);
        std::vector<float> &projected = wide;  // the attention read its queries already
        product(normed.data(), linear<T>(b.packed[1], b.bias[1], n_embd, n_embd), projected.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += projected[i];
        layer_norm(x.data(), b.ln_2[0], b.ln_2[1], normed.data(), rows, n_embd, m.epsilon);
        product(normed.data(), linear<T>(b.packed[2], b.bias[2], n_embd, 4 * n_embd), wide.data(), rows, tiles);
        gelu(wide.data(), activated.data(), rows * 4 * n_embd);
        product(activated.data(), linear<T>(b.packed[3], b.bias[3], 4 * n_embd, n_embd), wide.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += wide[i];
    }
    const int64_t first = rows - a.last;  // the rows whose logits are asked for
    layer_norm(x.data() + first * n_embd, m.ln_f[0], m.ln_f[1], normed.data(), a.last, n_embd, m.epsilon);
    product(normed.data(), linear<T>(m.output, m.output_bias, n_embd, m.logit_columns), a.out, a.last, tiles);
}

// A field of model()'s dict: an int, or a tensor as (address, elements) whose element count must be `elements`.
bool field(PyObject *spec, const char *name, int64_t &value) {
    PyObject *item = PyDict_GetItemString(spec, name);
    if (!item) {
        PyErr_Format(PyExc_KeyError, "model: no field %s", name);
        return false;
    }
    value = PyLong_AsLongLong(item);
    return !PyErr_Occurred();
}

template <typename P>
bool tensor(PyObject *spec, const char *name, int64_t elements, P &address) {
    PyObject *item = PyDict_GetItemString(spec, name);
    if (!item || !PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
        PyErr_Format(PyExc_KeyError, "model: field %s must be (address, elements)", name);
        return false;
    }
    const long long got = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
    address = static_cast<P>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(item, 0)));
    if (PyErr_Occurred()) return false;
    if (got != elements || !address) {
        PyErr_Format(PyExc_ValueError, "model: %s holds %lld elements where the shape needs %lld", name, got,
                     static_cast<long long>(elements));
        return false;
    }
    return true;
}

void free_model(PyObject *capsule) { delete static_cast<Model *>(PyCapsule_GetPointer(capsule, "forward.Model")); }

Model *model_of(PyObject *capsule) { return static_cast<Model *>(PyCapsule_GetPointer(capsule, "forward.Model")); }

// model(spec) -> a capsule: the model forward() and chain() run, read from a dict of named fields. Ints: n_embd,
// heads, layers, capacity (the cache's slots), vocabulary, positions, logit_columns, element_bytes (2: bfloat16, 4:
// float32); epsilon (a float); tensors, each as (address, elements): wte, wpe, cache, ln_f.weight, ln_f.bias,
// output.packed, output.bias, and per layer i "h.{i}.ln_1.weight" (and .bias, ln_2 likewise, float32) and
// "h.{i}.attn.c_attn.packed" (and .bias; attn.c_proj, mlp.c_fc and mlp.c_proj likewise: decode/native's
// pack_for_products, float32 biases padded to 16 columns).
PyObject *model(PyObject *, PyObject *spec) {
    if (!PyDict_Check(spec)) {
        PyErr_SetString(PyExc_TypeError, "model: expected a dict of named fields");
        return nullptr;
    }
    auto m = std::make_unique<Model>();
    if (!field(spec, "n_embd", m->n_embd) || !field(spec, "heads", m->heads) || !field(spec, "layers", m->layers)
        || !field(spec, "capacity", m->capacity) || !field(spec, "vocabulary", m->vocabulary)
        || !field(spec, "positions", m->positions) || !field(spec, "logit_columns", m->logit_columns)
        || !field(spec, "element_bytes", m->element_bytes))
        return nullptr;
    const int64_t n = m->n_embd;
    if (n <= 0 || n % 16 || m->heads <= 0 || n % m->heads || m->layers <= 0 || m->capacity <= 0
        || m->logit_columns <= 0 || (m->element_bytes != 2 && m->element_bytes != 4)) {
        PyErr_SetString(PyExc_ValueError, "model: n_embd a multiple of 16 and of heads, layers, slots and logit columns "
                                          "at least 1, and 2 or 4 bytes an element");
        return nullptr;
    }
    m->head_dim = n / m->heads;
    PyObject *epsilon = PyDict_GetItemString(spec, "epsilon");
    m->epsilon = epsilon ? static_cast<float>(PyFloat_AsDouble(epsilon)) : -1.0f;
    if (PyErr_Occurred() || !(m->epsilon >= 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "model: epsilon must be a float of at least 0");
        return nullptr;
    }
    const int64_t columns = (m->logit_columns + 15) / 16 * 16, per_pair = m->element_bytes == 2 ? 2 : 1;
    // a packed (in, out) weight: out padded to 16 columns, and in bfloat16 in to pairs of rows
    auto packed = [&](int64_t in, int64_t out) { return (in + per_pair - 1) / per_pair * per_pair * ((out + 15) / 16 * 16); };
    if (!tensor(spec, "wte", m->vocabulary * n, m->wte) || !tensor(spec, "wpe", m->positions * n, m->wpe)
        || !tensor(spec, "cache", 2 * m->layers * m->capacity * n, m->cache)
        || !tensor(spec, "ln_f.weight", n, m->ln_f[0]) || !tensor(spec, "ln_f.bias", n, m->ln_f[1])
        || !tensor(spec, "output.packed", packed(n, m->logit_columns), m->output)
        || !tensor(spec, "output.bias", columns, m->output_bias))
        return nullptr;
    const char *linear_names[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
    const int64_t ins[4] = {n, n, n, 4 * n}, outs[4] = {3 * n, n, 4 * n, n};
    m->blocks.resize(m->layers);
    char name[96];
    for (int64_t l = 0; l < m->layers; l++) {
        Model::Block &b = m->blocks[l];
        for (int side = 0; side < 2; side++) {
            const char *part = side ? "bias" : "weight";
            snprintf(name, sizeof name, "h.%lld.ln_1.%s", static_cast<long long>(l), part);
            if (!tensor(spec, name, n, b.ln_1[side])) return nullptr;
            snprintf(name, sizeof name, "h.%lld.ln_2.%s", static_cast<long long>(l), part);
            if (!tensor(spec, name, n, b.ln_2[side])) return nullptr;
        }
        for (int p = 0; p < 4; p++) {
            snprintf(name, sizeof name, "h.%lld.%s.packed", static_cast<long long>(l), linear_names[p]);
            if (!tensor(spec, name, packed(ins[p], outs[p]), b.packed[p])) return nullptr;
            snprintf(name, sizeof name, "h.%lld.%s.bias", static_cast<long long>(l), linear_names[p]);
            if (!tensor(spec, name, outs[p], b.bias[p])) return nullptr;
        }
    }
    PyObject *capsule = PyCapsule_New(m.get(), "forward.Model", free_model);
    if (capsule) m.release();
    return capsule;
}

// The forward of a's rows in model m, once they are checked against it: their slots, the logits asked for, their
// tokens and positions (refused as torch's embedding lookups would refuse them).
bool forward_checked(const Model &m, const Rows &a, const char *function) {
    const auto rows = static_cast<int64_t>(a.ids.size());
    if (a.end != a.start + rows || a.positions.size() != a.ids.size() || a.last < 0 || a.last > rows || a.start < 0
        || a.end > m.capacity) {
        PyErr_Format(PyExc_ValueError, "%s: the rows do not match the cache's slots", function);
        return false;
    }
    for (int64_t r = 0; r < rows; r++)
        if (a.ids[r] < 0 || a.ids[r] >= m.vocabulary || a.positions[r] < 0 || a.positions[r] >= m.positions) {
            PyErr_Format(PyExc_IndexError, "%s: token %lld or position %lld out of range", function,
                         static_cast<long long>(a.ids[r]), static_cast<long long>(a.positions[r]));
            return false;
        }
    if (m.element_bytes == 2)
        forward<bf16>(m, a);
    else
        forward<float>(m, a);
    return true;
}

// A capsule from model() and the rows' tokens and positions: a call's first three arguments.
Model *read_rows(PyObject *const *args, Rows &a) {
    Model *m = model_of(args[0]);
    if (!m || !read_ints(args[1], a.ids, "ids") || !read_ints(args[2], a.positions, "positions")) return nullptr;
    return m;
}

// blocks(model, ids, positions, start, mask, columns, last, out, out_elements)
//   model: a capsule from model(); ids, positions: lists of the new rows' tokens and positions (a list costs less to
//   make than a tensor), whose keys and values go to cache slots start..start + rows; mask: a bool (rows x columns)
//   address over the last `columns` slots, or 0 for a chain; out: the address of float32 logits (last x logit
//   columns, `out_elements` in all) of the last `last` rows.
PyObject *blocks(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes_arguments("blocks", nargs, 9)) return nullptr;
    Rows a;
    const Model *m = read_rows(args, a);
    if (!m) return nullptr;
    a.start = PyLong_AsLongLong(args[3]);
    a.end = a.start + static_cast<int64_t>(a.ids.size());
    const int64_t columns = PyLong_AsLongLong(args[5]);
    a.visible = Visibility{static_cast<const uint8_t *>(PyLong_AsVoidPtr(args[4])), columns, a.start, a.end};
    a.last = PyLong_AsLongLong(args[6]);
    a.out = static_cast<float *>(PyLong_AsVoidPtr(args[7]));
    const long long out_elements = PyLong_AsLongLong(args[8]);
    if (PyErr_Occurred()) return nullptr;
    if (out_elements != a.last * m->logit_columns || (!a.out && a.last) || columns < 0 || columns > a.end
        || (a.visible.mask && columns < static_cast<int64_t>(a.ids.size()))) {
        PyErr_SetString(PyExc_ValueError, "blocks: out must hold last x logit columns floats, and a mask cover the new "
                                          "rows within the cache's slots");
        return nullptr;
    }
    if (!forward_checked(*m, a, "blocks")) return nullptr;
    Py_RETURN_NONE;
}

// chain(model, ids, positions, start, steps, top_k, temperature, top_p, shortlist_tokens, uniforms, mapping)
//   -> (tokens, distributions or None)
// A chain drafter's `steps` draft forwards as one call (ChainDrafter.propose): the first over the new rows (from
// slot `start`, the last of them the tree's root), each later one over the token drawn after the row before, one
// position further; after each, the token that follows: the argmax when greedy (temperature 0; as row_argmax), else
// under the top-k setting a draw at the next of `uniforms` from the processed distribution (TopK.read, draw_at), each
// distribution made as `mapping()`. shortlist_tokens: the logits' column -> token array, or None.
PyObject *chain(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes_arguments("chain", nargs, 11)) return nullptr;
    Rows a;
    const Model *m = read_rows(args, a);
    if (!m) return nullptr;
    a.start = PyLong_AsLongLong(args[3]);
    const int64_t steps = PyLong_AsLongLong(args[4]);
    TopK setting;
    setting.k = PyLong_AsLongLong(args[5]);
    setting.temperature = PyFloat_AsDouble(args[6]);
    setting.top_p = PyFloat_AsDouble(args[7]);
    Int64Array column_token;
    PyObject *uniforms = args[9], *mapping = args[10];
    const bool greedy = setting.temperature == 0;
    const int64_t columns = m->logit_columns;
    if (PyErr_Occurred() || !column_token.open(args[8], "shortlist tokens") || (!greedy && !setting.check("chain")))
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
        if (!forward_checked(*m, a, "chain")) {
            Py_CLEAR(distributions);
            break;
        }
        int64_t token;
        if (greedy) {
            float largest_logit;
            const int64_t column = row_argmax(logits.data(), columns, &largest_logit);
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

// supported(bytes an element): whether this CPU runs this build's forward of a model in bfloat16 (2) or float32 (4):
// the AVX-512 build needs AVX-512 (and AVX-512 BF16 for bfloat16), the AVX2 build AVX2 and FMA.
PyObject *supported(PyObject *, PyObject *bytes) {
    const long element = PyLong_AsLong(bytes);
    if (PyErr_Occurred()) return nullptr;
    __builtin_cpu_init();
#ifdef FORWARD_AVX512
    const bool runs = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                      && __builtin_cpu_supports("avx512vl") && (element == 4 || __builtin_cpu_supports("avx512bf16"));
#else
    const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return PyBool_FromLong(runs && (element == 2 || element == 4));
}

// tiles(model, on) -> whether the model's products now run on AMX's tiles: asked for (on) and possible here (a
// bfloat16 model, n_embd a multiple of 32, a CPU with AMX-BF16); None for `on` only asks.
PyObject *tiles(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes_arguments("tiles", nargs, 2)) return nullptr;
    Model *m = model_of(args[0]);
    if (!m) return nullptr;
    const bool possible = m->element_bytes == 2 && m->n_embd % 32 == 0 && tiles_granted();
    if (args[1] == Py_None) return PyBool_FromLong(possible);
    const int on = PyObject_IsTrue(args[1]);
    if (on < 0) return nullptr;
    m->tiles = on && possible;
    return PyBool_FromLong(m->tiles);
}

PyMethodDef methods[] = {
    {"model", model, METH_O, "A model's shape and tensors, read and checked once, as a capsule."},
    {"blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(blocks)), METH_FASTCALL,
     "A GPT-2's forward over a few new rows."},
    {"chain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(chain)), METH_FASTCALL,
     "A chain drafter's draft forwards and the tokens each chooses, as one call."},
    {"supported", supported, METH_O, "Whether this CPU runs this build's forward of a model with elements of this many bytes."},
    {"tiles", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tiles)), METH_FASTCALL,
     "Sets (or, with None, asks) whether a bfloat16 model's products run on AMX's tiles."},
    {nullptr, nullptr, 0, nullptr}};

#define STRINGIFY_(name) #name
#define STRINGIFY(name) STRINGIFY_(name)
#define CONCATENATE_(a, b) a##b
#define CONCATENATE(a, b) CONCATENATE_(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(TORCH_EXTENSION_NAME), "A GPT-2's forward over a few rows.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC CONCATENATE(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
