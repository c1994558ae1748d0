// The parts of forward.cpp's layers that run a row at a time: layer norm and RMS norm, rotary positions, attention of
// the new rows over the cache (its heads split over torch's threads, a tree's mask for what each row sees, the query
// heads that share a key/value head scored together), GELU and SwiGLU, in float32 a vector at a time (a bfloat16
// model's attention scores, with AMX, on its tiles). A row's attention adds its terms by the rank of the slots it
// sees, not by where they lie in the cache.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "products.h"
#include "vectors.h"

namespace {

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

// RMS norm of each row of x (rows x n, n a multiple of 16) into out in the model's dtype: x / sqrt(mean(x^2) + epsilon)
// times the weight, as Llama's RMSNorm computes it.
template <typename T>
VECTOR_TARGET void rms_norm(const float *x, const float *weight, T *out, int64_t rows, int64_t n, float epsilon) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        Vec square = zeros();
        for (int64_t i = 0; i < n; i += LANES) square = fma(load(row + i), load(row + i), square);
        const Vec scale = splat(1.0f / std::sqrt(sum(square) / n + epsilon));
        for (int64_t i = 0; i < n; i += LANES) store(out + r * n + i, mul(mul(load(row + i), scale), load(weight + i)));
    }
}

// Rotary positions in place over `heads` heads of head_dim elements (head_dim even) from `vectors`, at a position
// whose angles' cosines and sines are cos and sin (head_dim / 2 each): element i and i + head_dim / 2 of a head turn
// by angle i, as transformers' rotate_half pairs them.
inline void rotate(float *vectors, int64_t heads, int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = vectors + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

template <typename T>
struct Cache {  // the engine's kv_cache: (2, layers, heads, capacity, head_dim), keys at [0], values at [1]; its heads
                // are the key/value heads, which groups of query heads share
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

#if TILES_BUILD
// The same for up to 16 rows on AMX's tiles (tile_sums): the rows' bfloat16 queries (`dim` apart) the tile A, and each
// chunk's keys as across_slots lays them (an element pair a 64-byte row, 16 slots across) the tile B. A row's scores
// are its own dot products whatever the rows and slots beside it.
template <int C>
AMX_TARGET void tiled_key_dots(const bf16 *queries, int64_t dim, const __m512i *keys, int64_t m, float *scores,
                               int64_t end, int64_t count, TileRows &configured) {
    alignas(64) float sums[C][16 * 16];
    configure_tiles(one_pass(m), configured);
    tile_sums<C>(queries, dim * sizeof(bf16), dim, [&](int c, int64_t k) { return keys + c * KEY_WIDTH + k / 2; }, sums);
    for (int c = 0; c < C; c++)
        for (int64_t r = 0; r < m; r++)
            _mm512_mask_storeu_ps(scores + r * end + 16 * c, first_lanes(count - 16 * c), _mm512_load_ps(sums[c] + 16 * r));
}

using TiledKeyDots = void (*)(const bf16 *, int64_t, const __m512i *, int64_t, float *, int64_t, int64_t, TileRows &);
constexpr TiledKeyDots TILED_KEY_DOTS[4] = {tiled_key_dots<1>, tiled_key_dots<2>, tiled_key_dots<3>, tiled_key_dots<4>};
#endif

// Scores (rows x end) of each row's query (`stride` apart) against every cached key of one head, `width` 32-bit
// steps a key (head_dim float32 elements, or head_dim / 2 bfloat16 pairs: a multiple of 16), 64 slots at a time laid
// across the slots (`across_slots`) for `key_dots`.
template <typename T>
VECTOR_TARGET void scores_across_slots(const void *queries, int64_t stride, const T *keys, int64_t rows, int64_t end,
                                     int64_t dim, int64_t width, float scale, float *scores, bool tiles) {
    __m512i key_vectors[4 * KEY_WIDTH];
#if TILES_BUILD
    [[maybe_unused]] TileRows configured{};  // where the scores run on the tiles
#endif
    for (int64_t first = 0; first < end; first += 64) {
        const int64_t count = end - first, chunks = std::min<int64_t>(4, (count + 15) / 16);
        for (int64_t c = 0; c < 4; c++)  // chunks past the last slot: zeros, never stored
            if (c < chunks)
                across_slots(keys + (first + 16 * c) * dim, count - 16 * c, width, key_vectors + c * KEY_WIDTH);
            else
                std::fill(key_vectors + c * KEY_WIDTH, key_vectors + c * KEY_WIDTH + width, _mm512_setzero_si512());
#if TILES_BUILD
        if constexpr (std::is_same_v<T, bf16>)
            if (tiles) {  // (the queries: bfloat16, a head's row apart)
                for (int64_t r0 = 0; r0 < rows; r0 += 16)
                    TILED_KEY_DOTS[chunks - 1](static_cast<const bf16 *>(queries) + r0 * dim, dim, key_vectors,
                                               std::min<int64_t>(16, rows - r0), scores + r0 * end + first, end, count,
                                               configured);
                continue;
            }
#endif
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t r = std::min<int64_t>(4, rows - r0);
            for (int64_t c = 0; c < chunks; c += KEY_CHUNKS[r - 1])
                KEY_DOTS<T>[r - 1](static_cast<const int32_t *>(queries) + r0 * stride, stride,
                                   key_vectors + c * KEY_WIDTH, width, scores + r0 * end + first + 16 * c, end,
                                   count - 16 * c, scale);
        }
    }
#if TILES_BUILD
    if (tiles) release_tiles();
#endif
}

// The same with head_dim a multiple of 32: AVX-512 BF16 dot products over the query rounded to bfloat16, or with
// `tiles` AMX's tile products (a CPU with AMX-BF16, tiles_granted()).
VECTOR_TARGET void scores_of(const float *queries, int64_t stride, const bf16 *keys, int64_t rows, int64_t end, int64_t dim,
                           float scale, float *scores, bool tiles) {
    if (dim % 32 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    std::vector<bf16> rounded(rows * dim);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d++) rounded[r * dim + d] = to_bf16(queries[r * stride + d] * scale);
    scores_across_slots(rounded.data(), dim / 2, keys, rows, end, dim, dim / 2, scale, scores, tiles);
}

// The same over float32 keys with head_dim a multiple of 16: fused multiply-adds (no tiles).
VECTOR_TARGET void scores_of(const float *queries, int64_t stride, const float *keys, int64_t rows, int64_t end,
                           int64_t dim, float scale, float *scores, bool) {
    if (dim % 16 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    scores_across_slots(queries, stride, keys, rows, end, dim, dim, scale, scores, false);
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
                             int64_t dim, float scale, float *scores, bool = false) {
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

// The same over bfloat16 keys: widened to float32 first (no tiles in this build).
VECTOR_TARGET void scores_of(const float *queries, int64_t stride, const bf16 *keys, int64_t rows, int64_t end,
                             int64_t dim, float scale, float *scores, bool) {
    if (dim % 8 || dim > 128) return scores_one_by_one(queries, stride, keys, rows, end, dim, scale, scores);
    static thread_local std::vector<float> widened;
    widened.resize(end * dim);
    widen(keys, widened.data(), end * dim);
    scores_of(queries, stride, widened.data(), rows, end, dim, scale, scores);
}
#endif

// The vector registers the build has: a pass of weighted_values keeps its rows' sums in all but two of them.
constexpr int REGISTERS = LANES == 16 ? 32 : 16;

// The rows a pass of weighted_values takes when a head's row is C vectors: as many as their sums fit in registers
// (at most 8).
constexpr int value_rows(int C) { return std::max(1, std::min(8, (REGISTERS - 2) / C)); }

// R rows' sums (C vectors each, `dim` = C LANES apart) of their weights (`end` apart) times the values of slots
// 0..end (`dim` apart, float32 or bfloat16 widened as it is read), slot by slot in order with fused multiply-adds:
// the same terms in the same order whatever R, so that a row's sums do not depend on the rows beside it. The order
// by slot also keeps a tree's node equal to the same token decoded after its ancestors (dot products over pairs of
// slots would pair a slot with whichever comes next in the cache, which differs between the two).
template <typename T, int R, int C>
VECTOR_TARGET void weighted_pass(const float *weights, const T *values, int64_t end, float *sums) {
    constexpr int64_t dim = C * LANES;
    Vec acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = zeros();
    for (int64_t slot = 0; slot < end; slot++)
        for (int c = 0; c < C; c++) {
            const Vec value = load(values + slot * dim + LANES * c);
            for (int r = 0; r < R; r++) acc[r][c] = fma(splat(weights[r * end + slot]), value, acc[r][c]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) store(sums + r * dim + LANES * c, acc[r][c]);
}

// weighted_pass over `rows` rows: passes of R rows, then the rest in one pass of fewer.
template <typename T, int C, int R = value_rows(C)>
VECTOR_TARGET void weighted_rows(const float *weights, const T *values, int64_t rows, int64_t end, float *sums) {
    for (; rows >= R; rows -= R, weights += R * end, sums += R * C * LANES) weighted_pass<T, R, C>(weights, values, end, sums);
    if constexpr (R > 1)
        if (rows) weighted_rows<T, C, R - 1>(weights, values, rows, end, sums);
}

// WEIGHTED_ROWS<T>[C - 1]: weighted_rows for a head's row of C vectors, C up to 128 elements.
template <typename T, size_t... C>
constexpr auto weighted_rows_table(std::index_sequence<C...>) {
    return std::array{weighted_rows<T, static_cast<int>(C) + 1>...};
}
template <typename T>
constexpr auto WEIGHTED_ROWS = weighted_rows_table<T>(std::make_index_sequence<128 / LANES>());

// sums (rows x dim) = weights (rows x end) @ values (end x dim) of one head: weighted_rows where dim is a multiple of
// LANES up to 128, else one by one.
template <typename T>
VECTOR_TARGET void weighted_values(const float *weights, const T *values, int64_t rows, int64_t end, int64_t dim,
                                   float *sums) {
    if (dim % LANES || dim > 128) return weighted_one_by_one(weights, values, rows, end, dim, sums);
    WEIGHTED_ROWS<T>[dim / LANES - 1](weights, values, rows, end, sums);
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

// Where attention reads its queries and writes its output: each row's queries `stride` apart (its q, k, v row), its
// output `width` apart (heads x head_dim), query head h reading key/value head h / group; whether its scores run on
// AMX's tiles (a bfloat16 model's, where its products do).
struct Heads {
    int64_t heads, group, stride, width;
    bool tiles;
};

// Attention of each row's query over the slots it sees through `heads` query heads from `head` that share one
// key/value head, into their columns of out (rows x width) in the model's dtype: the heads' queries are scored as
// one block of heads x rows rows, so that the key/value head's slots are read (and its keys laid across the slots)
// once for them all. queries (heads x rows x head_dim, where the block's queries are gathered), scores (heads x rows
// x end) and sums (heads x rows x head_dim) are room to work in. A row's scores, softmax and sums are its own whatever
// the rows beside it.
template <typename T>
VECTOR_TARGET void group_attention(const float *qkv, const Cache<T> &cache, int64_t layer, int64_t head, int64_t heads,
                                   const Visibility &visible, T *out, int64_t rows, const Heads &shape, float *queries,
                                   float *scores, float *sums) {
    const int64_t dim = cache.head_dim, end = visible.end, kv_head = head / shape.group, block = heads * rows;
    // block row h rows + r: row r's query through head + h, read where it lies when one stride reaches every row of the
    // block (one head's rows, or one row's heads), else gathered
    const float *block_queries = qkv + head * dim;
    const int64_t stride = heads == 1 ? shape.stride : dim;
    if (heads > 1 && rows > 1) {
        for (int64_t h = 0; h < heads; h++)
            for (int64_t r = 0; r < rows; r++)
                std::copy_n(qkv + r * shape.stride + (head + h) * dim, dim, queries + (h * rows + r) * dim);
        block_queries = queries;
    }
    scores_of(block_queries, stride, cache.at(0, layer, kv_head, 0), block, end, dim,
              1.0f / std::sqrt(static_cast<float>(dim)), scores, shape.tiles);
    for (int64_t i = 0; i < block; i++) {
        const int64_t r = i % rows;
        float *row = scores + i * end;
        for (int64_t slot = visible.open(r); slot < end; slot++)
            if (!visible.sees(r, slot)) row[slot] = -INFINITY;
        softmax(row, visible, r);
    }
    weighted_values(scores, cache.at(1, layer, kv_head, 0), block, end, dim, sums);
    for (int64_t i = 0; i < block; i++)
        for (int64_t d = 0; d < dim; d += LANES)
            store(out + (i % rows) * shape.width + (head + i / rows) * dim + d, load(sums + i * dim + d, dim - d), dim - d);
}

// One sequence's rows in a layer's attention: their queries, keys and values (Heads::stride apart), its cache and
// what each row sees there, and where their output goes (Heads::width apart).
template <typename T>
struct Attending {
    const float *qkv;
    Cache<T> cache;
    const Visibility *visible;
    T *out;
    int64_t rows;
};

// Rows (a group's heads x a sequence's rows) one call of group_attention scores at most: a decoding step's rows take
// a group's query heads together, a prompt's many rows a head at a time (their scores would outgrow the caches).
constexpr int64_t GROUP_ROWS = 64;

// The most query heads of a group one call of group_attention takes for a sequence of `rows` rows.
inline int64_t heads_a_call(int64_t rows, int64_t group) {
    return std::clamp<int64_t>(GROUP_ROWS / std::max<int64_t>(rows, 1), 1, group);
}

// Multiply-adds of attention past which its (query head, sequence) pairs are split among torch's threads: far fewer
// than a product's (PARALLEL_WORK), as attention runs them at a fraction of the products' rate (each pair lays its
// keys across the slots and sums its values slot by slot), so that a draft's forward over a row of each of a few
// sequences shares its pairs too.
constexpr int64_t ATTENTION_PARALLEL_WORK = 1 << 13;

// Attention of every sequence's rows over its own cache. The (query head, sequence) pairs, by key/value head, then
// sequence, then query head, are split among torch's threads where the work pays for waking them, each thread taking
// a run of them: its heads of every sequence, the heads in its run that share a key/value head in one call of
// group_attention (heads_a_call), so that a key/value head is read once for them.
template <typename T>
void attention(const std::vector<Attending<T>> &sequences, int64_t layer, const Heads &shape) {
    const auto count = static_cast<int64_t>(sequences.size());
    const int64_t pairs = shape.heads * count, group = shape.group, dim = sequences[0].cache.head_dim;
    int64_t work = 0, most_rows = 0, most_scores = 0;  // the most rows, and scores, of one call
    for (const Attending<T> &s : sequences) {
        const int64_t call_rows = heads_a_call(s.rows, group) * s.rows;
        work += 2 * s.rows * s.visible->end * shape.width;
        most_rows = std::max(most_rows, call_rows);
        most_scores = std::max(most_scores, call_rows * s.visible->end);
    }
    at::parallel_for(0, pairs, work >= ATTENTION_PARALLEL_WORK ? 1 : pairs, [&](int64_t first, int64_t last) {
        std::vector<float> queries(most_rows * dim), scores(most_scores), sums(most_rows * dim);
        for (int64_t pair = first; pair < last;) {
            const int64_t kv_head = pair / (count * group), in_group = pair % group;
            const Attending<T> &s = sequences[pair / group % count];
            const int64_t heads = std::min({group - in_group, last - pair, heads_a_call(s.rows, group)});
            group_attention(s.qkv, s.cache, layer, kv_head * group + in_group, heads, *s.visible, s.out, s.rows, shape,
                            queries.data(), scores.data(), sums.data());
            pair += heads;
        }
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

// SwiGLU over each row of x (rows x 2 n: the gate's n columns, then the up projection's): silu(gate) * up, silu(g) =
// g / (1 + exp(-g)), into out (rows x n, n a multiple of 16) in the model's dtype for the next product.
template <typename T>
VECTOR_TARGET void swiglu(const float *x, T *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i += LANES) {
            const Vec gate = load(x + 2 * r * n + i), up = load(x + 2 * r * n + n + i);
            store(out + r * n + i, mul(div(gate, add(splat(1.0f), exp(sub(zeros(), gate)))), up));
        }
}

// Activations one thread computes before the others are woken for the rest
constexpr int64_t ACTIVATION_GRAIN = 1 << 14;

// The MLP's activation of x (rows x n for GELU, rows x 2 n for SwiGLU) into out (rows x n), the rows split among
// torch's threads where there are many: an element's value is the same whichever thread computes it.
template <typename T>
void activation(bool gated, const float *x, T *out, int64_t rows, int64_t n) {
    at::parallel_for(0, rows, std::max<int64_t>(1, ACTIVATION_GRAIN / n), [&](int64_t first, int64_t last) {
        if (gated)
            swiglu(x + 2 * first * n, out + first * n, last - first, n);
        else
            gelu(x + first * n, out + first * n, (last - first) * n);
    });
}

}  // namespace
