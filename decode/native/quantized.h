// The products of forward.cpp over a weight-only quantized layer: y = x @ W + bias, W in llama.cpp's Q8_0 or Q4_0
// blocks (32 weights along the input, an int8 or 4-bit value each, one float16 scale d), packed once at load by
// decode/models/quantized.py's pack_quantized: output columns in blocks of 16, and for every 32 inputs the 16 columns'
// scales, then their values input by input (Q4_0: line k holds input k in its low nibbles, input k + 16 in its high).
// The activations stay float32: each weight q d is formed exactly in float32 as it is read (an 8-bit integer times an
// 11-bit scale), then multiplied and added as the float32 products do, so the product is the float32 product of the
// dequantized matrix, its terms added in input order. A row's sums do not depend on the call's other rows.
#pragma once

#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vectors.h"

namespace {

enum WeightFormat : int64_t { DENSE = 0, Q8_0 = 1, Q4_0 = 2 };

constexpr int64_t QUANT_BLOCK = 32;  // weights a block, along the input

// Bytes of a packed group (16 columns x 32 inputs): their scales, then their values
template <int F>
constexpr int64_t GROUP_BYTES = 32 + (F == Q8_0 ? 512 : 256);

struct QuantizedLinear {
    const uint8_t *packed;
    const float *bias;
    int64_t in, out;
};

// The bytes of a packed quantized (in, out) layer, out padded to 16 columns.
inline int64_t quantized_bytes(int64_t format, int64_t in, int64_t out) {
    return (out + 15) / 16 * (in / QUANT_BLOCK) * (format == Q8_0 ? GROUP_BYTES<Q8_0> : GROUP_BYTES<Q4_0>);
}

constexpr int64_t VECTORS_A_BLOCK = 16 / LANES;

// The LANES weight values of one line from column `first` on, as float32: Q8_0's int8s; Q4_0's nibbles (the low
// ones, or with `high` the high ones) less 8.
template <int F>
VECTOR_TARGET inline Vec values(const uint8_t *line, int64_t first, bool high) {
#ifdef FORWARD_AVX512
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(line + first));
    if constexpr (F == Q8_0) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const __m128i nibbles = _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(15));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles), _mm512_set1_epi32(8)));
#else
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(line + first));
    if constexpr (F == Q8_0) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m128i nibbles = _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(15));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(nibbles), _mm256_set1_epi32(8)));
#endif
}

// A group's 16 float16 scales as float32.
VECTOR_TARGET inline void scales_of(const uint8_t *group, float *scales) {
#ifdef FORWARD_AVX512
    _mm512_store_ps(scales, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(group))));
#else
    for (int h = 0; h < 2; h++)
        _mm256_store_ps(scales + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(group + 16 * h))));
#endif
}

// y (R rows x B blocks of 16 columns from block b0) = x @ W + bias, the sums in registers: each input's B blocks of
// weights are formed once for the R rows. Columns past `out` are not stored.
template <int F, int R, int B>
VECTOR_TARGET void quantized_tile(const float *x, const QuantizedLinear &w, float *y, int64_t r0, int64_t b0) {
    const int64_t groups = w.in / QUANT_BLOCK;
    const uint8_t *blocks[B];
    Vec acc[R][B * VECTORS_A_BLOCK];
    alignas(64) float scales[B][16];
    for (int j = 0; j < B; j++) {
        blocks[j] = w.packed + (b0 + j) * groups * GROUP_BYTES<F>;
        for (int v = 0; v < VECTORS_A_BLOCK; v++)
            for (int r = 0; r < R; r++) acc[r][j * VECTORS_A_BLOCK + v] = load(w.bias + (b0 + j) * 16 + v * LANES);
    }
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < B; j++) scales_of(blocks[j] + g * GROUP_BYTES<F>, scales[j]);
        for (int k = 0; k < QUANT_BLOCK; k++) {
            Vec weight[B * VECTORS_A_BLOCK];
            for (int j = 0; j < B; j++) {
                const uint8_t *line = blocks[j] + g * GROUP_BYTES<F> + 32 + 16 * (F == Q8_0 ? k : k % 16);
                for (int v = 0; v < VECTORS_A_BLOCK; v++)
                    weight[j * VECTORS_A_BLOCK + v] = mul(values<F>(line, v * LANES, k >= 16), load(scales[j] + v * LANES));
            }
            for (int r = 0; r < R; r++) {
                const Vec input = splat(x[(r0 + r) * w.in + g * QUANT_BLOCK + k]);
                for (int i = 0; i < B * VECTORS_A_BLOCK; i++) acc[r][i] = fma(input, weight[i], acc[r][i]);
            }
        }
    }
    for (int j = 0; j < B; j++)
        for (int v = 0; v < VECTORS_A_BLOCK; v++) {
            const int64_t column = (b0 + j) * 16 + v * LANES;
            for (int r = 0; r < R; r++) store(y + (r0 + r) * w.out + column, acc[r][j * VECTORS_A_BLOCK + v], w.out - column);
        }
}

// The rows a tile takes, and the blocks a tile of R rows covers (QUANTIZED_BLOCKS[R - 1]): sums, a step's weights
// and an input within the registers (32 with AVX-512, 16 with AVX2)
constexpr int64_t QUANTIZED_ROWS = 4;
#ifdef FORWARD_AVX512
constexpr int64_t QUANTIZED_BLOCKS[4] = {4, 4, 4, 4};
#else
constexpr int64_t QUANTIZED_BLOCKS[4] = {2, 2, 1, 1};
#endif

template <int F>
using QuantizedTile = void (*)(const float *, const QuantizedLinear &, float *, int64_t, int64_t);
template <int F, int R>
constexpr QuantizedTile<F> QUANTIZED_TILE_ROW[4] = {quantized_tile<F, R, 1>, quantized_tile<F, R, 2>,
                                                    quantized_tile<F, R, 3>, quantized_tile<F, R, 4>};
template <int F>
constexpr const QuantizedTile<F> *QUANTIZED_TILES[4] = {QUANTIZED_TILE_ROW<F, 1>, QUANTIZED_TILE_ROW<F, 2>,
                                                        QUANTIZED_TILE_ROW<F, 3>, QUANTIZED_TILE_ROW<F, 4>};

// y (rows x out) = x @ W + bias over the (up to) 64 output columns from block b0: every row, a tile's rows at a
// time, over the group's weights while they stay in cache.
template <int F>
void quantized_columns(const float *x, const QuantizedLinear &w, float *y, int64_t rows, int64_t b0) {
    const int64_t blocks = std::min<int64_t>(4, (w.out + 15) / 16 - b0);
    for (int64_t r0 = 0; r0 < rows; r0 += QUANTIZED_ROWS) {
        const int64_t r = std::min<int64_t>(QUANTIZED_ROWS, rows - r0), step = QUANTIZED_BLOCKS[r - 1];
        for (int64_t b = 0; b < blocks; b += step)
            QUANTIZED_TILES<F>[r - 1][std::min(step, blocks - b) - 1](x, w, y, r0, b0 + b);
    }
}

// y (rows x out, float32) = x (rows x in, float32) @ W + bias, W in `format`, the column groups split among torch's
// threads as the float products' are.
inline void quantized_product(int64_t format, const float *x, const QuantizedLinear &w, float *y, int64_t rows,
                              int64_t parallel_work) {
    const int64_t groups = (w.out + 63) / 64;
    const int64_t grain = rows * w.in * w.out >= parallel_work ? 1 : groups;
    at::parallel_for(0, groups, grain, [&](int64_t first, int64_t last) {
        for (int64_t g = first; g < last; g++) {
            if (format == Q8_0)
                quantized_columns<Q8_0>(x, w, y, rows, 4 * g);
            else
                quantized_columns<Q4_0>(x, w, y, rows, 4 * g);
        }
    });
}

}  // namespace
