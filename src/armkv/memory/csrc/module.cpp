// The Python module: every source's functions (bindings.h)

#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_ops(m);
  bind_write(m);
  bind_decode(m);
  bind_chunk(m);
  bind_index(m);
}
