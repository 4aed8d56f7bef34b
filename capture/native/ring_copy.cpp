// The copies between a bucket laid out for gloo's ring and its members' gradients
// (capture/runtime/ddp_buckets.py, Buckets._filled and Buckets.finish, the reference and
// the fallback), done in one pass over the memory without a tensor object per piece.
//
// The layout (capture/runtime/gloo_ring.py): the bucket is a ``[ring, row]`` buffer and a
// member ``(column, numel, dtype, width)`` has its chunk ``r`` (elements ``r * width`` on,
// at most ``width`` of them) in row ``r`` from ``column``.  In Python that is a slice, a
// view and a copy per piece: about 30 us of objects for tiny GPT-2's 28 members, per side.
//
// Only float and double gradients that are plain contiguous CPU tensors of the planned
// size are copied here; for anything else the functions answer False before writing, and
// the reference does it.  Dividing: ``a / size`` in the gradient's own type, correctly
// rounded, as the hook's ``grad / size`` computes each element on the CPU.

#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "methods.h"

namespace py = pybind11;

namespace {

// Elements of a bucket above which, where ATen has threads, the reference copies it.  With
// one thread this pass was the faster at every size measured (6.5 million elements too);
// with two, ATen's parallel copies read a 6.5-million-element bucket back faster (0.60
// against 0.77 ms).  The bound is an estimate for more cores, not measured past two: where
// the reference's cost per piece (about 0.1 ms a bucket) is what one thread's copy of the
// bucket costs at 16 threads' bandwidth.
constexpr int64_t kAlone = int64_t(1) << 18;

struct Member {
  int64_t column, numel, width;
};

struct Piece {
  const Member* member;
  char* grad;  // nullptr: nothing written for the member (its cells take zeros), or it is empty
};

// The plan's members, or false (with no error set) where one is not of the expected form.
bool read_members(PyObject* members, std::vector<Member>* out) {
  if (!PyTuple_Check(members)) {
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(members);
  out->reserve(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* m = PyTuple_GET_ITEM(members, k);
    if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 4) {
      return false;
    }
    Member member{PyLong_AsLongLong(PyTuple_GET_ITEM(m, 0)), PyLong_AsLongLong(PyTuple_GET_ITEM(m, 1)),
                  PyLong_AsLongLong(PyTuple_GET_ITEM(m, 3))};
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    out->push_back(member);
  }
  return true;
}

// Is ``obj`` a plain contiguous CPU tensor of ``dtype`` (float or double) and ``numel``
// elements?  Then ``*data`` is its first element (nullptr where it has none).
bool plain(PyObject* obj, c10::ScalarType dtype, int64_t numel, char** data) {
  if (!THPVariable_CheckExact(obj)) {  // a plain Tensor: Buckets.ready took no other gradient
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || !t.device().is_cpu() || t.scalar_type() != dtype ||
      t.numel() != numel || !t.is_contiguous() || t.is_neg() || t.is_conj() || t.requires_grad()) {
    return false;
  }
  *data = static_cast<char*>(t.data_ptr());
  return true;
}

// A call's bucket: the buffer's first element and the pieces to copy.
struct Bucket {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t row = 0, ring = 0;
  char* flat = nullptr;
  std::vector<Member> members;
  std::vector<Piece> pieces;  // each points into ``members``
};

// (flat, members, ring, written, ...): the call's bucket, or false where the
// reference must do it.  ``missing_too``: members nothing was written for are pieces too
// (their cells zeroed).
bool parse(PyObject* const* args, Py_ssize_t nargs, int nfixed, bool missing_too, Bucket* b) {
  if (nargs != nfixed || !THPVariable_Check(args[0]) || !PyList_Check(args[3])) {
    return false;
  }
  const at::Tensor& buffer = THPVariable_Unpack(args[0]);
  b->dtype = buffer.scalar_type();
  if (b->dtype != c10::kFloat && b->dtype != c10::kDouble) {
    return false;
  }
  b->ring = PyLong_AsLongLong(args[2]);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (b->ring <= 0 || buffer.numel() % b->ring != 0 || !read_members(args[1], &b->members)) {
    return false;
  }
  if (buffer.numel() > kAlone && at::get_num_threads() > 1) {
    return false;  // ATen's copies, in parallel, beat one thread here
  }
  b->row = buffer.numel() / b->ring;
  if (!plain(args[0], b->dtype, buffer.numel(), &b->flat)) {
    return false;
  }
  for (const Member& m : b->members) {  // every cell inside the buffer, as the layout promises
    if (m.column < 0 || m.width < 0 || m.numel < 0 || m.column + m.width > b->row || m.numel > b->ring * m.width) {
      return false;
    }
  }
  std::vector<char> seen(b->members.size(), 0);
  PyObject* written = args[3];
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(written); ++k) {
    PyObject* pair = PyList_GET_ITEM(written, k);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
      return false;
    }
    const long long index = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    if (index < 0 || index >= static_cast<long long>(b->members.size()) || seen[index]) {
      return false;
    }
    seen[index] = 1;
    const Member* m = &b->members[index];
    char* data = nullptr;
    if (!plain(PyTuple_GET_ITEM(pair, 0), b->dtype, m->numel, &data)) {
      return false;
    }
    b->pieces.push_back({m, data});
  }
  if (missing_too) {
    for (size_t k = 0; k < b->members.size(); ++k) {
      if (!seen[k]) {
        b->pieces.push_back({&b->members[k], nullptr});
      }
    }
  }
  return true;
}

// The cells of ``pieces``, one member's in one row each: ``f(to, from, written, width,
// grad)``, ``written`` elements of ``grad`` from ``from`` for the ``width`` at ``to``.
template <typename F>
void each_cell(const std::vector<Piece>& pieces, int64_t row, int64_t ring, F f) {
  for (const Piece& piece : pieces) {
    const Member& m = *piece.member;
    for (int64_t r = 0; r < ring; ++r) {
      const int64_t written = piece.grad ? std::clamp<int64_t>(m.numel - r * m.width, 0, m.width) : 0;
      f(r * row + m.column, r * m.width, written, m.width, piece.grad);
    }
  }
}

// cell[i] = from[i] / divisor.  Where the divisor is a power of two, times its inverse:
// the same real number, so the same rounding, and a loop the compiler makes vector code of
// (a division per element would take longer than the copy).
template <typename T>
__attribute__((optimize("tree-vectorize"))) void divide(T* __restrict cell, const T* __restrict from, int64_t n,
                                                        T divisor) {
  int exponent = 0;
  if (std::frexp(divisor, &exponent) == T(0.5)) {
    const T inverse = std::ldexp(T(1), 1 - exponent);
    for (int64_t i = 0; i < n; ++i) {
      cell[i] = from[i] * inverse;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    cell[i] = from[i] / divisor;
  }
}

template <typename T>
void fill(T* flat, int64_t row, int64_t ring, const std::vector<Member>& members, const std::vector<Piece>& pieces,
          T divisor) {
  each_cell(pieces, row, ring, [&](int64_t to, int64_t from, int64_t written, int64_t width, char* grad) {
    if (written > 0) {
      divide(flat + to, reinterpret_cast<const T*>(grad) + from, written, divisor);
    }
    std::fill(flat + to + written, flat + to + width, T(0));  // a gap, or a member with nothing to reduce
  });
  int64_t used = 0;  // each row's columns after the last member's
  for (const Member& m : members) {
    used = std::max(used, m.column + m.width);
  }
  for (int64_t r = 0; r < ring; ++r) {
    std::fill(flat + r * row + used, flat + (r + 1) * row, T(0));
  }
}

template <typename T>
void read(const T* flat, int64_t row, int64_t ring, const std::vector<Piece>& pieces) {
  each_cell(pieces, row, ring, [&](int64_t to, int64_t from, int64_t written, int64_t, char* grad) {
    if (written > 0) {
      std::memcpy(reinterpret_cast<T*>(grad) + from, flat + to, written * sizeof(T));
    }
  });
}

// ring_fill(flat, members, ring, written, size): every cell of the buffer written, each
// written member's gradient divided by ``size`` in its cells, zeros everywhere else.
PyObject* ring_fill(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  Bucket b;
  if (!parse(args, nargs, 5, true, &b)) {
    Py_RETURN_FALSE;
  }
  const long long size = PyLong_AsLongLong(args[4]);
  if (PyErr_Occurred() || size <= 0) {
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  if (b.dtype == c10::kFloat) {
    fill(reinterpret_cast<float*>(b.flat), b.row, b.ring, b.members, b.pieces, static_cast<float>(size));
  } else {
    fill(reinterpret_cast<double*>(b.flat), b.row, b.ring, b.members, b.pieces, static_cast<double>(size));
  }
  Py_RETURN_TRUE;
}

// ring_read(flat, members, ring, written): each written member's sums copied from its cells
// into its gradient.
PyObject* ring_read(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  Bucket b;
  if (!parse(args, nargs, 4, false, &b)) {
    Py_RETURN_FALSE;
  }
  if (b.dtype == c10::kFloat) {
    read(reinterpret_cast<const float*>(b.flat), b.row, b.ring, b.pieces);
  } else {
    read(reinterpret_cast<const double*>(b.flat), b.row, b.ring, b.pieces);
  }
  Py_RETURN_TRUE;
}

PyMethodDef fill_def = {"ring_fill", GRADFX_FASTCALL(ring_fill), METH_FASTCALL,
                        "a gloo-ring bucket's buffer filled from its members' gradients, divided"};
PyMethodDef read_def = {"ring_read", GRADFX_FASTCALL(ring_read), METH_FASTCALL,
                        "a gloo-ring bucket's sums copied into its members' gradients"};

}  // namespace

void add_ring_copy(py::module_& m) {
  gradfx_native::add_functions(m, {&fill_def, &read_def});
}
