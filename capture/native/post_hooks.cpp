// A node's post-hooks as the engine runs them, C++ hooks included.
//
// DistributedDataParallel's reducer hooks each parameter's AccumulateGrad with a C++
// post-hook: no Python binding lists or calls it.  The graph gradfx generates calls the
// node's whole post-hook list here, in registration order, Python hooks (their C++
// wrappers) among them, with the arguments the engine's call_post_hooks passes: the
// node's outputs (none for an accumulator) and its inputs.  The GIL is released, as
// the engine runs nodes without it; the Python hooks take it themselves.  Meanwhile the node
// is what Python's current-node question answers (hook_ops.running_node).

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

// hook_ops' thread-local whose ``node`` Python's current-node question answers while an
// opaque call runs (hook_ops.running_node): set by set_running_node_holder.
PyObject* running = nullptr;

// The previous value of running.node (a new reference; None where unset), or nullptr.
PyObject* swap_running(PyObject* node) {
  PyObject* previous = PyObject_GetAttrString(running, "node");
  if (previous == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
      return nullptr;
    }
    PyErr_Clear();
    previous = Py_NewRef(Py_None);
  }
  if (PyObject_SetAttrString(running, "node", node) < 0) {
    Py_DECREF(previous);
    return nullptr;
  }
  return previous;
}

PyObject* run_hooks(PyObject* node_obj, PyObject* inputs_obj) {
  HANDLE_TH_ERRORS
  if (running == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "run_post_hooks: set_running_node_holder was not called");
    return nullptr;
  }
  if (!PyTuple_Check(inputs_obj)) {
    PyErr_SetString(PyExc_TypeError, "run_post_hooks(node, inputs: tuple)");
    return nullptr;
  }
  Node* node = builtin_node(node_obj);
  if (node == nullptr) {
    return nullptr;
  }
  torch::autograd::variable_list inputs;
  const Py_ssize_t n = PyTuple_GET_SIZE(inputs_obj);
  inputs.reserve(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* item = PyTuple_GET_ITEM(inputs_obj, k);
    if (item == Py_None) {
      inputs.emplace_back();
    } else if (THPVariable_Check(item)) {
      inputs.push_back(THPVariable_Unpack(item));
    } else {
      PyErr_SetString(PyExc_TypeError, "run_post_hooks: inputs must be tensors or None");
      return nullptr;
    }
  }
  // Python run by a hook (a Python post-hook, a DDP comm hook) sees the node running, as
  // in eager; put back whatever happens.
  PyObject* previous = swap_running(node_obj);
  if (previous == nullptr) {
    return nullptr;
  }
  struct Restore {
    PyObject* previous;
    ~Restore() {
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);  // an error in flight survives the restore
      if (PyObject_SetAttrString(running, "node", previous) < 0) {
        PyErr_Clear();
      }
      Py_DECREF(previous);
      PyErr_Restore(type, value, trace);
    }
  } restore{previous};
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

// run_post_hooks(node, inputs: tuple of Tensor or None)
PyObject* run_post_hooks(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "run_post_hooks(node, inputs: tuple)");
    return nullptr;
  }
  return run_hooks(args[0], args[1]);
}

PyObject* set_holder(PyObject* /*self*/, PyObject* holder) {
  Py_INCREF(holder);
  Py_XSETREF(running, holder);
  Py_RETURN_NONE;
}

}  // namespace

PyObject* gradfx_native::run_node_post_hooks(PyObject* node, PyObject* inputs) {
  return run_hooks(node, inputs);
}

namespace {

#define GRADFX_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&f))
PyMethodDef count_def = {"cpp_post_hooks", cpp_post_hooks, METH_O,
                         "how many of a builtin node's post-hooks are C++ hooks"};
PyMethodDef all_cpp_def = {"post_hooks_all_cpp", post_hooks_all_cpp, METH_O,
                            "whether a builtin node has post-hooks and all of them are C++ hooks"};
PyMethodDef run_def = {"run_post_hooks", GRADFX_FASTCALL(run_post_hooks), METH_FASTCALL,
                       "run a node's post-hooks, C++ and Python, as the engine does"};
PyMethodDef holder_def = {"set_running_node_holder", set_holder, METH_O,
                          "the thread-local whose node attribute names the node running"};
#undef GRADFX_FASTCALL

}  // namespace

void add_post_hooks(py::module_& m) {
  for (PyMethodDef* def : {&count_def, &all_cpp_def, &run_def, &holder_def}) {
    m.attr(def->ml_name) = py::reinterpret_steal<py::object>(PyCFunction_New(def, nullptr));
  }
}
