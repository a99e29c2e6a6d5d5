#pragma once

// Each source binds its functions into the module (module.cpp)

#include <torch/extension.h>

void bind_ops(pybind11::module_& m);
void bind_decode(pybind11::module_& m);
void bind_chunk(pybind11::module_& m);
void bind_index(pybind11::module_& m);
void bind_write(pybind11::module_& m);
