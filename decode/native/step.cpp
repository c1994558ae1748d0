// A decoding step's loops over trees, in C++: decode/kernels/cpp.py's NativeKernels, one call per rule of the
// StepKernels interface (decode/kernels/base.py): the trigram's tree below a new context (trigram_reader), the
// staged drafter's greedy ranking of the draft's logits and its choice of the oracle's tree (staged_selection),
// sample-match verification under greedy decoding and multi-draft rejection under top-k sampling, each row's best
// tokens (top_tokens) and, under top-k sampling, its processed distribution and draws from it (distributions,
// draws), the continuations a context repeats (continuations); and a commit's moves in a CPU cache
// (GPT2Engine.commit). Each follows the portable code (decode/kernels/portable.py) step for step, ties included
// (torch's top-k, which a row's k > 1 best tokens take there, orders ties as it likes; here the lower column comes
// first), and tests/test_native.py compares the two. After a forward,
// every torch, numpy or list operation of a step pays for caches that the forward evicted; one call here replaces
// tens of them. What is read off a row of logits is rows.h's, which forward.cpp's chain of draft forwards reads too.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "contexts.h"
#include "rows.h"

namespace {

// staged_selection(logits, order, parents, tokens, depths, copied, shortlist_tokens, shortlist_columns, max_depth,
//                  budget) -> (tokens, parents, kept)
// logits: float32 (rows, columns), row i the draft's logits after node order[i]; the shortlist's arrays (or None):
// column -> token and token -> column (-1 off it). Returns the oracle's tree, numbered as Tree.chosen numbers it,
// and for each of its nodes the candidate it came from (n + i: the draft's leaf i).
const char *const STAGED_SELECTION[] = {"logits", "order", "parents", "tokens", "depths", "copied",
                                        "shortlist_tokens", "shortlist_columns", "max_depth", "budget"};
PyObject *staged_selection(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(STAGED_SELECTION);
    Logits logits;
    std::vector<int64_t> order, parents, tokens, depths, copied;
    Int64Array column_token, token_column;
    if (!named.open("staged_selection", args, nargs, kwnames) || !logits.open(named["logits"]) ||
        !read_ints(named["order"], order, "order") || !read_ints(named["parents"], parents, "parents") ||
        !read_ints(named["tokens"], tokens, "tokens") || !read_ints(named["depths"], depths, "depths") ||
        !read_ints(named["copied"], copied, "copied") || !column_token.open(named["shortlist_tokens"], "shortlist tokens") ||
        !token_column.open(named["shortlist_columns"], "shortlist columns"))
        return nullptr;
    const int64_t rows = logits.rows, columns = logits.columns;
    const int64_t max_depth = PyLong_AsLongLong(named["max_depth"]), budget = PyLong_AsLongLong(named["budget"]);
    const int64_t n = static_cast<int64_t>(parents.size());
    if (PyErr_Occurred()) return nullptr;
    if (n == 0 || rows != n || static_cast<int64_t>(order.size()) != n || static_cast<int64_t>(tokens.size()) != n ||
        static_cast<int64_t>(depths.size()) != n || (column_token.data && column_token.size != columns)) {
        PyErr_SetString(PyExc_ValueError, "staged_selection: the tree's lists and the logits' rows disagree");
        return nullptr;
    }
    std::vector<int64_t> row(n), best_token(n);
    std::vector<float> best_value(n);
    for (int64_t i = 0; i < n; i++) row[order[i]] = i;
    for (int64_t node = 0; node < n; node++) {  // ranked_children: each node's best child and its logit
        const int64_t column = row_argmax(logits.row(row[node]), columns, &best_value[node]);
        best_token[node] = column_token.data ? column_token.data[column] : column;
    }
    // Tree.cumulative over the edges' weights, exp(logit - the parent row's best), a logit off the shortlist -inf
    std::vector<double> score(n, 1.0);
    for (int64_t node = 1; node < n; node++) {
        const int64_t parent = parents[node], token = tokens[node];
        const int64_t column = !token_column.data ? token : (token < token_column.size ? token_column.data[token] : -1);
        const double value = column >= 0 ? static_cast<double>(logits.row(row[parent])[column]) : -INFINITY;
        score[node] = score[parent] * std::exp(value - static_cast<double>(best_value[parent]));
    }
    // StagedDrafter.draft_leaves: the best child of each node above max_depth that the trigram did not propose,
    // weighing as much as its parent (its weight relative to the best is 1)
    std::vector<int64_t> candidate_parent(parents), candidate_token(tokens);
    for (int64_t node = 0; node < n; node++) {
        if (depths[node] >= max_depth) continue;
        bool proposed = false;
        for (int64_t child = node + 1; child < n && !proposed; child++)
            proposed = parents[child] == node && tokens[child] == best_token[node];
        if (!proposed) {
            candidate_parent.push_back(node);
            candidate_token.push_back(best_token[node]);
            score.push_back(score[node]);
        }
    }
    if (!copied.empty()) {  // the context's continuations, and the root above them, go first
        score[0] += 1.0;
        for (int64_t node : copied) score[node] += (node == 0 ? 0.0 : 1.0);
    }
    // best_first: the `budget` best candidates (ties: the earlier), in order; then Tree.chosen's depth-first
    // numbering, each node's children by descending score (ties: the earlier)
    const int64_t m = static_cast<int64_t>(score.size());
    std::vector<int64_t> ranked(m);
    for (int64_t i = 0; i < m; i++) ranked[i] = i;
    const auto higher = [&score](int64_t a, int64_t b) { return score[a] > score[b]; };
    std::stable_sort(ranked.begin(), ranked.end(), higher);
    ranked.resize(std::min(budget, m));
    std::sort(ranked.begin(), ranked.end());
    std::vector<std::vector<int64_t>> below(m);
    for (size_t i = 1; i < ranked.size(); i++) below[candidate_parent[ranked[i]]].push_back(ranked[i]);
    std::vector<int64_t> new_index(m, -1), kept, out_tokens, out_parents, stack{0};
    while (!stack.empty()) {
        const int64_t node = stack.back();
        stack.pop_back();
        new_index[node] = static_cast<int64_t>(kept.size());
        kept.push_back(node);
        out_tokens.push_back(candidate_token[node]);
        out_parents.push_back(node == 0 ? -1 : new_index[candidate_parent[node]]);
        std::vector<int64_t> &children = below[node];
        std::stable_sort(children.begin(), children.end(), higher);
        stack.insert(stack.end(), children.rbegin(), children.rend());
    }
    return Py_BuildValue("(NNN)", int_list(out_tokens), int_list(out_parents), int_list(kept));
}

// greedy_walk(logits, tokens, parents) -> (path, following)
// sample_match under greedy decoding: from the root, follow the child that carries the oracle's argmax (row i:
// the oracle's logits after node i), else stop; the accepted nodes and the argmax that follows them.
const char *const GREEDY_WALK[] = {"logits", "tokens", "parents"};
PyObject *greedy_walk(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(GREEDY_WALK);
    Logits logits;
    std::vector<int64_t> tokens, parents;
    if (!named.open("greedy_walk", args, nargs, kwnames) || !logits.open(named["logits"]) ||
        !read_ints(named["tokens"], tokens, "tokens") || !read_ints(named["parents"], parents, "parents"))
        return nullptr;
    const int64_t rows = logits.rows, columns = logits.columns;
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (n == 0 || rows < n || static_cast<int64_t>(parents.size()) != n) {
        PyErr_SetString(PyExc_ValueError, "greedy_walk: the tree's lists and the logits' rows disagree");
        return nullptr;
    }
    std::vector<int64_t> path{0};
    float unused;
    while (true) {
        const int64_t node = path.back(), token = row_argmax(logits.row(node), columns, &unused);
        int64_t next = -1;
        for (int64_t child = node + 1; child < n && next < 0; child++)  // children come after their parent, in order
            if (parents[child] == node && tokens[child] == token) next = child;
        if (next < 0) return Py_BuildValue("(NL)", int_list(path), static_cast<long long>(token));
        path.push_back(next);
    }
}

// top_tokens(logits, k, shortlist_tokens) -> [tokens of each row]
// Each row's k best tokens, best first (through the shortlist's column -> token array, when not None):
// StepKernels.top_tokens (and row_argmax with k = 1).
const char *const TOP_TOKENS[] = {"logits", "k", "shortlist_tokens"};
PyObject *top_tokens(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(TOP_TOKENS);
    Logits logits;
    Int64Array column_token;
    if (!named.open("top_tokens", args, nargs, kwnames) || !logits.open(named["logits"]) ||
        !column_token.open(named["shortlist_tokens"], "shortlist tokens"))
        return nullptr;
    const int64_t rows = logits.rows, columns = logits.columns, k = PyLong_AsLongLong(named["k"]);
    if (PyErr_Occurred()) return nullptr;
    if (column_token.data && column_token.size != columns) {
        PyErr_SetString(PyExc_ValueError, "top_tokens: the shortlist and the logits' columns disagree");
        return nullptr;
    }
    if (k < 1 || k > columns) {
        PyErr_Format(PyExc_ValueError, "top_tokens: k must be 1..%lld (the logits' columns), not %lld",
                     static_cast<long long>(columns), static_cast<long long>(k));
        return nullptr;
    }
    std::vector<int64_t> tokens(k);
    std::vector<float> values(k);
    PyObject *out = PyList_New(rows);
    for (int64_t row = 0; out && row < rows; row++) {
        row_top(logits.row(row), columns, k, tokens.data(), values.data());
        if (column_token.data)
            for (int64_t &token : tokens) token = column_token.data[token];
        PyList_SET_ITEM(out, row, int_list(tokens));
    }
    return out;
}

// The processed distribution after rows of float32 logits under a top-k setting (sampling.Sampling.probs over a
// row's support), read from the named arguments logits, top_k, temperature, top_p and shortlist_tokens (the
// shortlist's column -> token array, or None).
struct SparseRows : Logits {
    TopK setting;
    Int64Array column_token;

    template <typename Arguments>
    bool open(const Arguments &named, const char *function) {
        if (!Logits::open(named["logits"])) return false;
        setting.k = PyLong_AsLongLong(named["top_k"]);
        setting.temperature = PyFloat_AsDouble(named["temperature"]);
        setting.top_p = PyFloat_AsDouble(named["top_p"]);
        if (PyErr_Occurred() || !column_token.open(named["shortlist_tokens"], "shortlist tokens")) return false;
        if (column_token.data && column_token.size != columns) {
            PyErr_Format(PyExc_ValueError, "%s: the shortlist and the logits' columns disagree", function);
            return false;
        }
        return setting.check(function);
    }

    // Row `row`'s distribution (TopK.read).
    void read(int64_t row, std::vector<std::pair<int64_t, double>> &out) {
        setting.read(this->row(row), columns, column_token.data, out);
    }
};

bool read_rows(PyObject *list, const SparseRows &logits, std::vector<int64_t> &rows, const char *function) {
    if (!read_ints(list, rows, "row_list")) return false;
    for (const int64_t row : rows)
        if (row < 0 || row >= logits.rows) {
            PyErr_Format(PyExc_ValueError, "%s: a listed row is outside the logits", function);
            return false;
        }
    return true;
}

// draws(logits, top_k, temperature, top_p, shortlist_tokens, rows, count, uniforms)
//   -> ([the drawn tokens of each listed row], [its distribution])
// ranking.draw_children under top-k sampling: each listed row's distribution (SparseRows.read, as a
// distribution_dict), and `count` draws from it, row i's draw j at uniforms[i * count + j] (Sparse.draw). With count
// 0: Sampling.distributions.
const char *const DRAWS[] = {"logits", "top_k", "temperature", "top_p", "shortlist_tokens", "rows", "count", "uniforms"};
PyObject *draws(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(DRAWS);
    SparseRows logits;
    std::vector<int64_t> listed;
    if (!named.open("draws", args, nargs, kwnames) || !logits.open(named, "draws") ||
        !read_rows(named["rows"], logits, listed, "draws"))
        return nullptr;
    const int64_t count = PyLong_AsLongLong(named["count"]);
    PyObject *uniforms = named["uniforms"];
    if (PyErr_Occurred()) return nullptr;
    if (!PyList_Check(uniforms) || PyList_GET_SIZE(uniforms) != static_cast<Py_ssize_t>(listed.size() * count)) {
        PyErr_SetString(PyExc_ValueError, "draws: uniforms must be a list of count draws per listed row");
        return nullptr;
    }
    std::vector<std::pair<int64_t, double>> distribution;
    std::vector<int64_t> drawn(count);
    PyObject *tokens = PyList_New(listed.size()), *dists = PyList_New(listed.size());
    for (size_t i = 0; tokens && dists && i < listed.size(); i++) {
        logits.read(listed[i], distribution);
        for (int64_t j = 0; j < count; j++)
            drawn[j] = draw_at(distribution, PyFloat_AsDouble(PyList_GET_ITEM(uniforms, i * count + j)));
        PyObject *made = distribution_dict(distribution), *row_tokens = int_list(drawn);
        if (!made || !row_tokens || PyErr_Occurred()) {
            Py_XDECREF(made);
            Py_XDECREF(row_tokens);
            Py_CLEAR(tokens);
            break;
        }
        PyList_SET_ITEM(dists, i, made);
        PyList_SET_ITEM(tokens, i, row_tokens);
    }
    if (!tokens || !dists) {
        Py_XDECREF(tokens);
        Py_XDECREF(dists);
        return nullptr;
    }
    return Py_BuildValue("(NN)", tokens, dists);
}

// rejection_walk(logits, top_k, temperature, top_p, shortlist_tokens, tokens, parents, child_dists, uniforms)
//   -> (path, following, uniforms used)
// verify.multi_draft_rejection under top-k sampling, step for step: the oracle's p at a node is SparseRows.read of
// its row (row i: after node i); the children of a node (after it, in order) were drawn from child_dists[node], a
// {token: probability} dict. Child x is accepted when u * q[x] < r[x], r starting as p and becoming
// normalise(max(r - q, 0)) (verify.remainder) after each rejection; with every child rejected, the token drawn from
// r follows. The uniforms are read in order, one a child tried and one for the last draw: at most one a node.
const char *const REJECTION_WALK[] = {"logits", "top_k", "temperature", "top_p", "shortlist_tokens", "tokens",
                                      "parents", "child_dists", "uniforms"};
PyObject *rejection_walk(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(REJECTION_WALK);
    SparseRows logits;
    std::vector<int64_t> tokens, parents;
    if (!named.open("rejection_walk", args, nargs, kwnames) || !logits.open(named, "rejection_walk") ||
        !read_ints(named["tokens"], tokens, "tokens") || !read_ints(named["parents"], parents, "parents"))
        return nullptr;
    PyObject *child_dists = named["child_dists"], *uniforms = named["uniforms"];
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (n == 0 || logits.rows < n || static_cast<int64_t>(parents.size()) != n || !PyDict_Check(child_dists) ||
        !PyList_Check(uniforms) || PyList_GET_SIZE(uniforms) < n) {
        PyErr_SetString(PyExc_ValueError, "rejection_walk: the tree, the logits' rows and the uniforms disagree");
        return nullptr;
    }
    // a node's q, read once from its dict: q[token] is then a scan of a few tens of pairs (0 for a token it leaves out,
    // as Sparse gives), where a dict lookup would make a Python int a token
    std::vector<std::pair<int64_t, double>> q;
    auto read_q = [&](int64_t node) -> bool {
        PyObject *key = PyLong_FromLongLong(node), *dict = key ? PyDict_GetItemWithError(child_dists, key) : nullptr;
        Py_XDECREF(key);
        if (!dict || !PyDict_Check(dict)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "rejection_walk: a node with children has no dict in child_dists");
            return false;
        }
        q.clear();
        Py_ssize_t at = 0;
        PyObject *token, *probability;
        while (PyDict_Next(dict, &at, &token, &probability))
            q.emplace_back(PyLong_AsLongLong(token), PyFloat_AsDouble(probability));
        return !PyErr_Occurred();
    };
    auto at = [](const std::vector<std::pair<int64_t, double>> &distribution, int64_t token) {
        for (const auto &[t, p] : distribution)
            if (t == token) return p;
        return 0.0;
    };
    std::vector<int64_t> path{0};
    std::vector<std::pair<int64_t, double>> residual, left;
    Py_ssize_t used = 0;
    while (true) {
        const int64_t node = path.back();
        logits.read(node, residual);
        bool accepted = false, read = false;
        for (int64_t child = node + 1; child < n && !accepted; child++) {
            if (parents[child] != node) continue;
            if (!read && !(read = read_q(node))) return nullptr;
            const double u = PyFloat_AsDouble(PyList_GET_ITEM(uniforms, used++));
            if (PyErr_Occurred()) return nullptr;
            if (u * at(q, tokens[child]) < at(residual, tokens[child])) {
                path.push_back(child);
                accepted = true;
                break;
            }
            left.clear();  // normalise(max(r - q, 0)), the residual itself where q covers all of it
            double total = 0;
            for (const auto &[token, r] : residual) {
                const double q_token = at(q, token);
                if (r > q_token) left.emplace_back(token, r - q_token);
            }
            for (const auto &entry : left) total += entry.second;
            if (total > 0) {
                for (auto &entry : left) entry.second /= total;
                residual.swap(left);
            }
        }
        if (accepted) continue;
        const int64_t following = draw_at(residual, PyFloat_AsDouble(PyList_GET_ITEM(uniforms, used++)));
        if (PyErr_Occurred()) return nullptr;
        return Py_BuildValue("(NLn)", int_list(path), static_cast<long long>(following), used);
    }
}

// commit_slots(cache, planes, capacity, slot_bytes, length, keep)
// GPT2Engine.commit's moves over its cache of `planes` planes (keys and values of each layer's heads) of `capacity`
// slots of `slot_bytes` bytes at address `cache` (a bfloat16 cache has no buffer to pass: decode/native's SlotMover holds
// the tensor): slot length + i takes slot length + keep[i]. `keep` increases, so a slot is read
// before any move writes it, and a move never overlaps its source.
const char *const COMMIT_SLOTS[] = {"cache", "planes", "capacity", "slot_bytes", "length", "keep"};
PyObject *commit_slots(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(COMMIT_SLOTS);
    if (!named.open("commit_slots", args, nargs, kwnames)) return nullptr;
    auto *cache = static_cast<char *>(PyLong_AsVoidPtr(named["cache"]));
    const int64_t planes = PyLong_AsLongLong(named["planes"]), capacity = PyLong_AsLongLong(named["capacity"]);
    const int64_t slot_bytes = PyLong_AsLongLong(named["slot_bytes"]), length = PyLong_AsLongLong(named["length"]);
    std::vector<int64_t> keep;
    if (PyErr_Occurred() || !read_ints(named["keep"], keep, "keep")) return nullptr;
    for (size_t i = 0; i < keep.size(); i++)
        if (keep[i] < static_cast<int64_t>(i) || (i > 0 && keep[i] <= keep[i - 1]) || length + keep[i] >= capacity) {
            PyErr_SetString(PyExc_ValueError, "commit_slots: keep must increase and stay inside the cache");
            return nullptr;
        }
    for (int64_t plane = 0; plane < planes; plane++) {
        char *slots = cache + plane * capacity * slot_bytes;
        for (size_t i = 0; i < keep.size(); i++)
            if (keep[i] != static_cast<int64_t>(i))
                std::memcpy(slots + (length + i) * slot_bytes, slots + (length + keep[i]) * slot_bytes, slot_bytes);
    }
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"top_tokens", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(top_tokens)), METH_FASTCALL | METH_KEYWORDS,
     "Each row's k best tokens."},
    {"draws", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(draws)), METH_FASTCALL | METH_KEYWORDS,
     "Each listed row's processed distribution over its support, and draws from it."},
    {"rejection_walk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rejection_walk)), METH_FASTCALL | METH_KEYWORDS,
     "Multi-draft rejection verification under top-k sampling."},
    {"trigram_tree", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(trigram_tree)), METH_FASTCALL | METH_KEYWORDS,
     "The trigram's tree below a context."},
    {"staged_selection", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(staged_selection)), METH_FASTCALL | METH_KEYWORDS,
     "The staged drafter's greedy selection of the oracle's tree."},
    {"greedy_walk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(greedy_walk)), METH_FASTCALL | METH_KEYWORDS,
     "Sample-match verification under greedy decoding."},
    {"continuations", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(continuations)), METH_FASTCALL | METH_KEYWORDS,
     "The continuations of the context's longest repeated suffix."},
    {"commit_slots", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(commit_slots)), METH_FASTCALL | METH_KEYWORDS,
     "A cache's kept slots moved into place."},
    {"set_distribution_type", set_distribution_type, METH_O, "The dict subclass the distributions are returned as."},
    {nullptr, nullptr, 0, nullptr}};

// torch's extension builder names the module (TORCH_EXTENSION_NAME: decode/native adds the source's hash)
#define STRINGIFY_(name) #name
#define STRINGIFY(name) STRINGIFY_(name)
#define CONCATENATE_(a, b) a##b
#define CONCATENATE(a, b) CONCATENATE_(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(TORCH_EXTENSION_NAME), "A decoding step's loops over trees.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC CONCATENATE(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
