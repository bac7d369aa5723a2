// opd_schemas_py: prints python/cache_dit_opd/_schemas.py, the Python
// client's copy of the op table (kernels/ops.def), expanded by the
// preprocessor like kernels/torch_bindings.cpp expands it.
//
//   build/kernels/opd_schemas_py > python/cache_dit_opd/_schemas.py
//
// Needs neither torch nor CUDA (only the table's strings are used).
#include <cstdio>

#include "kernels/ops.def"

namespace {

void Op(const char* name, const char* overload, const char* schema) {
  std::printf("        \"%s%s\": \"%s\",\n", name, overload, schema);
}

}  // namespace

int main() {
  std::printf(
      "\"\"\"The op schemas of namespace cache_dit_cuda_ops, by family: GENERATED, do not edit.\n"
      "\n"
      "Written by kernels/tools/schemas_py.cc from kernels/ops.def (the one table of schemas);\n"
      "tests/python/test_client_schemas.py checks that this file is fresh and that it equals what the\n"
      "kernel library registers. Keys are \"name\" or \"name.overload\"; values follow the name.\n"
      "\"\"\"\n\n"
      "NAMESPACE = \"cache_dit_cuda_ops\"\n\n"
      "SCHEMAS = {\n");
#define CACHE_DIT_PY_OP(name, overload, schema, entry) Op(#name, overload, schema);
#define CACHE_DIT_PY_FAMILY(family, list) \
  std::printf("    \"%s\": {\n", #family); \
  list(CACHE_DIT_PY_OP) std::printf("    },\n");
  CACHE_DIT_OP_FAMILIES(CACHE_DIT_PY_FAMILY)
  std::printf("}\n");
  return 0;
}
