// DistributedDataParallel's Python-reducer hook as the bucketed graph calls it, for the
// graphs gradfx's eager backend generates: Buckets.ready's common case
// (capture/runtime/ddp_buckets.py, the reference, and the fallback for every other case)
// without a Python frame, and with the C++ reads of the gradient the Python reads wrap.
//
// The common case: the hook is DDP's own (its code and closure as graph/distributed's
// reducer_of recognized them), the DDP has no comm hook and syncs, the parameter's
// ``.grad`` is a plain dense Tensor of the planned size and dtype that records no
// history, the ranks have not turned away, and the bucket still takes members from this
// process group.  Then the gradient joins its bucket, and the bucket's last member
// starts its all-reduce (Buckets._start, in Python: once per bucket).  Anything else,
// decided before anything changes, goes to the reference, which does it all again.

#include <pybind11/pybind11.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include "methods.h"

namespace py = pybind11;

namespace {

PyObject* fallback = nullptr;        // Buckets.ready
PyObject* known = nullptr;           // graph/distributed._known: [DDP hook's code, its self's cell]
PyObject* ddp_type = nullptr;        // torch.nn.parallel.DistributedDataParallel
PyObject* partial_type = nullptr;    // functools.partial
PyObject* parameter_type = nullptr;  // torch.nn.Parameter

struct Names {
  PyObject *func, *comm_hooks, *sync, *process_group, *size, *plan, *agreement, *answer, *left, *group, *written,
      *start;
};
Names names;

// The DDP whose hook ``hook`` is (a new reference), or nullptr with no error set.
PyObject* ddp_of(PyObject* hook) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(hook)) != partial_type) {
    return nullptr;
  }
  PyObject* func = PyObject_GetAttr(hook, names.func);
  if (func == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* ddp = nullptr;
  if (PyFunction_Check(func) && PyList_GET_SIZE(known) == 2 && PyFunction_GET_CODE(func) == PyList_GET_ITEM(known, 0)) {
    PyObject* closure = PyFunction_GET_CLOSURE(func);
    const Py_ssize_t at = PyLong_AsSsize_t(PyList_GET_ITEM(known, 1));
    if (closure != nullptr && PyTuple_Check(closure) && at >= 0 && at < PyTuple_GET_SIZE(closure)) {
      PyObject* cell = PyTuple_GET_ITEM(closure, at);
      PyObject* value = PyCell_Check(cell) ? PyCell_GET(cell) : nullptr;
      if (value != nullptr && PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(ddp_type))) {
        Py_INCREF(value);
        ddp = value;
      }
    }
  }
  PyErr_Clear();  // an unreadable index: the reference decides
  Py_DECREF(func);
  return ddp;
}

// References taken on the way, dropped however the call ends.
struct Held {
  PyObject* refs[16] = {};
  int n = 0;
  PyObject* operator()(PyObject* o) {
    if (o != nullptr) {
      refs[n++] = o;
    }
    return o;
  }
  ~Held() {
    for (int k = 0; k < n; ++k) {
      Py_DECREF(refs[k]);
    }
  }
};

// True where the object is truthy; false where it is not or cannot be told (error cleared).
bool truthy(PyObject* o) {
  const int t = o == nullptr ? -1 : PyObject_IsTrue(o);
  if (t < 0) {
    PyErr_Clear();
  }
  return t == 1;
}

// Does the common case hold?  Then join the gradient to its bucket and return true; the
// bucket's start may raise (nullptr result through ``failed``).
bool joined(PyObject* const* args, bool* failed) {
  PyObject* self = args[0];
  PyObject* bucket_obj = args[1];
  PyObject* member_obj = args[2];
  PyObject* variable = args[4];
  Held held;
  PyObject* ddp = held(ddp_of(args[3]));
  PyObject* comm_hooks = ddp == nullptr ? nullptr : held(PyObject_GetAttr(ddp, names.comm_hooks));
  if (comm_hooks == nullptr || truthy(comm_hooks) || !truthy(held(PyObject_GetAttr(ddp, names.sync)))) {
    PyErr_Clear();  // what cannot be read: the reference reads it, and raises what it raises
    return false;
  }
  if (!(THPVariable_CheckExact(variable) || reinterpret_cast<PyObject*>(Py_TYPE(variable)) == parameter_type)) {
    return false;
  }
  const at::Tensor& grad = THPVariable_Unpack(variable).grad();
  if (!grad.defined() || grad.requires_grad() || grad.layout() != at::kStrided) {
    return false;
  }
  const Py_ssize_t bucket = PyLong_AsSsize_t(bucket_obj);
  const Py_ssize_t member = PyLong_AsSsize_t(member_obj);
  PyObject* plan = held(PyObject_GetAttr(self, names.plan));
  PyObject* left = held(PyObject_GetAttr(self, names.left));
  PyObject* groups = held(PyObject_GetAttr(self, names.group));
  PyObject* written = held(PyObject_GetAttr(self, names.written));
  PyObject* agreement = held(PyObject_GetAttr(self, names.agreement));
  if (PyErr_Occurred() || plan == nullptr || left == nullptr || groups == nullptr || written == nullptr ||
      agreement == nullptr || !PyTuple_Check(plan) || !PyList_Check(left) || !PyList_Check(groups) ||
      !PyList_Check(written) || bucket < 0 || bucket >= PyTuple_GET_SIZE(plan) || bucket >= PyList_GET_SIZE(left) ||
      bucket >= PyList_GET_SIZE(groups) || bucket >= PyList_GET_SIZE(written)) {
    PyErr_Clear();
    return false;
  }
  if (agreement != Py_None) {
    PyObject* answer = held(PyObject_GetAttr(agreement, names.answer));
    if (answer == nullptr || answer == Py_False) {  // False: the ranks turned away, each gradient goes alone
      PyErr_Clear();
      return false;
    }
  }
  const long long to_come = PyLong_AsLongLong(PyList_GET_ITEM(left, bucket));
  PyObject* planned = PyTuple_GET_ITEM(plan, bucket);  // (numel, members, ring, gaps)
  if (to_come <= 0 || PyErr_Occurred() || !PyTuple_Check(planned) || PyTuple_GET_SIZE(planned) != 4) {
    PyErr_Clear();
    return false;
  }
  PyObject* members = PyTuple_GET_ITEM(planned, 1);
  if (!PyTuple_Check(members) || member < 0 || member >= PyTuple_GET_SIZE(members)) {
    PyErr_Clear();
    return false;
  }
  PyObject* spec = PyTuple_GET_ITEM(members, member);  // (offset, numel, dtype, width)
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4 || !THPDtype_Check(PyTuple_GET_ITEM(spec, 2))) {
    return false;
  }
  const long long numel = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 1));
  const long long ring = PyLong_AsLongLong(PyTuple_GET_ITEM(planned, 2));
  if (PyErr_Occurred() || grad.numel() != numel ||
      reinterpret_cast<THPDtype*>(PyTuple_GET_ITEM(spec, 2))->scalar_type != grad.scalar_type()) {
    PyErr_Clear();
    return false;
  }
  PyObject* group = held(PyObject_GetAttr(ddp, names.process_group));
  PyObject* size_obj = group == nullptr ? nullptr : held(PyObject_CallMethodNoArgs(group, names.size));
  const long long size = size_obj == nullptr ? -1 : PyLong_AsLongLong(size_obj);
  PyObject* bucket_group = PyList_GET_ITEM(groups, bucket);
  if (PyErr_Occurred() || size < 1 || (size > 2 && (size != ring || grad.device().type() != at::kCPU)) ||
      (bucket_group != Py_None && bucket_group != group)) {
    PyErr_Clear();
    return false;
  }
  PyObject* grad_obj = held(THPVariable_Wrap(grad));
  if (grad_obj == nullptr || !THPVariable_CheckExact(grad_obj)) {
    PyErr_Clear();
    return false;
  }
  PyObject* entry = held(PyTuple_Pack(2, grad_obj, member_obj));
  PyObject* now_left = held(PyLong_FromLongLong(to_come - 1));
  PyObject* slot = PyList_GET_ITEM(written, bucket);
  if (entry == nullptr || now_left == nullptr || !PyList_Check(slot)) {
    PyErr_Clear();
    return false;
  }
  // Decided: the reference's own steps from here (ready, then _done).
  if (PyList_Append(slot, entry) < 0) {
    *failed = true;
    return true;
  }
  Py_INCREF(group);
  PyList_SetItem(groups, bucket, group);
  Py_INCREF(now_left);
  PyList_SetItem(left, bucket, now_left);
  if (to_come == 1) {
    PyObject* started = PyObject_CallMethodOneArg(self, names.start, bucket_obj);
    if (started == nullptr) {
      *failed = true;
    } else {
      Py_DECREF(started);
    }
  }
  return true;
}

PyObject* ready(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (fallback == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "bucket_ready: set_bucket_fallback was not called");
    return nullptr;
  }
  if (nargs == 5 || nargs == 6) {
    bool failed = false;
    try {
      if (joined(args, &failed)) {
        if (failed) {
          return nullptr;
        }
        Py_RETURN_NONE;
      }
    } catch (const std::exception& err) {
      PyErr_SetString(PyExc_RuntimeError, err.what());
      return nullptr;
    }
  }
  return PyObject_Vectorcall(fallback, args, nargs, nullptr);
}

// Buckets.ready, graph/distributed._known, DistributedDataParallel, functools.partial,
// torch.nn.Parameter.
PyObject* set_fallback(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyList_Check(args[1]) || !PyType_Check(args[2]) || !PyType_Check(args[3]) ||
      !PyType_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "set_bucket_fallback(ready, known, DistributedDataParallel, "
                                     "functools.partial, Parameter)");
    return nullptr;
  }
  PyObject** slots[] = {&fallback, &known, &ddp_type, &partial_type, &parameter_type};
  for (int k = 0; k < 5; ++k) {
    Py_INCREF(args[k]);
    Py_XDECREF(*slots[k]);
    *slots[k] = args[k];
  }
  Py_RETURN_NONE;
}

PyMethodDef ready_def = {"bucket_ready", GRADFX_FASTCALL(ready), METH_FASTCALL,
                         "Buckets.ready's common case, for the eager backend's graphs"};
PyMethodDef fallback_def = {"set_bucket_fallback", GRADFX_FASTCALL(set_fallback), METH_FASTCALL,
                            "what bucket_ready hands every other case to, and what it recognizes DDP's hook by"};

}  // namespace

void add_buckets(py::module_& m) {
  names = {PyUnicode_InternFromString("func"),          PyUnicode_InternFromString("_comm_hooks"),
           PyUnicode_InternFromString("require_backward_grad_sync"),
           PyUnicode_InternFromString("process_group"), PyUnicode_InternFromString("size"),
           PyUnicode_InternFromString("plan"),          PyUnicode_InternFromString("agreement"),
           PyUnicode_InternFromString("answer"),        PyUnicode_InternFromString("left"),
           PyUnicode_InternFromString("group"),         PyUnicode_InternFromString("written"),
           PyUnicode_InternFromString("_start")};
  gradfx_native::add_functions(m, {&ready_def, &fallback_def});
}
