#include "common/call.h"

namespace cache_dit_opd {

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto) \
  case DType::e: return bytes;
    CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
    case DType::kUnspecified: return 0;
  }
  return 0;
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto) \
  case DType::e: return name;
    CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
    case DType::kUnspecified: return "unspecified";
  }
  return "dtype(" + std::to_string(static_cast<int32_t>(dtype)) + ")";
}

const char* CallTransportName(CallTransport transport) {
  return transport == CallTransport::kRing ? "ring" : "grpc";
}

}  // namespace cache_dit_opd
