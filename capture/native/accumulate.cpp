// AccumulateGrad for the graphs gradfx's eager backend generates: eager's own rules
// (torch's gradient layout contract helpers), without a Python frame, a Python object
// for the detached gradient, or the Python attribute reads per leaf that
// capture/run/runtime_ops.accumulate_grad_unchecked (the reference, and the fallback for
// every case but the common one) needs.
//
// Only where everything is as in a plain training step: grad mode off, strided dense
// tensors, a leaf that is a Tensor or Parameter, no sparse ``.grad``.  The first
// gradient is stolen, as eager steals it, when the graph says it has no later use and
// nothing else refers to it: its C++ use count is one and its Python reference count is
// that of a gradient the graph's code holds in one local (``refs``, measured at load).
// A count just above it (a frame evaluator may hold one more) goes to the Python
// reference, which decides as it always has.

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#include "methods.h"

namespace py = pybind11;

namespace {

PyObject* fallback = nullptr;   // runtime_ops.accumulate_grad_unchecked
PyObject* check_layout = nullptr;  // runtime_ops._check_layout (CHECK_RESULT's warning)
Py_ssize_t refs = -1;           // an unshared gradient's reference count here
PyObject* parameter_type = nullptr;

bool plain(const at::Tensor& t) {
  return t.layout() == at::kStrided && !t.is_nested();
}

PyObject* python(PyObject* const* args) {
  // As accumulate_grad calls it: one call further from the graph's local.
  PyObject* call[] = {args[0], args[1], args[2], PyTuple_GET_ITEM(PyTuple_GET_ITEM(fallback, 1), 0),
                      PyTuple_GET_ITEM(PyTuple_GET_ITEM(fallback, 1), 1)};
  return PyObject_Vectorcall(PyTuple_GET_ITEM(fallback, 0), call, 5, nullptr);
}

PyObject* accumulate(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "accumulate_grad(variable, grad, may_steal)");
    return nullptr;
  }
  if (fallback == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "accumulate_grad: set_accumulate_fallback was not called");
    return nullptr;
  }
  PyObject* var_obj = args[0];
  PyObject* grad_obj = args[1];
  if (grad_obj == Py_None) {
    Py_RETURN_NONE;
  }
  if (!(THPVariable_CheckExact(var_obj) || reinterpret_cast<PyObject*>(Py_TYPE(var_obj)) == parameter_type) ||
      !THPVariable_CheckExact(grad_obj) || !PyBool_Check(args[2]) || torch::autograd::GradMode::is_enabled()) {
    return python(args);
  }
  try {
    const at::Tensor& variable = THPVariable_Unpack(var_obj);
    const at::Tensor& grad = THPVariable_Unpack(grad_obj);
    if (!variable.requires_grad()) {
      Py_RETURN_NONE;
    }
    if (!plain(variable) || !plain(grad)) {
      return python(args);
    }
    at::Tensor& old = variable.mutable_grad();
    if (!old.defined()) {
      const bool may_steal = args[2] == Py_True && grad.use_count() <= 1;
      if (may_steal && Py_REFCNT(grad_obj) > refs) {
        return python(args);  // maybe one more reference than a graph's local: the reference decides
      }
      if (may_steal && torch::autograd::utils::obeys_layout_contract(grad, variable)) {
        old = grad.detach();
      } else {
        old = torch::autograd::utils::clone_obey_contract(grad, variable);
      }
      Py_RETURN_NONE;
    }
    if (!plain(old)) {
      return python(args);
    }
    old += grad;
    if (old.strides() != variable.strides()) {
      PyObject* wrapped = THPVariable_Wrap(old);
      if (wrapped == nullptr) {
        return nullptr;
      }
      PyObject* call[] = {wrapped, var_obj};
      PyObject* r = PyObject_Vectorcall(check_layout, call, 2, nullptr);
      Py_DECREF(wrapped);
      return r;
    }
    Py_RETURN_NONE;
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
}

PyObject* refcount(PyObject* /*self*/, PyObject* arg) {
  return PyLong_FromSsize_t(Py_REFCNT(arg));
}

// (reference function, (its unshared_refs, its calls)), the layout warning, Parameter,
// and the reference count accumulate_grad sees of a gradient held in one local.
PyObject* set_fallback(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 2 || !PyLong_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "set_accumulate_fallback((fn, (unshared_refs, calls)), check_layout, "
                                     "Parameter, refs)");
    return nullptr;
  }
  for (PyObject* o : {args[0], args[1], args[2]}) {
    Py_INCREF(o);
  }
  Py_XDECREF(fallback);
  Py_XDECREF(check_layout);
  Py_XDECREF(parameter_type);
  fallback = args[0];
  check_layout = args[1];
  parameter_type = args[2];
  refs = PyLong_AsSsize_t(args[3]);
  Py_RETURN_NONE;
}

PyMethodDef accumulate_def = {"accumulate_grad", GRADFX_FASTCALL(accumulate), METH_FASTCALL,
                              "AccumulateGrad as eager runs it, for the eager backend's graphs"};
PyMethodDef refcount_def = {"refcount", refcount, METH_O, "the argument's reference count as a C function sees it"};
PyMethodDef fallback_def = {"set_accumulate_fallback", GRADFX_FASTCALL(set_fallback), METH_FASTCALL,
                            "what accumulate_grad hands every other case to"};

}  // namespace

void add_accumulate(py::module_& m) {
  gradfx_native::add_functions(m, {&accumulate_def, &refcount_def, &fallback_def});
}
