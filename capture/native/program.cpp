// A cache-hit walk in one C++ call, for structures of builtin nodes and leaves alone
// (capture/graph/walk_program.py builds the plan and says which): the structure, then
// the same reads and checks as the walker's generated Python lines, in their order, then
// the inputs, owners and sizes those lines return.  None where the lines would bail, or
// where this call is not sure they would not (a leaf with tensor hooks): the lines then
// run, and decide.  Nothing is taken over, so running them after it changes nothing.

#include <pybind11/pybind11.h>

#include <vector>

#include "checks.h"

namespace py = pybind11;

namespace {

enum Step : long { kMetas = 0, kValue = 1, kSaved = 2, kLeaf = 3, kGrad = 4 };
enum Value : long { kSize = 0, kSizes = 1, kNone = 2, kEqual = 3 };
enum Input : long { kGradInput = 0, kSavedInput = 1, kNodeInput = 2, kLeafInput = 3 };

long at(PyObject* tuple, Py_ssize_t k) {
  return PyLong_AsLong(PyTuple_GET_ITEM(tuple, k));
}

// emit_values' check of one saved value ``x`` (a new reference, consumed).
bool value(PyObject* x, long mode, PyObject* arg, PyObject* sizes) {
  py::object owned = py::reinterpret_steal<py::object>(x);
  switch (mode) {
    case kSize:  // type(x) is int; sizes.append(x)
      return PyLong_CheckExact(x) && PyList_Append(sizes, x) == 0;
    case kSizes: {  // type(x) is tuple and len(x) == n; sizes += x
      if (!PyTuple_CheckExact(x) || PyTuple_GET_SIZE(x) != PyLong_AsSsize_t(arg)) {
        return false;
      }
      for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(x); ++k) {
        if (PyList_Append(sizes, PyTuple_GET_ITEM(x, k)) != 0) {
          return false;
        }
      }
      return true;
    }
    case kNone:
      return x == Py_None;
    case kEqual: {  // type(x) is T and x == C
      if (reinterpret_cast<PyObject*>(Py_TYPE(x)) != PyTuple_GET_ITEM(arg, 0)) {
        return false;
      }
      const int same = PyObject_RichCompareBool(x, PyTuple_GET_ITEM(arg, 1), Py_EQ);
      if (same < 0) {
        PyErr_Clear();  // the Python line would raise here; the lines decide
        return false;
      }
      return same == 1;
    }
    default:
      return false;
  }
}

// The leaf's tensor hooks: the lines' cheap condition (none), else they decide.
bool no_tensor_hooks(PyObject* leaf) {
  static PyObject* backward = PyUnicode_InternFromString("_backward_hooks");
  static PyObject* post = PyUnicode_InternFromString("_post_accumulate_grad_hooks");
  for (PyObject* name : {backward, post}) {
    PyObject* hooks = PyObject_GetAttr(leaf, name);
    if (hooks == nullptr) {
      PyErr_Clear();
      return false;
    }
    Py_DECREF(hooks);
    if (hooks != Py_None) {
      return false;
    }
  }
  return true;
}

// ``plan``: (structure plan, steps, inputs, held, HeldByNode, n).
//   steps   in the lines' order: (kGrad, k, expected), (kMetas, i, expected),
//           (kValue, i, descriptor, mode, arg), (kSaved, i, spec), (kLeaf, i, expected);
//   inputs  the returned inputs: (kGradInput, k, 0), (kSavedInput, i, j), (kNodeInput, i, 0),
//           (kLeafInput, i, 0);
//   held    (i, offsets, mask) per node whose saved tensors stay with it (HeldByNode).
// Returns (nodes, owned, inputs, sizes, sequence numbers), or None.
PyObject* program(PyObject* tensors, PyObject* grads, PyObject* plan) {
  PyObject* steps = PyTuple_GET_ITEM(plan, 1);
  PyObject* layout = PyTuple_GET_ITEM(plan, 2);
  PyObject* held = PyTuple_GET_ITEM(plan, 3);
  PyObject* held_type = PyTuple_GET_ITEM(plan, 4);
  const Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(plan, 5));

  py::object found = py::reinterpret_steal<py::object>(gradfx_native::structure(tensors, PyTuple_GET_ITEM(plan, 0)));
  if (!found || found.ptr() == Py_None) {
    return found.release().ptr();
  }
  PyObject* nodes = PyTuple_GET_ITEM(found.ptr(), 0);
  PyObject** node = PySequence_Fast_ITEMS(nodes);
  PyObject** grad = PySequence_Fast_ITEMS(grads);

  py::list sizes;
  std::vector<py::object> saved(n), leaves(n);
  for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(steps); ++s) {
    PyObject* step = PyTuple_GET_ITEM(steps, s);
    const long i = at(step, 1);
    bool ok = false;
    switch (at(step, 0)) {
      case kGrad:
        ok = gradfx_native::tensor(grad[i], PyTuple_GET_ITEM(step, 2), sizes.ptr());
        break;
      case kMetas:
        ok = gradfx_native::metas(node[i], PyTuple_GET_ITEM(step, 2), sizes.ptr());
        break;
      case kValue: {
        PyObject* descriptor = PyTuple_GET_ITEM(step, 2);
        PyObject* x = Py_TYPE(descriptor)->tp_descr_get(descriptor, node[i],
                                                        reinterpret_cast<PyObject*>(Py_TYPE(node[i])));
        if (x == nullptr) {
          return nullptr;  // the getter raised: so would the line
        }
        ok = value(x, at(step, 3), PyTuple_GET_ITEM(step, 4), sizes.ptr());
        break;
      }
      case kSaved: {
        PyObject* xs = gradfx_native::saved(node[i], PyTuple_GET_ITEM(step, 2), sizes.ptr());
        if (xs == nullptr) {
          return nullptr;
        }
        saved[i] = py::reinterpret_steal<py::object>(xs);
        ok = xs != Py_None;
        break;
      }
      case kLeaf: {
        PyObject* v = gradfx_native::leaf(node[i], PyTuple_GET_ITEM(step, 2), sizes.ptr());
        if (v == nullptr) {
          return nullptr;
        }
        leaves[i] = py::reinterpret_steal<py::object>(v);
        ok = v != Py_None && no_tensor_hooks(v);
        break;
      }
    }
    if (PyErr_Occurred()) {
      return nullptr;
    }
    if (!ok) {
      Py_RETURN_NONE;
    }
  }

  py::list owned(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    Py_INCREF(Py_None);
    PyList_SET_ITEM(owned.ptr(), k, Py_None);
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(held); ++k) {
    PyObject* h = PyTuple_GET_ITEM(held, k);
    const long i = at(h, 0);
    PyObject* args[] = {node[i], PyTuple_GET_ITEM(h, 1), PyTuple_GET_ITEM(h, 2)};
    PyObject* o = PyObject_Vectorcall(held_type, args, 3, nullptr);
    if (o == nullptr) {
      return nullptr;
    }
    PyList_SetItem(owned.ptr(), i, o);
  }

  py::list inputs(PyTuple_GET_SIZE(layout));
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(layout); ++k) {
    PyObject* ref = PyTuple_GET_ITEM(layout, k);
    const long i = at(ref, 1);
    PyObject* item;
    switch (at(ref, 0)) {
      case kGradInput:
        item = grad[i];
        break;
      case kSavedInput:
        item = PyTuple_GET_ITEM(saved[i].ptr(), at(ref, 2));
        break;
      case kNodeInput:
        item = node[i];
        break;
      default:
        item = leaves[i].ptr();
    }
    Py_INCREF(item);
    PyList_SET_ITEM(inputs.ptr(), k, item);
  }
  return PyTuple_Pack(5, nodes, owned.ptr(), inputs.ptr(), sizes.ptr(), PyTuple_GET_ITEM(found.ptr(), 1));
}

PyObject* program_fastcall(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 6) {
    PyErr_SetString(PyExc_TypeError, "program(tensors, grads, plan)");
    return nullptr;
  }
  PyObject* tensors = PySequence_Fast(args[0], "tensors must be a sequence");
  if (tensors == nullptr) {
    return nullptr;
  }
  PyObject* grads = PySequence_Fast(args[1], "grads must be a sequence");
  if (grads == nullptr) {
    Py_DECREF(tensors);
    return nullptr;
  }
  PyObject* result = nullptr;
  try {
    result = program(tensors, grads, args[2]);
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  Py_DECREF(tensors);
  Py_DECREF(grads);
  return result;
}

PyMethodDef program_def = {
    "program", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&program_fastcall)), METH_FASTCALL,
    "a cache-hit walk of builtin nodes and leaves: (nodes, owned, inputs, sizes, seq) or None"};

}  // namespace

void add_program(py::module_& m) {
  m.attr("program") = py::reinterpret_steal<py::object>(PyCFunction_New(&program_def, nullptr));
}
