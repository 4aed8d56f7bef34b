// The cache-hit walker's structure check in C++ (capture/graph/fast_walk.py emits the
// call): roots, node types, edges and the order of sequence numbers, read straight off
// the C++ nodes, without the tuple of tuples ``next_functions`` builds per node.  It
// answers None wherever the Python lines would bail, or where it is not sure they would
// not (a tensor subclass among the roots): the generic walk then decides, as on any miss.

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <unordered_set>
#include <vector>

#include "checks.h"

namespace py = pybind11;
using torch::autograd::Node;

namespace {

// A new reference to the node's Python object (the one next_functions hands out), or
// nullptr with no error set where its type is not ``expected``.
PyObject* object_of(const decltype(torch::autograd::Edge::function)& fn, PyObject* expected) {
  PyObject* obj = torch::autograd::functionToPyObject(fn);
  if (obj == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != expected) {
    Py_DECREF(obj);
    return nullptr;
  }
  return obj;
}

}  // namespace

// ``plan``: (roots, types, edges, chain), built by fast_walk from the recorded walk:
//   roots  per root tensor (node index, output_nr); a root's index is new or an earlier root's;
//   types  per node, its Python type;
//   edges  per node, per next edge None (undefined) or (node index, input_nr), an index
//          one past the nodes seen so far being a first sighting (discovery order);
//   chain  (a, b, strict) pairs: seq[a] < seq[b] (strict) or <= (ties keep discovery order).
// Returns (nodes, sequence numbers) as lists, or None.  ``tensors``: a PySequence_Fast.

PyObject* gradfx_native::structure(PyObject* tensors, PyObject* plan) {
  PyObject* roots = PyTuple_GET_ITEM(plan, 0);
  PyObject* types = PyTuple_GET_ITEM(plan, 1);
  PyObject* edges = PyTuple_GET_ITEM(plan, 2);
  PyObject* chain = PyTuple_GET_ITEM(plan, 3);
  const Py_ssize_t n = PyTuple_GET_SIZE(types);
  if (PySequence_Fast_GET_SIZE(tensors) != PyTuple_GET_SIZE(roots)) {
    Py_RETURN_NONE;
  }
  std::vector<Node*> nodes;
  nodes.reserve(n);
  std::unordered_set<Node*> seen;
  seen.reserve(2 * n);
  py::list objects(n);  // filled in discovery order; owns the references
  auto add = [&](Node* node, PyObject* obj) -> bool {
    if (!seen.insert(node).second) {
      Py_DECREF(obj);  // a predicted new node that is an earlier one
      return false;
    }
    PyList_SET_ITEM(objects.ptr(), static_cast<Py_ssize_t>(nodes.size()), obj);
    nodes.push_back(node);
    return true;
  };

  PyObject** items = PySequence_Fast_ITEMS(tensors);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(roots); ++k) {
    PyObject* t = items[k];
    if (!THPVariable_CheckExact(t)) {
      Py_RETURN_NONE;  // a subclass's grad_fn may run its own code: the generic walk reads it
    }
    const at::Tensor& tensor = THPVariable_Unpack(t);
    PyObject* root = PyTuple_GET_ITEM(roots, k);
    const long j = PyLong_AsLong(PyTuple_GET_ITEM(root, 0));
    const auto& fn = tensor.grad_fn();
    if (!fn || static_cast<long>(tensor.output_nr()) != PyLong_AsLong(PyTuple_GET_ITEM(root, 1))) {
      Py_RETURN_NONE;
    }
    if (j < static_cast<long>(nodes.size())) {
      if (fn.get() != nodes[j]) {
        Py_RETURN_NONE;
      }
      continue;
    }
    if (j != static_cast<long>(nodes.size())) {
      Py_RETURN_NONE;
    }
    PyObject* obj = object_of(fn, PyTuple_GET_ITEM(types, j));
    if (obj == nullptr || !add(fn.get(), obj)) {
      Py_RETURN_NONE;
    }
  }

  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i >= static_cast<Py_ssize_t>(nodes.size())) {
      Py_RETURN_NONE;  // a plan whose discovery order skips a node
    }
    PyObject* expected = PyTuple_GET_ITEM(edges, i);
    const auto& next = nodes[i]->next_edges();
    if (static_cast<Py_ssize_t>(next.size()) != PyTuple_GET_SIZE(expected)) {
      Py_RETURN_NONE;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(expected); ++k) {
      PyObject* e = PyTuple_GET_ITEM(expected, k);
      const auto& edge = next[k];
      if (e == Py_None) {
        if (edge.function) {
          Py_RETURN_NONE;
        }
        continue;
      }
      const long j = PyLong_AsLong(PyTuple_GET_ITEM(e, 0));
      if (!edge.function || static_cast<long>(edge.input_nr) != PyLong_AsLong(PyTuple_GET_ITEM(e, 1))) {
        Py_RETURN_NONE;
      }
      if (j < static_cast<long>(nodes.size())) {
        if (edge.function.get() != nodes[j]) {
          Py_RETURN_NONE;
        }
        continue;
      }
      if (j != static_cast<long>(nodes.size()) || j >= n) {
        Py_RETURN_NONE;
      }
      PyObject* obj = object_of(edge.function, PyTuple_GET_ITEM(types, j));
      if (obj == nullptr || !add(edge.function.get(), obj)) {
        Py_RETURN_NONE;
      }
    }
  }
  if (static_cast<Py_ssize_t>(nodes.size()) != n) {
    Py_RETURN_NONE;
  }

  std::vector<uint64_t> seq(n);
  py::list numbers(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    seq[i] = nodes[i]->sequence_nr();
    PyObject* number = PyLong_FromUnsignedLongLong(seq[i]);
    if (number == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(numbers.ptr(), i, number);
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(chain); ++k) {
    PyObject* link = PyTuple_GET_ITEM(chain, k);
    const uint64_t a = seq[PyLong_AsLong(PyTuple_GET_ITEM(link, 0))];
    const uint64_t b = seq[PyLong_AsLong(PyTuple_GET_ITEM(link, 1))];
    if (PyTuple_GET_ITEM(link, 2) == Py_True ? !(a < b) : !(a <= b)) {
      Py_RETURN_NONE;
    }
  }
  return PyTuple_Pack(2, objects.ptr(), numbers.ptr());
}

namespace {

PyObject* structure_fastcall(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 4) {
    PyErr_SetString(PyExc_TypeError, "expected 2 arguments: tensors, plan (roots, types, edges, chain)");
    return nullptr;
  }
  PyObject* tensors = PySequence_Fast(args[0], "tensors must be a sequence");
  if (tensors == nullptr) {
    return nullptr;
  }
  PyObject* result = nullptr;
  try {
    result = gradfx_native::structure(tensors, args[1]);
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  Py_DECREF(tensors);
  return result;
}

PyMethodDef structure_def = {
    "structure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&structure_fastcall)), METH_FASTCALL,
    "the walker's roots, types, edges and sequence order checked: (nodes, sequence numbers) or None"};

}  // namespace

void add_structure(py::module_& m) {
  m.attr("structure") = py::reinterpret_steal<py::object>(PyCFunction_New(&structure_def, nullptr));
}
