// Reads of the generated cache-hit walker (capture/graph/fast_walk.py) done in C++: the
// same checks as its Python lines, on the same C++ state, without a Python object per
// value read.  Each answers False where the Python lines would bail, or where it is not
// sure they would not (the generic walk then decides, as for any miss).

#include <pybind11/pybind11.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Layout.h>

#include <memory>

#include "checks.h"

namespace py = pybind11;
using torch::autograd::Node;

namespace {

template <typename Owner>
Node* raw(const std::weak_ptr<Owner>& owner) {
  return owner.lock().get();  // the graph keeps the node alive while its object is read
}

template <typename Owner>
Node* raw(const Owner& owner) {
  return owner.get();
}

// The node behind a grad_fn object: a builtin node's, or a custom Function's ctx.
Node* node_of(PyObject* object) {
  if (torch::autograd::THPCppFunction_Check(object)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(object)->cdata.get();
  }
  if (THPFunction_Check(object)) {
    return raw(reinterpret_cast<THPFunction*>(object)->cdata);
  }
  return nullptr;
}

bool append_int(PyObject* list, int64_t value) {
  PyObject* number = PyLong_FromLongLong(value);
  if (number == nullptr) {
    return false;
  }
  int failed = PyList_Append(list, number);
  Py_DECREF(number);
  return failed == 0;
}

}  // namespace

// Python's checks of emit_metas: as many inputs, each of that rank, dtype and device;
// then every shape appended to ``sizes``.  ``expected``: per input (ndim, dtype, device).
bool gradfx_native::metas(PyObject* object, PyObject* expected, PyObject* sizes) {
  Node* node = node_of(object);
  if (node == nullptr || !PyTuple_Check(expected) || !PyList_Check(sizes) ||
      node->num_inputs() != static_cast<size_t>(PyTuple_GET_SIZE(expected))) {
    return false;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(expected); ++k) {
    const auto& meta = node->input_metadata(k);
    if (meta.was_default_constructed() || meta.is_nested_tensor() || meta.is_tensor_subclass()) {
      return false;  // shapes Python reads otherwise: the generic walk decides
    }
    PyObject* entry = PyTuple_GET_ITEM(expected, k);
    PyObject* dtype = PyTuple_GET_ITEM(entry, 1);
    PyObject* device = PyTuple_GET_ITEM(entry, 2);
    if (!THPDtype_Check(dtype) || !THPDevice_Check(device) ||
        reinterpret_cast<THPDtype*>(dtype)->scalar_type != meta.dtype().toScalarType() ||
        reinterpret_cast<THPDevice*>(device)->device != meta.device()) {
      return false;
    }
    auto shape = meta.shape_as_dim_vector();
    if (static_cast<long long>(shape.size()) != PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0))) {
      return false;
    }
    for (const auto& size : shape) {
      auto value = size.maybe_as_int();
      if (!value.has_value() || !append_int(sizes, *value)) {
        return false;
      }
    }
  }
  return true;
}

// AccumulateKind.check's reads of a leaf: the node's variable, exactly of the expected
// type, with that requires_grad and grad_dtype, then emit_tensor's checks.  ``expected``:
// (emit_tensor's tuple, requires_grad, grad_dtype or None).  The leaf, or None.
PyObject* gradfx_native::leaf(PyObject* object, PyObject* expected, PyObject* sizes) {
  if (!torch::autograd::THPCppFunction_Check(object) || !PyTuple_Check(expected) || PyTuple_GET_SIZE(expected) != 3) {
    Py_RETURN_NONE;
  }
  auto* node = dynamic_cast<torch::autograd::AccumulateGrad*>(node_of(object));
  if (node == nullptr || !node->variable.defined()) {
    Py_RETURN_NONE;
  }
  const at::Tensor& variable = node->variable;
  PyObject* grad_dtype = PyTuple_GET_ITEM(expected, 2);
  const auto dtype = variable.grad_dtype();
  if (variable.requires_grad() != (PyTuple_GET_ITEM(expected, 1) == Py_True) ||
      (grad_dtype == Py_None ? dtype.has_value()
                             : !THPDtype_Check(grad_dtype) || !dtype.has_value() ||
                                   reinterpret_cast<THPDtype*>(grad_dtype)->scalar_type != *dtype)) {
    Py_RETURN_NONE;
  }
  PyObject* obj = THPVariable_Wrap(variable);
  if (obj == nullptr) {
    return nullptr;
  }
  if (!gradfx_native::tensor(obj, PyTuple_GET_ITEM(expected, 0), sizes)) {
    Py_DECREF(obj);
    if (PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  return obj;
}

namespace {

PyObject* leaf_fastcall(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "leaf(node, expected, sizes)");
    return nullptr;
  }
  try {
    return gradfx_native::leaf(args[0], args[1], args[2]);
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
}

// Called with three positional arguments, without pybind11's argument conversion: these
// run for every node of every cached backward.
template <bool (*check)(PyObject*, PyObject*, PyObject*)>
PyObject* fastcall(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "expected 3 arguments: object, expected, sizes");
    return nullptr;
  }
  bool ok;
  try {
    ok = check(args[0], args[1], args[2]);
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
  if (PyErr_Occurred()) {
    return nullptr;  // an allocation failed
  }
  return PyBool_FromLong(ok);
}

PyMethodDef metas_def = {"metas", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastcall<gradfx_native::metas>)),
                         METH_FASTCALL, "emit_metas' checks of a node's input metadata; its shapes appended to sizes"};
PyMethodDef tensor_def = {"tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastcall<gradfx_native::tensor>)),
                          METH_FASTCALL, "emit_tensor's checks of a tensor; its sizes (strides) appended to sizes"};

PyMethodDef leaf_def = {"leaf", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&leaf_fastcall)),
                        METH_FASTCALL, "AccumulateKind.check's reads of a leaf: the leaf, or None"};

}  // namespace

// Python's checks of emit_tensor: exactly that type, rank, dtype, layout, device and
// contiguity; then its sizes (and strides where it is not contiguous) appended.
// ``expected``: (type, ndim, dtype, layout, device, contiguous).
bool gradfx_native::tensor(PyObject* obj, PyObject* expected, PyObject* sizes) {
  if (!PyTuple_Check(expected) || PyTuple_GET_SIZE(expected) != 6 || !PyList_Check(sizes) ||
      reinterpret_cast<PyObject*>(Py_TYPE(obj)) != PyTuple_GET_ITEM(expected, 0) || !THPVariable_Check(obj)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  PyObject* dtype = PyTuple_GET_ITEM(expected, 2);
  PyObject* layout = PyTuple_GET_ITEM(expected, 3);
  PyObject* device = PyTuple_GET_ITEM(expected, 4);
  if (!THPDtype_Check(dtype) || !THPLayout_Check(layout) || !THPDevice_Check(device) ||
      t.layout() != at::kStrided || t.is_nested() ||
      t.dim() != PyLong_AsLongLong(PyTuple_GET_ITEM(expected, 1)) ||
      reinterpret_cast<THPDtype*>(dtype)->scalar_type != t.scalar_type() ||
      reinterpret_cast<THPLayout*>(layout)->layout != t.layout() ||
      reinterpret_cast<THPDevice*>(device)->device != t.device()) {
    return false;
  }
  bool contiguous = t.is_contiguous();
  if (contiguous != (PyTuple_GET_ITEM(expected, 5) == Py_True)) {
    return false;
  }
  for (auto size : t.sizes()) {
    if (!append_int(sizes, size)) {
      return false;
    }
  }
  if (!contiguous) {
    for (auto stride : t.strides()) {
      if (!append_int(sizes, stride)) {
        return false;
      }
    }
  }
  return true;
}

void add_walk(py::module_& m) {
  m.attr("metas") = py::reinterpret_steal<py::object>(PyCFunction_New(&metas_def, nullptr));
  m.attr("tensor") = py::reinterpret_steal<py::object>(PyCFunction_New(&tensor_def, nullptr));
  m.attr("leaf") = py::reinterpret_steal<py::object>(PyCFunction_New(&leaf_def, nullptr));
}
