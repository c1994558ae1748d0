// What step.cpp drafts from a context alone, without a model: the trigram's tree below it (trigram_reader) and the
// continuations of its longest repeated suffix (continuations).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "rows.h"

namespace {

// One successor of a trigram context, as decode/models/successors.py's SUCCESSOR dtype lays it out.
struct Successor {
    int32_t token;
    float prob;
    int32_t next;
};
static_assert(sizeof(Successor) == 12, "SUCCESSOR is 12 bytes");

// trigram_tree(histories, successors, vocab_size, before_root, root, widths) -> (tokens, probs)
// The tokens and probabilities of the tree below the context (before_root, root), level by level: the row after
// the context (its trigram history's when seen, else the root's own), then each level's rows by the `next` of the
// level above, widths[d] successors of each. histories: the successor table's sorted int64 keys; successors: its
// (rows, width) array of 12-byte Successor records (decode/models/successors.py).
const char *const TRIGRAM_TREE[] = {"histories", "successors", "vocab_size", "before_root", "root", "widths"};
PyObject *trigram_tree(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(TRIGRAM_TREE);
    Array history_array, successor_array;
    std::vector<int64_t> widths;
    if (!named.open("trigram_tree", args, nargs, kwnames) ||
        !history_array.open(named["histories"], "histories", "ql", 8, 1) ||
        !successor_array.open(named["successors"], "successors", "", sizeof(Successor), 2) ||
        !read_ints(named["widths"], widths, "widths"))
        return nullptr;
    const auto *histories = history_array.data<const int64_t>();
    const int64_t history_count = history_array.count(), width = successor_array.size(1);
    const auto *successors = successor_array.data<const Successor>();
    const int64_t vocab_size = PyLong_AsLongLong(named["vocab_size"]);
    const int64_t before_root = PyLong_AsLongLong(named["before_root"]), root = PyLong_AsLongLong(named["root"]);
    if (PyErr_Occurred()) return nullptr;
    for (const int64_t level_width : widths)
        if (level_width < 0 || level_width > width) {
            PyErr_SetString(PyExc_ValueError, "trigram_tree: a width past the table's successors");
            return nullptr;
        }
    if (root < 0 || root >= vocab_size || successor_array.size(0) < history_count + vocab_size) {
        PyErr_SetString(PyExc_ValueError, "trigram_tree: the root outside the vocabulary, or a table without a row "
                                          "for each history and each token");
        return nullptr;
    }
    const int64_t key = before_root * (vocab_size + 2) + root;  // SuccessorTable.rows_after
    const int64_t found = std::lower_bound(histories, histories + history_count, key) - histories;
    std::vector<int64_t> rows{found < history_count && histories[found] == key ? found : history_count + root}, below;
    std::vector<int64_t> tokens{root};
    std::vector<double> probs{1.0};
    for (const int64_t level_width : widths) {
        below.clear();
        for (const int64_t row : rows)
            for (int64_t rank = 0; rank < level_width; rank++) {
                const Successor &next = successors[row * width + rank];
                tokens.push_back(next.token);
                probs.push_back(next.prob);
                below.push_back(next.next);
            }
        rows.swap(below);
    }
    PyObject *prob_list = PyList_New(probs.size());
    for (size_t i = 0; prob_list && i < probs.size(); i++) PyList_SET_ITEM(prob_list, i, PyFloat_FromDouble(probs[i]));
    return Py_BuildValue("(NN)", int_list(tokens), prob_list);
}

// continuations(tokens, max_ngram, length, branches) -> chains
// StepKernels.continuations: for the longest suffix of at most max_ngram tokens that occurred
// before, the `length` tokens after its occurrences, latest first, up to `branches` different ones; a chain that
// runs into the end of the sequence repeats its period.
const char *const CONTINUATIONS[] = {"tokens", "max_ngram", "length", "branches"};
PyObject *continuations(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(CONTINUATIONS);
    std::vector<int64_t> tokens;
    if (!named.open("continuations", args, nargs, kwnames) || !read_ints(named["tokens"], tokens, "tokens"))
        return nullptr;
    const int64_t max_ngram = PyLong_AsLongLong(named["max_ngram"]), length = PyLong_AsLongLong(named["length"]);
    const int64_t branches = PyLong_AsLongLong(named["branches"]);
    if (PyErr_Occurred()) return nullptr;
    const int64_t size = static_cast<int64_t>(tokens.size());
    std::vector<std::vector<int64_t>> chains;
    for (int64_t n = std::min(max_ngram, size - 1); n > 0 && chains.empty(); n--) {
        const int64_t *suffix = tokens.data() + size - n;
        for (int64_t end = size - 1; end >= n; end--) {  // an occurrence ending before the last token
            if (!std::equal(suffix, suffix + n, tokens.data() + end - n)) continue;
            std::vector<int64_t> chain(tokens.begin() + end, tokens.begin() + std::min(end + length, size));
            while (static_cast<int64_t>(chain.size()) < length) chain.push_back(chain[chain.size() - (size - end)]);
            if (std::find(chains.begin(), chains.end(), chain) != chains.end()) continue;
            chains.push_back(std::move(chain));
            if (static_cast<int64_t>(chains.size()) == branches) break;
        }
    }
    PyObject *out = PyList_New(chains.size());
    for (size_t i = 0; out && i < chains.size(); i++) PyList_SET_ITEM(out, i, int_list(chains[i]));
    return out;
}

}  // namespace
