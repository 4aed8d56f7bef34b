// The saved tensors of a builtin node, read and released in C++ for the cache-hit
// walker (kinds.py emits the calls; capture/graph/saved.py: HeldByNode).
//
// A builtin node keeps each saved tensor in a SavedVariable member.  The walker
// generated for a structure learns, once, where each member lies in its node type
// (``offsets``, from the pybind11 objects ``_raw_saved_*`` return, which refer to the
// members themselves); a later node of that exact type has them at the same place.
// Then per backward:
//   saved  eager's checks as the ``_saved_*`` getters run them (no hooks, not freed, not
//          modified in place), and emit_tensor's checks of each tensor: the tensors, or
//          None where the Python lines would bail or raise (the generic walk then reads
//          the node itself and raises eager's own error where there is one);
//   reset  the variables released, as the engine's release_variables does: once the
//          graph holds the tensors, or after the backward.
// Nothing is taken over (no hooks): the node keeps its tensors, as in eager, until then.

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "checks.h"

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;

namespace {

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

}  // namespace

// Pass 1.  ``spec``: (offsets, expected), expected per variable None (saved undefined)
// or emit_tensor's tuple.  The defined tensors as the getters unpack them, or None.
PyObject* gradfx_native::saved(PyObject* obj, PyObject* spec, PyObject* sizes) {
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

namespace {

// After the backward (or before its graph runs, which then holds the tensors): free the
// variables at ``offsets`` as the engine's release_variables does once a node has run.
// A later unpack raises eager's own error.
PyObject* reset(PyObject* obj, PyObject* where) {
  auto* fn = builtin(obj);
  if (fn == nullptr || !PyTuple_Check(where)) {
    PyErr_SetString(PyExc_TypeError, "reset: a builtin node and the offsets of its saved variables");
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(where); ++k) {
    member(fn, PyTuple_GET_ITEM(where, k))->reset_data();
  }
  Py_RETURN_NONE;
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
  return call<3>(gradfx_native::saved, args, nargs, "saved(node, (offsets, expected), sizes)");
}
PyObject* reset_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return call<2>(reset, args, nargs, "reset(node, offsets)");
}

#define GRADFX_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&f))
PyMethodDef offsets_def = {"offsets", GRADFX_FASTCALL(offsets_fastcall), METH_FASTCALL,
                           "where a builtin node's saved variables lie in it (byte offsets), or None"};
PyMethodDef saved_def = {"saved", GRADFX_FASTCALL(saved_fastcall), METH_FASTCALL,
                         "a builtin node's saved tensors checked and unpacked (pass 1), or None"};
PyMethodDef reset_def = {"reset", GRADFX_FASTCALL(reset_fastcall), METH_FASTCALL,
                         "a builtin node's saved variables released, as the engine releases them"};
#undef GRADFX_FASTCALL

}  // namespace

void add_saved(py::module_& m) {
  for (PyMethodDef* def : {&offsets_def, &saved_def, &reset_def}) {
    m.attr(def->ml_name) = py::reinterpret_steal<py::object>(PyCFunction_New(def, nullptr));
  }
}
