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
//   HeldByNode  the variables released, as the engine's release_variables does: once the
//          graph holds the tensors, or after the backward.
// Nothing is taken over (no hooks): the node keeps its tensors, as in eager, until then.

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <ATen/SavedTensorHooks.h>

#include <memory>
#include <vector>

#include "checks.h"
#include "methods.h"

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

// Pass 1: eager's checks of each variable as the ``_saved_*`` getters run them, then
// emit_tensor's checks of each defined tensor (``specs[k].tensor`` indexes ``tensors``;
// -1: saved undefined).  The defined tensors as the getters unpack them, or None.
PyObject* gradfx_native::saved(const NodePtr& node, const SavedSpec* specs, size_t count,
                               const TensorSpec* tensors, std::vector<int64_t>* sizes) {
  py::list found;
  for (size_t k = 0; k < count; ++k) {
    auto* var = reinterpret_cast<SavedVariable*>(reinterpret_cast<char*>(node.get()) + specs[k].offset);
    if (var->has_hooks()) {
      Py_RETURN_NONE;  // ours from a retained run, or the user's
    }
    at::Tensor tensor;
    try {
      tensor = var->unpack(node);
    } catch (const std::exception&) {
      Py_RETURN_NONE;  // freed or modified in place: the generic walk raises eager's error
    }
    if (specs[k].tensor < 0) {
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
    if (!gradfx_native::tensor(wrapped, tensors[specs[k].tensor], sizes)) {
      if (PyErr_Occurred()) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
    if (PyList_Append(found.ptr(), wrapped) != 0) {
      return nullptr;
    }
  }
  return PyList_AsTuple(found.ptr());
}

namespace {

// The Python lines' form: ``spec`` (offsets, expected), expected per variable None
// (saved undefined) or emit_tensor's tuple.
PyObject* saved_tuple(PyObject* obj, PyObject* spec, PyObject* sizes) {
  auto* fn = builtin(obj);
  if (fn == nullptr || !PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2 || !PyList_Check(sizes)) {
    Py_RETURN_NONE;
  }
  PyObject* where = PyTuple_GET_ITEM(spec, 0);
  PyObject* expected = PyTuple_GET_ITEM(spec, 1);
  if (!PyTuple_Check(where) || !PyTuple_Check(expected) || PyTuple_GET_SIZE(where) != PyTuple_GET_SIZE(expected)) {
    Py_RETURN_NONE;
  }
  std::vector<gradfx_native::SavedSpec> specs(PyTuple_GET_SIZE(where));
  std::vector<gradfx_native::TensorSpec> tensors;
  for (size_t k = 0; k < specs.size(); ++k) {
    specs[k].offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(where, k));
    PyObject* want = PyTuple_GET_ITEM(expected, k);
    if (want != Py_None) {
      tensors.emplace_back();
      if (!gradfx_native::parse_tensor(want, &tensors.back())) {
        Py_RETURN_NONE;
      }
      specs[k].tensor = static_cast<int32_t>(tensors.size() - 1);
    }
  }
  std::vector<int64_t> found;
  PyObject* xs = gradfx_native::saved(fn->cdata, specs.data(), specs.size(), tensors.data(), &found);
  if (xs != nullptr && xs != Py_None && !gradfx_native::extend(sizes, found)) {
    Py_DECREF(xs);
    return nullptr;
  }
  return xs;
}

}  // namespace

namespace {

// HeldByNode (capture/graph/saved.py says what it is for): a builtin node whose saved
// tensors a cache hit read and left to it, and where they lie in it.  ``release`` frees
// them as the engine's release_variables does once a node has run (a later unpack
// raises eager's own error).  A C type: the one-call walk makes one per such node per
// backward, where a Python class's instance cost a call of its __init__.
struct Held {
  PyObject_HEAD
  gradfx_native::NodePtr node;  // placement-constructed: the object's memory is C's
  PyObject* object;             // the node's Python object, given or made when asked for
  PyObject* offsets;            // tuple of byte offsets
  PyObject* mask;               // tuple: per saved variable, was it defined
};

PyObject* held_new(PyTypeObject* type, PyObject* args, PyObject* kwargs);
void held_dealloc(PyObject* self);

PyObject* held_release(PyObject* self, PyObject* /*unused*/) {
  auto* h = reinterpret_cast<Held*>(self);
  char* base = reinterpret_cast<char*>(h->node.get());
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(h->offsets); ++k) {
    reinterpret_cast<SavedVariable*>(base + PyLong_AsSsize_t(PyTuple_GET_ITEM(h->offsets, k)))->reset_data();
  }
  Py_RETURN_NONE;
}

PyObject* held_node(PyObject* self, void* /*closure*/) {
  auto* h = reinterpret_cast<Held*>(self);
  if (h->object == nullptr) {
    h->object = torch::autograd::functionToPyObject(h->node);
    if (h->object == nullptr) {
      return nullptr;
    }
  }
  Py_INCREF(h->object);
  return h->object;
}

PyObject* held_offsets(PyObject* self, void* /*closure*/) {
  PyObject* o = reinterpret_cast<Held*>(self)->offsets;
  Py_INCREF(o);
  return o;
}

PyObject* held_mask(PyObject* self, void* /*closure*/) {
  PyObject* o = reinterpret_cast<Held*>(self)->mask;
  Py_INCREF(o);
  return o;
}

PyMethodDef held_methods[] = {
    {"release", held_release, METH_NOARGS, "free the saved variables as the engine does once a node has run"},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef held_getset[] = {
    {"node", held_node, nullptr, "the node (its Python object)", nullptr},
    {"offsets", held_offsets, nullptr, "where its saved variables lie in it (bytes)", nullptr},
    {"mask", held_mask, nullptr, "per saved variable: was it defined", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject held_type = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "gradfx_native.HeldByNode";
  t.tp_basicsize = sizeof(Held);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = "the saved tensors of a builtin node that a cache hit read and left to the node";
  t.tp_new = held_new;
  t.tp_dealloc = held_dealloc;
  t.tp_methods = held_methods;
  t.tp_getset = held_getset;
  return t;
}();

PyObject* make_held(const gradfx_native::NodePtr& node, PyObject* object, PyObject* offsets, PyObject* mask) {
  if (!PyTuple_Check(offsets) || !PyTuple_Check(mask)) {
    PyErr_SetString(PyExc_TypeError, "HeldByNode(node, offsets, mask): offsets and mask are tuples");
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(offsets); ++k) {
    const Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, k));
    if (offset < static_cast<Py_ssize_t>(sizeof(Node)) || offset > (1 << 16)) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "HeldByNode: an offset that is not one of a saved variable");
      }
      return nullptr;
    }
  }
  auto* h = PyObject_New(Held, &held_type);
  if (h == nullptr) {
    return nullptr;
  }
  new (&h->node) gradfx_native::NodePtr(node);
  Py_XINCREF(object);
  Py_INCREF(offsets);
  Py_INCREF(mask);
  h->object = object;
  h->offsets = offsets;
  h->mask = mask;
  return reinterpret_cast<PyObject*>(h);
}

PyObject* held_new(PyTypeObject* /*type*/, PyObject* args, PyObject* kwargs) {
  PyObject *object, *offsets, *mask;
  if (kwargs != nullptr || !PyArg_UnpackTuple(args, "HeldByNode", 3, 3, &object, &offsets, &mask)) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "HeldByNode(node, offsets, mask)");
    }
    return nullptr;
  }
  auto* fn = builtin(object);
  if (fn == nullptr) {
    PyErr_SetString(PyExc_TypeError, "HeldByNode: node must be a builtin autograd node");
    return nullptr;
  }
  return make_held(fn->cdata, object, offsets, mask);
}

void held_dealloc(PyObject* self) {
  auto* h = reinterpret_cast<Held*>(self);
  std::destroy_at(&h->node);
  Py_XDECREF(h->object);
  Py_DECREF(h->offsets);
  Py_DECREF(h->mask);
  PyObject_Free(self);
}

}  // namespace

PyObject* gradfx_native::held(const NodePtr& node, PyObject* offsets, PyObject* mask) {
  return make_held(node, nullptr, offsets, mask);
}

namespace {

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
  return call<3>(saved_tuple, args, nargs, "saved(node, (offsets, expected), sizes)");
}

PyMethodDef offsets_def = {"offsets", GRADFX_FASTCALL(offsets_fastcall), METH_FASTCALL,
                           "where a builtin node's saved variables lie in it (byte offsets), or None"};
PyMethodDef saved_def = {"saved", GRADFX_FASTCALL(saved_fastcall), METH_FASTCALL,
                         "a builtin node's saved tensors checked and unpacked (pass 1), or None"};

}  // namespace

namespace {

// with_saved(raws, tensors, fn, args): ``fn(*args)`` while the saved variables ``raws``
// (a builtin node's ``_raw_saved_*`` objects) hold ``tensors`` instead (None: undefined),
// each as a plain SavedVariable without hooks, so that the node's formula reads those and
// calls no unpack hook; the variables are as they were afterwards, whatever ``fn`` did.
// For a node whose saved tensors are under the user's saved_tensors_hooks: gradfx unpacks
// them itself, once and in the node's order (capture/graph/unpacked.py), then runs the
// formula on what the hooks gave (for real) or on fakes of it (while tracing).
py::object with_saved(const py::tuple& raws, const py::tuple& tensors, const py::object& fn,
                      const py::tuple& args) {
  const size_t n = raws.size();
  if (tensors.size() != n) {
    throw std::invalid_argument("with_saved: as many tensors as saved variables");
  }
  std::vector<SavedVariable*> vars;
  std::vector<at::Tensor> values(n);
  for (size_t k = 0; k < n; ++k) {
    vars.push_back(raws[k].cast<SavedVariable*>());
    for (size_t j = 0; j < k; ++j) {
      if (vars[j] == vars[k]) {
        throw std::invalid_argument("with_saved: a saved variable given twice");
      }
    }
    PyObject* t = tensors[k].ptr();
    if (t != Py_None) {
      if (!THPVariable_Check(t)) {
        throw std::invalid_argument("with_saved: tensors are tensors or None");
      }
      values[k] = THPVariable_Unpack(t);
    }
  }
  std::vector<SavedVariable> kept(n);
  size_t swapped = 0;
  auto restore = [&]() {
    for (size_t k = 0; k < swapped; ++k) {
      *vars[k] = std::move(kept[k]);
    }
    swapped = 0;
  };
  // A saved_tensors_hooks context around the backward must not pack the stand-ins.
  const bool was_tracing = at::SavedTensorDefaultHooks::set_tracing(true);
  try {
    for (; swapped < n; ++swapped) {
      SavedVariable fresh = values[swapped].defined() ? SavedVariable(values[swapped], false) : SavedVariable();
      kept[swapped] = std::move(*vars[swapped]);
      *vars[swapped] = std::move(fresh);
    }
  } catch (...) {
    at::SavedTensorDefaultHooks::set_tracing(was_tracing);
    restore();
    throw;
  }
  at::SavedTensorDefaultHooks::set_tracing(was_tracing);
  try {
    py::object out = fn(*args);
    restore();
    return out;
  } catch (...) {
    restore();
    throw;
  }
}

// reset_saved(raws): the engine's release of these saved variables once their node has run
// (release_variables): data and hooks dropped, so a later unpack raises eager's error.
void reset_saved(const py::tuple& raws) {
  for (const auto& raw : raws) {
    raw.cast<SavedVariable*>()->reset_data();
  }
}

// The node's SavedVariable at each of ``offsets`` (byte offsets from ``offsets``).
std::vector<SavedVariable*> variables_at(PyObject* obj, const py::tuple& offsets, gradfx_native::NodePtr* node) {
  auto* fn = builtin(obj);
  if (fn == nullptr) {
    throw std::invalid_argument("a builtin autograd node");
  }
  *node = fn->cdata;
  char* base = reinterpret_cast<char*>(node->get());
  std::vector<SavedVariable*> vars;
  for (const auto& offset : offsets) {
    vars.push_back(reinterpret_cast<SavedVariable*>(base + offset.cast<Py_ssize_t>()));
  }
  return vars;
}

// unpack_at(node, offsets): the node's saved tensors at ``offsets`` as its apply unpacks them
// (the user's unpack hooks run here, eager's errors are raised here); None for undefined.
py::tuple unpack_at(const py::handle& obj, const py::tuple& offsets) {
  gradfx_native::NodePtr node;
  auto vars = variables_at(obj.ptr(), offsets, &node);
  py::tuple out(vars.size());
  for (size_t k = 0; k < vars.size(); ++k) {
    at::Tensor t = vars[k]->unpack(node);
    if (t.defined()) {
      out[k] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
      if (!out[k].ptr()) {
        throw py::error_already_set();
      }
    } else {
      out[k] = py::none();
    }
  }
  return out;
}

// reset_at(node, offsets): reset_saved for the node's variables at ``offsets``.
void reset_at(const py::handle& obj, const py::tuple& offsets) {
  gradfx_native::NodePtr node;
  for (SavedVariable* var : variables_at(obj.ptr(), offsets, &node)) {
    var->reset_data();
  }
}

}  // namespace

void add_saved(py::module_& m) {
  m.def("unpack_at", &unpack_at, "a builtin node's saved tensors at these offsets, unpacked as its apply does");
  m.def("reset_at", &reset_at, "release a builtin node's saved variables at these offsets");
  m.def("with_saved", &with_saved, "fn(*args) with a node's saved variables holding the given tensors");
  m.def("reset_saved", &reset_saved, "release saved variables as the engine does after their node ran");
  gradfx_native::add_functions(m, {&offsets_def, &saved_def});
  if (PyType_Ready(&held_type) < 0) {
    throw py::error_already_set();
  }
  // Nothing of it is a graph input: the node keeps its tensors (saved.py's owners' ``tensors``).
  if (PyDict_SetItemString(held_type.tp_dict, "tensors", py::tuple().ptr()) < 0) {
    throw py::error_already_set();
  }
  PyType_Modified(&held_type);
  Py_INCREF(&held_type);
  m.attr("HeldByNode") = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(&held_type));
}
