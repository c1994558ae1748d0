// A GPT-2's or a Llama-family model's forward over a few new rows in one C++ call, and chains of a draft's forwards
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
// (AVX-512 VNNI, AMX-INT8's tiles, or AVX2's byte products). Attention with the tree's mask runs its heads over the same
// threads (a bfloat16 model's scores on AMX's tiles where its products run there); the norms, rotary positions, softmax, GELU or SwiGLU and the residuals run a vector at a time over the rows
// in place, in float32.
// A forward's rows may belong to several sequences, each with its own cache (the weights are read once for all of them:
// a server's requests in flight verify their trees in one call); each sequence's rows attend to its own cache only.
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
    int64_t n_embd, heads, kv_heads, head_dim, intermediate, layers, vocabulary, positions, logit_columns,
        element_bytes;
    float epsilon;
    int64_t format = DENSE;  // the linear layers' weights: in the model's dtype, or in Q8_0 or Q4_0 blocks
    bool tiles = false;      // the products on AMX's tiles (a bfloat16 model's on AMX-BF16, a quantized one's on AMX-INT8)
    const void *wte = nullptr;                      // the token embeddings in the model's dtype, or
    const void *embeddings = nullptr;               // a quantized model's, packed as a layer (nullptr for both: the
                                                    // output layer's columns)
    const void *wpe = nullptr;                      // GPT-2's positions
    const float *cos = nullptr, *sin = nullptr;     // the Llama family's: (positions, head_dim / 2) each
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
    int64_t slot_elements() const { return 2 * layers * kv_heads * head_dim; }  // a cache slot's keys and values
    // whether the products can run on AMX's tiles: a quantized model's (AMX-INT8), or a bfloat16 model's (AMX-BF16),
    // every product's input a multiple of 32
    bool tileable() const {
        if (format != DENSE) return tiles_granted(INT8_TILES);
        return element_bytes == 2 && n_embd % 32 == 0 && q_width() % 32 == 0 && intermediate % 32 == 0 && tiles_granted();
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
                      PARALLEL_WORK, tiles);
}

// One sequence's rows in a forward: rows first..first + count of the call, whose keys and values go to its cache's slots
// start..end (an engine's kv_cache: (2, layers, kv_heads, capacity, head_dim)), what each sees there, and the logits
// asked of its last `last` rows.
struct Part {
    void *cache;
    int64_t capacity, first, count, start, end;
    Visibility visible;
    int64_t last;
};

// A forward's new rows: their tokens and positions, the sequences they belong to (in order, each a run of rows), and
// where the logits asked for go (out: each part's asked rows in turn, a row of logit columns each).
struct Rows {
    std::vector<int64_t> ids, positions;
    std::vector<Part> parts;
    float *out;
};

// A float16 value as float32 (exact).
inline float half_to_float(uint16_t half) {
    const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16, exponent = (half >> 10) & 31u, mantissa = half & 1023u;
    if (exponent == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(static_cast<float>(mantissa), -24);  // zero, subnormals
    const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

// Token `id`'s embedding (n_embd float32) into `out`: its row of wte, or its column of the packed embeddings (a
// quantized model's) or of the packed output layer (where that is the embeddings, the whole vocabulary's):
// pack_for_products' 16 columns a block, pairs of inputs side by side in bfloat16, or pack_quantized's 16 scales for
// each 32 inputs, then lines of 4 bytes a column. Each weight is the value a lookup in the dequantized matrix gives.
template <typename T>
void embedding(const Model &m, int64_t id, float *out) {
    const int64_t n = m.n_embd;
    if (m.wte) {
        const T *row = static_cast<const T *>(m.wte) + id * n;
        for (int64_t i = 0; i < n; i++) out[i] = to_float(row[i]);
        return;
    }
    const int64_t j = id % 16;
    const void *packed = m.embeddings ? m.embeddings : m.output;
    if (m.format == DENSE) {
        constexpr int64_t per_step = sizeof(T) == 2 ? 2 : 1;
        const T *block = static_cast<const T *>(packed) + id / 16 * 16 * n;
        for (int64_t i = 0; i < n; i++) out[i] = to_float(block[i / per_step * 16 * per_step + j * per_step + i % per_step]);
        return;
    }
    const bool q8 = m.format == Q8_0;
    const int64_t group_bytes = q8 ? GROUP_BYTES<Q8_0> : GROUP_BYTES<Q4_0>, lines = q8 ? LINES<Q8_0> : LINES<Q4_0>;
    const auto *block = static_cast<const uint8_t *>(packed) + id / 16 * (n / QUANT_BLOCK) * group_bytes;
    for (int64_t g = 0; g < n / QUANT_BLOCK; g++, out += QUANT_BLOCK) {
        const uint8_t *group = block + g * group_bytes, *values = group + 32 + 4 * j;
        uint16_t scale;
        std::memcpy(&scale, group + 2 * j, sizeof scale);
        const float d = half_to_float(scale);
        for (int64_t k = 0; k < 4 * lines; k++) {  // input k's value is byte k % 4 of line k / 4
            const uint8_t value = values[64 * (k / 4) + k % 4];
            if (q8) {
                out[k] = static_cast<float>(static_cast<int8_t>(value)) * d;
            } else {  // low nibbles: inputs 0-15; high: 16-31
                out[k] = static_cast<float>((value & 15) - 8) * d;
                out[16 + k] = static_cast<float>((value >> 4) - 8) * d;
            }
        }
    }
}

// Rows whose embeddings one thread reads before the others are woken for the rest
constexpr int64_t EMBEDDING_GRAIN = 8;
// Rows whose keys and values (turned to their positions first, in the Llama family) one thread stores in the cache
// before the others are woken for the rest: a row's stores miss the cache, its new slots not read before
constexpr int64_t KEYS_GRAIN = 16;

// A new row's q, k, v (`row`, at `position`) turned to its position (the Llama family's rotary positions), and its key
// and value stored in `slot` of the layer's cache.
template <typename T>
VECTOR_TARGET void cache_row(const Model &m, float *row, int64_t position, const Cache<T> &cache, int64_t layer,
                             int64_t slot) {
    const int64_t dim = m.head_dim, kv_width = m.kv_heads * dim;
    if (m.cos) {
        const int64_t at = position * (dim / 2);
        rotate(row, m.heads + m.kv_heads, dim, m.cos + at, m.sin + at);
    }
    const float *keys = row + m.q_width(), *values = keys + kv_width;
    for (int64_t h = 0; h < m.kv_heads; h++)
        for (int64_t d = 0; d < dim; d += LANES) {
            store(cache.at(0, layer, h, slot) + d, load(keys + h * dim + d, dim - d), dim - d);
            store(cache.at(1, layer, h, slot) + d, load(values + h * dim + d, dim - d), dim - d);
        }
}

// The forward, in a model of dtype T.
template <typename T>
VECTOR_TARGET void forward(const Model &m, const Rows &a) {
    const auto rows = static_cast<int64_t>(a.ids.size());
    const int64_t n_embd = m.n_embd, dim = m.head_dim, q_width = m.q_width();
    const int64_t qkv_width = m.qkv_width(), inner = m.intermediate;
    // AMX's tiles where asked for (tiles() sets them only where tileable()): the products', and a bfloat16 model's
    // attention scores
    const bool tiles = m.tiles;
    const Heads heads{m.heads, m.heads / m.kv_heads, qkv_width, q_width, tiles && m.format == DENSE};
    const auto *wpe = static_cast<const T *>(m.wpe);
    std::vector<float> x(rows * n_embd), wide(rows * std::max({qkv_width, m.mlp_in_width(), n_embd}));
    std::vector<T> normed(rows * std::max(n_embd, q_width)), activated(rows * inner);
    // (a row's embedding read in packed weights gathers a line of them for every two inputs: the rows split among
    // the threads where there are many)
    at::parallel_for(0, rows, EMBEDDING_GRAIN, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; r++) {
            embedding<T>(m, a.ids[r], x.data() + r * n_embd);
            if (wpe)
                for (int64_t i = 0; i < n_embd; i++) x[r * n_embd + i] += to_float(wpe[a.positions[r] * n_embd + i]);
        }
    });
    std::vector<Attending<T>> sequences;  // each part's rows in every layer's attention: its q, k, v and its output
    std::vector<size_t> part_of;          // each row's part
    for (const Part &p : a.parts) {
        part_of.insert(part_of.end(), p.count, sequences.size());
        sequences.push_back({wide.data() + p.first * qkv_width,
                             {static_cast<T *>(p.cache), m.layers, m.kv_heads, p.capacity, dim}, &p.visible,
                             normed.data() + p.first * q_width, p.count});
    }
    for (int64_t l = 0; l < m.layers; l++) {
        const Model::Block &b = m.blocks[l];
        normalize(m, x.data(), b.norm_1, normed.data(), rows);
        multiply(m, b.packed[0], b.bias[0], normed.data(), n_embd, qkv_width, wide.data(), rows, tiles);  // q, k, v
        at::parallel_for(0, rows, KEYS_GRAIN, [&](int64_t first, int64_t last) {
            for (int64_t r = first; r < last; r++) {
                const Part &p = a.parts[part_of[r]];
                cache_row(m, wide.data() + r * qkv_width, a.positions[r], sequences[part_of[r]].cache, l,
                          p.start + r - p.first);
            }
        });
        attention(sequences, l, heads);
        std::vector<float> &projected = wide;  // the attention read its queries already
        multiply(m, b.packed[1], b.bias[1], normed.data(), q_width, n_embd, projected.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += projected[i];
        normalize(m, x.data(), b.norm_2, normed.data(), rows);
        multiply(m, b.packed[2], b.bias[2], normed.data(), n_embd, m.mlp_in_width(), wide.data(), rows, tiles);
        activation(m.architecture == LLAMA, wide.data(), activated.data(), rows, inner);
        multiply(m, b.packed[3], b.bias[3], activated.data(), inner, n_embd, wide.data(), rows, tiles);
        for (int64_t i = 0; i < rows * n_embd; i++) x[i] += wide[i];
    }
    std::vector<float> asked;  // the rows whose logits are asked for, each part's last ones
    for (const Part &p : a.parts)
        asked.insert(asked.end(), x.begin() + (p.first + p.count - p.last) * n_embd, x.begin() + (p.first + p.count) * n_embd);
    const auto asked_rows = static_cast<int64_t>(asked.size()) / n_embd;
    normalize(m, asked.data(), m.norm_f, normed.data(), asked_rows);
    multiply(m, m.output, m.output_bias, normed.data(), n_embd, m.logit_columns, a.out, asked_rows, tiles);
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

// model(spec) -> a capsule: the model forward() and chains() run, read from a dict of named fields. Ints: n_embd,
// heads, layers, vocabulary, positions, logit_columns, element_bytes (2: bfloat16, 4:
// float32); optional ints: architecture (0: GPT-2, the default; 1: the Llama family), kv_heads (default heads),
// head_dim (default n_embd / heads), intermediate (the MLP's width, default 4 n_embd), format (0, the default: linear
// layers in the model's dtype; 1: Q8_0, 2: Q4_0 blocks, their packed tensors then bytes, decode/models/quantized.py's
// pack_quantized); epsilon (a float). Tensors, each as (address, elements, element_bytes): wte, or a quantized
// model's embeddings.packed (pack_quantized), or neither where the output layer's columns are the whole vocabulary's
// embeddings (they are read there), norm_f.weight,
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
        || !field(spec, "vocabulary", m->vocabulary)
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
        || m->logit_columns <= 0 || (m->element_bytes != 2 && m->element_bytes != 4)) {
        PyErr_SetString(PyExc_ValueError, "model: architecture 0 (GPT-2) or 1 (Llama); n_embd, heads x head_dim and the "
                                          "MLP's width multiples of 16; query heads a multiple of the key/value heads "
                                          "(GPT-2: as many, heads x head_dim = n_embd); layers and logit columns at least "
                                          "1; 2 or 4 bytes an element");
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
    const bool wte = PyDict_GetItemString(spec, "wte"), embeddings = PyDict_GetItemString(spec, "embeddings.packed");
    if ((wte && embeddings) || (embeddings && m->format == DENSE) || (!wte && !embeddings && m->vocabulary > m->logit_columns)) {
        PyErr_SetString(PyExc_ValueError, "model: the embeddings are wte, or a quantized model's embeddings.packed, or "
                                          "else the output layer's columns, which must then cover the vocabulary");
        return nullptr;
    }
    if ((wte && !tensor(spec, "wte", m->vocabulary * n, bytes, m->wte))
        || (embeddings && !tensor(spec, "embeddings.packed", quantized_bytes(m->format, n, m->vocabulary), 1, m->embeddings))
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

// The forward of a's rows in model m, once they are checked against it: each part's slots within its cache and the
// logits asked of it, the parts covering the rows in turn, their tokens and positions (refused as torch's embedding
// lookups would refuse them).
bool forward_checked(const Model &m, const Rows &a, const char *function) {
    const auto rows = static_cast<int64_t>(a.ids.size());
    int64_t covered = 0;
    for (const Part &p : a.parts) {
        if (p.first != covered || p.count < 1 || p.end != p.start + p.count || p.last < 0 || p.last > p.count
            || p.start < 0 || p.end > p.capacity) {
            PyErr_Format(PyExc_ValueError, "%s: the rows do not match the cache's slots", function);
            return false;
        }
        covered += p.count;
    }
    if (covered != rows || a.positions.size() != a.ids.size()) {
        PyErr_Format(PyExc_ValueError, "%s: the parts must cover the rows, a position each", function);
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

// A sequence's cache, (address, elements, element_bytes) of an engine's (2, layers, kv_heads, capacity, head_dim)
// kv_cache in the model's dtype, as part p's (its capacity read from its size).
bool read_cache(const Model &m, PyObject *cache, Part &p) {
    if (!PyTuple_Check(cache) || PyTuple_GET_SIZE(cache) != 3) {
        PyErr_SetString(PyExc_TypeError, "cache must be (address, elements, element_bytes)");
        return false;
    }
    p.cache = PyLong_AsVoidPtr(PyTuple_GET_ITEM(cache, 0));
    const int64_t elements = PyLong_AsLongLong(PyTuple_GET_ITEM(cache, 1)), bytes = PyLong_AsLongLong(PyTuple_GET_ITEM(cache, 2));
    if (PyErr_Occurred()) return false;
    if (!p.cache || bytes != m.element_bytes || elements <= 0 || elements % m.slot_elements()) {
        PyErr_SetString(PyExc_ValueError, "cache must be a (2, layers, kv_heads, capacity, head_dim) tensor in the model's "
                                          "dtype");
        return false;
    }
    p.capacity = elements / m.slot_elements();
    return true;
}

// Part p of a's rows from a sequence's cache, first slot, mask (a bool (count, columns) array over the last `columns`
// slots, held open in `mask`; None: a chain) and the number of its rows whose logits are asked; its rows are those a
// holds from p.first on, `count` of them.
bool read_part(const Model &m, PyObject *cache, PyObject *start, PyObject *mask_array, PyObject *last, Array &mask,
               Part &p) {
    if (!read_cache(m, cache, p) || !mask.open(mask_array, "mask", "?", 1, 2, true)) return false;
    p.start = PyLong_AsLongLong(start);
    p.last = PyLong_AsLongLong(last);
    if (PyErr_Occurred()) return false;
    p.end = p.start + p.count;
    const int64_t columns = mask.size(1);
    p.visible = Visibility{mask.data<const uint8_t>(), columns, p.start, p.end};
    if (columns > p.end || (p.visible.mask && (columns < p.count || mask.size(0) != p.count))) {
        PyErr_SetString(PyExc_ValueError, "a mask has one row a new row, over the new rows and slots before them within "
                                          "the cache's");
        return false;
    }
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

// Whether out is the float32 (rows, logit columns) array of the logits a's parts ask for, opened for writing into.
bool read_out(const Model &m, PyObject *array, Rows &a, Array &out, const char *function) {
    if (!out.open(array, "out", "f", 4, 2, false, true)) return false;
    int64_t asked = 0;
    for (const Part &p : a.parts) asked += p.last;
    if (out.size(0) != asked || out.size(1) != m.logit_columns) {
        PyErr_Format(PyExc_ValueError, "%s: out must be (the rows whose logits are asked, logit columns)", function);
        return false;
    }
    a.out = out.data<float>();
    return true;
}

// blocks(model, cache, ids, positions, start, mask, last, out)
//   model: a capsule from model(); cache: the engine's kv_cache as (address, elements, element_bytes); ids,
//   positions: lists of the new rows' tokens and positions (a list costs less to make than a tensor), whose keys and
//   values go to cache slots start..start + rows; mask: a bool (rows, columns) array over the last `columns` slots,
//   or None for a chain; out: the float32 (last, logit columns) array the logits of the last `last` rows are
//   written to.
const char *const BLOCKS[] = {"model", "cache", "ids", "positions", "start", "mask", "last", "out"};
PyObject *blocks(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(BLOCKS);
    Rows a;
    Array mask, out;
    if (!named.open("blocks", args, nargs, kwnames)) return nullptr;
    const Model *m = read_rows(named, a);
    if (!m) return nullptr;
    Part &p = a.parts.emplace_back();
    p.first = 0;
    p.count = static_cast<int64_t>(a.ids.size());
    if (!read_part(*m, named["cache"], named["start"], named["mask"], named["last"], mask, p)
        || !read_out(*m, named["out"], a, out, "blocks") || !forward_checked(*m, a, "blocks"))
        return nullptr;
    Py_RETURN_NONE;
}

// batch(model, parts, out)
//   One forward over the new rows of several sequences, each with its own cache: parts is a list of tuples (cache,
//   ids, positions, start, mask, last), each as blocks() takes them for one sequence; out: the float32 (rows, logit
//   columns) array the logits asked of each part are written to, the parts' in turn. A part's logits are those
//   blocks() gives it alone.
const char *const BATCH[] = {"model", "parts", "out"};
PyObject *batch(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(BATCH);
    Rows a;
    Array out;
    if (!named.open("batch", args, nargs, kwnames)) return nullptr;
    const Model *m = model_of(named["model"]);
    PyObject *parts = named["parts"];
    if (!m) return nullptr;
    if (!PyList_Check(parts) || PyList_GET_SIZE(parts) == 0) {
        PyErr_SetString(PyExc_TypeError, "batch: parts must be a non-empty list of (cache, ids, positions, start, mask, "
                                         "last) tuples");
        return nullptr;
    }
    const Py_ssize_t n = PyList_GET_SIZE(parts);
    std::vector<std::unique_ptr<Array>> masks;  // held open for the call
    std::vector<int64_t> ids, positions;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *part = PyList_GET_ITEM(parts, i);
        if (!PyTuple_Check(part) || PyTuple_GET_SIZE(part) != 6) {
            PyErr_SetString(PyExc_TypeError, "batch: each part is a (cache, ids, positions, start, mask, last) tuple");
            return nullptr;
        }
        if (!read_ints(PyTuple_GET_ITEM(part, 1), ids, "ids") || !read_ints(PyTuple_GET_ITEM(part, 2), positions, "positions"))
            return nullptr;
        Part &p = a.parts.emplace_back();
        p.first = static_cast<int64_t>(a.ids.size());
        p.count = static_cast<int64_t>(ids.size());
        a.ids.insert(a.ids.end(), ids.begin(), ids.end());
        a.positions.insert(a.positions.end(), positions.begin(), positions.end());
        masks.push_back(std::make_unique<Array>());
        if (!read_part(*m, PyTuple_GET_ITEM(part, 0), PyTuple_GET_ITEM(part, 3), PyTuple_GET_ITEM(part, 4),
                       PyTuple_GET_ITEM(part, 5), *masks.back(), p))
            return nullptr;
    }
    if (!read_out(*m, named["out"], a, out, "batch") || !forward_checked(*m, a, "batch")) return nullptr;
    Py_RETURN_NONE;
}

// One sequence's chain in chains(): its rows of the next forward (the new rows at first, then the token chosen), the
// tokens chosen so far, and how it chooses them.
struct Chain {
    Part part;
    std::vector<int64_t> ids, positions, tokens;
    int64_t steps = 0;
    TopK setting;
    PyObject *uniforms = nullptr;      // borrowed from the part's tuple
    PyObject *distributions = nullptr;  // a new list when sampling, else None (a new reference either way)

    Chain() = default;
    Chain(const Chain &) = delete;
    Chain &operator=(const Chain &) = delete;
    ~Chain() { Py_XDECREF(distributions); }

    bool greedy() const { return setting.temperature == 0; }

    // The token after this chain's row of logits (step `step`): its argmax when greedy (as row_argmax), else a draw at
    // the step's uniform from the processed distribution, which is kept.
    bool choose(const float *logits, int64_t columns, const int64_t *column_token, int64_t step,
                std::vector<std::pair<int64_t, double>> &distribution) {
        int64_t token;
        if (greedy()) {
            float largest_logit;
            const int64_t column = row_argmax(logits, columns, &largest_logit);
            token = column_token ? column_token[column] : column;
        } else {
            setting.read(logits, columns, column_token, distribution);
            token = draw_at(distribution, PyFloat_AsDouble(PyList_GET_ITEM(uniforms, step)));
            PyObject *made = distribution_dict(distribution);
            const bool kept = made && PyList_Append(distributions, made) == 0;
            Py_XDECREF(made);
            if (!kept) return false;
        }
        tokens.push_back(token);
        part.start += static_cast<int64_t>(ids.size());
        ids.assign(1, token);
        positions.assign(1, positions.back() + 1);
        return true;
    }
};

// Chain i of chains() from its part (cache, ids, positions, start, steps, top_k, temperature, top_p, uniforms).
bool read_chain(const Model &m, PyObject *tuple, Chain &c) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 9) {
        PyErr_SetString(PyExc_TypeError, "chains: each part is a (cache, ids, positions, start, steps, top_k, "
                                         "temperature, top_p, uniforms) tuple");
        return false;
    }
    if (!read_cache(m, PyTuple_GET_ITEM(tuple, 0), c.part) || !read_ints(PyTuple_GET_ITEM(tuple, 1), c.ids, "ids")
        || !read_ints(PyTuple_GET_ITEM(tuple, 2), c.positions, "positions"))
        return false;
    c.part.start = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, 3));
    c.steps = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, 4));
    c.setting.k = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, 5));
    c.setting.temperature = PyFloat_AsDouble(PyTuple_GET_ITEM(tuple, 6));
    c.setting.top_p = PyFloat_AsDouble(PyTuple_GET_ITEM(tuple, 7));
    c.uniforms = PyTuple_GET_ITEM(tuple, 8);
    if (PyErr_Occurred() || (!c.greedy() && !c.setting.check("chains"))) return false;
    if (c.ids.empty() || c.ids.size() != c.positions.size() || c.steps < 0 || !PyList_Check(c.uniforms)
        || PyList_GET_SIZE(c.uniforms) != (c.greedy() ? 0 : c.steps)) {
        PyErr_SetString(PyExc_ValueError, "chains: at least one row, a position each, and a uniform draw a step when "
                                          "sampling");
        return false;
    }
    c.distributions = c.greedy() ? Py_NewRef(Py_None) : PyList_New(0);
    return c.distributions != nullptr;
}

// chains(model, parts, shortlist_tokens) -> [(tokens, distributions or None), ...]
// Chain drafters' draft forwards, several sequences' at once (ChainDrafter.propose; decode.batch drafts every request
// in flight this way): parts is a list of tuples (cache, ids, positions, start, steps, top_k, temperature, top_p,
// uniforms), one a sequence. A sequence's first forward is over its new rows (from slot `start` of its cache, as
// blocks() takes them; the last of them the tree's root), each later one over the token chosen after the row before,
// one position further, for `steps` forwards; after each, the token that follows: the argmax when greedy (temperature
// 0; as row_argmax), else under its top-k setting a draw at the next of its `uniforms` from the processed distribution
// (TopK.read, draw_at), each distribution a distribution_dict. Each step's forwards of every sequence still drafting
// run as one forward, which reads the weights once for all of them; a sequence's tokens are those it gets alone.
// shortlist_tokens: the logits' column -> token array, or None.
const char *const CHAINS[] = {"model", "parts", "shortlist_tokens"};
PyObject *chains(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(CHAINS);
    if (!named.open("chains", args, nargs, kwnames)) return nullptr;
    const Model *m = model_of(named["model"]);
    PyObject *parts = named["parts"];
    Int64Array column_token;
    if (!m || !column_token.open(named["shortlist_tokens"], "shortlist tokens")) return nullptr;
    const int64_t columns = m->logit_columns;
    if (!PyList_Check(parts) || PyList_GET_SIZE(parts) == 0 || (column_token.data && column_token.size != columns)) {
        PyErr_SetString(PyExc_ValueError, "chains: a non-empty list of parts, and a shortlist of the logits' columns");
        return nullptr;
    }
    const Py_ssize_t n = PyList_GET_SIZE(parts);
    std::vector<Chain> drafting(n);
    int64_t longest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!read_chain(*m, PyList_GET_ITEM(parts, i), drafting[i])) return nullptr;
        longest = std::max(longest, drafting[i].steps);
    }
    std::vector<float> logits(n * columns);
    std::vector<std::pair<int64_t, double>> distribution;
    for (int64_t step = 0; step < longest; step++) {
        Rows a;
        std::vector<Chain *> stepping;  // the sequences with a forward at this step, in the forward's order
        for (Chain &c : drafting) {
            if (step >= c.steps) continue;
            Part &p = a.parts.emplace_back(c.part);
            p.first = static_cast<int64_t>(a.ids.size());
            p.count = static_cast<int64_t>(c.ids.size());
            p.end = p.start + p.count;
            p.visible = Visibility{nullptr, 0, p.start, p.end};
            p.last = 1;
            a.ids.insert(a.ids.end(), c.ids.begin(), c.ids.end());
            a.positions.insert(a.positions.end(), c.positions.begin(), c.positions.end());
            stepping.push_back(&c);
        }
        a.out = logits.data();
        if (!forward_checked(*m, a, "chains")) return nullptr;
        for (size_t i = 0; i < stepping.size(); i++)
            if (!stepping[i]->choose(logits.data() + i * columns, columns, column_token.data, step, distribution))
                return nullptr;
    }
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *pair = Py_BuildValue("(NO)", int_list(drafting[i].tokens), drafting[i].distributions);
        if (!pair) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, pair);
    }
    return out;
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
// quantized model on a CPU with AMX-INT8, or a bfloat16 model, every product's input a multiple of 32, on a CPU with
// AMX-BF16); None for `on` only asks.
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
// bias: float32, the output columns padded to 16; x: float32 (rows, in); out: float32 (rows, out); tiles: whether on
// AMX's tiles (where the CPU has AMX-INT8; the same bits either way).
const char *const QUANTIZED_PRODUCT[] = {"format", "packed", "bias", "x", "out", "tiles"};
PyObject *quantized_product_of(PyObject *, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Named named(QUANTIZED_PRODUCT);
    Array packed, bias, x, out;
    if (!named.open("quantized_product", args, nargs, kwnames) || !packed.open(named["packed"], "packed", "B", 1, 3)
        || !bias.open(named["bias"], "bias", "f", 4, 1) || !x.open(named["x"], "x", "f", 4, 2)
        || !out.open(named["out"], "out", "f", 4, 2, false, true))
        return nullptr;
    const int64_t format = PyLong_AsLongLong(named["format"]);
    const int tiles = PyObject_IsTrue(named["tiles"]);
    if (PyErr_Occurred() || tiles < 0) return nullptr;
    const int64_t rows = x.size(0), in = x.size(1), columns = out.size(1);
    if ((format != Q8_0 && format != Q4_0) || !quantized_supported() || in % QUANT_BLOCK || out.size(0) != rows
        || packed.count() != quantized_bytes(format, in, columns) || bias.count() != (columns + 15) / 16 * 16) {
        PyErr_SetString(PyExc_ValueError, "quantized_product: format 1 or 2 on a CPU that runs it, a packed layer and "
                                          "a bias of x's inputs and out's columns");
        return nullptr;
    }
    quantized_product(format, x.data<const float>(), QuantizedLinear{packed.data<const uint8_t>(), bias.data<const float>(), in, columns},
                      out.data<float>(), rows, PARALLEL_WORK, tiles && tiles_granted(INT8_TILES));
    Py_RETURN_NONE;
}

// quantized_supported() -> whether this CPU runs this build's products over Q8_0 and Q4_0 blocks.
PyObject *quantized_supported_here(PyObject *, PyObject *) { return PyBool_FromLong(quantized_supported()); }

PyMethodDef methods[] = {
    {"model", model, METH_O, "A model's shape and tensors, read and checked once, as a capsule."},
    {"blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(blocks)), METH_FASTCALL | METH_KEYWORDS,
     "A GPT-2's or Llama-family model's forward over a few new rows."},
    {"batch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(batch)), METH_FASTCALL | METH_KEYWORDS,
     "One forward over the new rows of several sequences, each with its own cache."},
    {"chains", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(chains)), METH_FASTCALL | METH_KEYWORDS,
     "Chain drafters' draft forwards and the tokens each chooses, several sequences' as one call a step."},
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
