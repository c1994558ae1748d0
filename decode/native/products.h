// The products of forward.cpp: y = x @ W + bias over a linear layer packed once at load, in groups of 64 output
// columns split over torch's threads, every row of the call using a group's weights while they are in cache. The
// tiles keep their sums in registers (AVX-512 or AVX2 with FMA, by the build's defines) or, a bfloat16 model on a
// CPU with AMX, in its tile unit. A row's sums add up in the same order whatever the call's other rows.
#pragma once

#include <immintrin.h>

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

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
// tile of R rows covers: their sums in up to 12 of the 16 registers, with room for a step's weights and an input. A
// bfloat16 tile of 2 rows takes one block: over two, its sums and widened weights outgrow the registers.
template <typename T>
constexpr int64_t ROWS_A_TILE = std::is_same_v<T, bf16> ? 4 : 6;
// Whether a tile fetches the weights a product reads next, while it computes
constexpr bool PREFETCH = true;
template <typename T>
constexpr int64_t BLOCKS_A_TILE[6] = {4, std::is_same_v<T, bf16> ? 1 : 2, std::is_same_v<T, bf16> ? 1 : 2, 1, 1, 1};
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

// y (rows x out, float32) = x (rows x in) @ W + bias over the (up to) 64 output columns from block b0 (of 16 columns)
// to block `end`: every row, a tile's rows at a time, over the group's weights while they stay in cache.
template <typename T>
void product_columns(const Input<T> *x, const Linear<T> &w, float *y, int64_t rows, int64_t b0, int64_t end) {
    const int64_t all = (w.out + 15) / 16, blocks = std::min<int64_t>(4, end - b0), steps = w.in / ROWS_A_STEP<T>;
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

// Multiply-adds past which a product's column blocks are split among torch's threads: waking them costs a few
// microseconds, a product of this size some tens.
constexpr int64_t PARALLEL_WORK = 1 << 18;

#if TILES_BUILD
// The same products on AMX's tile unit (TDPBF16PS), for a bfloat16 model on a CPU that has it: the packed weights
// of a block of 16 columns are, 16 steps at a time, the tile B the instruction reads (16 rows of 16 column pairs),
// the input's rows 32 elements at a time the tile A (up to 16 rows), each block's sums a tile C of 16 float32
// columns. A pass over 16 rows or fewer keeps 4 blocks' sums in tiles 0-3, the input in tile 4 and weights in tiles
// 5 and 6 in turn; past 16 rows, two passes run at once (16 rows and up to 16 after them, 2 blocks), each weight tile
// read once for both.
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_a_row[16];
    uint8_t rows[16];
};

// The rows of each of the 8 tiles (64 bytes each; 0: unused).
using TileRows = std::array<uint8_t, 8>;

// One pass over m rows (tiled_pass): 4 blocks' sums in tiles 0-3, the input in tile 4, weights in tiles 5 and 6.
TileRows one_pass(int64_t m) {
    const auto r = static_cast<uint8_t>(m);
    return {r, r, r, r, r, 16, 16, 0};
}

// Two passes at once (tiled_pair), over 16 rows and the m after them: the first's 2 blocks' sums in tiles 0-1 and
// its input in tile 4, the second's in tiles 2-3 and 5, weights in tiles 6 and 7.
TileRows two_passes(int64_t m) {
    const auto r = static_cast<uint8_t>(m);
    return {16, 16, r, r, 16, r, 16, 16};
}

// Sets this thread's tiles to `rows` unless `configured` says they are set so already.
AMX_TARGET void configure_tiles(const TileRows &rows, TileRows &configured) {
    if (rows == configured) return;
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_a_row[t] = rows[t] ? 64 : 0;
        config.rows[t] = rows[t];
    }
    _tile_loadconfig(&config);
    configured = rows;
}

// Rows r0..r0 + m of y, block `block`'s columns: a tile's sums (16 a row, stored) plus the bias; the columns past
// `out` (an output layer's) are not stored.
AMX_TARGET inline void store_sums(const float *sums, const Linear<bf16> &w, float *y, int64_t r0, int64_t m,
                                  int64_t block) {
    const int64_t column = block * 16;
    const __m512 bias = _mm512_loadu_ps(w.bias + column);
    for (int64_t r = 0; r < m; r++)
        _mm512_mask_storeu_ps(y + (r0 + r) * w.out + column, first_lanes(w.out - column),
                              _mm512_add_ps(_mm512_load_ps(sums + 16 * r), bias));
}

// The tile products of up to 16 rows with B (up to 4) blocks of 16 columns, their sums stored into `sums` (a block's
// 16 x 16 float32): the rows (`a`, `stride` bytes apart), 32 inputs at a time, in tile 4; the step's tile of block j
// (`tile_b(j, k)`: 16 rows of 64 bytes, input pairs k / 2.. by 16 columns) in tiles 5 and 6 in turn; block j's sums in
// tile j (one_pass's configuration).
template <int B, typename TileB>
AMX_TARGET inline void tile_sums(const bf16 *a, int64_t stride, int64_t in, TileB tile_b, float (*sums)[16 * 16]) {
    _tile_zero(0);
    if constexpr (B > 1) _tile_zero(1);
    if constexpr (B > 2) _tile_zero(2);
    if constexpr (B > 3) _tile_zero(3);
    for (int64_t k = 0; k < in; k += 32) {
        _tile_loadd(4, a + k, stride);
        _tile_loadd(5, tile_b(0, k), 64);
        _tile_dpbf16ps(0, 4, 5);
        if constexpr (B > 1) {
            _tile_loadd(6, tile_b(1, k), 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if constexpr (B > 2) {
            _tile_loadd(5, tile_b(2, k), 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if constexpr (B > 3) {
            _tile_loadd(6, tile_b(3, k), 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    _tile_stored(0, sums[0], 64);
    if constexpr (B > 1) _tile_stored(1, sums[1], 64);
    if constexpr (B > 2) _tile_stored(2, sums[2], 64);
    if constexpr (B > 3) _tile_stored(3, sums[3], 64);
}

// Rows r0..r0 + m (m <= 16) of y over B blocks from block b0 in one pass.
template <int B>
AMX_TARGET void tiled_pass(const bf16 *x, const Linear<bf16> &w, float *y, int64_t r0, int64_t m, int64_t b0,
                           TileRows &configured) {
    const int64_t steps = w.in / 2;
    const bf16 *weights = w.packed + b0 * steps * 32;
    alignas(64) float sums[B][16 * 16];
    configure_tiles(one_pass(m), configured);
    tile_sums<B>(x + r0 * w.in, w.in * sizeof(bf16), w.in,
                 [&](int j, int64_t k) { return weights + j * steps * 32 + k * 16; }, sums);
    for (int j = 0; j < B; j++) store_sums(sums[j], w, y, r0, m, b0 + j);
}

// Rows r0..r0 + 16 + m (m <= 16) of y over B (1 or 2) blocks from block b0: two passes at once, each weight tile
// multiplying both passes' inputs. A row's sums are the same products in the same order as in tiled_pass.
template <int B>
AMX_TARGET void tiled_pair(const bf16 *x, const Linear<bf16> &w, float *y, int64_t r0, int64_t m, int64_t b0,
                           TileRows &configured) {
    const int64_t steps = w.in / 2;
    const bf16 *weights = w.packed + b0 * steps * 32;
    alignas(64) float sums[2][B][16 * 16];
    configure_tiles(two_passes(m), configured);
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (B > 1) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < w.in; k += 32) {
        _tile_loadd(4, x + r0 * w.in + k, w.in * sizeof(bf16));
        _tile_loadd(5, x + (r0 + 16) * w.in + k, w.in * sizeof(bf16));
        _tile_loadd(6, weights + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (B > 1) {
            _tile_loadd(7, weights + steps * 32 + k * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0][0], 64);
    _tile_stored(2, sums[1][0], 64);
    if constexpr (B > 1) {
        _tile_stored(1, sums[0][1], 64);
        _tile_stored(3, sums[1][1], 64);
    }
    for (int j = 0; j < B; j++) {
        store_sums(sums[0][j], w, y, r0, 16, b0 + j);
        store_sums(sums[1][j], w, y, r0 + 16, m, b0 + j);
    }
}

// y (rows x out) = x @ W + bias over B blocks of 16 columns from block b0: 32 rows at a time in pairs of passes
// (tiled_pair, two blocks at a time), the last 16 or fewer in one pass (tiled_pass).
template <int B>
AMX_TARGET void tiled_columns(const bf16 *x, const Linear<bf16> &w, float *y, int64_t rows, int64_t b0,
                              TileRows &configured) {
    int64_t r0 = 0;
    for (; rows - r0 > 16; r0 += 32) {
        const int64_t m = std::min<int64_t>(16, rows - r0 - 16);
        for (int64_t j = 0; j < B; j += 2)
            if (B - j >= 2)
                tiled_pair<2>(x, w, y, r0, m, b0 + j, configured);
            else
                tiled_pair<1>(x, w, y, r0, m, b0 + j, configured);
    }
    if (r0 < rows) tiled_pass<B>(x, w, y, r0, rows - r0, b0, configured);
}

AMX_TARGET void release_tiles() { _tile_release(); }

using TiledColumns = void (*)(const bf16 *, const Linear<bf16> &, float *, int64_t, int64_t, TileRows &);
constexpr TiledColumns TILED[4] = {tiled_columns<1>, tiled_columns<2>, tiled_columns<3>, tiled_columns<4>};
#endif

enum TileProducts { BF16_TILES, INT8_TILES };

// Whether this process may use AMX's tiles for `products` (AMX-BF16's or AMX-INT8's): the CPU has them and Linux
// granted the tiles' state (asked once).
bool tiles_granted(TileProducts products = BF16_TILES) {
#if TILES_BUILD
    static const bool granted = [] {
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("amx-tile")) return false;
        constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return granted && (products == BF16_TILES ? __builtin_cpu_supports("amx-bf16") : __builtin_cpu_supports("amx-int8"));
#else
    (void)products;
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
// of 32, tiles_granted()). The threads share the columns in blocks of 16, each taking its run of blocks 4 at a time:
// groups of 4 blocks would not share evenly (SmolLM2's 576 columns are 9 groups, 5 and 4 for two threads).
template <typename T>
void product(const T *rows_in, const Linear<T> &w, float *y, int64_t rows, bool tiles) {
    static thread_local std::vector<float> room;
    const Input<T> *x = as_input(rows_in, rows * w.in, room);
    const int64_t blocks = (w.out + 15) / 16;
    const int64_t grain = rows * w.in * w.out >= PARALLEL_WORK ? 1 : blocks;  // a chunk this big runs in this thread
    at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
#if TILES_BUILD
        if constexpr (std::is_same_v<T, bf16>) {
            if (tiles) {
                TileRows configured{};
                for (int64_t b = first; b < last; b += 4)
                    TILED[std::min<int64_t>(4, last - b) - 1](x, w, y, rows, b, configured);
                release_tiles();
                return;
            }
        }
#endif
        for (int64_t b = first; b < last; b += 4) product_columns(x, w, y, rows, b, last);
    });
}

}  // namespace
