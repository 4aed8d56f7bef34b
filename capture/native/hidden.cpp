// What some builtin autograd nodes hold in C++ members that no Python binding shows,
// read for the structure key (gradfx/capture/graph/hidden.py says why each is read).
//
// hidden(node) answers a tuple of plain Python values, or None where the node is of
// no kind read here.  Built against the installed torch's own headers, per release
// (capture/native/__init__.py); the member names below are those of torch 2.11-2.14.

#include <pybind11/pybind11.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/python_cpp_function.h>

namespace py = pybind11;
using torch::autograd::Node;
namespace gen = torch::autograd::generated;

namespace {

template <typename Ints>
py::tuple ints(const Ints& values) {
  py::tuple out(values.size());
  for (size_t k = 0; k < values.size(); ++k) {
    out[k] = py::int_(static_cast<int64_t>(values[k]));
  }
  return out;
}

// Sizes, strides and storage offset of a TensorGeometry (concrete in eager).
py::tuple geometry(const at::TensorGeometry& g) {
  py::tuple sizes(g.dim()), strides(g.dim());
  for (int64_t k = 0; k < g.dim(); ++k) {
    sizes[k] = py::int_(g.sym_sizes()[k].guard_int(__FILE__, __LINE__));
    strides[k] = py::int_(g.sym_strides()[k].guard_int(__FILE__, __LINE__));
  }
  return py::make_tuple(sizes, strides, g.sym_storage_offset().guard_int(__FILE__, __LINE__));
}

py::object optional_bool(const std::optional<bool>& value) {
  return value.has_value() ? py::object(py::bool_(*value)) : py::object(py::none());
}

py::object dtype_object(at::ScalarType type) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(type)));
}

template <typename AsStrided>
py::object as_strided(AsStrided* node) {
  return py::make_tuple(geometry(node->self_geometry));
}

py::object hidden(py::handle object) {
  if (!torch::autograd::THPCppFunction_Check(object.ptr())) {
    return py::none();
  }
  Node* node = reinterpret_cast<torch::autograd::THPCppFunction*>(object.ptr())->cdata.get();
  if (auto* n = dynamic_cast<gen::NativeDropoutBackward0*>(node)) {
    return py::make_tuple(optional_bool(n->train));
  }
  if (auto* n = dynamic_cast<gen::AsStridedBackward0*>(node)) {
    return as_strided(n);
  }
  if (auto* n = dynamic_cast<gen::AsStridedBackward1*>(node)) {
    return as_strided(n);
  }
  if (auto* n = dynamic_cast<gen::AsStridedBackward0_copy*>(node)) {
    return as_strided(n);
  }
  if (auto* n = dynamic_cast<gen::BlockDiagBackward0*>(node)) {
    py::tuple sizes(n->tensors_args_sizes.size()), types(n->tensors_args_scalartypes.size());
    for (size_t k = 0; k < sizes.size(); ++k) {
      sizes[k] = ints(n->tensors_args_sizes[k]);
    }
    for (size_t k = 0; k < types.size(); ++k) {
      types[k] = dtype_object(n->tensors_args_scalartypes[k]);
    }
    return py::make_tuple(sizes, types);
  }
  if (auto* n = dynamic_cast<torch::autograd::CopySlices*>(node)) {
    // fn: the node of the in-place op on the view (None once released); a view_fn
    // replays views as_strided cannot express (the caller leaves such a node opaque).
    py::object fn = py::none();
    if (n->fn) {
      fn = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(n->fn));
    }
    return py::make_tuple(geometry(n->base), geometry(n->view), fn, py::bool_(static_cast<bool>(n->view_fn)));
  }
  return py::none();
}

}  // namespace

void add_hidden(py::module_& m) {
  m.def("hidden", &hidden, "The C++ members of a builtin node the structure key holds, or None");
}
