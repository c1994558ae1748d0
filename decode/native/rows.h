// What decode/native's modules read off a row of float32 logits (step.cpp's loops over trees, forward.cpp's chain of
// draft forwards): its best columns, under a top-k setting its processed distribution and a draw from it, and the
// Python values they are handed over as (arguments.h). Each follows its Python code step for step, ties included
// (decode/sampling.py, decode/ranking.py).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "arguments.h"

namespace {

#if defined(__GNUC__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

// The k columns of the row's largest values, largest first (ties: the lower column), into `best`: a block of 64
// columns is read value by value only when its largest value (vectorised) beats the k-th best so far.
VECTOR_CLONES void row_top(const float *row, int64_t columns, int64_t k, int64_t *best, float *values) {
    int64_t count = 0;
    for (int64_t start = 0; start < columns; start += 64) {
        const int64_t end = std::min(start + 64, columns);
        float block = row[start];
#pragma omp simd reduction(max : block)
        for (int64_t c = start; c < end; c++) block = row[c] > block ? row[c] : block;
        if (count == k && !(block > values[k - 1])) continue;
        for (int64_t c = start; c < end; c++) {
            const float value = row[c];
            if (count == k && !(value > values[k - 1])) continue;
            int64_t at = count < k ? count++ : k - 1;  // the last place, then up past every smaller value
            for (; at > 0 && values[at - 1] < value; at--) {
                values[at] = values[at - 1];
                best[at] = best[at - 1];
            }
            values[at] = value;
            best[at] = c;
        }
    }
}

// The first column that holds the row's largest value, as numpy's argmax (rows hold no NaN).
int64_t row_argmax(const float *row, int64_t columns, float *largest) {
    int64_t at;
    row_top(row, columns, 1, &at, largest);
    return at;
}

// The columns whose values are at or above the row's k-th largest value, largest first (ties: the lower column), into
// `support` as (value, column). Among the maxima of blocks of 32 columns, the k-th largest bounds the k-th largest
// value from below (k blocks hold a value at or above it), so only the values at or above that bound are collected,
// from the blocks whose maximum reaches it; the k-th largest is then found among those few. Reading a row of 8192
// values this way took a fifth of the time of inserting each into the k best (row_top), k = 50, in a tight loop.
VECTOR_CLONES void row_support(const float *row, int64_t columns, int64_t k, std::vector<float> &maxima,
                               std::vector<float> &candidates, std::vector<std::pair<float, int64_t>> &support) {
    constexpr int64_t block = 32;
    const int64_t blocks = (columns + block - 1) / block;
    maxima.resize(blocks);
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * block, end = std::min(start + block, columns);
        float largest = row[start];
#pragma omp simd reduction(max : largest)
        for (int64_t c = start; c < end; c++) largest = row[c] > largest ? row[c] : largest;
        maxima[b] = largest;
    }
    float bound = -INFINITY;
    if (blocks >= k) {
        candidates.assign(maxima.begin(), maxima.end());
        std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(), std::greater<float>());
        bound = candidates[k - 1];
    }
    support.clear();
    for (int64_t b = 0; b < blocks; b++) {
        if (!(maxima[b] >= bound)) continue;
        for (int64_t c = b * block, end = std::min(c + block, columns); c < end; c++)
            if (row[c] >= bound) support.emplace_back(row[c], c);
    }
    candidates.resize(support.size());
    for (size_t j = 0; j < support.size(); j++) candidates[j] = support[j].first;
    std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(), std::greater<float>());
    const float kth = candidates[k - 1];
    support.erase(std::remove_if(support.begin(), support.end(), [kth](const auto &s) { return s.first < kth; }),
                  support.end());
    std::stable_sort(support.begin(), support.end(), [](const auto &a, const auto &b) { return a.first > b.first; });
}

// The processed distribution of a row of logits under a top-k setting (sampling.Sampling.probs over the row's
// support), with room to work in kept between rows.
struct TopK {
    int64_t k = 0;
    double temperature = 0, top_p = 0;
    std::vector<float> maxima, candidates;
    std::vector<std::pair<float, int64_t>> support;  // (value, column)
    std::vector<double> weights;

    bool check(const char *function) const {
        if (k < 1 || !(temperature > 0) || !(top_p > 0)) {
            PyErr_Format(PyExc_ValueError, "%s: top_k, temperature and top_p must be positive", function);
            return false;
        }
        return true;
    }

    // The row's distribution, likeliest first, as (token, probability): the logits over the temperature, every
    // column at or above the top_k-th largest value (ties at the k-th kept, as the masking does), then top-p (the
    // likeliest tokens while the mass before each stays under top_p). Computed in double; tokens of probability 0
    // (a logit of -inf) are left out.
    void read(const float *row, int64_t columns, const int64_t *column_token,
              std::vector<std::pair<int64_t, double>> &out) {
        row_support(row, columns, std::min(k, columns), maxima, candidates, support);
        weights.assign(support.size(), 0.0);
        double total = 0;
        for (size_t j = 0; j < support.size(); j++)
            total += weights[j] = std::exp((static_cast<double>(support[j].first) - support[0].first) / temperature);
        size_t kept = support.size();
        if (top_p < 1.0) {  // drop each token the mass before which already reaches top_p
            double before = 0;
            for (kept = 0; kept < support.size() && before / total < top_p; kept++) before += weights[kept];
            total = before;
        }
        out.clear();
        for (size_t j = 0; j < kept && weights[j] > 0; j++) {
            const int64_t column = support[j].second;
            out.emplace_back(column_token ? column_token[column] : column, weights[j] / total);
        }
    }
};

// The token at `uniform` (in [0, 1)) of a distribution's cumulative probabilities, in its order (sampling.Sparse.draw).
int64_t draw_at(const std::vector<std::pair<int64_t, double>> &distribution, double uniform) {
    for (const auto &[token, probability] : distribution) {
        uniform -= probability;
        if (uniform < 0) return token;
    }
    return distribution.back().first;  // rounding left the sum a hair under `uniform`: the last token
}

}  // namespace
