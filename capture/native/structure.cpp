// The cache-hit walker's structure check in C++ (capture/graph/fast_walk.py emits the
// call): roots, node types, edges and the order of sequence numbers, read straight off
// the C++ nodes, without the tuple of tuples ``next_functions`` builds per node.  It
// answers None wherever the Python lines would bail, or where it is not sure they would
// not (a tensor subclass among the roots): the generic walk then decides, as on any miss.
//
// Before any of it, ``plain_call``: is a backward call one that gradfx's Python checks
// (capture/run/routing.torch_internal, session._eager_refuses and _prepare's) would all
// pass?  True only where it is sure; False sends the call through those checks.

#include <pybind11/pybind11.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <typeindex>
#include <typeinfo>
#include <memory>
#include <vector>

#include "checks.h"
#include "methods.h"

namespace py = pybind11;
using torch::autograd::Node;

struct gradfx_native::Structure {
  struct Link {
    int32_t a, b;
    bool strict;
  };
  py::object keep;  // the plan's tuple: it owns the types
  std::vector<std::pair<int32_t, int32_t>> roots;  // (node index, output_nr)
  std::vector<PyObject*> types;
  std::vector<std::type_index> cpp_types;  // per node, where the plan was parsed with its nodes
  std::vector<int32_t> edge_begin;  // per node, where its edges start in ``edges``; n + 1 entries
  std::vector<std::pair<int32_t, int32_t>> edges;  // (node index, input_nr); index -1: undefined
  std::vector<Link> chain;
};

namespace {

int32_t small(PyObject* number) {
  const long value = PyLong_AsLong(number);
  return value < 0 || value > (1L << 30) ? -2 : static_cast<int32_t>(value);
}

bool pair(PyObject* t, std::pair<int32_t, int32_t>* out) {
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2 || !PyLong_Check(PyTuple_GET_ITEM(t, 0)) ||
      !PyLong_Check(PyTuple_GET_ITEM(t, 1))) {
    return false;
  }
  *out = {small(PyTuple_GET_ITEM(t, 0)), small(PyTuple_GET_ITEM(t, 1))};
  return out->first >= 0 && out->second >= 0;
}

}  // namespace

// ``plan``: (roots, types, edges, chain), built by fast_walk from the recorded walk:
//   roots  per root tensor (node index, output_nr); a root's index is new or an earlier root's;
//   types  per node, its Python type;
//   edges  per node, per next edge None (undefined) or (node index, input_nr), an index
//          one past the nodes seen so far being a first sighting (discovery order);
//   chain  (a, b, strict) pairs: seq[a] < seq[b] (strict) or <= (ties keep discovery order).
gradfx_native::Structure* gradfx_native::parse_structure(PyObject* plan, PyObject* nodes) {
  auto bad = [] {
    PyErr_SetString(PyExc_ValueError, "a structure plan is (roots, types, edges, chain) as fast_walk builds it");
    return nullptr;
  };
  if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 4) {
    return bad();
  }
  PyObject* roots = PyTuple_GET_ITEM(plan, 0);
  PyObject* types = PyTuple_GET_ITEM(plan, 1);
  PyObject* edges = PyTuple_GET_ITEM(plan, 2);
  PyObject* chain = PyTuple_GET_ITEM(plan, 3);
  if (!PyTuple_Check(roots) || !PyTuple_Check(types) || !PyTuple_Check(edges) || !PyTuple_Check(chain) ||
      PyTuple_GET_SIZE(edges) != PyTuple_GET_SIZE(types)) {
    return bad();
  }
  auto out = std::make_unique<Structure>();
  out->keep = py::reinterpret_borrow<py::object>(plan);
  const Py_ssize_t n = PyTuple_GET_SIZE(types);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(roots); ++k) {
    std::pair<int32_t, int32_t> root;
    if (!pair(PyTuple_GET_ITEM(roots, k), &root) || root.first >= n) {
      return bad();
    }
    out->roots.push_back(root);
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    out->types.push_back(PyTuple_GET_ITEM(types, i));
    out->edge_begin.push_back(static_cast<int32_t>(out->edges.size()));
    PyObject* row = PyTuple_GET_ITEM(edges, i);
    if (!PyTuple_Check(row)) {
      return bad();
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(row); ++k) {
      std::pair<int32_t, int32_t> edge{-1, 0};
      PyObject* e = PyTuple_GET_ITEM(row, k);
      if (e != Py_None && (!pair(e, &edge) || edge.first >= n)) {
        return bad();
      }
      out->edges.push_back(edge);
    }
  }
  out->edge_begin.push_back(static_cast<int32_t>(out->edges.size()));
  if (nodes != nullptr) {
    if (!PyList_Check(nodes) || PyList_GET_SIZE(nodes) != n) {
      return bad();
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* obj = PyList_GET_ITEM(nodes, i);
      // A custom Function's node is a PyNode whatever its class: the C++ type check
      // cannot tell its classes apart, which the caller checks (program.cpp's kCall).
      Node* node = gradfx_native::node_of(obj);
      if (node == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(obj)) != out->types[i]) {
        return bad();
      }
      out->cpp_types.emplace_back(typeid(*node));
    }
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(chain); ++k) {
    PyObject* link = PyTuple_GET_ITEM(chain, k);
    if (!PyTuple_Check(link) || PyTuple_GET_SIZE(link) != 3 || !PyLong_Check(PyTuple_GET_ITEM(link, 0)) ||
        !PyLong_Check(PyTuple_GET_ITEM(link, 1))) {
      return bad();
    }
    const int32_t a = small(PyTuple_GET_ITEM(link, 0)), b = small(PyTuple_GET_ITEM(link, 1));
    if (a < 0 || b < 0 || a >= n || b >= n) {
      return bad();
    }
    out->chain.push_back({a, b, PyTuple_GET_ITEM(link, 2) == Py_True});
  }
  return out.release();
}

void gradfx_native::free_structure(Structure* plan) {
  delete plan;
}

int gradfx_native::structure(PyObject* tensors, const Structure& plan, bool by_type, std::vector<NodePtr>* nodes) {
  const size_t n = plan.types.size();
  if (static_cast<size_t>(PySequence_Fast_GET_SIZE(tensors)) != plan.roots.size() ||
      (by_type && plan.cpp_types.size() != n)) {
    return 0;
  }
  nodes->clear();
  nodes->reserve(n);
  // A node joins in discovery order; with by_type, only of the plan's C++ type.
  auto join = [&](const NodePtr& fn) {
    if (by_type && std::type_index(typeid(*fn)) != plan.cpp_types[nodes->size()]) {
      return false;
    }
    nodes->push_back(fn);
    return true;
  };
  PyObject** items = PySequence_Fast_ITEMS(tensors);
  for (size_t k = 0; k < plan.roots.size(); ++k) {
    PyObject* t = items[k];
    if (!THPVariable_CheckExact(t)) {
      return 0;  // a subclass's grad_fn may run its own code: the generic walk reads it
    }
    const at::Tensor& tensor = THPVariable_Unpack(t);
    const auto [j, nr] = plan.roots[k];
    const auto& fn = tensor.grad_fn();
    if (!fn || static_cast<int32_t>(tensor.output_nr()) != nr) {
      return 0;
    }
    if (static_cast<size_t>(j) < nodes->size()) {
      if (fn != (*nodes)[j]) {
        return 0;
      }
      continue;
    }
    if (static_cast<size_t>(j) != nodes->size() || !join(fn)) {
      return 0;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (i >= nodes->size()) {
      return 0;  // a plan whose discovery order skips a node
    }
    const auto& next = (*nodes)[i]->next_edges();
    const int32_t begin = plan.edge_begin[i];
    if (next.size() != static_cast<size_t>(plan.edge_begin[i + 1] - begin)) {
      return 0;
    }
    for (size_t k = 0; k < next.size(); ++k) {
      const auto [j, nr] = plan.edges[begin + k];
      const auto& edge = next[k];
      if (j < 0) {
        if (edge.function) {
          return 0;
        }
        continue;
      }
      if (!edge.function || static_cast<int32_t>(edge.input_nr) != nr) {
        return 0;
      }
      if (static_cast<size_t>(j) < nodes->size()) {
        if (edge.function != (*nodes)[j]) {
          return 0;
        }
        continue;
      }
      if (static_cast<size_t>(j) != nodes->size() || !join(edge.function)) {
        return 0;
      }
    }
  }
  if (nodes->size() != n) {
    return 0;
  }
  // No predicted-new node may be an earlier one.
  std::vector<const void*> distinct(n);
  for (size_t i = 0; i < n; ++i) {
    distinct[i] = (*nodes)[i].get();
  }
  std::sort(distinct.begin(), distinct.end());
  if (std::adjacent_find(distinct.begin(), distinct.end()) != distinct.end()) {
    return 0;
  }
  for (const auto& link : plan.chain) {
    const uint64_t a = (*nodes)[link.a]->sequence_nr(), b = (*nodes)[link.b]->sequence_nr();
    if (link.strict ? !(a < b) : !(a <= b)) {
      return 0;
    }
  }
  return 1;
}

PyObject* gradfx_native::sequence_numbers(const std::vector<NodePtr>& nodes) {
  py::list numbers(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    PyObject* number = PyLong_FromUnsignedLongLong(nodes[i]->sequence_nr());
    if (number == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(numbers.ptr(), i, number);
  }
  return numbers.release().ptr();
}

PyObject* gradfx_native::type_of(const Structure& plan, size_t i) {
  return plan.types[i];
}

namespace {

// The Python lines' form: (node objects, sequence numbers) as lists, or None.
PyObject* structure_objects(PyObject* tensors, const gradfx_native::Structure& plan) {
  std::vector<gradfx_native::NodePtr> nodes;
  if (gradfx_native::structure(tensors, plan, false, &nodes) != 1) {
    Py_RETURN_NONE;
  }
  py::list objects(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    PyObject* obj = torch::autograd::functionToPyObject(nodes[i]);
    if (obj == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(objects.ptr(), i, obj);
    if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != gradfx_native::type_of(plan, i)) {
      Py_RETURN_NONE;
    }
  }
  PyObject* numbers = gradfx_native::sequence_numbers(nodes);
  if (numbers == nullptr) {
    return nullptr;
  }
  PyObject* result = PyTuple_Pack(2, objects.ptr(), numbers);
  Py_DECREF(numbers);
  return result;
}

}  // namespace

namespace {

const char* const kStructure = "gradfx structure plan";

PyObject* compile_structure(PyObject* /*self*/, PyObject* plan) {
  gradfx_native::Structure* parsed = gradfx_native::parse_structure(plan, nullptr);
  if (parsed == nullptr) {
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(parsed, kStructure, [](PyObject* c) {
    gradfx_native::free_structure(static_cast<gradfx_native::Structure*>(PyCapsule_GetPointer(c, kStructure)));
  });
  if (capsule == nullptr) {
    gradfx_native::free_structure(parsed);
  }
  return capsule;
}

PyObject* structure_fastcall(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyCapsule_IsValid(args[1], kStructure)) {
    PyErr_SetString(PyExc_TypeError, "structure(tensors, plan): plan from compile_structure");
    return nullptr;
  }
  const auto* plan = static_cast<gradfx_native::Structure*>(PyCapsule_GetPointer(args[1], kStructure));
  PyObject* tensors = PySequence_Fast(args[0], "tensors must be a sequence");
  if (tensors == nullptr) {
    return nullptr;
  }
  PyObject* result = nullptr;
  try {
    result = structure_objects(tensors, *plan);
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  Py_DECREF(tensors);
  return result;
}

// A root or input as the Python checks pass it: a Tensor or Parameter that requires grad
// (a root without grad_fn or requires_grad, an input without requires_grad: eager's
// error), not on the meta device, with no key of a functorch transform, vmap's batching,
// functionalization or Python dispatch (torch's own tracing and transforms).
bool plain_tensor(PyObject* t, PyObject* parameter) {
  if (!(THPVariable_CheckExact(t) || reinterpret_cast<PyObject*>(Py_TYPE(t)) == parameter)) {
    return false;
  }
  const at::Tensor& tensor = THPVariable_Unpack(t);
  constexpr c10::DispatchKeySet kTransformed({c10::DispatchKey::FuncTorchGradWrapper,
                                              c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Batched,
                                              c10::DispatchKey::BatchedNestedTensor, c10::DispatchKey::Functionalize,
                                              c10::DispatchKey::Python});
  return tensor.requires_grad() && !tensor.is_meta() && !tensor.key_set().has_any(kTransformed);
}

// A root's gradient as the Python checks pass it: a tensor (eager raises for a missing
// one), not batched (autograd.grad's is_grads_batched, vmap).
bool plain_grad(PyObject* g) {
  if (!THPVariable_Check(g)) {
    return false;
  }
  constexpr c10::DispatchKeySet kBatched({c10::DispatchKey::FuncTorchGradWrapper,
                                          c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Batched,
                                          c10::DispatchKey::BatchedNestedTensor, c10::DispatchKey::Functionalize});
  return !THPVariable_Unpack(g).key_set().has_any(kBatched);
}

PyObject* plain_call(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  static PyObject* parameter = nullptr;  // torch.nn.Parameter, for the process
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "plain_call(tensors, grads, inputs)");
    return nullptr;
  }
  if (parameter == nullptr) {
    PyObject* nn = PyImport_ImportModule("torch.nn");
    parameter = nn == nullptr ? nullptr : PyObject_GetAttrString(nn, "Parameter");
    Py_XDECREF(nn);
    if (parameter == nullptr) {
      return nullptr;
    }
  }
  // A user's dispatch mode sees the backward's compute; torch's tracing modes own theirs.
  if (c10::impl::TorchDispatchModeTLS::stack_len() != 0) {
    Py_RETURN_FALSE;
  }
  PyObject* tensors = args[0];
  PyObject* grads = args[1];
  PyObject* inputs = args[2];
  if (!PyTuple_CheckExact(tensors) || !PyTuple_CheckExact(grads) ||
      PyTuple_GET_SIZE(tensors) != PyTuple_GET_SIZE(grads) || PyTuple_GET_SIZE(tensors) == 0 ||
      !(inputs == Py_None || PyTuple_CheckExact(inputs))) {
    Py_RETURN_FALSE;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(tensors); ++k) {
    if (!plain_tensor(PyTuple_GET_ITEM(tensors, k), parameter) || !plain_grad(PyTuple_GET_ITEM(grads, k))) {
      Py_RETURN_FALSE;
    }
  }
  if (inputs != Py_None) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(inputs); ++k) {
      if (!plain_tensor(PyTuple_GET_ITEM(inputs, k), parameter)) {
        Py_RETURN_FALSE;
      }
    }
  }
  Py_RETURN_TRUE;
}

PyMethodDef compile_def = {"compile_structure", &compile_structure, METH_O,
                           "a structure plan (roots, types, edges, chain) parsed once, for structure()"};
PyMethodDef structure_def = {
    "structure", GRADFX_FASTCALL(structure_fastcall), METH_FASTCALL,
    "the walker's roots, types, edges and sequence order checked: (nodes, sequence numbers) or None"};
PyMethodDef plain_call_def = {
    "plain_call", GRADFX_FASTCALL(plain_call), METH_FASTCALL,
    "(tensors, grads, inputs) of a backward call: True where gradfx's Python checks would all pass it"};

}  // namespace

void add_structure(py::module_& m) {
  gradfx_native::add_functions(m, {&compile_def, &structure_def, &plain_call_def});
}
