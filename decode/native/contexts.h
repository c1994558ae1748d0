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

// trigram_tree(histories_address, histories, successors_address, successors_width, vocab_size, before_root, root,
//              widths) -> (tokens, probs)
// The tokens and probabilities of the tree below the context (before_root, root), level by level: the row after
// the context (its trigram history's when seen, else the root's own), then each level's rows by the `next` of the
// level above, widths[d] successors of each.
PyObject *trigram_tree(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes_arguments("trigram_tree", nargs, 8)) return nullptr;
    const auto *histories = static_cast<const int64_t *>(PyLong_AsVoidPtr(args[0]));
    const int64_t history_count = PyLong_AsLongLong(args[1]);
    const auto *successors = static_cast<const Successor *>(PyLong_AsVoidPtr(args[2]));
    const int64_t width = PyLong_AsLongLong(args[3]), vocab_size = PyLong_AsLongLong(args[4]);
    const int64_t before_root = PyLong_AsLongLong(args[5]), root = PyLong_AsLongLong(args[6]);
    std::vector<int64_t> widths;
    if (PyErr_Occurred() || !read_ints(args[7], widths, "widths")) return nullptr;
    const int64_t key = before_root * (vocab_size + 2) + root;  // SuccessorTable.rows_after
    const int64_t found = std::min<int64_t>(std::lower_bound(histories, histories + history_count, key) - histories,
                                            history_count - 1);
    std::vector<int64_t> rows{histories[found] == key ? found : history_count + root}, below;
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
PyObject *continuations(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes_arguments("continuations", nargs, 4)) return nullptr;
    std::vector<int64_t> tokens;
    if (!read_ints(args[0], tokens, "tokens")) return nullptr;
    const int64_t max_ngram = PyLong_AsLongLong(args[1]), length = PyLong_AsLongLong(args[2]);
    const int64_t branches = PyLong_AsLongLong(args[3]);
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
