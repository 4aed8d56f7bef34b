// How the compiled part's sources add their C functions to the module: plain CPython
// functions (METH_FASTCALL: no pybind11 argument conversion on the cache-hit path), each
// a module attribute.
#pragma once

#include <pybind11/pybind11.h>

#include <initializer_list>

// A METH_FASTCALL function as PyMethodDef's ml_meth holds it.
#define GRADFX_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&f))

namespace gradfx_native {

inline void add_functions(pybind11::module_& m, std::initializer_list<PyMethodDef*> defs) {
  for (PyMethodDef* def : defs) {
    m.attr(def->ml_name) = pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(def, nullptr));
  }
}

}  // namespace gradfx_native
