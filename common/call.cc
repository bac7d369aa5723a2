#include "common/call.h"

namespace cache_dit_opd {

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kBool: return 1;
    case DType::kUnspecified: return 0;
  }
  return 0;
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kUnspecified: return "unspecified";
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3FN: return "float8_e4m3fn";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
    case DType::kBool: return "bool";
    case DType::kFloat8E5M2: return "float8_e5m2";
  }
  return "dtype(" + std::to_string(static_cast<int32_t>(dtype)) + ")";
}

}  // namespace cache_dit_opd
