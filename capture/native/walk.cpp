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

}  // namespace

void add_walk(py::module_& m) {
  m.def("metas", &metas, "emit_metas' checks of a node's input metadata; its shapes appended to sizes");
}
