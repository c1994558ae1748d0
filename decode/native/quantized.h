// The products of forward.cpp over a weight-only quantized layer: y = x @ W + bias, W in llama.cpp's Q8_0 or Q4_0
// blocks (32 weights along the input, an int8 or a 4-bit value each, one float16 scale d), as llama.cpp computes
// them: each row's inputs quantized block by block to int8 (a float32 scale each, Q8_0's rule), the blocks' dot
// products summed exactly in int32, then scaled by the two scales and added in float32.
//
// Packed once at load by decode/native's pack_quantized: output columns in blocks of 16, and for every 32 inputs the
// 16 columns' scales (32 bytes), then their values in lines of 64 bytes, byte 4j + t of line m holding column j's
// value for input 4m + t (Q8_0: 8 lines, int8) or, Q4_0, input 4m + t in its low nibble and 16 + 4m + t in its high
// one (4 lines, as each column's llama.cpp block pairs inputs k and k + 16). A line is the operand of AVX-512 VNNI's
// dot product of 4 bytes a lane (VPDPBUSD) against 4 of a row's inputs broadcast; AVX2 forms the same sums with
// VPMADDUBSW and VPMADDWD. Both are exact: a row's sums do not depend on the call's other rows, nor on the build.
#pragma once

#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "products.h"
#include "vectors.h"

#ifdef FORWARD_AVX512
#define QUANTIZED_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma,f16c")))
#else
#define QUANTIZED_TARGET __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

enum WeightFormat : int64_t { DENSE = 0, Q8_0 = 1, Q4_0 = 2 };

constexpr int64_t QUANT_BLOCK = 32;  // weights a block, along the input

// 64-byte lines of values in a packed group (16 columns x 32 inputs), and the group's bytes with its scales
template <int F>
constexpr int64_t LINES = F == Q8_0 ? 8 : 4;
template <int F>
constexpr int64_t GROUP_BYTES = 32 + 64 * LINES<F>;

struct QuantizedLinear {
    const uint8_t *packed;
    const float *bias;
    int64_t in, out;
};

// The bytes of a packed quantized (in, out) layer, out padded to 16 columns.
inline int64_t quantized_bytes(int64_t format, int64_t in, int64_t out) {
    return (out + 15) / 16 * (in / QUANT_BLOCK) * (format == Q8_0 ? GROUP_BYTES<Q8_0> : GROUP_BYTES<Q4_0>);
}

// (a superset of VECTOR_TARGET's sets, so that the vector helpers inline into the products)
// Whether this CPU runs this build's quantized products: AVX-512 VNNI, or AVX2 and F16C.
inline bool quantized_supported() {
    __builtin_cpu_init();
#ifdef FORWARD_AVX512
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c");
#else
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
}

// A call's rows as the products read them: each block of 32 inputs as int8 values v = round(x / s), s = max |x| / 127
// (0 for a block of zeros), with s and the sum of the v.
struct QuantizedRows {
    std::vector<uint8_t> values;  // rows x in
    std::vector<float> scales;    // rows x in / 32
    std::vector<int32_t> sums;    // rows x in / 32
    int64_t in = 0;
};

#ifdef FORWARD_AVX512
using Ints = __m512i;
constexpr int64_t INT_VECTORS_A_BLOCK = 1;

QUANTIZED_TARGET inline Ints int_zeros() { return _mm512_setzero_si512(); }
QUANTIZED_TARGET inline Ints line_part(const uint8_t *line, int) { return _mm512_loadu_si512(line); }
QUANTIZED_TARGET inline __m512 block_scales(const uint8_t *group, int) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(group)));
}
// sums + the 4-byte dot products of each lane: unsigned bytes `u` with signed bytes `s`
QUANTIZED_TARGET inline Ints dot4(Ints sums, Ints u, Ints s) { return _mm512_dpbusd_epi32(sums, u, s); }
QUANTIZED_TARGET inline Ints low_nibbles(Ints v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
QUANTIZED_TARGET inline Ints high_nibbles(Ints v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
QUANTIZED_TARGET inline Ints splat4(const uint8_t *bytes) {
    int32_t word;
    std::memcpy(&word, bytes, sizeof word);
    return _mm512_set1_epi32(word);
}
QUANTIZED_TARGET inline Ints sub_ints(Ints a, Ints b) { return _mm512_sub_epi32(a, b); }
QUANTIZED_TARGET inline Ints add_ints(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
QUANTIZED_TARGET inline int32_t int_sum(Ints v) { return _mm512_reduce_add_epi32(v); }
// round(x * inverse) (to nearest, ties to even: the default rounding mode), within [-127, 127]
QUANTIZED_TARGET inline Ints row_values(Vec x, Vec inverse) {
    return _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(mul(x, inverse)), _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}
// A block's 32 values (2 vectors of int32) as bytes
QUANTIZED_TARGET inline void store_bytes(const Ints *v, uint8_t *out) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(out), _mm512_cvtepi32_epi8(v[0]));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(out + 16), _mm512_cvtepi32_epi8(v[1]));
}
QUANTIZED_TARGET inline Ints splat_int(int32_t v) { return _mm512_set1_epi32(v); }
QUANTIZED_TARGET inline __m512 to_floats(Ints v) { return _mm512_cvtepi32_ps(v); }
// A Q8_0 line as q8_dot's weights operand: each value v as v + 128, VPDPBUSD's unsigned operand (one XOR a line,
// shared by a tile's rows; the sums then carry 128 times the row's values, taken off after)
QUANTIZED_TARGET inline Ints q8_weights(Ints line) { return _mm512_xor_si512(line, _mm512_set1_epi8(static_cast<char>(0x80))); }
// A Q8_0 line's dot products with 4 row values
QUANTIZED_TARGET inline Ints q8_dot(Ints sums, Ints row, Ints weights) { return dot4(sums, weights, row); }
// What a Q8_0 product's sums carry beyond the exact ones: this times the sum of the row's values in the block
constexpr int32_t Q8_OFFSET = 128;
#else
using Ints = __m256i;
constexpr int64_t INT_VECTORS_A_BLOCK = 2;

QUANTIZED_TARGET inline Ints int_zeros() { return _mm256_setzero_si256(); }
QUANTIZED_TARGET inline Ints line_part(const uint8_t *line, int h) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(line + 32 * h));
}
QUANTIZED_TARGET inline __m256 block_scales(const uint8_t *group, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(group + 16 * h)));
}
// sums + the 4-byte dot products of each lane: unsigned bytes `u` with signed bytes `s`, where no two neighbouring
// products pass 32767 (VPMADDUBSW saturates its 16-bit pairs): a nibble by a value, or |v| by a value
QUANTIZED_TARGET inline Ints dot4(Ints sums, Ints u, Ints s) {
    return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
QUANTIZED_TARGET inline Ints low_nibbles(Ints v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
QUANTIZED_TARGET inline Ints high_nibbles(Ints v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
QUANTIZED_TARGET inline Ints splat4(const uint8_t *bytes) {
    int32_t word;
    std::memcpy(&word, bytes, sizeof word);
    return _mm256_set1_epi32(word);
}
QUANTIZED_TARGET inline Ints sub_ints(Ints a, Ints b) { return _mm256_sub_epi32(a, b); }
QUANTIZED_TARGET inline Ints add_ints(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
QUANTIZED_TARGET inline int32_t int_sum(Ints v) {
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 0xb1)));
}
QUANTIZED_TARGET inline Ints row_values(Vec x, Vec inverse) {
    return _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(mul(x, inverse)), _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}
// A block's 32 values (4 vectors of int32) as bytes: the saturating packs (exact within [-127, 127]) interleave the
// 128-bit halves, 4 bytes of one vector at a time, which the permutation puts back in order
QUANTIZED_TARGET inline void store_bytes(const Ints *v, uint8_t *out) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
QUANTIZED_TARGET inline Ints splat_int(int32_t v) { return _mm256_set1_epi32(v); }
QUANTIZED_TARGET inline __m256 to_floats(Ints v) { return _mm256_cvtepi32_ps(v); }
QUANTIZED_TARGET inline Ints q8_weights(Ints line) { return line; }
// A Q8_0 line's dot products with 4 row values: |v| by the weight with v's sign, each pair within 2 x 127 x 127
QUANTIZED_TARGET inline Ints q8_dot(Ints sums, Ints row, Ints weights) {
    return dot4(sums, _mm256_sign_epi8(row, row), _mm256_sign_epi8(weights, row));
}
constexpr int32_t Q8_OFFSET = 0;
#endif

template <typename T>
QUANTIZED_TARGET void quantize_rows(const T *x, int64_t rows, int64_t in, QuantizedRows &q) {
    const int64_t blocks = in / QUANT_BLOCK;
    q.in = in;
    q.values.resize(rows * in);
    q.scales.resize(rows * blocks);
    q.sums.resize(rows * blocks);
    alignas(64) float block[QUANT_BLOCK];
    for (int64_t b = 0; b < rows * blocks; b++) {
        if constexpr (std::is_same_v<T, float>)
            std::memcpy(block, x + b * QUANT_BLOCK, sizeof block);
        else
            widen(x + b * QUANT_BLOCK, block, QUANT_BLOCK);
        Vec magnitude = zeros();
        for (int64_t k = 0; k < QUANT_BLOCK; k += LANES) magnitude = max(magnitude, max(load(block + k), sub(zeros(), load(block + k))));
        const float scale = largest(magnitude) / 127, inverse = scale ? 1 / scale : 0;
        Ints values[QUANT_BLOCK / LANES], sum = int_zeros();
        for (int64_t k = 0; k < QUANT_BLOCK / LANES; k++) {
            values[k] = row_values(load(block + k * LANES), splat(inverse));
            sum = add_ints(sum, values[k]);
        }
        store_bytes(values, q.values.data() + b * QUANT_BLOCK);
        q.scales[b] = scale;
        q.sums[b] = int_sum(sum);
    }
}

// y (R rows x B blocks of 16 columns from block b0) = x @ W + bias: for each group of 32 inputs, the int32 dot
// products of every row with each column's values (each line loaded once for the R rows), less the offset the
// unsigned operand carries (the sum of the row's values times 8 for Q4_0, times Q8_OFFSET for Q8_0), then scaled by
// the column's scale times the row's and added to the float32 sums in input order. Columns past `out` are not stored.
// Groups ahead whose lines a tile fetches as it computes: its blocks are read as several streams at once, which the
// hardware's prefetching alone follows too late (measured: decode.bench_engine's quantized curves)
constexpr int64_t PREFETCH_GROUPS = 16;

template <int F, int R, int B>
QUANTIZED_TARGET void quantized_tile(const QuantizedRows &x, const QuantizedLinear &w, float *y, int64_t r0, int64_t b0) {
    constexpr int V = INT_VECTORS_A_BLOCK;
    const int64_t groups = w.in / QUANT_BLOCK;
    const uint8_t *blocks[B];
    Vec acc[R][B * V];
    for (int j = 0; j < B; j++) {
        blocks[j] = w.packed + (b0 + j) * groups * GROUP_BYTES<F>;
        for (int v = 0; v < V; v++)
            for (int r = 0; r < R; r++) acc[r][j * V + v] = load(w.bias + (b0 + j) * 16 + v * LANES);
    }
    for (int64_t g = 0; g < groups; g++) {
        if (g + PREFETCH_GROUPS < groups)
            for (int j = 0; j < B; j++)
                for (int64_t line = 0; line < GROUP_BYTES<F>; line += 64)
                    _mm_prefetch(reinterpret_cast<const char *>(blocks[j] + (g + PREFETCH_GROUPS) * GROUP_BYTES<F> + line), _MM_HINT_T0);
        Ints sums[R][B * V];
        for (int i = 0; i < B * V; i++)
            for (int r = 0; r < R; r++) sums[r][i] = int_zeros();
        const uint8_t *rows[R];
        for (int r = 0; r < R; r++) rows[r] = x.values.data() + (r0 + r) * x.in + g * QUANT_BLOCK;
        for (int m = 0; m < LINES<F>; m++)
            for (int j = 0; j < B; j++)
                for (int v = 0; v < V; v++) {
                    const Ints line = line_part(blocks[j] + g * GROUP_BYTES<F> + 32 + 64 * m, v);
                    if constexpr (F == Q8_0) {
                        const Ints weights = q8_weights(line);
                        for (int r = 0; r < R; r++) sums[r][j * V + v] = q8_dot(sums[r][j * V + v], splat4(rows[r] + 4 * m), weights);
                    } else {
                        const Ints low = low_nibbles(line), high = high_nibbles(line);
                        for (int r = 0; r < R; r++) {
                            sums[r][j * V + v] = dot4(sums[r][j * V + v], low, splat4(rows[r] + 4 * m));
                            sums[r][j * V + v] = dot4(sums[r][j * V + v], high, splat4(rows[r] + 16 + 4 * m));
                        }
                    }
                }
        Vec scales[B * V];
        for (int j = 0; j < B; j++)
            for (int v = 0; v < V; v++) scales[j * V + v] = block_scales(blocks[j] + g * GROUP_BYTES<F>, v);
        for (int r = 0; r < R; r++) {
            const int64_t block = (r0 + r) * groups + g;
            const Vec row_scale = splat(x.scales[block]);
            const Ints row_offset = splat_int((F == Q8_0 ? Q8_OFFSET : 8) * x.sums[block]);
            for (int i = 0; i < B * V; i++) {
                const Ints exact = sub_ints(sums[r][i], row_offset);
                acc[r][i] = fma(to_floats(exact), mul(scales[i], row_scale), acc[r][i]);
            }
        }
    }
    for (int j = 0; j < B; j++)
        for (int v = 0; v < V; v++) {
            const int64_t column = (b0 + j) * 16 + v * LANES;
            for (int r = 0; r < R; r++) store(y + (r0 + r) * w.out + column, acc[r][j * V + v], w.out - column);
        }
}

// The rows a tile takes, and the blocks a tile of R rows covers (QUANTIZED_BLOCKS[R - 1]): its int32 and float32
// sums, a line and the rows' values within the registers (32 with AVX-512, 16 with AVX2)
constexpr int64_t QUANTIZED_ROWS = 4;
#ifdef FORWARD_AVX512
constexpr int64_t QUANTIZED_BLOCKS[4] = {4, 4, 2, 2};
#else
constexpr int64_t QUANTIZED_BLOCKS[4] = {2, 1, 1, 1};
#endif

template <int F>
using QuantizedTile = void (*)(const QuantizedRows &, const QuantizedLinear &, float *, int64_t, int64_t);
template <int F, int R>
constexpr QuantizedTile<F> QUANTIZED_TILE_ROW[4] = {quantized_tile<F, R, 1>, quantized_tile<F, R, 2>,
                                                    quantized_tile<F, R, 3>, quantized_tile<F, R, 4>};
template <int F>
constexpr const QuantizedTile<F> *QUANTIZED_TILES[4] = {QUANTIZED_TILE_ROW<F, 1>, QUANTIZED_TILE_ROW<F, 2>,
                                                        QUANTIZED_TILE_ROW<F, 3>, QUANTIZED_TILE_ROW<F, 4>};

// y (rows x out) = x @ W + bias over the (up to) 64 output columns from block b0 (of 16 columns) to block `end`:
// every row, a tile's rows at a time, over the group's weights while they stay in cache.
template <int F>
void quantized_columns(const QuantizedRows &x, const QuantizedLinear &w, float *y, int64_t rows, int64_t b0,
                       int64_t end) {
    const int64_t blocks = std::min<int64_t>(4, end - b0);
    for (int64_t r0 = 0; r0 < rows; r0 += QUANTIZED_ROWS) {
        const int64_t r = std::min<int64_t>(QUANTIZED_ROWS, rows - r0), step = QUANTIZED_BLOCKS[r - 1];
        for (int64_t b = 0; b < blocks; b += step)
            QUANTIZED_TILES<F>[r - 1][std::min(step, blocks - b) - 1](x, w, y, r0, b0 + b);
    }
}

#if TILES_BUILD
#define INT8_TILES_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma,f16c,amx-tile,amx-int8")))

// The same products on AMX's tile unit, where the CPU has AMX-INT8: a group's lines are the tile B that TDPBSSD
// reads (8 rows of the 16 columns' 4 values for 4 inputs; Q4_0's nibbles first set one to a byte, the 16 low
// ones' lines then the 16 high ones', for TDPBSUD), the rows' values for the group's 32 inputs the tile A (up to 16
// rows), each block's int32 sums a tile C. Integer sums are exact: a row's products are bit for bit those of the
// dot products above, whichever runs. Tiles 0-3 hold the sums of 4 blocks, tile 4 the rows, tiles 5-7 weights.
INT8_TILES_TARGET void configure_int8_tiles(int64_t rows) {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_a_row[t] = t == 4 ? QUANT_BLOCK : 64;
        config.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 8);
    }
    _tile_loadconfig(&config);
}

// A group's 8 lines of weights as tile B reads them: Q8_0's as packed; Q4_0's unpacked into `room`, one value a byte
template <int F>
INT8_TILES_TARGET const uint8_t *weight_lines(const uint8_t *group, uint8_t *room) {
    if constexpr (F == Q8_0) {
        return group + 32;
    } else {
        for (int m = 0; m < LINES<F>; m++) {
            const __m512i line = _mm512_loadu_si512(group + 32 + 64 * m);
            _mm512_store_si512(room + 64 * m, low_nibbles(line));
            _mm512_store_si512(room + 64 * (LINES<F> + m), high_nibbles(line));
        }
        return room;
    }
}

// Block J's sums over a group into tile J, its weights (`lines`) in tile W (the instructions name tiles by number)
#define INT8_TILE_SUMS(J, W, lines)                                                 \
    do {                                                                            \
        _tile_zero(J);                                                              \
        _tile_loadd(W, lines, 64);                                                  \
        if constexpr (F == Q8_0) _tile_dpbssd(J, 4, W); else _tile_dpbsud(J, 4, W); \
    } while (0)

// y (rows x out) = x @ W + bias over B blocks of 16 columns from block b0, 16 rows at a time (the tiles configured
// for `configured` rows; set again for fewer): each group's int32 sums from the tiles, then scaled and added to the
// float32 sums as quantized_tile does. The tiles sum a group while the vector units scale the group before (its sums
// stored a group earlier, so that they are in memory when read), and Q4_0's weights are unpacked a group ahead.
template <int F, int B>
INT8_TILES_TARGET void tiled_quantized_columns(const QuantizedRows &x, const QuantizedLinear &w, float *y, int64_t rows,
                                               int64_t b0, int64_t &configured) {
    const int64_t groups = w.in / QUANT_BLOCK;
    const uint8_t *blocks[B];
    for (int j = 0; j < B; j++) blocks[j] = w.packed + (b0 + j) * groups * GROUP_BYTES<F>;
    alignas(64) int32_t sums[2][B][16 * 16];  // a group's, by its parity
    alignas(64) uint8_t room[2][B][8 * 64];   // Q4_0's unpacked lines, by the group's parity
    alignas(64) float acc[16][B * 16];
    const uint8_t *lines[2][B];
    const auto unpack = [&](int64_t g) INT8_TILES_TARGET {
        for (int j = 0; j < B; j++) lines[g % 2][j] = weight_lines<F>(blocks[j] + g * GROUP_BYTES<F>, room[g % 2][j]);
    };
    // the float32 sums of group g's block sums (tile-stored at sums[g % 2])
    const auto scale = [&](int64_t r0, int64_t m, int64_t g) INT8_TILES_TARGET {
        Vec scales[B];
        for (int j = 0; j < B; j++) scales[j] = block_scales(blocks[j] + g * GROUP_BYTES<F>, 0);
        for (int64_t r = 0; r < m; r++) {
            const int64_t block = (r0 + r) * groups + g;
            const Vec row_scale = splat(x.scales[block]);
            const Ints row_offset = splat_int(F == Q8_0 ? 0 : 8 * x.sums[block]);
            for (int j = 0; j < B; j++) {
                const Ints exact = sub_ints(_mm512_load_si512(sums[g % 2][j] + 16 * r), row_offset);
                store(acc[r] + 16 * j, fma(to_floats(exact), mul(scales[j], row_scale), load(acc[r] + 16 * j)));
            }
        }
    };
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t m = std::min<int64_t>(16, rows - r0);
        if (m != configured) configure_int8_tiles(configured = m);
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < B; j++) store(acc[r] + 16 * j, load(w.bias + (b0 + j) * 16));
        unpack(0);
        for (int64_t g = 0; g < groups; g++) {
            if (g + PREFETCH_GROUPS < groups)
                for (int j = 0; j < B; j++)
                    for (int64_t line = 0; line < GROUP_BYTES<F>; line += 64)
                        _mm_prefetch(reinterpret_cast<const char *>(blocks[j] + (g + PREFETCH_GROUPS) * GROUP_BYTES<F> + line), _MM_HINT_T0);
            _tile_loadd(4, x.values.data() + r0 * x.in + g * QUANT_BLOCK, x.in);
            INT8_TILE_SUMS(0, 5, lines[g % 2][0]);
            if constexpr (B > 1) INT8_TILE_SUMS(1, 6, lines[g % 2][1]);
            if constexpr (B > 2) INT8_TILE_SUMS(2, 7, lines[g % 2][2]);
            if constexpr (B > 3) INT8_TILE_SUMS(3, 5, lines[g % 2][3]);
            if (g + 1 < groups) unpack(g + 1);
            if (g > 0) scale(r0, m, g - 1);
            _tile_stored(0, sums[g % 2][0], 64);
            if constexpr (B > 1) _tile_stored(1, sums[g % 2][1], 64);
            if constexpr (B > 2) _tile_stored(2, sums[g % 2][2], 64);
            if constexpr (B > 3) _tile_stored(3, sums[g % 2][3], 64);
        }
        scale(r0, m, groups - 1);
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < B; j++) {
                const int64_t column = (b0 + j) * 16;
                store(y + (r0 + r) * w.out + column, load(acc[r] + 16 * j), w.out - column);
            }
    }
}
#undef INT8_TILE_SUMS

template <int F>
using TiledQuantizedColumns = void (*)(const QuantizedRows &, const QuantizedLinear &, float *, int64_t, int64_t, int64_t &);
template <int F>
constexpr TiledQuantizedColumns<F> TILED_QUANTIZED[4] = {tiled_quantized_columns<F, 1>, tiled_quantized_columns<F, 2>,
                                                         tiled_quantized_columns<F, 3>, tiled_quantized_columns<F, 4>};
#endif

// The fewest rows whose products run on AMX's tiles where a quantized model's do: a call of fewer reads its weights
// from memory sooner as dot products, whose sums are the same (measured: decode.bench_engine on a Q8_0 and a Q4_0
// model, docs/profiling.md)
constexpr int64_t QUANTIZED_TILE_ROWS = 8;

// y over the column blocks first..last (16 columns each) of W in format F, up to 4 at a time, on AMX's tiles with
// `tiles`
template <int F>
void quantized_blocks(const QuantizedRows &x, const QuantizedLinear &w, float *y, int64_t rows, int64_t first,
                      int64_t last, bool tiles) {
#if TILES_BUILD
    if (tiles) {
        int64_t configured = 0;
        for (int64_t b = first; b < last; b += 4)
            TILED_QUANTIZED<F>[std::min<int64_t>(4, last - b) - 1](x, w, y, rows, b, configured);
        release_tiles();
        return;
    }
#else
    (void)tiles;
#endif
    for (int64_t b = first; b < last; b += 4) quantized_columns<F>(x, w, y, rows, b, last);
}

// y (rows x out, float32) = x (rows x in, the model's dtype) @ W + bias, W in `format`: the rows quantized once, the
// column blocks split among torch's threads as the other products' are; on AMX's tiles with `tiles`
// (tiles_granted(INT8_TILES)) from QUANTIZED_TILE_ROWS rows on, with the same bits.
template <typename T>
void quantized_product(int64_t format, const T *input, const QuantizedLinear &w, float *y, int64_t rows,
                       int64_t parallel_work, bool tiles) {
    static thread_local QuantizedRows room;
    QuantizedRows &x = room;  // the caller's: a thread_local named in the lambda would be each worker thread's own
    quantize_rows(input, rows, w.in, x);
    const int64_t blocks = (w.out + 15) / 16;
    const int64_t grain = rows * w.in * w.out >= parallel_work ? 1 : blocks;
    const bool tiled = tiles && rows >= QUANTIZED_TILE_ROWS;
    at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
        if (format == Q8_0)
            quantized_blocks<Q8_0>(x, w, y, rows, first, last, tiled);
        else
            quantized_blocks<Q4_0>(x, w, y, rows, first, last, tiled);
    });
}

}  // namespace
