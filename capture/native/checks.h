// Checks shared by the compiled part's sources.
//
// Each check has two forms: one that takes the expected values as the Python tuple the
// walker's generated lines hold (parsed per call), and one that takes them parsed once
// into the plain structs below, for the one-call walk (program.cpp), whose plan is read
// on every backward right after a forward has pushed it out of the caches: a few
// contiguous arrays are a few cache lines, where the tuples were thousands of objects.
#pragma once

#include <Python.h>
#include <c10/core/Device.h>
#include <c10/core/Layout.h>
#include <c10/core/ScalarType.h>
#include <c10/core/SymInt.h>
#include <torch/csrc/autograd/edge.h>

#include <cstdint>
#include <vector>

namespace gradfx_native {

using NodePtr = decltype(torch::autograd::Edge::function);  // shared_ptr or intrusive_ptr by release

// emit_tensor's tuple (type, ndim, dtype, layout, device, contiguous), parsed.
struct TensorSpec {
  PyObject* type = nullptr;  // borrowed: the plan's tuple keeps it
  int64_t ndim = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Layout layout = c10::kStrided;
  c10::Device device{c10::kCPU};
  bool contiguous = false;
};

// emit_metas' entry per input (ndim, dtype, device), parsed.
struct MetaSpec {
  int64_t ndim = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device{c10::kCPU};
};

// AccumulateKind's leaf expectation (emit_tensor's tuple, requires_grad, grad_dtype or None).
struct LeafSpec {
  TensorSpec tensor;
  bool requires_grad = false;
  bool has_grad_dtype = false;
  c10::ScalarType grad_dtype = c10::ScalarType::Undefined;
};

// One saved variable of a builtin node: its byte offset in the node, and the index of its
// TensorSpec (-1: the variable was saved undefined).
struct SavedSpec {
  int64_t offset = 0;
  int32_t tensor = -1;
};

// Parsers: false where the tuple is not of the form the walker emits.
bool parse_tensor(PyObject* expected, TensorSpec* out);
bool parse_metas(PyObject* expected, std::vector<MetaSpec>* out);
bool parse_leaf(PyObject* expected, LeafSpec* out);

// The checks.  Sizes (and strides) are appended to ``sizes`` as the Python lines append
// them.  False / None where the Python lines would bail, or where not sure they would not.
bool tensor(PyObject* obj, const TensorSpec& spec, std::vector<int64_t>* sizes);
bool metas(torch::autograd::Node* node, const MetaSpec* specs, size_t count, std::vector<int64_t>* sizes);
// The leaf (a new reference), None (not the cached leaf), or nullptr with an error set.
PyObject* leaf(torch::autograd::Node* node, const LeafSpec& spec, std::vector<int64_t>* sizes);
// The defined saved tensors as a tuple (a new reference), None, or nullptr with an error set.
PyObject* saved(const NodePtr& node, const SavedSpec* specs, size_t count, const TensorSpec* tensors,
                std::vector<int64_t>* sizes);

// A HeldByNode (saved.cpp) of ``node``: its variables at ``offsets`` left to it; a new reference.
PyObject* held(const NodePtr& node, PyObject* offsets, PyObject* mask);

// The node behind a grad_fn object (a builtin node's, or a custom Function's ctx), or
// nullptr for any other object (walk.cpp).
torch::autograd::Node* node_of(PyObject* object);

// How many of the node's post-hooks are C++ hooks, not a Python hook's wrapper (post_hooks.cpp).
long cpp_post_hook_count(torch::autograd::Node* node);

// Sizes gathered in C++ appended to a Python list; false (an error set) if that fails.
bool extend(PyObject* list, const std::vector<int64_t>& sizes);

// The structure check (structure.cpp): its plan parsed once (with ``nodes``, the recorded
// walk's node objects, it also holds each node's C++ type), then per backward the nodes
// in discovery order into ``nodes``: 1 where they are the plan's, 0 where not, -1 on an
// error.  ``by_type``: check each node's C++ type against the plan's (no Python object is
// made; a custom Function's node is a PyNode of any class, its class left to the caller);
// else the Python lines' check of each node object's type is left to the caller.
struct Structure;
Structure* parse_structure(PyObject* plan, PyObject* nodes);  // nullptr with an error set where malformed
void free_structure(Structure* plan);
int structure(PyObject* tensors, const Structure& plan, bool by_type, std::vector<NodePtr>* nodes);
// The sequence numbers of ``nodes`` as a list, or nullptr.
PyObject* sequence_numbers(const std::vector<NodePtr>& nodes);
// The plan's Python type of node ``i``.
PyObject* type_of(const Structure& plan, size_t i);

// A saved value read from its C++ field (fields.cpp): a list of plain sizes, or one int.
struct FieldValue {
  const std::vector<c10::SymInt>* ints = nullptr;  // the node's own vector; none: ``number``
  int64_t number = 0;
};
// false where the getter must read it (a symbolic size, another kind of scalar).
using FieldRead = bool (*)(const torch::autograd::Node* node, FieldValue* out);
// The reader of saved value ``name`` ("_saved_self_sym_sizes") of nodes of ``node``'s C++
// type, or nullptr where fields.cpp names no such field.
FieldRead field_reader(const torch::autograd::Node& node, const char* name);
// The Python object torch's getter gives for ``value``: a tuple of ints, or an int.
PyObject* field_object(const FieldValue& value);

}  // namespace gradfx_native
