// How the entry points of step.cpp and forward.cpp read what Python hands them. Every argument is passed by name
// (Named: a call names each one, none is positional); an array comes through the buffer protocol (Array: a numpy
// array, or a CPU tensor's numpy()), its element type, shape and contiguity checked here, at the boundary, and held
// for the call; the distributions a call returns are made as one Python type, registered once per module
// (set_distribution_type: sampling.Sparse).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

// A METH_FASTCALL | METH_KEYWORDS call's arguments by name: each of `names` is required, no other (nor any
// positional one) is taken; `arguments["name"]` is its value.
template <size_t N>
struct Named {
    const char *const (&names)[N];
    PyObject *values[N] = {};

    explicit Named(const char *const (&names)[N]) : names(names) {}

    bool open(const char *function, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
        const Py_ssize_t given = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
        for (Py_ssize_t k = 0; k < given && nargs == 0; k++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, k);
            size_t i = 0;
            while (i < N && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) i++;
            if (i == N || values[i]) {
                PyErr_Format(PyExc_TypeError, "%s: unexpected or repeated argument %U", function, key);
                return false;
            }
            values[i] = args[k];
        }
        for (size_t i = 0; i < N; i++)
            if (nargs != 0 || !values[i]) {
                PyErr_Format(PyExc_TypeError, "%s takes its %zu arguments by name; %s is missing", function, N,
                             nargs ? "every name" : names[i]);
                return false;
            }
        return true;
    }

    PyObject *operator[](const char *name) const {
        for (size_t i = 0; i < N; i++)
            if (std::strcmp(names[i], name) == 0) return values[i];
        return nullptr;  // a name the entry point did not declare: a bug here, caught by the tests of each entry point
    }
};

// An array passed by the buffer protocol: `format` the struct codes its element may have ("f": float32, "ql":
// int64, "?": bool; "" any, its size `itemsize`), `dimensions` its number of dimensions, C-contiguous. With
// `optional`, None stands for no array (data() is null).
struct Array {
    Py_buffer view{};

    bool open(PyObject *object, const char *name, const char *format, Py_ssize_t itemsize, int dimensions,
              bool optional = false, bool writable = false) {
        if (optional && object == Py_None) return true;
        if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s array (a numpy array or a CPU tensor's numpy())",
                         name, writable ? ", writable" : "");
            return false;
        }
        const char *code = view.format ? view.format : "B";
        if (*code == '<' || *code == '=' || *code == '@') code++;
        if (view.ndim != dimensions || view.itemsize != itemsize || (*format && (!*code || code[1] || !std::strchr(format, *code)))) {
            PyErr_Format(PyExc_TypeError, "%s must be %d-dimensional with %zd-byte elements of type '%s' (got %d "
                         "dimensions of %zd-byte '%s')", name, dimensions, itemsize, format, view.ndim, view.itemsize,
                         view.format ? view.format : "B");
            return false;
        }
        return true;
    }

    template <typename T>
    T *data() const { return static_cast<T *>(view.buf); }
    int64_t size(int dimension) const { return view.obj ? view.shape[dimension] : 0; }
    int64_t count() const { return view.obj ? view.len / view.itemsize : 0; }

    ~Array() {
        if (view.obj) PyBuffer_Release(&view);
    }
};

// Float32 logits, (rows, columns), C-contiguous.
struct Logits {
    Array array;
    const float *data = nullptr;
    int64_t rows = 0, columns = 0;

    bool open(PyObject *object, const char *name = "logits") {
        if (!array.open(object, name, "f", 4, 2)) {
            PyErr_Format(PyExc_TypeError, "%s must be contiguous float32 rows in CPU memory, (rows, columns) as a numpy "
                         "array", name);
            return false;
        }
        data = array.data<const float>();
        rows = array.size(0);
        columns = array.size(1);
        return true;
    }
    const float *row(int64_t i) const { return data + i * columns; }
};

// An int64 array, or None (a shortlist's column -> token or token -> column arrays).
struct Int64Array {
    Array array;
    const int64_t *data = nullptr;
    Py_ssize_t size = 0;

    bool open(PyObject *object, const char *name) {
        if (!array.open(object, name, "ql", 8, 1, true)) return false;
        data = array.data<const int64_t>();
        size = array.count();
        return true;
    }
};

bool read_ints(PyObject *list, std::vector<int64_t> &out, const char *name) {
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of ints", name);
        return false;
    }
    const Py_ssize_t n = PyList_GET_SIZE(list);
    out.resize(n);
    for (Py_ssize_t i = 0; i < n; i++) out[i] = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    return !PyErr_Occurred();
}

PyObject *int_list(const std::vector<int64_t> &values) {
    PyObject *list = PyList_New(values.size());
    for (size_t i = 0; list && i < values.size(); i++) PyList_SET_ITEM(list, i, PyLong_FromLongLong(values[i]));
    return list;
}

// The type a distribution is returned as: a dict subclass (sampling.Sparse), set once as the module is loaded.
PyObject *distribution_type = nullptr;

PyObject *set_distribution_type(PyObject *, PyObject *type) {
    if (!PyType_Check(type) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(type), &PyDict_Type)) {
        PyErr_SetString(PyExc_TypeError, "set_distribution_type: expected a subclass of dict");
        return nullptr;
    }
    Py_INCREF(type);
    Py_XSETREF(distribution_type, type);
    Py_RETURN_NONE;
}

// A distribution, {token: probability} in its order, as a new distribution_type.
PyObject *distribution_dict(const std::vector<std::pair<int64_t, double>> &distribution) {
    if (!distribution_type) {
        PyErr_SetString(PyExc_RuntimeError, "set_distribution_type was not called as the module was loaded");
        return nullptr;
    }
    PyObject *out = PyObject_CallNoArgs(distribution_type);
    for (size_t j = 0; out && j < distribution.size(); j++) {
        PyObject *token = PyLong_FromLongLong(distribution[j].first);
        PyObject *probability = PyFloat_FromDouble(distribution[j].second);
        if (!token || !probability || PyDict_SetItem(out, token, probability) < 0) Py_CLEAR(out);
        Py_XDECREF(token);
        Py_XDECREF(probability);
    }
    return out;
}

}  // namespace
