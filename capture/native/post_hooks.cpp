// A node's post-hooks as the engine runs them, C++ hooks included.
//
// DistributedDataParallel's reducer hooks each parameter's AccumulateGrad with a C++
// post-hook: no Python binding lists or calls it.  The graph gradfx generates calls the
// node's whole post-hook list here, in registration order, Python hooks (their C++
// wrappers) among them, with the arguments the engine's call_post_hooks passes: the
// node's outputs (none for an accumulator) and its inputs, and the node as the running
// one.  The GIL is released, as the engine runs nodes without it; the Python hooks take
// it themselves.  In C, not Python: a Python frame around each call cost DDP's tiny
// GPT-2 backward 60 us (28 calls, their code cold after the forward).

#include "checks.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <typeinfo>
#include "methods.h"

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

// The object whose attribute "node" says which node runs as an opaque call on this thread
// (hook_ops._task, a threading.local): torch._C._current_autograd_node answers it, as the
// engine's current_evaluating_node, to Python code a C++ hook calls (a comm hook).
PyObject* running = nullptr;
PyObject* node_attr = nullptr;

PyObject* set_running(PyObject* /*self*/, PyObject* holder) {
  if (node_attr == nullptr && (node_attr = PyUnicode_InternFromString("node")) == nullptr) {
    return nullptr;
  }
  Py_INCREF(holder);
  Py_XSETREF(running, holder);
  Py_RETURN_NONE;
}

// running.node = node while the hooks run; the previous value back after, on errors too.
class RunningNode {
 public:
  explicit RunningNode(PyObject* node) {
    previous_ = PyObject_GetAttr(running, node_attr);
    if (previous_ == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        throw python_error();
      }
      PyErr_Clear();
      Py_INCREF(Py_None);
      previous_ = Py_None;
    }
    if (PyObject_SetAttr(running, node_attr, node) < 0) {
      Py_DECREF(previous_);
      throw python_error();
    }
  }
  ~RunningNode() {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);  // an error on its way out stays as it was
    if (PyObject_SetAttr(running, node_attr, previous_) < 0) {
      PyErr_Clear();
    }
    PyErr_Restore(type, value, trace);
    Py_DECREF(previous_);
  }
  RunningNode(const RunningNode&) = delete;
  RunningNode& operator=(const RunningNode&) = delete;

 private:
  PyObject* previous_;
};

// call_node_post_hooks(node, inputs: tuple of Tensor or None): the node's post-hooks, in
// registration order, as the engine's call_post_hooks runs them (no outputs: an
// accumulator's), with the node as the running one.
PyObject* call_node_post_hooks(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "call_node_post_hooks(node, inputs: tuple)");
    return nullptr;
  }
  if (running == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "call_node_post_hooks: set_running was not called");
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
      PyErr_SetString(PyExc_TypeError, "call_node_post_hooks: inputs must be tensors or None");
      return nullptr;
    }
  }
  RunningNode as_running(args[0]);
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

PyMethodDef count_def = {"cpp_post_hooks", cpp_post_hooks, METH_O,
                         "how many of a builtin node's post-hooks are C++ hooks"};
PyMethodDef all_cpp_def = {"post_hooks_all_cpp", post_hooks_all_cpp, METH_O,
                            "whether a builtin node has post-hooks and all of them are C++ hooks"};
PyMethodDef running_def = {"set_running", set_running, METH_O,
                           "the thread-local whose attribute node names the running node"};
PyMethodDef call_def = {"call_node_post_hooks", GRADFX_FASTCALL(call_node_post_hooks), METH_FASTCALL,
                        "run a node's post-hooks, C++ and Python, as the engine does"};

}  // namespace

void add_post_hooks(py::module_& m) {
  gradfx_native::add_functions(m, {&count_def, &all_cpp_def, &running_def, &call_def});
}
