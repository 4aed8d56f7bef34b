// A builtin node's saved values read straight from their C++ fields, for the fields the
// one-call walk (program.cpp) checks most: a view's sizes, a matmul's sizes, strides and
// factors, a transpose's dims.  torch's Python getter builds a Python object per read
// (a tuple and its ints): on tiny GPT-2 its 141 reads were a third of the walk's time,
// with the getters' code cold after the forward.
//
// Each field is named below by node type and member; a release whose node lacks the
// member, or keeps it in another C++ type, leaves it to the getter (the detection below
// compiles either way).  program.cpp uses a field only after its value matched the
// getter's on the recorded node, and falls back to the getter for symbolic sizes.

#include "checks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include <cstring>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

namespace gen = torch::autograd::generated;
using gradfx_native::FieldRead;
using gradfx_native::FieldValue;
using torch::autograd::Node;

namespace {

bool load(const std::vector<c10::SymInt>& xs, FieldValue* out) {
  for (const c10::SymInt& x : xs) {
    if (x.is_heap_allocated()) {
      return false;  // symbolic: the getter's SymInt decides
    }
  }
  out->ints = &xs;
  return true;
}

bool load(int64_t x, FieldValue* out) {
  out->ints = nullptr;
  out->number = x;
  return true;
}

bool load(const at::Scalar& x, FieldValue* out) {
  if (x.isSymbolic() || x.type() != at::ScalarType::Long) {
    return false;  // the getter gives a float, bool or complex, or a SymInt
  }
  return load(x.toLong(), out);
}

template <class V>
bool load(const V& /*other*/, FieldValue* /*out*/) {
  return false;  // another C++ type in this release: the getter reads it
}

template <class T, class Get>
bool read(const Node* node, FieldValue* out) {
  return load(Get{}(static_cast<const T*>(node)), out);
}

struct Entry {
  std::type_index type;
  const char* name;
  FieldRead read;
};

template <class T, class Get, class Has>
void add(std::vector<Entry>* table, const char* name) {
  if constexpr (Has::value) {
    table->push_back({std::type_index(typeid(T)), name, &read<T, Get>});
  }
}

#define GRADFX_FIELD_ACCESS(field)                                                                        \
  struct get_##field {                                                                                    \
    template <class T>                                                                                    \
    const auto& operator()(const T* node) const {                                                         \
      return node->field;                                                                                 \
    }                                                                                                     \
  };                                                                                                      \
  template <class T, class = void>                                                                        \
  struct has_##field : std::false_type {};                                                                \
  template <class T>                                                                                      \
  struct has_##field<T, std::void_t<decltype(std::declval<const T&>().field)>> : std::true_type {};

GRADFX_FIELD_ACCESS(self_sym_sizes)
GRADFX_FIELD_ACCESS(self_sym_strides)
GRADFX_FIELD_ACCESS(mat1_sym_sizes)
GRADFX_FIELD_ACCESS(mat1_sym_strides)
GRADFX_FIELD_ACCESS(mat2_sym_sizes)
GRADFX_FIELD_ACCESS(mat2_sym_strides)
GRADFX_FIELD_ACCESS(alpha)
GRADFX_FIELD_ACCESS(beta)
GRADFX_FIELD_ACCESS(dim)
GRADFX_FIELD_ACCESS(dim0)
GRADFX_FIELD_ACCESS(dim1)
GRADFX_FIELD_ACCESS(normalized_shape)
#undef GRADFX_FIELD_ACCESS

#define GRADFX_FIELD(Type, field) \
  add<gen::Type, get_##field, has_##field<gen::Type>>(&table, "_saved_" #field)

const std::vector<Entry>& fields() {
  static const std::vector<Entry> table = [] {
    std::vector<Entry> table;
    GRADFX_FIELD(ViewBackward0, self_sym_sizes);
    GRADFX_FIELD(UnsafeViewBackward0, self_sym_sizes);
    GRADFX_FIELD(ReshapeAliasBackward0, self_sym_sizes);
    GRADFX_FIELD(ExpandBackward0, self_sym_sizes);
    GRADFX_FIELD(AddmmBackward0, alpha);
    GRADFX_FIELD(AddmmBackward0, beta);
    GRADFX_FIELD(AddmmBackward0, mat1_sym_sizes);
    GRADFX_FIELD(AddmmBackward0, mat1_sym_strides);
    GRADFX_FIELD(AddmmBackward0, mat2_sym_sizes);
    GRADFX_FIELD(AddmmBackward0, mat2_sym_strides);
    GRADFX_FIELD(MmBackward0, self_sym_sizes);
    GRADFX_FIELD(MmBackward0, self_sym_strides);
    GRADFX_FIELD(MmBackward0, mat2_sym_sizes);
    GRADFX_FIELD(MmBackward0, mat2_sym_strides);
    GRADFX_FIELD(AddBackward0, alpha);
    GRADFX_FIELD(SubBackward0, alpha);
    GRADFX_FIELD(TransposeBackward0, dim0);
    GRADFX_FIELD(TransposeBackward0, dim1);
    GRADFX_FIELD(CatBackward0, dim);
    GRADFX_FIELD(SplitBackward0, dim);
    GRADFX_FIELD(SplitBackward0, self_sym_sizes);
    GRADFX_FIELD(LogSoftmaxBackward0, dim);
    GRADFX_FIELD(SoftmaxBackward0, dim);
    GRADFX_FIELD(UnsqueezeBackward0, dim);
    GRADFX_FIELD(NativeLayerNormBackward0, normalized_shape);
    return table;
  }();
  return table;
}

#undef GRADFX_FIELD

}  // namespace

FieldRead gradfx_native::field_reader(const Node& node, const char* name) {
  const std::type_index type(typeid(node));
  for (const Entry& entry : fields()) {
    if (entry.type == type && std::strcmp(entry.name, name) == 0) {
      return entry.read;
    }
  }
  return nullptr;
}

PyObject* gradfx_native::field_object(const FieldValue& value) {
  if (value.ints == nullptr) {
    return PyLong_FromLongLong(value.number);
  }
  const auto& xs = *value.ints;
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(xs.size()));
  for (size_t k = 0; tuple != nullptr && k < xs.size(); ++k) {
    PyObject* x = PyLong_FromLongLong(xs[k].as_int_unchecked());
    if (x == nullptr) {
      Py_CLEAR(tuple);
    } else {
      PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(k), x);
    }
  }
  return tuple;
}
