// The TORCH_LIBRARY registration of namespace cache_dit_cuda_ops, expanded
// from the one op table (kernels/ops.def): a def per op overload, its CUDA
// kernel, its Meta kernel (which runs the same checks as the CUDA launcher)
// and a CPU kernel that runs those checks to name the misplaced tensor. Families are compiled in by the build (CACHE_DIT_WITH_<FAMILY>).
//
// The namespace comes from the build (CACHE_DIT_OPS_NAMESPACE) so the schema
// strings never repeat it.
#include <torch/library.h>

#include <utility>

#include "kernels/ops.def"
#include "kernels/ops.h"

#ifndef CACHE_DIT_OPS_NAMESPACE
#error "CACHE_DIT_OPS_NAMESPACE must be defined by the build"
#endif

// CPU: the Meta kernel's checks, so that a CPU tensor gets a ValueError that
// names it (there is no CPU implementation; without this kernel the
// dispatcher's own error names no argument).
template <auto Meta>
struct RejectCpu;
template <typename R, typename... A, R (*Meta)(A...)>
struct RejectCpu<Meta> {
  static R call(A... args) {
    Meta(std::forward<A>(args)...);
    C10_THROW_ERROR(ValueError, "this op runs on CUDA tensors only (it has no CPU kernel)");
  }
};

#define CACHE_DIT_LIBRARY_EXPAND(ns, m) TORCH_LIBRARY(ns, m)
#define CACHE_DIT_LIBRARY_IMPL_EXPAND(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

#define CACHE_DIT_DEF(name, overload, schema, entry) m.def(#name overload schema);
#define CACHE_DIT_CUDA(name, overload, schema, entry) m.impl(#name overload, &entry);
#define CACHE_DIT_META(name, overload, schema, entry) m.impl(#name overload, &entry##_meta);
#define CACHE_DIT_CPU(name, overload, schema, entry) m.impl(#name overload, &RejectCpu<&entry##_meta>::call);

CACHE_DIT_LIBRARY_EXPAND(CACHE_DIT_OPS_NAMESPACE, m) {
#ifdef CACHE_DIT_WITH_ATTN
  CACHE_DIT_OPS_ATTN(CACHE_DIT_DEF)
#endif
#ifdef CACHE_DIT_WITH_COMM
  CACHE_DIT_OPS_COMM(CACHE_DIT_DEF)
#endif
#ifdef CACHE_DIT_WITH_SVDQ
  CACHE_DIT_OPS_SVDQ(CACHE_DIT_DEF)
#endif
}

CACHE_DIT_LIBRARY_IMPL_EXPAND(CACHE_DIT_OPS_NAMESPACE, CUDA, m) {
#ifdef CACHE_DIT_WITH_ATTN
  CACHE_DIT_OPS_ATTN(CACHE_DIT_CUDA)
#endif
#ifdef CACHE_DIT_WITH_COMM
  CACHE_DIT_OPS_COMM(CACHE_DIT_CUDA)
#endif
#ifdef CACHE_DIT_WITH_SVDQ
  CACHE_DIT_OPS_SVDQ(CACHE_DIT_CUDA)
#endif
}

CACHE_DIT_LIBRARY_IMPL_EXPAND(CACHE_DIT_OPS_NAMESPACE, Meta, m) {
#ifdef CACHE_DIT_WITH_ATTN
  CACHE_DIT_OPS_ATTN(CACHE_DIT_META)
#endif
#ifdef CACHE_DIT_WITH_COMM
  CACHE_DIT_OPS_COMM(CACHE_DIT_META)
#endif
#ifdef CACHE_DIT_WITH_SVDQ
  CACHE_DIT_OPS_SVDQ(CACHE_DIT_META)
#endif
}

CACHE_DIT_LIBRARY_IMPL_EXPAND(CACHE_DIT_OPS_NAMESPACE, CPU, m) {
#ifdef CACHE_DIT_WITH_ATTN
  CACHE_DIT_OPS_ATTN(CACHE_DIT_CPU)
#endif
#ifdef CACHE_DIT_WITH_COMM
  CACHE_DIT_OPS_COMM(CACHE_DIT_CPU)
#endif
#ifdef CACHE_DIT_WITH_SVDQ
  CACHE_DIT_OPS_SVDQ(CACHE_DIT_CPU)
#endif
}
