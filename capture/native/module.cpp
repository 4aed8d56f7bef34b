// gradfx's compiled part, one extension: hidden.cpp (hidden state of builtin nodes), and
// for the cache-hit walker walk.cpp (metadata, tensor and leaf reads), structure.cpp
// (roots, edges, sequence order), saved.cpp (saved tensors read and released) and
// program.cpp (a whole walk of builtin nodes and leaves in one call); for the eager
// backend's graphs accumulate.cpp (AccumulateGrad); for graphs that run a node's C++
// post-hooks (DistributedDataParallel's reducer) post_hooks.cpp; for the bucketed graphs
// of DDP's Python reducer buckets.cpp (Buckets.ready) and ring_copy.cpp (the copies of a
// bucket laid out for gloo's ring); for graphs that call user code
// torch_function.cpp (aten ops without __torch_function__, user code with its state).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void add_hidden(py::module_& m);
void add_walk(py::module_& m);
void add_structure(py::module_& m);
void add_saved(py::module_& m);
void add_program(py::module_& m);
void add_accumulate(py::module_& m);
void add_post_hooks(py::module_& m);
void add_buckets(py::module_& m);
void add_ring_copy(py::module_& m);
void add_torch_function(py::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradfx's compiled part (capture/native)";
  add_hidden(m);
  add_walk(m);
  add_structure(m);
  add_saved(m);
  add_program(m);
  add_accumulate(m);
  add_post_hooks(m);
  add_buckets(m);
  add_ring_copy(m);
  add_torch_function(m);
}
