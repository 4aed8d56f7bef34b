// A node's post-hooks as the engine runs them, C++ hooks included.
//
// DistributedDataParallel's reducer hooks each parameter's AccumulateGrad with a C++
// post-hook: no Python binding lists or calls it.  The graph gradfx generates calls the
// node's whole post-hook list here, in registration order, Python hooks (their C++
// wrappers) among them, with the arguments the engine's call_post_hooks passes: the
// node's outputs (none for an accumulator) and its inputs.  The GIL is released, as
// the engine runs nodes without it; the Python hooks take it themselves.

#include "checks.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <typeinfo>

namespace py = pybind11;
using torch::autograd::Node;

namespace {

Node* builtin_node(PyObject* obj) {
  if (!torch::autograd::THPCppFunction_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "expected a builtin autograd node (AccumulateGrad)");
    return nullptr;
  }
  return reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get();
}

// Is this a Python hook's wrapper?  By its dynamic type's name: libtorch_python does not
// export the type's RTTI for a dynamic_cast.
bool python_hook(const torch::autograd::FunctionPostHook& hook) {
  return std::strstr(typeid(hook).name(), "PyFunctionPostHook") != nullptr;
}

}  // namespace

long gradfx_native::cpp_post_hook_count(Node* node) {
  long count = 0;
  for (const auto& hook : node->post_hooks()) {
    if (!python_hook(*hook)) {
      ++count;
    }
  }
  return count;
}

namespace {

PyObject* cpp_post_hooks(PyObject* /*self*/, PyObject* obj) {
  Node* node = builtin_node(obj);
  if (node == nullptr) {
    return nullptr;
  }
  return PyLong_FromLong(gradfx_native::cpp_post_hook_count(node));
}

PyObject* post_hooks_all_cpp(PyObject* /*self*/, PyObject* obj) {
  Node* node = builtin_node(obj);
  if (node == nullptr) {
    return nullptr;
  }
  const auto& hooks = node->post_hooks();
  return PyBool_FromLong(!hooks.empty() && gradfx_native::cpp_post_hook_count(node) == static_cast<long>(hooks.size()));
}

// run_post_hooks(node, inputs: tuple of Tensor or None)
PyObject* run_post_hooks(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "run_post_hooks(node, inputs: tuple)");
    return nullptr;
  }
  Node* node = builtin_node(args[0]);
  if (node == nullptr) {
    return nullptr;
  }
  torch::autograd::variable_list inputs;
  const Py_ssize_t n = PyTuple_GET_SIZE(args[1]);
  inputs.reserve(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* item = PyTuple_GET_ITEM(args[1], k);
    if (item == Py_None) {
      inputs.emplace_back();
    } else if (THPVariable_Check(item)) {
      inputs.push_back(THPVariable_Unpack(item));
    } else {
      PyErr_SetString(PyExc_TypeError, "run_post_hooks: inputs must be tensors or None");
      return nullptr;
    }
  }
  {
    py::gil_scoped_release no_gil;
    torch::autograd::variable_list outputs;
    for (const auto& hook : node->post_hooks()) {
      outputs = (*hook)(outputs, inputs);
    }
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

#define GRADFX_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&f))
PyMethodDef count_def = {"cpp_post_hooks", cpp_post_hooks, METH_O,
                         "how many of a builtin node's post-hooks are C++ hooks"};
PyMethodDef all_cpp_def = {"post_hooks_all_cpp", post_hooks_all_cpp, METH_O,
                            "whether a builtin node has post-hooks and all of them are C++ hooks"};
PyMethodDef run_def = {"run_post_hooks", GRADFX_FASTCALL(run_post_hooks), METH_FASTCALL,
                       "run a node's post-hooks, C++ and Python, as the engine does"};
#undef GRADFX_FASTCALL

}  // namespace

void add_post_hooks(py::module_& m) {
  for (PyMethodDef* def : {&count_def, &all_cpp_def, &run_def}) {
    m.attr(def->ml_name) = py::reinterpret_steal<py::object>(PyCFunction_New(def, nullptr));
  }
}
