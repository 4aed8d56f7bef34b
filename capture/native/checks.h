// Checks shared by the compiled part's sources.
#pragma once

#include <Python.h>

namespace gradfx_native {

// emit_tensor's checks of the Python tensor ``obj`` against ``expected`` (type, ndim,
// dtype, layout, device, contiguous); its sizes (and strides) appended to ``sizes``.
bool tensor(PyObject* obj, PyObject* expected, PyObject* sizes);

}  // namespace gradfx_native
