// The float32 vector operations of decode/native/forward.cpp, for the instruction set the module is built for:
// AVX-512 (FORWARD_AVX512: 16 lanes, a bfloat16 model's stores by AVX-512 BF16's conversion) or AVX2 with FMA (8
// lanes). Every function carries its set as a target attribute, so the module loads on any x86 CPU and its
// supported() can say whether this one runs it.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#ifdef FORWARD_AVX512
#define VECTOR_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#else
#define VECTOR_TARGET __attribute__((target("avx2,fma")))
#endif

namespace {

using bf16 = uint16_t;

inline float to_float(bf16 value) {
    const uint32_t bits = static_cast<uint32_t>(value) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

inline float to_float(float value) { return value; }

// Round to nearest even, as torch's float32 -> bfloat16 conversion (the rows hold no NaN).
inline bf16 to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    return static_cast<bf16>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

constexpr float EXP_COEFFICIENTS[7] = {1.54035304e-04f, 1.33335581e-03f, 9.61812911e-03f, 5.55041087e-02f,
                                       2.40226507e-01f, 6.93147181e-01f, 1.0f};  // (ln 2)^k / k!, k = 6 down to 0
constexpr float EXP_LEADING = 1.52527338e-05f;                                    // k = 7

#ifdef FORWARD_AVX512
using Vec = __m512;
constexpr int64_t LANES = 16;

// Mask of the first min(count, 16) of 16 lanes.
inline __mmask16 first_lanes(int64_t count) { return count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1); }

VECTOR_TARGET inline Vec zeros() { return _mm512_setzero_ps(); }
VECTOR_TARGET inline Vec splat(float value) { return _mm512_set1_ps(value); }
VECTOR_TARGET inline Vec load(const float *at) { return _mm512_loadu_ps(at); }
// 16 bfloat16 elements as float32 (exact: a bfloat16 is the upper half of a float32)
VECTOR_TARGET inline Vec load(const bf16 *at) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(at))), 16));
}
// The first min(count, LANES) floats at `at`, the other lanes `fill` (nothing past them is read)
VECTOR_TARGET inline Vec load(const float *at, int64_t count, Vec fill = _mm512_setzero_ps()) {
    return _mm512_mask_loadu_ps(fill, first_lanes(count), at);
}
VECTOR_TARGET inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
VECTOR_TARGET inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
VECTOR_TARGET inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
VECTOR_TARGET inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
VECTOR_TARGET inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
VECTOR_TARGET inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
VECTOR_TARGET inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c
VECTOR_TARGET inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
VECTOR_TARGET inline float largest(Vec v) { return _mm512_reduce_max_ps(v); }
// `values` in the first min(count, LANES) lanes where `scores` is not -inf, else 0
VECTOR_TARGET inline Vec where_seen(Vec scores, Vec values, int64_t count) {
    return _mm512_maskz_mov_ps(_mm512_mask_cmp_ps_mask(first_lanes(count), scores, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                               values);
}

// The first min(count, LANES) lanes stored in the model's dtype: rounded to bfloat16 (to nearest even, as torch's
// conversion; the rows hold no NaN), or as they are.
VECTOR_TARGET inline void store(bf16 *out, Vec values, int64_t count = LANES) {
    _mm256_mask_storeu_epi16(out, first_lanes(count), (__m256i)_mm512_cvtneps_pbh(values));
}

VECTOR_TARGET inline void store(float *out, Vec values, int64_t count = LANES) {
    _mm512_mask_storeu_ps(out, first_lanes(count), values);
}

VECTOR_TARGET inline Vec round_to_integer(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
VECTOR_TARGET inline Vec power_of_two(Vec whole) {  // 2^n for integral n in float32's normal range
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23));
}
#else
using Vec = __m256;
constexpr int64_t LANES = 8;

// -1 in the first min(count, 8) of 8 lanes, 0 in the others: maskload's and maskstore's mask.
VECTOR_TARGET inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count < 8 ? count : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

VECTOR_TARGET inline Vec zeros() { return _mm256_setzero_ps(); }
VECTOR_TARGET inline Vec splat(float value) { return _mm256_set1_ps(value); }
VECTOR_TARGET inline Vec load(const float *at) { return _mm256_loadu_ps(at); }
VECTOR_TARGET inline Vec load(const bf16 *at) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(at))), 16));
}
VECTOR_TARGET inline Vec load(const float *at, int64_t count, Vec fill = _mm256_setzero_ps()) {
    if (count >= 8) return _mm256_loadu_ps(at);
    const __m256i lanes = first_lanes(count);
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(at, lanes), _mm256_castsi256_ps(lanes));
}
VECTOR_TARGET inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
VECTOR_TARGET inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
VECTOR_TARGET inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
VECTOR_TARGET inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
VECTOR_TARGET inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
VECTOR_TARGET inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
VECTOR_TARGET inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
VECTOR_TARGET inline float sum(Vec v) {
    const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
VECTOR_TARGET inline float largest(Vec v) {
    const __m128 halves = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pairs = _mm_max_ps(halves, _mm_movehl_ps(halves, halves));
    return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}
VECTOR_TARGET inline Vec where_seen(Vec scores, Vec values, int64_t count) {
    const Vec seen = _mm256_and_ps(_mm256_cmp_ps(scores, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                   _mm256_castsi256_ps(first_lanes(count)));
    return _mm256_and_ps(seen, values);
}

VECTOR_TARGET inline void store(bf16 *out, Vec values, int64_t count = LANES) {
    const __m256i bits = _mm256_castps_si256(values);  // rounded to nearest even as to_bf16
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    if (count >= 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i *>(out), halves);
    } else {
        alignas(16) bf16 lanes[8];
        _mm_store_si128(reinterpret_cast<__m128i *>(lanes), halves);
        std::memcpy(out, lanes, count * sizeof(bf16));
    }
}

VECTOR_TARGET inline void store(float *out, Vec values, int64_t count = LANES) {
    if (count >= 8)
        _mm256_storeu_ps(out, values);
    else
        _mm256_maskstore_ps(out, first_lanes(count), values);
}

VECTOR_TARGET inline Vec round_to_integer(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
VECTOR_TARGET inline Vec power_of_two(Vec whole) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(whole), _mm256_set1_epi32(127)), 23));
}
#endif

// n elements of a model's rows in dtype T as float32 (n a multiple of LANES): where the products and attention of
// the AVX2 build read a bfloat16 cache or input.
VECTOR_TARGET inline void widen(const bf16 *from, float *to, int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) store(to + i, load(from + i));
}

// exp(x) to float32 precision, a vector at a time: 2^(x log2 e) as 2^n 2^f, n the nearest integer, 2^f for |f| <= 1/2
// by its Taylor polynomial of degree 7 (within 1e-8 relative).
VECTOR_TARGET inline Vec exp(Vec x) {
    x = min(max(x, splat(-87.0f)), splat(88.0f));
    const Vec t = mul(x, splat(1.44269504f));
    const Vec whole = round_to_integer(t), f = sub(t, whole);
    Vec p = splat(EXP_LEADING);
    for (const float c : EXP_COEFFICIENTS) p = fma(p, f, splat(c));
    return mul(p, power_of_two(whole));
}

}  // namespace
