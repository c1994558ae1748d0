// A GPT-2's or a Llama-family model's forward over a few new rows in one C++ call, and a chain of a draft's forwards
// (decode/native loads it; the lean engines of decode/models call it through their `logits` for a draft's forwards and
// an oracle's). A step's forward is
// a few rows through every weight of the model: torch spends it starting some thirty operations a layer, each cold after
// the other model's forward, and its products read a weight again for every few rows. Here each product runs over
// weights packed once at load, in groups of 64 columns split over torch's threads: every row of the call uses a group's
// weights while they are in cache, so a forward of 1 to 64 rows reads each weight from memory once. The products are a
// bfloat16 model's AVX-512 BF16 dot products or, on a CPU with AMX, its tiles; a float32 model's AVX-512 fused
// multiply-adds; or, in the AVX2 build (no FORWARD_AVX512), fused multiply-adds of 8 floats for either dtype, a
// bfloat16 weight widened to float32 as it is read. A quantized model's products (Q8_0 or Q4_0 blocks, quantized.h)
// quantize each row to int8 block by block, as llama.cpp's do, and sum its products with the weights in int32
// (AVX-512 VNNI, or AVX2's byte products). Attention with the tree's mask runs its heads over the same
// threads; the norms, rotary positions, softmax, GELU or SwiGLU and the residuals run a vector at a time over the rows
// in place, in float32.
// The model's dtype (`T`: bf16 or float) is that of its embeddings, its unquantized weights, its cache and the products' inputs. Every row adds
// its terms in the same order whatever the call's other rows: a row's logits are bit for bit the same alone or beside
// others. They differ from torch's in rounding only, as two kernels' do (docs/exactness.md).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "layers.h"
#include "products.h"
#include "quantized.h"
#include "rows.h"
#include "vectors.h"

namespace {

// The architectures forward() runs: GPT-2 (learned positions, layer norms with biases, GELU MLPs) and the Llama family
// (rotary positions, RMS norms, SwiGLU MLPs, grouped-query attention; Qwen2's q/k/v biases are the products' biases).
enum Architecture : int64_t { GPT2 = 0, LLAMA = 1 };

// A model as forward() reads it: its shape and the addresses of its tensors, read and checked once by model() from
// named fields and kept in a capsule that the Python object holding the tensors owns.
struct Model {
    int64_t architecture = GPT2;
    int64_t n_embd, heads, kv_heads, head_dim, intermediate, layers, capacity, vocabulary, positions, logit_columns,
        element_bytes;
    float epsilon;
    int64_t format = DENSE;  // the linear layers' weights: in the model's dtype, or in Q8_0 or Q4_0 blocks
    bool tiles = false;      // a bfloat16 model's products on AMX's tiles
    const void *wte;
    const void *wpe = nullptr;                      // GPT-2's positions
    const float *cos = nullptr, *sin = nullptr;     // the Llama family's: (positions, head_dim / 2) each
    void *cache;  // the engine's kv_cache: (2, layers, kv_heads, capacity, head_dim)
    struct Block {
        const float *norm_1[2], *norm_2[2];  // weight, bias (nullptr: an RMS norm)
        const void *packed[4];               // qkv, attn_out, mlp_in (the Llama family's: gate, then up), mlp_out
        const float *bias[4];
    };
    std::vector<Block> blocks;
    const float *norm_f[2];
    const void *output;  // the output layer's packed weight, its bias zeros
    const float *output_bias;

    int64_t q_width() const { return heads * head_dim; }
    int64_t qkv_width() const { return (heads + 2 * kv_heads) * head_dim; }
    int64_t mlp_in_width() const { return architecture == LLAMA ? 2 * intermediate : intermediate; }
    // whether the products can run on AMX's tiles: a bfloat16 model's, every product's input a multiple of 32
    bool tileable() const {
        return format == DENSE && element_bytes == 2 && n_embd % 32 == 0 && q_width() % 32 == 0 && intermediate % 32 == 0
               && tiles_granted();
    }
};

// Each row of x normalized into out by the model's norm: layer norm with a bias, RMS norm without.
template <typename T>
VECTOR_TARGET void normalize(const Model &m, const float *x, const float *const norm[2], T *out, int64_t rows) {
    if (norm[1])
        layer_norm(x, norm[0], norm[1], out, rows, m.n_embd, m.epsilon);
    else
        rms_norm(x, norm[0], out, rows, m.n_embd, m.epsilon);
}

template <typename T>
Linear<T> linear(const void *packed, const float *bias, int64_t in, int64_t out) {
    return Linear<T>{static_cast<const T *>(packed), bias, in, out};
}

// y (rows x out) = x @ W + bias for one of the model's linear layers, packed as its format says: in the model's dtype
// (products.h, on AMX's tiles with `tiles`) or quantized (quantized.h, the rows quantized to int8 as it reads them).
template <typename T>
VECTOR_TARGET void multiply(const Model &m, const void *packed, const float *bias, const T *x, int64_t in, int64_t out,
                            float *y, int64_t rows, bool tiles) {
    if (m.format == DENSE) {
        product(x, linear<T>(packed, bias, in, out), y, rows, tiles);
        return;
    }
    quantized_product(m.format, x, QuantizedLinear{static_cast<const uint8_t *>(packed), bias, in, out}, y, rows,
                      PARALLEL_WORK);
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
    const int64_t n_embd = m.n_embd, dim = m.head_dim, q_width = m.q_width(), kv_width = m.kv_heads * dim;
    const int64_t qkv_width = m.qkv_width(), inner = m.intermediate;
    const Cache<T> cache{static_cast<T *>(m.cache), m.layers, m.kv_heads, m.capacity, dim};
    const Heads heads{m.heads, m.heads / m.kv_heads, qkv_width, q_width};
    const auto *wte = static_cast<const T *>(m.wte), *wpe = static_cast<const T *>(m.wpe);
    std::vector<float> x(rows * n_embd), wide(rows * std::max({qkv_width, m.mlp_in_width(), n_embd}));
    std::vector<T> normed(rows * std::max(n_embd, q_width)), activated(rows * inner);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n_embd; i++)
            x[r * n_embd + i] = to_float(wte[a.ids[r] * n_embd + i]) + (wpe ? to_float(wpe[a.positions[r] * n_embd + i]) : 0.0f);
    // AMX's tiles where asked for and granted (every product's input a multiple of 32 elements)
    const bool tiles = m.tiles && std::is_same_v<T, bf16> && tiles_granted();
    for (int64_t l = 0; l < m.layers; l++) {
        const Model::Block &b = m.blocks[l];
        normalize(m, x.data(), b.norm_1, normed.data(), rows);
        multiply(m, b.packed[0], b.bias[0], normed.data(), n_embd, qkv_width, wide.data(), rows, tiles);  // q, k, v
        for (int64_t r = 0; r < rows; r++) {
            float *row = wide.data() + r * qkv_width;
            if (m.cos) {  // the queries' and keys' rotary positions
                const int64_t at = a.positions[r] * (dim / 2);
                rotate(row, m.heads + m.kv_heads, dim, m.cos + at, m.sin + at);
            }
            for (int64_t h = 0; h < m.kv_heads; h++)
                for (int64_t d = 0; d < dim; d += LANES)
                    for (int64_t kind = 0; kind < 2; kind++)  // the key, then the value
                        store(cache.at(kind, l, h, a.start + r) + d,
                              load(row + q_width + kind * kv_width + h * dim + d, dim - d), dim - d);
        }
        attention(wide.data(), cache, l, a.visible, normed.data(), rows, heads);
        std::vector<float> &projected = wide;  // the attention read its queries already
        multiply(m, b.packed[1], b.bias[1], normed.data(), q_width, n_embd, projected.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += projected[i];
        normalize(m, x.data(), b.norm_2, normed.data(), rows);
        multiply(m, b.packed[2], b.bias[2], normed.data(), n_embd, m.mlp_in_width(), wide.data(), rows, tiles);
        if (m.architecture == LLAMA)
            swiglu(wide.data(), activated.data(), rows, inner);
        else
            gelu(wide.data(), activated.data(), rows * inner);
        multiply(m, b.packed[3], b.bias[3], activated.data(), inner, n_embd, wide.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += wide[i];
    }
    const int64_t first = rows - a.last;  // the rows whose logits are asked for
    normalize(m, x.data() + first * n_embd, m.norm_f, normed.data(), a.last);
    multiply(m, m.output, m.output_bias, normed.data(), n_embd, m.logit_columns, a.out, a.last, tiles);
}

// A field of model()'s dict: an int, or a tensor as (address, elements, element_bytes) whose element count must be
// `elements` and whose elements `bytes` bytes each (the model's element_bytes, or 4 for a float32 layer norm or bias).
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
bool tensor(PyObject *spec, const char *name, int64_t elements, int64_t bytes, P &address) {
    PyObject *item = PyDict_GetItemString(spec, name);
    if (!item || !PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_Format(PyExc_KeyError, "model: field %s must be (address, elements, element_bytes)", name);
        return false;
    }
    const long long got = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
    const long long got_bytes = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 2));
    address = static_cast<P>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(item, 0)));
    if (PyErr_Occurred()) return false;
    if (got != elements || !address) {
        PyErr_Format(PyExc_ValueError, "model: %s holds %lld elements where the shape needs %lld", name, got,
                     static_cast<long long>(elements));
        return false;
    }
    if (got_bytes != bytes) {
        PyErr_Format(PyExc_TypeError, "model: %s has %lld-byte elements where the model reads %lld-byte ones", name,
                     got_bytes, static_cast<long long>(bytes));
        return false;
    }
    return true;
}

void free_model(PyObject *capsule) { delete static_cast<Model *>(PyCapsule_GetPointer(capsule, "forward.Model")); }

Model *model_of(PyObject *capsule) { return static_cast<Model *>(PyCapsule_GetPointer(capsule, "forward.Model")); }

// An optional int field: its default where absent.
bool optional_field(PyObject *spec, const char *name, int64_t &value, int64_t otherwise) {
    value = otherwise;
    return !PyDict_GetItemString(spec, name) || field(spec, name, value);
}

// model(spec) -> a capsule: the model forward() and chain() run, read from a dict of named fields. Ints: n_embd,
// heads, layers, capacity (the cache's slots), vocabulary, positions, logit_columns, element_bytes (2: bfloat16, 4:
// float32); optional ints: architecture (0: GPT-2, the default; 1: the Llama family), kv_heads (default heads),
// head_dim (default n_embd / heads), intermediate (the MLP's width, default 4 n_embd), format (0, the default: linear
// layers in the model's dtype; 1: Q8_0, 2: Q4_0 blocks, their packed tensors then bytes, decode/models/quantized.py's
// pack_quantized); epsilon (a float). Tensors, each as (address, elements, element_bytes): wte, cache, norm_f.weight,
// output.packed, output.bias; GPT-2's wpe and norm_f.bias, the Llama family's rope.cos and rope.sin (float32,
// positions x head_dim / 2); per layer i "h.{i}.norm_1.weight" (and GPT-2's .bias; norm_2 likewise, float32) and
// "h.{i}.qkv.packed" (and .bias; attn_out, mlp_in and mlp_out likewise: decode/native's pack_for_products, float32
// biases). qkv's columns are the heads' queries, then the key/value heads' keys, then their values; the Llama family's
// mlp_in's the gate's, then the up projection's.
PyObject *model(PyObject *, PyObject *spec) {
    if (!PyDict_Check(spec)) {
        PyErr_SetString(PyExc_TypeError, "model: expected a dict of named fields");
        return nullptr;
    }
    auto m = std::make_unique<Model>();
    if (!field(spec, "n_embd", m->n_embd) || !field(spec, "heads", m->heads) || !field(spec, "layers", m->layers)
        || !field(spec, "capacity", m->capacity) || !field(spec, "vocabulary", m->vocabulary)
        || !field(spec, "positions", m->positions) || !field(spec, "logit_columns", m->logit_columns)
        || !field(spec, "element_bytes", m->element_bytes) || !optional_field(spec, "format", m->format, DENSE)
        || !optional_field(spec, "architecture", m->architecture, GPT2)
        || !optional_field(spec, "kv_heads", m->kv_heads, m->heads)
        || !optional_field(spec, "head_dim", m->head_dim, m->heads > 0 ? m->n_embd / m->heads : 0)
        || !optional_field(spec, "intermediate", m->intermediate, 4 * m->n_embd))
        return nullptr;
    const int64_t n = m->n_embd;
    if (m->format != DENSE && !quantized_supported()) {
        PyErr_SetString(PyExc_ValueError, "model: this CPU lacks the instructions of this build's quantized products "
                                          "(AVX-512 VNNI, or AVX2 and F16C)");
        return nullptr;
    }
    if (m->format != DENSE && (n % QUANT_BLOCK || m->q_width() % QUANT_BLOCK || m->intermediate % QUANT_BLOCK
                               || (m->format != Q8_0 && m->format != Q4_0))) {
        PyErr_Format(PyExc_ValueError, "model: format %lld is not one of 0 (the model's dtype), 1 (Q8_0) and 2 (Q4_0), "
                                       "or a product's input is not a multiple of %lld", static_cast<long long>(m->format),
                     static_cast<long long>(QUANT_BLOCK));
        return nullptr;
    }
    const bool llama = m->architecture == LLAMA;
    if ((m->architecture != GPT2 && !llama) || n <= 0 || n % 16 || m->heads <= 0 || m->kv_heads <= 0
        || m->heads % m->kv_heads || m->head_dim <= 0 || m->head_dim % 2 || m->q_width() % 16 || m->intermediate <= 0
        || m->intermediate % 16 || (!llama && (m->kv_heads != m->heads || m->q_width() != n)) || m->layers <= 0
        || m->capacity <= 0 || m->logit_columns <= 0 || (m->element_bytes != 2 && m->element_bytes != 4)) {
        PyErr_SetString(PyExc_ValueError, "model: architecture 0 (GPT-2) or 1 (Llama); n_embd, heads x head_dim and the "
                                          "MLP's width multiples of 16; query heads a multiple of the key/value heads "
                                          "(GPT-2: as many, heads x head_dim = n_embd); layers, slots and logit columns "
                                          "at least 1; 2 or 4 bytes an element");
        return nullptr;
    }
    PyObject *epsilon = PyDict_GetItemString(spec, "epsilon");
    m->epsilon = epsilon ? static_cast<float>(PyFloat_AsDouble(epsilon)) : -1.0f;
    if (PyErr_Occurred() || !(m->epsilon >= 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "model: epsilon must be a float of at least 0");
        return nullptr;
    }
    const int64_t columns = (m->logit_columns + 15) / 16 * 16, per_pair = m->element_bytes == 2 ? 2 : 1;
    // a packed (in, out) weight: out padded to 16 columns, and in bfloat16 in to pairs of rows
    auto packed = [&](int64_t in, int64_t out) {
        return m->format != DENSE ? quantized_bytes(m->format, in, out) : (in + per_pair - 1) / per_pair * per_pair * ((out + 15) / 16 * 16);
    };
    // of the model's own tensors; norms, biases and rotary tables are float32, quantized layers bytes
    const int64_t bytes = m->element_bytes, packed_bytes = m->format != DENSE ? 1 : bytes;
    if (!tensor(spec, "wte", m->vocabulary * n, bytes, m->wte)
        || !tensor(spec, "cache", 2 * m->layers * m->capacity * m->kv_heads * m->head_dim, bytes, m->cache)
        || !tensor(spec, "norm_f.weight", n, 4, m->norm_f[0])
        || !tensor(spec, "output.packed", packed(n, m->logit_columns), packed_bytes, m->output)
        || !tensor(spec, "output.bias", columns, 4, m->output_bias))
        return nullptr;
    m->norm_f[1] = nullptr;
    if (llama ? !tensor(spec, "rope.cos", m->positions * m->head_dim / 2, 4, m->cos)
                    || !tensor(spec, "rope.sin", m->positions * m->head_dim / 2, 4, m->sin)
              : !tensor(spec, "wpe", m->positions * n, bytes, m->wpe) || !tensor(spec, "norm_f.bias", n, 4, m->norm_f[1]))
        return nullptr;
    const char *linear_names[4] = {"qkv", "attn_out", "mlp_in", "mlp_out"};
    const int64_t ins[4] = {n, m->q_width(), n, m->intermediate}, outs[4] = {m->qkv_width(), n, m->mlp_in_width(), n};
    m->blocks.resize(m->layers);
    char name[96];
    for (int64_t l = 0; l < m->layers; l++) {
        Model::Block &b = m->blocks[l];
        for (int side = 0; side < 2; side++) {
            b.norm_1[side] = b.norm_2[side] = nullptr;
            if (side && llama) continue;  // RMS norms: no bias
            const char *part = side ? "bias" : "weight";
            snprintf(name, sizeof name, "h.%lld.norm_1.%s", static_cast<long long>(l), part);
            if (!tensor(spec, name, n, 4, b.norm_1[side])) return nullptr;
            snprintf(name, sizeof name, "h.%lld.norm_2.%s", static_cast<long long>(l), part);
            if (!tensor(spec, name, n, 4, b.norm_2[side])) return nullptr;
        }
        for (int p = 0; p < 4; p++) {
            snprintf(name, sizeof name, "h.%lld.%s.packed", static_cast<long long>(l), linear_names[p]);
            if (!tensor(spec, name, packed(ins[p], outs[p]), packed_bytes, b.packed[p])) return nullptr;
            snprintf(name, sizeof name, "h.%lld.%s.bias", static_cast<long long>(l), linear_names[p]);
            if (!tensor(spec, name, outs[p], 4, b.bias[p])) return nullptr;
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

// The named arguments model (a capsule from model()), ids and positions (the rows' tokens and positions).
template <typename Arguments>
Model *read_rows(const Arguments &named, Rows &a) {
    Model *m = model_of(named["model"]);
    if (!m || !read_ints(named["ids"], a.ids, "ids") || !read_ints(named["positions"], a.positions, "positions"))
        return nullptr;
    return m;
}

// blocks(model, ids, positions, start, mask, last, out)
//   model: a capsule from model(); ids, positions: lists of the new rows' tokens and positions (a list costs less to
//   make than a tensor), whose keys and values go to cache slots start..start + rows; mask: a bool (rows, columns)
//   array over the last `columns` slots, or None for a chain; out: the float32 (last, logit columns) array the
//   logits of the last `last` rows are written to.
const char *const BLOCKS[] = {"model", "ids", "positions", "start", "mask", "last", "out"};
PyObject *blocks(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(BLOCKS);
    Rows a;
    Array mask, out;
    if (!named.open("blocks", args, nargs, kwnames)) return nullptr;
    const Model *m = read_rows(named, a);
    if (!m || !mask.open(named["mask"], "mask", "?", 1, 2, true) || !out.open(named["out"], "out", "f", 4, 2, false, true))
        return nullptr;
    a.start = PyLong_AsLongLong(named["start"]);
    a.end = a.start + static_cast<int64_t>(a.ids.size());
    const int64_t columns = mask.size(1);
    a.visible = Visibility{mask.data<const uint8_t>(), columns, a.start, a.end};
    a.last = PyLong_AsLongLong(named["last"]);
    a.out = out.data<float>();
    if (PyErr_Occurred()) return nullptr;
    if (out.size(0) != a.last || out.size(1) != m->logit_columns || columns > a.end
        || (a.visible.mask && (columns < static_cast<int64_t>(a.ids.size()) || mask.size(0) != static_cast<int64_t>(a.ids.size())))) {
        PyErr_SetString(PyExc_ValueError, "blocks: out must be (last, logit columns), and a mask one row a new row over "
                                          "the new rows and slots before them within the cache's");
        return nullptr;
    }
    if (!forward_checked(*m, a, "blocks")) return nullptr;
    Py_RETURN_NONE;
}

// chain(model, ids, positions, start, steps, top_k, temperature, top_p, shortlist_tokens, uniforms)
//   -> (tokens, distributions or None)
// A chain drafter's `steps` draft forwards as one call (ChainDrafter.propose): the first over the new rows (from
// slot `start`, the last of them the tree's root), each later one over the token drawn after the row before, one
// position further; after each, the token that follows: the argmax when greedy (temperature 0; as row_argmax), else
// under the top-k setting a draw at the next of `uniforms` from the processed distribution (TopK.read, draw_at), each
// distribution a distribution_dict. shortlist_tokens: the logits' column -> token array, or None.
const char *const CHAIN[] = {"model", "ids", "positions", "start", "steps", "top_k", "temperature", "top_p",
                             "shortlist_tokens", "uniforms"};
PyObject *chain(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(CHAIN);
    Rows a;
    if (!named.open("chain", args, nargs, kwnames)) return nullptr;
    const Model *m = read_rows(named, a);
    if (!m) return nullptr;
    a.start = PyLong_AsLongLong(named["start"]);
    const int64_t steps = PyLong_AsLongLong(named["steps"]);
    TopK setting;
    setting.k = PyLong_AsLongLong(named["top_k"]);
    setting.temperature = PyFloat_AsDouble(named["temperature"]);
    setting.top_p = PyFloat_AsDouble(named["top_p"]);
    Int64Array column_token;
    PyObject *uniforms = named["uniforms"];
    const bool greedy = setting.temperature == 0;
    const int64_t columns = m->logit_columns;
    if (PyErr_Occurred() || !column_token.open(named["shortlist_tokens"], "shortlist tokens") ||
        (!greedy && !setting.check("chain")))
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
            PyObject *made = distribution_dict(distribution);
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
// bfloat16 model, every product's input a multiple of 32, a CPU with AMX-BF16); None for `on` only asks.
const char *const TILES_ARGUMENTS[] = {"model", "on"};
PyObject *tiles(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(TILES_ARGUMENTS);
    if (!named.open("tiles", args, nargs, kwnames)) return nullptr;
    Model *m = model_of(named["model"]);
    if (!m) return nullptr;
    const bool possible = m->tileable();
    if (named["on"] == Py_None) return PyBool_FromLong(possible);
    const int on = PyObject_IsTrue(named["on"]);
    if (on < 0) return nullptr;
    m->tiles = on && possible;
    return PyBool_FromLong(m->tiles);
}

// quantized_product(format, packed, bias, x, out): out = x @ W + bias for one quantized layer, as a forward computes
// it: format 1 (Q8_0) or 2 (Q4_0); packed: the uint8 packed layer (pack_quantized, 3-dimensional as it returns it);
// bias: float32, the output columns padded to 16; x: float32 (rows, in); out: float32 (rows, out).
const char *const QUANTIZED_PRODUCT[] = {"format", "packed", "bias", "x", "out"};
PyObject *quantized_product_of(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(QUANTIZED_PRODUCT);
    Array packed, bias, x, out;
    if (!named.open("quantized_product", args, nargs, kwnames) || !packed.open(named["packed"], "packed", "B", 1, 3)
        || !bias.open(named["bias"], "bias", "f", 4, 1) || !x.open(named["x"], "x", "f", 4, 2)
        || !out.open(named["out"], "out", "f", 4, 2, false, true))
        return nullptr;
    const int64_t format = PyLong_AsLongLong(named["format"]);
    if (PyErr_Occurred()) return nullptr;
    const int64_t rows = x.size(0), in = x.size(1), columns = out.size(1);
    if ((format != Q8_0 && format != Q4_0) || !quantized_supported() || in % QUANT_BLOCK || out.size(0) != rows
        || packed.count() != quantized_bytes(format, in, columns) || bias.count() != (columns + 15) / 16 * 16) {
        PyErr_SetString(PyExc_ValueError, "quantized_product: format 1 or 2 on a CPU that runs it, a packed layer and "
                                          "a bias of x's inputs and out's columns");
        return nullptr;
    }
    quantized_product(format, x.data<const float>(), QuantizedLinear{packed.data<const uint8_t>(), bias.data<const float>(), in, columns},
                      out.data<float>(), rows, PARALLEL_WORK);
    Py_RETURN_NONE;
}

// quantized_supported() -> whether this CPU runs this build's products over Q8_0 and Q4_0 blocks.
PyObject *quantized_supported_here(PyObject *, PyObject *) { return PyBool_FromLong(quantized_supported()); }

PyMethodDef methods[] = {
    {"model", model, METH_O, "A model's shape and tensors, read and checked once, as a capsule."},
    {"blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(blocks)), METH_FASTCALL | METH_KEYWORDS,
     "A GPT-2's or Llama-family model's forward over a few new rows."},
    {"chain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(chain)), METH_FASTCALL | METH_KEYWORDS,
     "A chain drafter's draft forwards and the tokens each chooses, as one call."},
    {"set_distribution_type", set_distribution_type, METH_O, "The dict subclass the distributions are returned as."},
    {"quantized_product", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(quantized_product_of)),
     METH_FASTCALL | METH_KEYWORDS, "One quantized layer's product, as a forward computes it."},
    {"quantized_supported", quantized_supported_here, METH_NOARGS,
     "Whether this CPU runs this build's products over Q8_0 and Q4_0 blocks."},
    {"supported", supported, METH_O, "Whether this CPU runs this build's forward of a model with elements of this many bytes."},
    {"tiles", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tiles)), METH_FASTCALL | METH_KEYWORDS,
     "Sets (or, with None, asks) whether a bfloat16 model's products run on AMX's tiles."},
    {nullptr, nullptr, 0, nullptr}};

#define STRINGIFY_(name) #name
#define STRINGIFY(name) STRINGIFY_(name)
#define CONCATENATE_(a, b) a##b
#define CONCATENATE(a, b) CONCATENATE_(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(TORCH_EXTENSION_NAME), "A GPT-2's or Llama-family model's forward over a few rows.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC CONCATENATE(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
