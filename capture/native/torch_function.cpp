// The eager backend's graphs that call user code (hooks, custom backwards, DDP's
// reducer) run their aten ops with __torch_function__ off, as the engine computes, and
// each call of other code with the thread's own torch-function state, as eager calls it.
//
// ``run_without_torch_function(forward, *args)``: forward(*args) with every torch-function
// handler off (torch._C.DisableTorchFunction's state); the state it found is kept for the
// calls below, and restored however forward ends.
// ``as_user(fn, *args, **kwargs)``: fn called with that kept state, the handlers off again
// after it, however it ends.  Outside a run it calls fn with the state as it is.
//
// Graphs of aten ops alone take torch's public bindings under the handlers off
// (backends/bindings.py); with these two, graphs that call hooks can too.

#include <ATen/PythonTorchFunctionTLS.h>
#include <pybind11/pybind11.h>
#include "methods.h"

namespace py = pybind11;

namespace {

using State = at::impl::TorchFunctionDisabledState;
using TLS = at::impl::PythonTorchFunctionTLS;

thread_local bool running = false;
thread_local State user_state = State::ENABLED;

struct Restore {
  State state;
  ~Restore() { TLS::set_disabled_state(state); }
};

PyObject* run_without(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "run_without_torch_function(forward, *args)");
    return nullptr;
  }
  const State found = TLS::get_disabled_state();
  const bool was_running = running;
  const State outer_user = user_state;
  user_state = found;
  running = true;
  PyObject* result;
  {
    Restore restore{found};
    TLS::set_disabled_state(State::ALL_DISABLED);
    result = PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  }
  running = was_running;
  user_state = outer_user;
  return result;
}

PyObject* as_user(PyObject* /*self*/, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "as_user(fn, *args, **kwargs)");
    return nullptr;
  }
  if (!running) {
    return PyObject_Vectorcall(args[0], args + 1, nargs - 1, kwnames);
  }
  Restore restore{TLS::get_disabled_state()};
  TLS::set_disabled_state(user_state);
  return PyObject_Vectorcall(args[0], args + 1, nargs - 1, kwnames);
}

PyMethodDef run_def = {"run_without_torch_function", GRADFX_FASTCALL(run_without), METH_FASTCALL,
                       "forward(*args) with every torch-function handler off; calls through as_user get the "
                       "state found"};
PyMethodDef as_user_def = {"as_user", GRADFX_FASTCALL(as_user), METH_FASTCALL | METH_KEYWORDS,
                           "fn(*args, **kwargs) with the torch-function state run_without_torch_function found"};

}  // namespace

void add_torch_function(py::module_& m) {
  gradfx_native::add_functions(m, {&run_def, &as_user_def});
}
