// The saved tensors of a builtin node, read and taken over in C++ for the cache-hit
// walker (capture/graph/saved.py says what taking over means, kinds.py emits the calls).
//
// A builtin node keeps each saved tensor in a SavedVariable member.  The walker
// generated for a structure learns, once, where each member lies in its node type
// (``offsets``, from the pybind11 objects ``_raw_saved_*`` return, which refer to the
// members themselves); a later node of that exact type has them at the same place.
// Then per backward:
//   saved  pass 1: eager's checks as the ``_saved_*`` getters run them (no hooks yet,
//          not freed, not modified in place), and emit_tensor's checks of each tensor;
//   take   pass 2: gradfx's pack/unpack pair registered on each, as ``register_hooks``
//          with SavedTensors.tensors.append and partial(_unpack, owner, k) does.
// Either answers None where the Python lines would bail or raise: the generic walk then
// reads the node itself and raises eager's own error where there is one.

#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <memory>

#include "checks.h"

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;

namespace {

// gradfx's pack/unpack pair on one saved variable: what torch's PySavedVariableHooks
// (which an extension cannot construct) does with the two callables, so that the
// variable reads back the same from Python (``unpack_hook``, ``data``) and unpacks the
// same in the engine.
struct OwnedHooks final : torch::autograd::SavedVariableHooks {
  OwnedHooks(PyObject* pack, PyObject* unpack) : pack_(pack), unpack_(unpack) {}  // both references stolen

  void call_pack_hook(const at::Tensor& tensor) override {
    py::gil_scoped_acquire gil;
    PyObject* obj = THPVariable_Wrap(tensor);
    if (obj == nullptr) {
      throw python_error();
    }
    PyObject* packed = PyObject_CallOneArg(pack_, obj);
    Py_DECREF(obj);
    if (packed == nullptr) {
      throw python_error();
    }
    data_ = packed;
  }

  at::Tensor call_unpack_hook() override {
    py::gil_scoped_acquire gil;
    PyObject* result = PyObject_CallOneArg(unpack_, data_ != nullptr ? data_ : Py_None);
    if (result == nullptr) {
      throw python_error();  // gradfx's own errors (freed, modified in place) are eager's
    }
    if (!THPVariable_Check(result)) {
      std::string type = Py_TYPE(result)->tp_name;
      Py_DECREF(result);
      TORCH_CHECK_TYPE(false, "Output of saved tensor unpack_hook expected to be a Tensor but got result of type ",
                       type);
    }
    at::Tensor tensor = THPVariable_Unpack(result);
    Py_DECREF(result);
    return tensor;
  }

  std::optional<std::pair<c10::SafePyObject, c10::SafePyObject>> retrieve_unpack_hook_data() const override {
    PyObject* data = data_ != nullptr ? data_ : Py_None;
    Py_INCREF(unpack_);
    Py_INCREF(data);
    return std::make_pair(c10::SafePyObject(unpack_, getPyInterpreter()), c10::SafePyObject(data, getPyInterpreter()));
  }

  ~OwnedHooks() override {
    if (Py_IsInitialized()) {  // at exit the objects are left to the interpreter's end
      py::gil_scoped_acquire gil;
      Py_XDECREF(pack_);
      Py_XDECREF(unpack_);
      Py_XDECREF(data_);
    }
  }

 private:
  PyObject* pack_;
  PyObject* unpack_;
  PyObject* data_ = nullptr;
};

torch::autograd::THPCppFunction* builtin(PyObject* obj) {
  if (!torch::autograd::THPCppFunction_Check(obj)) {
    return nullptr;
  }
  return reinterpret_cast<torch::autograd::THPCppFunction*>(obj);
}

SavedVariable* member(torch::autograd::THPCppFunction* fn, PyObject* offset) {
  return reinterpret_cast<SavedVariable*>(reinterpret_cast<char*>(fn->cdata.get()) + PyLong_AsSsize_t(offset));
}

// Where each of ``raws`` (the node's ``_raw_saved_*`` objects) lies in the node: a tuple
// of byte offsets, or None (not a builtin node, or not a member of it).
PyObject* offsets(PyObject* obj, PyObject* raws) {
  auto* fn = builtin(obj);
  if (fn == nullptr || !PyTuple_Check(raws)) {
    Py_RETURN_NONE;
  }
  const char* base = reinterpret_cast<const char*>(fn->cdata.get());
  py::tuple result(PyTuple_GET_SIZE(raws));
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(raws); ++k) {
    SavedVariable* var;
    try {
      var = py::handle(PyTuple_GET_ITEM(raws, k)).cast<SavedVariable*>();
    } catch (const py::cast_error&) {
      Py_RETURN_NONE;
    }
    const Py_ssize_t offset = reinterpret_cast<const char*>(var) - base;
    if (var == nullptr || offset < static_cast<Py_ssize_t>(sizeof(Node)) || offset > (1 << 16)) {
      Py_RETURN_NONE;  // held elsewhere (a list of saved tensors): the Python lines read it
    }
    PyObject* number = PyLong_FromSsize_t(offset);
    if (number == nullptr) {
      return nullptr;
    }
    PyTuple_SET_ITEM(result.ptr(), k, number);
  }
  return result.release().ptr();
}

// Pass 1.  ``spec``: (offsets, expected), expected per variable None (saved undefined)
// or emit_tensor's tuple.  The defined tensors as the getters unpack them, or None.
PyObject* saved(PyObject* obj, PyObject* spec, PyObject* sizes) {
  auto* fn = builtin(obj);
  if (fn == nullptr) {
    Py_RETURN_NONE;
  }
  PyObject* where = PyTuple_GET_ITEM(spec, 0);
  PyObject* expected = PyTuple_GET_ITEM(spec, 1);
  py::list tensors;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(where); ++k) {
    SavedVariable* var = member(fn, PyTuple_GET_ITEM(where, k));
    if (var->has_hooks()) {
      Py_RETURN_NONE;  // ours from a retained run, or the user's
    }
    at::Tensor tensor;
    try {
      tensor = var->unpack(fn->cdata);
    } catch (const std::exception&) {
      Py_RETURN_NONE;  // freed or modified in place: the generic walk raises eager's error
    }
    PyObject* want = PyTuple_GET_ITEM(expected, k);
    if (want == Py_None) {
      if (tensor.defined()) {
        Py_RETURN_NONE;
      }
      continue;
    }
    if (!tensor.defined()) {
      Py_RETURN_NONE;
    }
    PyObject* wrapped = THPVariable_Wrap(std::move(tensor));
    if (wrapped == nullptr) {
      return nullptr;
    }
    py::object owned = py::reinterpret_steal<py::object>(wrapped);
    if (!gradfx_native::tensor(wrapped, want, sizes)) {
      if (PyErr_Occurred()) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
    if (PyList_Append(tensors.ptr(), wrapped) != 0) {
      return nullptr;
    }
  }
  return PyList_AsTuple(tensors.ptr());
}

// Pass 2.  ``entry``: (offsets of the defined variables, mask, origin, SavedTensors,
// _unpack, functools.partial).  The new owner, sealed as SavedTensors.seal does.
PyObject* take(PyObject* obj, PyObject* entry) {
  auto* fn = builtin(obj);
  if (fn == nullptr || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 6) {
    PyErr_SetString(PyExc_TypeError, "take: a builtin node and (offsets, mask, origin, owner type, unpack, partial)");
    return nullptr;
  }
  PyObject* where = PyTuple_GET_ITEM(entry, 0);
  py::object owner = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(PyTuple_GET_ITEM(entry, 3)));
  if (!owner) {
    return nullptr;
  }
  py::object list = py::reinterpret_steal<py::object>(PyObject_GetAttrString(owner.ptr(), "tensors"));
  if (!list || !PyList_Check(list.ptr())) {
    PyErr_SetString(PyExc_TypeError, "take: the owner's tensors must be a list");
    return nullptr;
  }
  py::object append = py::reinterpret_steal<py::object>(PyObject_GetAttrString(list.ptr(), "append"));
  if (!append) {
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(where); ++k) {
    py::object index = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(k));
    PyObject* unpack = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(entry, 5), PyTuple_GET_ITEM(entry, 4),
                                                    owner.ptr(), index.ptr(), nullptr);
    if (unpack == nullptr) {
      return nullptr;
    }
    Py_INCREF(append.ptr());
    auto hooks = std::make_unique<OwnedHooks>(append.ptr(), unpack);
    try {
      member(fn, PyTuple_GET_ITEM(where, k))->register_hooks(std::move(hooks));
    } catch (python_error& err) {
      err.restore();
      return nullptr;
    } catch (const c10::Error& err) {
      PyErr_SetString(PyExc_RuntimeError, err.what_without_backtrace());
      return nullptr;
    }
  }
  // seal: the mask, the origin, and each tensor's version now (eager's check just passed)
  const Py_ssize_t n = PyList_GET_SIZE(list.ptr());
  py::list versions(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* t = PyList_GET_ITEM(list.ptr(), k);
    if (!THPVariable_Check(t)) {
      PyErr_SetString(PyExc_TypeError, "take: a packed value that is not a tensor");
      return nullptr;
    }
    PyObject* version = PyLong_FromLongLong(THPVariable_Unpack(t)._version());
    if (version == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(versions.ptr(), k, version);
  }
  if (PyObject_SetAttrString(owner.ptr(), "mask", PyTuple_GET_ITEM(entry, 1)) != 0 ||
      PyObject_SetAttrString(owner.ptr(), "origin", PyTuple_GET_ITEM(entry, 2)) != 0 ||
      PyObject_SetAttrString(owner.ptr(), "versions", versions.ptr()) != 0) {
    return nullptr;
  }
  return owner.release().ptr();
}

template <int N, typename F>
PyObject* call(F f, PyObject* const* args, Py_ssize_t nargs, const char* usage) {
  if (nargs != N) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  try {
    if constexpr (N == 2) {
      return f(args[0], args[1]);
    } else {
      return f(args[0], args[1], args[2]);
    }
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
}

PyObject* offsets_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return call<2>(offsets, args, nargs, "offsets(node, raw saved variables)");
}
PyObject* saved_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return call<3>(saved, args, nargs, "saved(node, (offsets, expected), sizes)");
}
PyObject* take_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return call<2>(take, args, nargs, "take(node, entry)");
}

#define GRADFX_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&f))
PyMethodDef offsets_def = {"offsets", GRADFX_FASTCALL(offsets_fastcall), METH_FASTCALL,
                           "where a builtin node's saved variables lie in it (byte offsets), or None"};
PyMethodDef saved_def = {"saved", GRADFX_FASTCALL(saved_fastcall), METH_FASTCALL,
                         "a builtin node's saved tensors checked and unpacked (pass 1), or None"};
PyMethodDef take_def = {"take", GRADFX_FASTCALL(take_fastcall), METH_FASTCALL,
                        "a builtin node's saved variables taken over by a new SavedTensors (pass 2)"};
#undef GRADFX_FASTCALL

}  // namespace

void add_saved(py::module_& m) {
  for (PyMethodDef* def : {&offsets_def, &saved_def, &take_def}) {
    m.attr(def->ml_name) = py::reinterpret_steal<py::object>(PyCFunction_New(def, nullptr));
  }
}
