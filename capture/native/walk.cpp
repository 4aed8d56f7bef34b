// Reads of the generated cache-hit walker (capture/graph/fast_walk.py) done in C++: the
// same checks as its Python lines, on the same C++ state, without a Python object per
// value read.  Each answers False where the Python lines would bail, or where it is not
// sure they would not (the generic walk then decides, as for any miss).

#include <pybind11/pybind11.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Layout.h>

#include <memory>

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

// Python's checks of emit_metas: as many inputs, each of that rank, dtype and device;
// then every shape appended to ``sizes``.  ``expected``: per input (ndim, dtype, device).
bool metas(py::handle object, py::tuple expected, py::list sizes) {
  Node* node = node_of(object.ptr());
  if (node == nullptr || node->num_inputs() != expected.size()) {
    return false;
  }
  for (size_t k = 0; k < expected.size(); ++k) {
    const auto& meta = node->input_metadata(k);
    if (meta.was_default_constructed() || meta.is_nested_tensor() || meta.is_tensor_subclass()) {
      return false;  // shapes Python reads otherwise: the generic walk decides
    }
    auto entry = py::reinterpret_borrow<py::tuple>(expected[k]);
    PyObject* dtype = entry[1].ptr();
    PyObject* device = entry[2].ptr();
    if (!THPDtype_Check(dtype) || !THPDevice_Check(device) ||
        reinterpret_cast<THPDtype*>(dtype)->scalar_type != meta.dtype().toScalarType() ||
        reinterpret_cast<THPDevice*>(device)->device != meta.device()) {
      return false;
    }
    auto shape = meta.shape_as_dim_vector();
    if (static_cast<int64_t>(shape.size()) != entry[0].cast<int64_t>()) {
      return false;
    }
    for (const auto& size : shape) {
      auto value = size.maybe_as_int();
      if (!value.has_value()) {
        return false;
      }
      sizes.append(py::int_(*value));
    }
  }
  return true;
}

// Python's checks of emit_tensor: exactly that type, rank, dtype, layout, device and
// contiguity; then its sizes (and strides where it is not contiguous) appended.
// ``expected``: (type, ndim, dtype, layout, device, contiguous).
bool tensor(py::handle object, py::tuple expected, py::list sizes) {
  PyObject* obj = object.ptr();
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != expected[0].ptr() || !THPVariable_Check(obj)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  PyObject* dtype = expected[2].ptr();
  PyObject* layout = expected[3].ptr();
  PyObject* device = expected[4].ptr();
  if (!THPDtype_Check(dtype) || !THPLayout_Check(layout) || !THPDevice_Check(device) ||
      t.layout() != at::kStrided || t.is_nested() ||
      t.dim() != expected[1].cast<int64_t>() ||
      reinterpret_cast<THPDtype*>(dtype)->scalar_type != t.scalar_type() ||
      reinterpret_cast<THPLayout*>(layout)->layout != t.layout() ||
      reinterpret_cast<THPDevice*>(device)->device != t.device()) {
    return false;
  }
  bool contiguous = t.is_contiguous();
  if (contiguous != expected[5].cast<bool>()) {
    return false;
  }
  for (auto size : t.sizes()) {
    sizes.append(py::int_(size));
  }
  if (!contiguous) {
    for (auto stride : t.strides()) {
      sizes.append(py::int_(stride));
    }
  }
  return true;
}

}  // namespace

void add_walk(py::module_& m) {
  m.def("metas", &metas, "emit_metas' checks of a node's input metadata; its shapes appended to sizes");
  m.def("tensor", &tensor, "emit_tensor's checks of a tensor; its sizes (strides) appended to sizes");
}
