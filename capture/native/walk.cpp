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
#include <vector>

#include "checks.h"
#include "methods.h"

namespace py = pybind11;
using torch::autograd::Node;

namespace {

// The Python-facing form of a check: the tuple parsed, the check run, its sizes appended.
bool appended(PyObject* sizes, const std::vector<int64_t>& found, bool ok) {
  return ok && gradfx_native::extend(sizes, found);
}

}  // namespace

namespace {

template <typename Owner>
Node* raw(const std::weak_ptr<Owner>& owner) {
  return owner.lock().get();  // the graph keeps the node alive while its object is read
}

template <typename Owner>
Node* raw(const Owner& owner) {
  return owner.get();
}

}  // namespace

Node* gradfx_native::node_of(PyObject* object) {
  if (torch::autograd::THPCppFunction_Check(object)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(object)->cdata.get();
  }
  if (THPFunction_Check(object)) {
    return raw(reinterpret_cast<THPFunction*>(object)->cdata);
  }
  return nullptr;
}

bool gradfx_native::extend(PyObject* list, const std::vector<int64_t>& sizes) {
  for (int64_t size : sizes) {
    PyObject* number = PyLong_FromLongLong(size);
    if (number == nullptr) {
      return false;
    }
    const int failed = PyList_Append(list, number);
    Py_DECREF(number);
    if (failed != 0) {
      return false;
    }
  }
  return true;
}

bool gradfx_native::parse_tensor(PyObject* expected, TensorSpec* out) {
  if (!PyTuple_Check(expected) || PyTuple_GET_SIZE(expected) != 6) {
    return false;
  }
  PyObject* dtype = PyTuple_GET_ITEM(expected, 2);
  PyObject* layout = PyTuple_GET_ITEM(expected, 3);
  PyObject* device = PyTuple_GET_ITEM(expected, 4);
  if (!PyType_Check(PyTuple_GET_ITEM(expected, 0)) || !PyLong_Check(PyTuple_GET_ITEM(expected, 1)) ||
      !THPDtype_Check(dtype) || !THPLayout_Check(layout) || !THPDevice_Check(device)) {
    return false;
  }
  out->type = PyTuple_GET_ITEM(expected, 0);
  out->ndim = PyLong_AsLongLong(PyTuple_GET_ITEM(expected, 1));
  out->dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  out->layout = reinterpret_cast<THPLayout*>(layout)->layout;
  out->device = reinterpret_cast<THPDevice*>(device)->device;
  out->contiguous = PyTuple_GET_ITEM(expected, 5) == Py_True;
  return true;
}

bool gradfx_native::parse_metas(PyObject* expected, std::vector<MetaSpec>* out) {
  if (!PyTuple_Check(expected)) {
    return false;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(expected); ++k) {
    PyObject* entry = PyTuple_GET_ITEM(expected, k);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3 || !PyLong_Check(PyTuple_GET_ITEM(entry, 0)) ||
        !THPDtype_Check(PyTuple_GET_ITEM(entry, 1)) || !THPDevice_Check(PyTuple_GET_ITEM(entry, 2))) {
      return false;
    }
    MetaSpec spec;
    spec.ndim = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
    spec.dtype = reinterpret_cast<THPDtype*>(PyTuple_GET_ITEM(entry, 1))->scalar_type;
    spec.device = reinterpret_cast<THPDevice*>(PyTuple_GET_ITEM(entry, 2))->device;
    out->push_back(spec);
  }
  return true;
}

bool gradfx_native::parse_leaf(PyObject* expected, LeafSpec* out) {
  if (!PyTuple_Check(expected) || PyTuple_GET_SIZE(expected) != 3 ||
      !parse_tensor(PyTuple_GET_ITEM(expected, 0), &out->tensor)) {
    return false;
  }
  out->requires_grad = PyTuple_GET_ITEM(expected, 1) == Py_True;
  PyObject* grad_dtype = PyTuple_GET_ITEM(expected, 2);
  out->has_grad_dtype = grad_dtype != Py_None;
  if (out->has_grad_dtype) {
    if (!THPDtype_Check(grad_dtype)) {
      return false;
    }
    out->grad_dtype = reinterpret_cast<THPDtype*>(grad_dtype)->scalar_type;
  }
  return true;
}

// Python's checks of emit_metas: as many inputs, each of that rank, dtype and device;
// then every shape appended.
bool gradfx_native::metas(Node* node, const MetaSpec* specs, size_t count, std::vector<int64_t>* sizes) {
  if (node == nullptr || node->num_inputs() != count) {
    return false;
  }
  for (size_t k = 0; k < count; ++k) {
    const auto& meta = node->input_metadata(k);
    // A nested tensor's shape Python reads otherwise: the generic walk decides.  A tensor
    // subclass's (DTensor's) outer sizes are read alike: the node runs as itself.
    if (meta.was_default_constructed() || meta.is_nested_tensor()) {
      return false;
    }
    if (specs[k].dtype != meta.dtype().toScalarType() || specs[k].device != meta.device()) {
      return false;
    }
    auto shape = meta.shape_as_dim_vector();
    if (static_cast<int64_t>(shape.size()) != specs[k].ndim) {
      return false;
    }
    for (const auto& size : shape) {
      auto value = size.maybe_as_int();
      if (!value.has_value()) {
        return false;
      }
      sizes->push_back(*value);
    }
  }
  return true;
}

static bool metas_of_tuple(PyObject* object, PyObject* expected, PyObject* sizes) {
  std::vector<gradfx_native::MetaSpec> specs;
  std::vector<int64_t> found;
  if (!PyList_Check(sizes) || !gradfx_native::parse_metas(expected, &specs)) {
    return false;
  }
  return appended(sizes, found, gradfx_native::metas(gradfx_native::node_of(object), specs.data(), specs.size(), &found));
}

// AccumulateKind.check's reads of a leaf: the node's variable, exactly of the expected
// type, with that requires_grad and grad_dtype, then emit_tensor's checks.
PyObject* gradfx_native::leaf(Node* any, const LeafSpec& spec, std::vector<int64_t>* sizes) {
  auto* node = dynamic_cast<torch::autograd::AccumulateGrad*>(any);
  if (node == nullptr || !node->variable.defined()) {
    Py_RETURN_NONE;
  }
  const at::Tensor& variable = node->variable;
  const auto dtype = variable.grad_dtype();
  if (variable.requires_grad() != spec.requires_grad || dtype.has_value() != spec.has_grad_dtype ||
      (dtype.has_value() && *dtype != spec.grad_dtype)) {
    Py_RETURN_NONE;
  }
  PyObject* obj = THPVariable_Wrap(variable);
  if (obj == nullptr) {
    return nullptr;
  }
  if (!gradfx_native::tensor(obj, spec.tensor, sizes)) {
    Py_DECREF(obj);
    if (PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  return obj;
}

static PyObject* leaf_of_tuple(PyObject* object, PyObject* expected, PyObject* sizes) {
  gradfx_native::LeafSpec spec;
  if (!torch::autograd::THPCppFunction_Check(object) || !PyList_Check(sizes) || !gradfx_native::parse_leaf(expected, &spec)) {
    Py_RETURN_NONE;
  }
  std::vector<int64_t> found;
  PyObject* v = gradfx_native::leaf(gradfx_native::node_of(object), spec, &found);
  if (v != nullptr && v != Py_None && !gradfx_native::extend(sizes, found)) {
    Py_DECREF(v);
    return nullptr;
  }
  return v;
}

namespace {

PyObject* leaf_fastcall(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "leaf(node, expected, sizes)");
    return nullptr;
  }
  try {
    return leaf_of_tuple(args[0], args[1], args[2]);
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
}

bool tensor_tuple(PyObject* obj, PyObject* expected, PyObject* sizes) {
  gradfx_native::TensorSpec spec;
  std::vector<int64_t> found;
  if (!PyList_Check(sizes) || !gradfx_native::parse_tensor(expected, &spec)) {
    return false;
  }
  return appended(sizes, found, gradfx_native::tensor(obj, spec, &found));
}

bool metas_tuple(PyObject* obj, PyObject* expected, PyObject* sizes) {
  return metas_of_tuple(obj, expected, sizes);
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

PyMethodDef metas_def = {"metas", GRADFX_FASTCALL(fastcall<metas_tuple>),
                         METH_FASTCALL, "emit_metas' checks of a node's input metadata; its shapes appended to sizes"};
PyMethodDef tensor_def = {"tensor", GRADFX_FASTCALL(fastcall<tensor_tuple>),
                          METH_FASTCALL, "emit_tensor's checks of a tensor; its sizes (strides) appended to sizes"};

// Does the node take the gradient of a tensor subclass (its input metadata says so; no
// Python binding shows it)?  Such a node runs as itself (graph.kinds).
PyObject* subclass_inputs(PyObject* /*self*/, PyObject* object) {
  Node* node = gradfx_native::node_of(object);
  if (node == nullptr) {
    PyErr_SetString(PyExc_TypeError, "subclass_inputs(node): expected an autograd node");
    return nullptr;
  }
  for (uint32_t k = 0; k < node->num_inputs(); ++k) {
    if (node->input_metadata(k).is_tensor_subclass()) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

PyMethodDef subclass_inputs_def = {"subclass_inputs", subclass_inputs, METH_O,
                                   "does the node take a tensor subclass's gradient"};

PyMethodDef leaf_def = {"leaf", GRADFX_FASTCALL(leaf_fastcall),
                        METH_FASTCALL, "AccumulateKind.check's reads of a leaf: the leaf, or None"};

}  // namespace

// Python's checks of emit_tensor: exactly that type, rank, dtype, layout, device and
// contiguity; then its sizes (and strides where it is not contiguous) appended.
bool gradfx_native::tensor(PyObject* obj, const TensorSpec& spec, std::vector<int64_t>* sizes) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != spec.type || !THPVariable_Check(obj)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.layout() != at::kStrided || t.is_nested() || t.dim() != spec.ndim || spec.dtype != t.scalar_type() ||
      spec.layout != t.layout() || spec.device != t.device()) {
    return false;
  }
  const bool contiguous = t.is_contiguous();
  if (contiguous != spec.contiguous) {
    return false;
  }
  for (auto size : t.sizes()) {
    sizes->push_back(size);
  }
  if (!contiguous) {
    for (auto stride : t.strides()) {
      sizes->push_back(stride);
    }
  }
  return true;
}

void add_walk(py::module_& m) {
  gradfx_native::add_functions(m, {&metas_def, &tensor_def, &leaf_def, &subclass_inputs_def});
}
