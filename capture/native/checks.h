// Checks shared by the compiled part's sources.
#pragma once

#include <Python.h>

namespace gradfx_native {

// emit_tensor's checks of the Python tensor ``obj`` against ``expected`` (type, ndim,
// dtype, layout, device, contiguous); its sizes (and strides) appended to ``sizes``.
bool tensor(PyObject* obj, PyObject* expected, PyObject* sizes);

// The walker's other reads, each documented where it is defined: emit_metas' checks
// (walk.cpp), a leaf's (walk.cpp: the leaf or None), a builtin node's saved tensors
// (saved.cpp: a tuple or None), the structure (structure.cpp: (nodes, seq) or None).
bool metas(PyObject* object, PyObject* expected, PyObject* sizes);
PyObject* leaf(PyObject* object, PyObject* expected, PyObject* sizes);
PyObject* saved(PyObject* obj, PyObject* spec, PyObject* sizes);
PyObject* structure(PyObject* tensors, PyObject* plan);

}  // namespace gradfx_native
