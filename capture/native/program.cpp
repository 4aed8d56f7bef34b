// A cache-hit walk in one C++ call, for structures of builtin nodes and leaves, leaves
// with post-accumulate-grad hooks among them, and custom Functions' nodes whose checks
// the plan hands back to Python (capture/graph/walk_program.py builds the plan and says
// which): the structure, then
// the same reads and checks as the walker's generated Python lines, in their order, then
// the inputs, owners and sizes those lines return (the nodes as a sequence that makes
// each node's Python object when asked for; a node's own input None).  None where the
// lines would bail, or where this call is not sure they would not (a leaf with tensor
// hooks): the lines then run, and decide.  Nothing is taken over, so running them after
// it changes nothing.  False where the lines would bail for sure, their own check being
// this call's (a gradient's, a node's metadata, a leaf, a leaf's count of
// post-accumulate-grad hooks): the lines are then spared, which matters where several
// structures share a root type and each backward tries the walkers of the others first
// (models of one architecture with DDP's Python reducer and without, in one process).

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <unordered_map>
#include <memory>
#include <vector>

#include "checks.h"
#include "methods.h"

namespace py = pybind11;

namespace {

using gradfx_native::LeafSpec;
using gradfx_native::MetaSpec;
using gradfx_native::NodePtr;
using gradfx_native::SavedSpec;
using gradfx_native::TensorSpec;

enum Kind : long { kMetas = 0, kValue = 1, kSaved = 2, kLeaf = 3, kGrad = 4, kForeign = 5, kCppHooks = 6, kCall = 7 };
enum Value : long { kSize = 0, kSizes = 1, kNone = 2, kEqual = 3 };
enum Input : long { kGradInput = 0, kSavedInput = 1, kNodeInput = 2, kLeafInput = 3, kHookInput = 4, kFilledLater = 5 };
// How a kEqual value compares: the forms emit_values' ``type(x) is T and x == C`` takes
// most, read without building C; any other C through Python's ==.
enum Equal : int8_t { kInt, kBool, kInts, kObject };

struct Step {
  int8_t kind;
  int8_t mode;  // kValue: Value; kEqual: Equal in ``equal``
  int8_t equal = kObject;
  int32_t i;             // the node (kGrad: the root)
  int32_t begin = 0;     // into the plan's specs or ints, by kind
  int32_t count = 0;
  int64_t number = 0;    // kSizes: the length; kInt: C; kLeaf: its post-accumulate-grad hooks
  PyObject* descriptor = nullptr;  // kValue: the getter; kCall: the check
  PyObject* proxy = nullptr;       // kValue: the object it is called on (``proxy_for``)
  PyObject* type = nullptr;        // kEqual: T
  PyObject* constant = nullptr;    // kEqual: C
  gradfx_native::FieldRead field = nullptr;  // kValue: the value's C++ field (fields.cpp), if read so
};

struct Held {
  int32_t i;
  PyObject* offsets;  // HeldByNode's arguments, borrowed from the plan's tuple
  PyObject* mask;
};

struct Program {
  py::object keep;  // the plan's tuple: owns every borrowed object below
  std::unique_ptr<gradfx_native::Structure, void (*)(gradfx_native::Structure*)> structure{
      nullptr, gradfx_native::free_structure};
  std::vector<Step> steps;
  std::vector<TensorSpec> tensors;
  std::vector<MetaSpec> metas;
  std::vector<LeafSpec> leaves;
  std::vector<SavedSpec> saved;
  std::vector<int64_t> ints;
  std::vector<std::array<int32_t, 3>> layout;
  std::vector<Held> held;
  int32_t n = 0;
  // The sizes of the last call and the list returned for them (program's end says why).
  mutable std::vector<int64_t> last_sizes;
  mutable py::object last_sizes_list;
};

// A saved value's getter reads only the node its object points at.  Rather than make
// every node's Python object on every backward (an allocation each, the bulk of a walk's
// time), each getter runs on one object per node type, pointed at the node for the
// call (under the GIL, which no getter releases).  Made once per type and kept for the
// process; never seen by the garbage collector (its traverse would read the node it
// points at between calls: none).
PyObject* proxy_for(PyObject* type) {
  static std::unordered_map<PyObject*, PyObject*> proxies;
  auto found = proxies.find(type);
  if (found != proxies.end()) {
    return found->second;
  }
  auto* t = reinterpret_cast<PyTypeObject*>(type);
  if (!PyType_Check(type) || t->tp_basicsize != static_cast<Py_ssize_t>(sizeof(torch::autograd::THPCppFunction))) {
    return nullptr;
  }
  PyObject* proxy = t->tp_alloc(t, 0);  // zeroed: an empty node pointer
  if (proxy == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (PyObject_IS_GC(proxy)) {
    PyObject_GC_UnTrack(proxy);
  }
  using CData = decltype(torch::autograd::THPCppFunction::cdata);
  new (&reinterpret_cast<torch::autograd::THPCppFunction*>(proxy)->cdata) CData();
  if (!torch::autograd::THPCppFunction_Check(proxy)) {
    return nullptr;  // not a builtin node's type: left allocated, never used
  }
  Py_INCREF(type);
  proxies.emplace(type, proxy);
  return proxy;
}

// ``getter`` on node ``node`` through the proxy of its type: a new reference, or nullptr.
PyObject* get(const Step& step, const NodePtr& node) {
  auto& cdata = reinterpret_cast<torch::autograd::THPCppFunction*>(step.proxy)->cdata;
  cdata = node;
  PyObject* x = Py_TYPE(step.descriptor)->tp_descr_get(step.descriptor, step.proxy,
                                                         reinterpret_cast<PyObject*>(Py_TYPE(step.proxy)));
  cdata.reset();
  return x;
}

// The walk's nodes, in discovery order, as a sequence: each node's Python object is
// made when first asked for (the graph asks for none unless it calls a node or a hook).
struct Walked {
  PyObject_HEAD
  std::vector<NodePtr>* nodes;
  std::vector<PyObject*>* objects;  // new references, or nullptr until asked for
};

Py_ssize_t walked_length(PyObject* self) {
  return static_cast<Py_ssize_t>(reinterpret_cast<Walked*>(self)->nodes->size());
}

PyObject* walked_item(PyObject* self, Py_ssize_t i) {
  auto* w = reinterpret_cast<Walked*>(self);
  if (i < 0 || static_cast<size_t>(i) >= w->nodes->size()) {
    PyErr_SetString(PyExc_IndexError, "node index out of range");
    return nullptr;
  }
  PyObject*& obj = (*w->objects)[i];
  if (obj == nullptr) {
    obj = torch::autograd::functionToPyObject((*w->nodes)[i]);
    if (obj == nullptr) {
      return nullptr;
    }
  }
  Py_INCREF(obj);
  return obj;
}

void walked_dealloc(PyObject* self) {
  auto* w = reinterpret_cast<Walked*>(self);
  for (PyObject* obj : *w->objects) {
    Py_XDECREF(obj);
  }
  delete w->objects;
  delete w->nodes;
  PyObject_Free(self);
}

PySequenceMethods walked_sequence = [] {
  PySequenceMethods m{};
  m.sq_length = walked_length;
  m.sq_item = walked_item;
  return m;
}();

PyTypeObject walked_type = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "gradfx_native.Walked";
  t.tp_basicsize = sizeof(Walked);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = "the nodes of a one-call walk, in discovery order; each node's object made when asked for";
  t.tp_dealloc = walked_dealloc;
  t.tp_as_sequence = &walked_sequence;
  return t;
}();

// The node objects a walk made for its kCall steps (new references), owned here until
// the Walked sequence takes them.
struct Objects {
  std::vector<PyObject*> items;
  Objects() = default;
  Objects(const Objects&) = delete;
  Objects& operator=(const Objects&) = delete;
  ~Objects() {
    for (PyObject* obj : items) {
      Py_XDECREF(obj);
    }
  }
  // Node i's object (borrowed), made once; nullptr with an error set.
  PyObject* of(const std::vector<NodePtr>& nodes, int32_t i) {
    if (items.empty()) {
      items.assign(nodes.size(), nullptr);
    }
    if (items[i] == nullptr) {
      items[i] = torch::autograd::functionToPyObject(nodes[i]);
    }
    return items[i];
  }
};

PyObject* walked(std::vector<NodePtr>&& nodes, Objects* made) {
  auto* w = PyObject_New(Walked, &walked_type);
  if (w == nullptr) {
    return nullptr;
  }
  w->nodes = new std::vector<NodePtr>(std::move(nodes));
  w->objects = new std::vector<PyObject*>(w->nodes->size(), nullptr);
  if (!made->items.empty()) {
    w->objects->swap(made->items);  // the objects go with the sequence
  }
  return reinterpret_cast<PyObject*>(w);
}

const char* const kProgram = "gradfx walk program";

long at(PyObject* tuple, Py_ssize_t k) {
  return PyLong_AsLong(PyTuple_GET_ITEM(tuple, k));
}

bool fits(PyObject* x, int64_t* out) {
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(x, &overflow);
  return overflow == 0 && !(*out == -1 && PyErr_Occurred());
}

// The value step's fields from (kValue, i, descriptor, mode, arg).
bool parse_value(Program* p, PyObject* step, Step* out) {
  out->descriptor = PyTuple_GET_ITEM(step, 2);
  out->mode = static_cast<int8_t>(at(step, 3));
  PyObject* arg = PyTuple_GET_ITEM(step, 4);
  if (Py_TYPE(out->descriptor)->tp_descr_get == nullptr) {
    return false;
  }
  switch (out->mode) {
    case kSize:
    case kNone:
      return true;
    case kSizes:
      out->number = PyLong_AsLongLong(arg);
      return out->number >= 0;
    case kEqual: {
      if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) != 2) {
        return false;
      }
      out->type = PyTuple_GET_ITEM(arg, 0);
      out->constant = PyTuple_GET_ITEM(arg, 1);
      PyObject* c = out->constant;
      if (out->type == reinterpret_cast<PyObject*>(&PyBool_Type) && PyBool_Check(c)) {
        out->equal = kBool;
      } else if (out->type == reinterpret_cast<PyObject*>(&PyLong_Type) && PyLong_CheckExact(c) &&
                 fits(c, &out->number)) {
        out->equal = kInt;
      } else if (out->type == reinterpret_cast<PyObject*>(&PyTuple_Type) && PyTuple_CheckExact(c)) {
        out->equal = kInts;
        out->begin = static_cast<int32_t>(p->ints.size());
        out->count = static_cast<int32_t>(PyTuple_GET_SIZE(c));
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(c); ++k) {
          int64_t v;
          if (!PyLong_CheckExact(PyTuple_GET_ITEM(c, k)) || !fits(PyTuple_GET_ITEM(c, k), &v)) {
            out->equal = kObject;
            break;
          }
          p->ints.push_back(v);
        }
      }
      PyErr_Clear();
      return true;
    }
    default:
      return false;
  }
}

// value()'s check of a saved value read from its field: 1 or 0 as value() would answer
// for the getter's object (fields.cpp: a tuple of plain ints, or an int), -1 where the
// getter's path must decide (a form the field does not give).  Nothing is appended to
// ``sizes`` unless it answers 1.
int from_field(const gradfx_native::FieldValue& v, const Step& step, const Program& p, std::vector<int64_t>* sizes) {
  if (v.ints == nullptr) {
    if (step.mode == kSize) {  // type(x) is int; sizes.append(x)
      sizes->push_back(v.number);
      return 1;
    }
    if (step.mode == kEqual && step.equal == kInt) {  // type(x) is int and x == C
      return v.number == step.number ? 1 : 0;
    }
    return -1;
  }
  const std::vector<c10::SymInt>& xs = *v.ints;
  const auto n = static_cast<int64_t>(xs.size());
  if (step.mode == kSizes) {  // type(x) is tuple and len(x) == n; sizes += x
    if (n != step.number) {
      return 0;
    }
    for (const c10::SymInt& x : xs) {
      sizes->push_back(x.as_int_unchecked());
    }
    return 1;
  }
  if (step.mode == kEqual && step.equal == kInts) {  // type(x) is tuple and x == C (C all ints)
    if (n != step.count) {
      return 0;
    }
    for (int64_t k = 0; k < n; ++k) {
      if (xs[k].as_int_unchecked() != p.ints[step.begin + k]) {
        return 0;
      }
    }
    return 1;
  }
  return -1;
}

// The field of a value step, where fields.cpp names one for its node's type, it reads on
// the recorded node ``obj`` what the getter reads there (same type, equal), and the step's
// check takes the form it gives (from_field answers); else nullptr: the getter serves.
gradfx_native::FieldRead checked_field(const Step& step, PyObject* obj, const Program& p) {
  if (!torch::autograd::THPCppFunction_Check(obj)) {
    return nullptr;
  }
  const auto& node = reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata;
  PyObject* name = PyObject_GetAttrString(step.descriptor, "__name__");
  if (name == nullptr || !PyUnicode_Check(name)) {
    Py_XDECREF(name);
    PyErr_Clear();
    return nullptr;
  }
  const char* text = PyUnicode_AsUTF8(name);
  gradfx_native::FieldRead read = text == nullptr ? nullptr : gradfx_native::field_reader(*node, text);
  Py_DECREF(name);
  gradfx_native::FieldValue v;
  std::vector<int64_t> scratch;
  if (read == nullptr || !read(node.get(), &v) || from_field(v, step, p, &scratch) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  py::object ours = py::reinterpret_steal<py::object>(gradfx_native::field_object(v));
  py::object theirs = py::reinterpret_steal<py::object>(get(step, node));
  if (!ours || !theirs || Py_TYPE(ours.ptr()) != Py_TYPE(theirs.ptr()) ||
      PyObject_RichCompareBool(ours.ptr(), theirs.ptr(), Py_EQ) != 1) {
    PyErr_Clear();
    return nullptr;
  }
  return read;
}

// The plan tuple, parsed (see ``program`` for its form) with the recorded walk's node
// objects (``nodes``: their C++ types); nullptr with an error set.
Program* parse(PyObject* plan, PyObject* nodes) {
  auto bad = [] {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_ValueError, "a walk program's plan is as walk_program.plan builds it");
    }
    return nullptr;
  };
  if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 5) {
    return bad();
  }
  auto p = std::make_unique<Program>();
  p->keep = py::reinterpret_borrow<py::object>(plan);
  p->structure.reset(gradfx_native::parse_structure(PyTuple_GET_ITEM(plan, 0), nodes));
  if (!p->structure) {
    return nullptr;
  }
  if (PyTuple_GET_SIZE(PyTuple_GET_ITEM(PyTuple_GET_ITEM(plan, 0), 1)) != PyLong_AsSsize_t(PyTuple_GET_ITEM(plan, 4))) {
    return bad();  // as many node types as nodes
  }
  PyObject* steps = PyTuple_GET_ITEM(plan, 1);
  PyObject* layout = PyTuple_GET_ITEM(plan, 2);
  PyObject* held = PyTuple_GET_ITEM(plan, 3);
  p->n = static_cast<int32_t>(PyLong_AsLong(PyTuple_GET_ITEM(plan, 4)));
  if (!PyTuple_Check(steps) || !PyTuple_Check(layout) || !PyTuple_Check(held) || p->n < 0) {
    return bad();
  }
  for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(steps); ++s) {
    PyObject* item = PyTuple_GET_ITEM(steps, s);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 3) {
      return bad();
    }
    Step step;
    step.kind = static_cast<int8_t>(at(item, 0));
    step.i = static_cast<int32_t>(at(item, 1));
    if (step.i < 0 || (step.kind != kGrad && step.i >= p->n)) {
      return bad();
    }
    PyObject* arg = PyTuple_GET_ITEM(item, 2);
    bool ok = false;
    switch (step.kind) {
      case kGrad:
        step.begin = static_cast<int32_t>(p->tensors.size());
        p->tensors.emplace_back();
        ok = gradfx_native::parse_tensor(arg, &p->tensors.back());
        break;
      case kMetas:
        step.begin = static_cast<int32_t>(p->metas.size());
        ok = gradfx_native::parse_metas(arg, &p->metas);
        step.count = static_cast<int32_t>(p->metas.size()) - step.begin;
        break;
      case kValue:
        step.proxy = proxy_for(gradfx_native::type_of(*p->structure, step.i));
        ok = step.proxy != nullptr && PyTuple_GET_SIZE(item) == 5 && parse_value(p.get(), item, &step);
        if (ok && PyList_Check(nodes) && step.i < PyList_GET_SIZE(nodes)) {
          step.field = checked_field(step, PyList_GET_ITEM(nodes, step.i), *p);
        }
        break;
      case kSaved: {  // (offsets, expected per variable: None or emit_tensor's tuple)
        if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) != 2) {
          return bad();
        }
        PyObject* where = PyTuple_GET_ITEM(arg, 0);
        PyObject* expected = PyTuple_GET_ITEM(arg, 1);
        if (!PyTuple_Check(where) || !PyTuple_Check(expected) || PyTuple_GET_SIZE(where) != PyTuple_GET_SIZE(expected)) {
          return bad();
        }
        step.begin = static_cast<int32_t>(p->saved.size());
        ok = true;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(where) && ok; ++k) {
          SavedSpec spec;
          spec.offset = PyLong_AsLongLong(PyTuple_GET_ITEM(where, k));
          PyObject* want = PyTuple_GET_ITEM(expected, k);
          if (want != Py_None) {
            spec.tensor = static_cast<int32_t>(p->tensors.size());
            p->tensors.emplace_back();
            ok = gradfx_native::parse_tensor(want, &p->tensors.back());
          }
          p->saved.push_back(spec);
        }
        step.count = static_cast<int32_t>(p->saved.size()) - step.begin;
        break;
      }
      case kLeaf:  // (expected[, post-accumulate-grad hooks the leaf has])
        step.begin = static_cast<int32_t>(p->leaves.size());
        p->leaves.emplace_back();
        step.number = PyTuple_GET_SIZE(item) > 3 ? at(item, 3) : 0;
        ok = step.number >= 0 && gradfx_native::parse_leaf(arg, &p->leaves.back());
        break;
      case kCppHooks:  // (bool): whether the accumulator has C++ post-hooks (DDP's reducer)
        step.number = PyObject_IsTrue(arg);
        ok = step.number >= 0;
        break;
      case kCall:  // (check): called with the node's object; True, an owner, or None / False
        step.descriptor = arg;
        ok = PyCallable_Check(arg) != 0;
        break;
      case kForeign:  // (offsets): the saved variables, of which one must carry hooks
        if (!PyTuple_Check(arg)) {
          return bad();
        }
        step.begin = static_cast<int32_t>(p->saved.size());
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(arg); ++k) {
          SavedSpec spec;
          spec.offset = PyLong_AsLongLong(PyTuple_GET_ITEM(arg, k));
          p->saved.push_back(spec);
        }
        step.count = static_cast<int32_t>(p->saved.size()) - step.begin;
        ok = step.count > 0;
        break;
    }
    if (!ok) {
      return bad();
    }
    p->steps.push_back(step);
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(layout); ++k) {
    PyObject* ref = PyTuple_GET_ITEM(layout, k);
    if (!PyTuple_Check(ref) || PyTuple_GET_SIZE(ref) != 3) {
      return bad();
    }
    p->layout.push_back({static_cast<int32_t>(at(ref, 0)), static_cast<int32_t>(at(ref, 1)),
                         static_cast<int32_t>(at(ref, 2))});
    const auto& r = p->layout.back();
    if (r[0] == kHookInput) {  // a hook of a leaf whose step reads that many
      bool read = false;
      for (const Step& step : p->steps) {
        read = read || (step.kind == kLeaf && step.i == r[1] && r[2] >= 0 && r[2] < step.number);
      }
      if (!read) {
        return bad();
      }
    }
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(held); ++k) {
    PyObject* h = PyTuple_GET_ITEM(held, k);
    if (!PyTuple_Check(h) || PyTuple_GET_SIZE(h) != 3) {
      return bad();
    }
    p->held.push_back({static_cast<int32_t>(at(h, 0)), PyTuple_GET_ITEM(h, 1), PyTuple_GET_ITEM(h, 2)});
    if (p->held.back().i < 0 || p->held.back().i >= p->n) {
      return bad();
    }
  }
  if (PyErr_Occurred()) {
    return nullptr;
  }
  return p.release();
}

// emit_values' check of one saved value ``x`` (a new reference, consumed).
bool value(PyObject* x, const Step& step, const Program& p, std::vector<int64_t>* sizes) {
  py::object owned = py::reinterpret_steal<py::object>(x);
  int64_t v;
  switch (step.mode) {
    case kSize:  // type(x) is int; sizes.append(x)
      if (!PyLong_CheckExact(x) || !fits(x, &v)) {
        PyErr_Clear();
        return false;
      }
      sizes->push_back(v);
      return true;
    case kSizes: {  // type(x) is tuple and len(x) == n; sizes += x
      if (!PyTuple_CheckExact(x) || PyTuple_GET_SIZE(x) != step.number) {
        return false;
      }
      for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(x); ++k) {
        PyObject* item = PyTuple_GET_ITEM(x, k);
        if (!PyLong_CheckExact(item) || !fits(item, &v)) {
          PyErr_Clear();
          return false;  // not a plain int: the lines decide
        }
        sizes->push_back(v);
      }
      return true;
    }
    case kNone:
      return x == Py_None;
    case kEqual:
      break;
    default:
      return false;
  }
  // type(x) is T and x == C
  if (reinterpret_cast<PyObject*>(Py_TYPE(x)) != step.type) {
    return false;
  }
  switch (step.equal) {
    case kBool:
      return x == step.constant;
    case kInt:
      if (fits(x, &v)) {
        return v == step.number;
      }
      PyErr_Clear();
      return false;  // beyond int64, unlike C
    case kInts: {
      if (PyTuple_GET_SIZE(x) != step.count) {
        return false;
      }
      bool plain = true;
      for (Py_ssize_t k = 0; k < step.count && plain; ++k) {
        PyObject* item = PyTuple_GET_ITEM(x, k);
        if (!PyLong_CheckExact(item) || !fits(item, &v)) {
          PyErr_Clear();
          plain = false;  // a float or bool equal to an int: Python's == says
        } else if (v != p.ints[step.begin + k]) {
          return false;
        }
      }
      if (plain) {
        return true;
      }
      break;
    }
    default:
      break;
  }
  const int same = PyObject_RichCompareBool(x, step.constant, Py_EQ);
  if (same < 0) {
    PyErr_Clear();  // the Python line would raise here; the lines decide
    return false;
  }
  return same == 1;
}

// A leaf of another type than Tensor or Parameter (whose hooks known_post_accumulate_count
// reads from their fields): the lines' cheap condition (no tensor hooks, read by attribute),
// else they decide.
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

// How many post-accumulate-grad hooks the leaf has where that is sure to be what the
// lines' ``collect`` counts (a plain Tensor or Parameter without tensor pre-hooks, its
// hooks in a dict or none), else -1: the lines decide.
Py_ssize_t known_post_accumulate_count(PyObject* leaf) {
  if (!THPVariable_CheckExact(leaf)) {
    return -1;
  }
  const auto* v = reinterpret_cast<THPVariable*>(leaf);
  if (v->backward_hooks != nullptr) {
    return -1;
  }
  if (v->post_accumulate_grad_hooks == nullptr) {
    return 0;
  }
  return PyDict_Check(v->post_accumulate_grad_hooks) ? PyDict_Size(v->post_accumulate_grad_hooks) : -1;
}

// The callables of a leaf whose ``count`` post-accumulate-grad hooks known_post_accumulate_count
// found, in registration order (the dict's own), as the lines' ``collect`` returns them; None
// where they cannot be listed (the lines decide).
py::object post_accumulate_hooks(PyObject* leaf, Py_ssize_t count) {
  PyObject* hooks = reinterpret_cast<THPVariable*>(leaf)->post_accumulate_grad_hooks;
  static PyObject* values_name = PyUnicode_InternFromString("values");
  PyObject* values = PyObject_CallMethodNoArgs(hooks, values_name);  // an OrderedDict's own order
  PyObject* listed = values == nullptr ? nullptr : PySequence_List(values);
  Py_XDECREF(values);
  if (listed == nullptr || PyList_GET_SIZE(listed) != count) {
    PyErr_Clear();
    Py_XDECREF(listed);
    return py::none();
  }
  return py::reinterpret_steal<py::object>(listed);
}

// The plan's tuple, as walk_program.plan builds it: (structure plan, steps, inputs, held, n):
//   steps   in the lines' order: (kGrad, k, expected), (kMetas, i, expected),
//           (kValue, i, descriptor, mode, arg), (kSaved, i, spec),
//           (kLeaf, i, expected[, post-accumulate-grad hooks]), (kForeign, i, offsets),
//           (kCppHooks, i, has C++ post-hooks), (kCall, i, check): the check of a node
//           this call cannot read (a custom Function's), called with the node's object:
//           True where it passes, an object where it passes and that is the node's owner,
//           None or False where the lines would bail;
//   inputs  the returned inputs: (kGradInput, k, 0), (kSavedInput, i, j), (kNodeInput, i, 0),
//           (kLeafInput, i, 0), (kHookInput, i, j): leaf i's post-accumulate-grad hook j,
//           (kFilledLater, i, j): None, which the caller replaces (node i's tensor pre-hooks);
//   held    (i, offsets, mask) per node whose saved tensors stay with it (HeldByNode).
// Returns (nodes as a Walked sequence, owned, inputs, sizes, sequence numbers), None, or
// False (the top of this file says when).
// A node's own entry among the inputs is None: a graph of builtin nodes reads none (the
// session gives a graph that does, one whose trace made a node opaque, its objects).
PyObject* program(PyObject* tensors, PyObject* grads, const Program& p) {
  if (PySequence_Fast_GET_SIZE(grads) != PySequence_Fast_GET_SIZE(tensors)) {
    Py_RETURN_NONE;
  }
  std::vector<NodePtr> nodes;
  if (gradfx_native::structure(tensors, *p.structure, true, &nodes) != 1) {
    Py_RETURN_NONE;
  }
  PyObject** grad = PySequence_Fast_ITEMS(grads);

  std::vector<int64_t> sizes;
  sizes.reserve(256);
  std::vector<py::object> saved(p.n), leaves(p.n), hooks(p.n), owners(p.n);
  Objects objects;
  for (const Step& step : p.steps) {
    const int32_t i = step.i;
    bool ok = false;
    bool sure = false;  // a failed check is the lines' own: they would bail
    switch (step.kind) {
      case kGrad:
        ok = gradfx_native::tensor(grad[i], p.tensors[step.begin], &sizes);
        sure = true;
        break;
      case kMetas:
        ok = gradfx_native::metas(nodes[i].get(), p.metas.data() + step.begin, step.count, &sizes);
        sure = true;
        break;
      case kValue: {
        if (step.field != nullptr) {
          gradfx_native::FieldValue v;
          const int known = step.field(nodes[i].get(), &v) ? from_field(v, step, p, &sizes) : -1;
          if (known >= 0) {
            ok = known == 1;
            break;
          }
        }
        PyObject* x = get(step, nodes[i]);
        if (x == nullptr) {
          return nullptr;  // the getter raised: so would the line
        }
        ok = value(x, step, p, &sizes);
        break;
      }
      case kSaved: {
        PyObject* xs = gradfx_native::saved(nodes[i], p.saved.data() + step.begin, step.count, p.tensors.data(), &sizes);
        if (xs == nullptr) {
          return nullptr;
        }
        saved[i] = py::reinterpret_steal<py::object>(xs);
        ok = xs != Py_None;
        break;
      }
      case kForeign: {
        // Saved tensors under hooks, which the caller's lines tell the user's from gradfx's
        // (saved.foreign_hooks): this step only finds that some variable carries them.
        char* base = reinterpret_cast<char*>(nodes[i].get());
        for (int32_t k = 0; k < step.count && !ok; ++k) {
          ok = reinterpret_cast<torch::autograd::SavedVariable*>(base + p.saved[step.begin + k].offset)->has_hooks();
        }
        break;
      }
      case kCppHooks:
        ok = (gradfx_native::cpp_post_hook_count(nodes[i].get()) > 0) == (step.number != 0);
        break;
      case kCall: {
        PyObject* obj = objects.of(nodes, i);
        if (obj == nullptr) {
          return nullptr;
        }
        PyObject* answer = PyObject_CallOneArg(step.descriptor, obj);
        if (answer == nullptr) {
          return nullptr;  // it raised: so would the lines (eager's error on reading a freed ctx)
        }
        ok = answer != Py_None && answer != Py_False;
        if (ok && answer != Py_True) {
          owners[i] = py::reinterpret_steal<py::object>(answer);
        } else {
          Py_DECREF(answer);
        }
        break;
      }
      case kLeaf: {
        PyObject* v = gradfx_native::leaf(nodes[i].get(), p.leaves[step.begin], &sizes);
        if (v == nullptr) {
          return nullptr;
        }
        leaves[i] = py::reinterpret_steal<py::object>(v);
        if (v == Py_None) {
          sure = true;  // not the cached leaf
          break;
        }
        const Py_ssize_t count = known_post_accumulate_count(v);
        if (count != step.number) {
          // another count of hooks is another key; an unknown one (tensor pre-hooks, a
          // subclass) the lines decide, but a subclass with no hooks at all passes here
          sure = count >= 0;
          ok = count < 0 && step.number == 0 && !THPVariable_CheckExact(v) && no_tensor_hooks(v);
          break;
        }
        if (count == 0) {
          ok = true;
          break;
        }
        hooks[i] = post_accumulate_hooks(v, count);
        ok = !hooks[i].is_none();
        break;
      }
    }
    if (PyErr_Occurred()) {
      return nullptr;
    }
    if (!ok) {
      if (sure) {
        Py_RETURN_FALSE;
      }
      Py_RETURN_NONE;
    }
  }

  py::list owned(p.n);
  for (int32_t k = 0; k < p.n; ++k) {
    Py_INCREF(Py_None);
    PyList_SET_ITEM(owned.ptr(), k, Py_None);
  }
  for (const Held& h : p.held) {
    PyObject* o = gradfx_native::held(nodes[h.i], h.offsets, h.mask);
    if (o == nullptr) {
      return nullptr;
    }
    PyList_SetItem(owned.ptr(), h.i, o);
  }
  for (int32_t k = 0; k < p.n; ++k) {
    if (owners[k]) {
      PyList_SetItem(owned.ptr(), k, owners[k].release().ptr());
    }
  }

  py::list inputs(p.layout.size());
  for (size_t k = 0; k < p.layout.size(); ++k) {
    const auto& ref = p.layout[k];
    const int32_t i = ref[1];
    PyObject* item;
    switch (ref[0]) {
      case kGradInput:
        item = grad[i];
        break;
      case kSavedInput:
        item = PyTuple_GET_ITEM(saved[i].ptr(), ref[2]);
        break;
      case kNodeInput:
      case kFilledLater:
        item = Py_None;
        break;
      case kHookInput:
        item = PyList_GET_ITEM(hooks[i].ptr(), ref[2]);
        break;
      default:
        item = leaves[i].ptr();
    }
    Py_INCREF(item);
    PyList_SET_ITEM(inputs.ptr(), k, item);
  }
  // A training loop's sizes repeat: the list made for the last call answers an equal
  // one (no one changes a walk's sizes once it has returned them), sparing an int
  // object per size and, as cache.lookup tries identity first, their comparison.
  py::object found_sizes;
  if (p.last_sizes_list && sizes == p.last_sizes) {
    found_sizes = p.last_sizes_list;
  } else {
    py::list made(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k) {
      PyObject* number = PyLong_FromLongLong(sizes[k]);
      if (number == nullptr) {
        return nullptr;
      }
      PyList_SET_ITEM(made.ptr(), k, number);
    }
    p.last_sizes = sizes;
    p.last_sizes_list = made;
    found_sizes = std::move(made);
  }
  py::object seq = py::reinterpret_steal<py::object>(gradfx_native::sequence_numbers(nodes));
  if (!seq) {
    return nullptr;
  }
  py::object walk = py::reinterpret_steal<py::object>(walked(std::move(nodes), &objects));
  if (!walk) {
    return nullptr;
  }
  return PyTuple_Pack(5, walk.ptr(), owned.ptr(), inputs.ptr(), found_sizes.ptr(), seq.ptr());
}

PyObject* compile_program(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "compile_program(plan, nodes)");
    return nullptr;
  }
  Program* parsed = parse(args[0], args[1]);
  if (parsed == nullptr) {
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(parsed, kProgram, [](PyObject* c) {
    delete static_cast<Program*>(PyCapsule_GetPointer(c, kProgram));
  });
  if (capsule == nullptr) {
    delete parsed;
  }
  return capsule;
}

PyObject* program_fastcall(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyCapsule_IsValid(args[2], kProgram)) {
    PyErr_SetString(PyExc_TypeError, "program(tensors, grads, plan): plan from compile_program");
    return nullptr;
  }
  const auto* plan = static_cast<Program*>(PyCapsule_GetPointer(args[2], kProgram));
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
    result = program(tensors, grads, *plan);
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  Py_DECREF(tensors);
  Py_DECREF(grads);
  return result;
}

PyMethodDef compile_def = {
    "compile_program", GRADFX_FASTCALL(compile_program), METH_FASTCALL,
    "a walk plan (walk_program.plan's tuple) parsed once with the recorded nodes, for program()"};
PyMethodDef program_def = {
    "program", GRADFX_FASTCALL(program_fastcall), METH_FASTCALL,
    "a cache-hit walk of builtin nodes and leaves: (nodes, owned, inputs, sizes, seq) or None"};

}  // namespace

void add_program(py::module_& m) {
  if (PyType_Ready(&walked_type) < 0) {
    throw py::error_already_set();
  }
  gradfx_native::add_functions(m, {&compile_def, &program_def});
}
