#include "tests/cpp/client/support/op_cases.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace cache_dit_opd::testing {
namespace {

void Put16(HostTensor& t, int64_t i, uint16_t v) { std::memcpy(t.storage.data() + 2 * i, &v, 2); }
void Put32(HostTensor& t, int64_t i, float v) { std::memcpy(t.storage.data() + 4 * i, &v, 4); }

float Draw(std::mt19937_64& rng, float scale) {
  // Mostly normal values; 2% zeros, 2% large magnitudes.
  std::uniform_int_distribution<int> pick(0, 99);
  std::normal_distribution<float> normal(0.0f, scale);
  const int p = pick(rng);
  if (p < 2) return 0.0f;
  if (p < 4) return normal(rng) * 1000.0f;
  return normal(rng);
}

// A finite e4m3fn code (0x7F and 0xFF are NaN).
uint8_t FiniteE4m3(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  uint8_t b;
  do {
    b = static_cast<uint8_t>(byte(rng));
  } while ((b & 0x7F) == 0x7F);
  return b;
}

}  // namespace

uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t b) {
  uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7E00);
  float a = std::fabs(f);
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to inf
  if (a < 6.103515625e-05f) {
    // Subnormal: value = m * 2^-24.
    const float m = std::nearbyint(a * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(m));
  }
  uint32_t ax;
  std::memcpy(&ax, &a, 4);
  uint32_t exp = ((ax >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = ax & 0x7FFFFF;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

Status OutputsFor(const std::string& op, const std::vector<HostTensor>& in, std::vector<HostTensor>* out) {
  out->clear();
  auto need = [&](size_t n) -> Status {
    if (in.size() != n) return Status::InvalidArgument(op, ": ", in.size(), " inputs, expected ", n);
    return Status::Ok();
  };
  if (op == kMerge) {
    OPD_RETURN_IF_ERROR(need(4));
    out->push_back(HostTensor::Contiguous(in[2].dtype, in[2].sizes));
    out->push_back(HostTensor::Contiguous(in[3].dtype, in[3].sizes));
  } else if (op == kQuant || op == kDequant) {
    OPD_RETURN_IF_ERROR(need(1));
    if (in[0].sizes.empty()) return Status::InvalidArgument(op, ": scalar input");
    auto s = in[0].sizes;
    s.back() += op == kQuant ? 2 : -2;
    out->push_back(HostTensor::Contiguous(op == kQuant ? DType::kFloat8E4M3FN : DType::kBFloat16, s));
  } else if (op == kQkvQuant) {
    OPD_RETURN_IF_ERROR(need(1));
    const auto& s = in[0].sizes;  // [B, S, P, N, D]
    if (s.size() != 5) return Status::InvalidArgument(op, ": input rank ", s.size());
    out->push_back(HostTensor::Contiguous(DType::kFloat8E4M3FN, {s[2], s[1], s[0], s[3], s[4] + 4}));
  } else if (op == kQkvDequant) {
    OPD_RETURN_IF_ERROR(need(1));
    const auto& s = in[0].sizes;  // [S, B, N, D + 4]
    if (s.size() != 4) return Status::InvalidArgument(op, ": input rank ", s.size());
    out->push_back(HostTensor::Contiguous(DType::kBFloat16, {s[1], s[0], s[2], s[3] - 4}));
  } else {
    return Status::InvalidArgument("unknown op ", op);
  }
  return Status::Ok();
}

HostTensor RandomBf16(std::mt19937_64& rng, std::vector<int64_t> sizes, float scale) {
  HostTensor t = HostTensor::Contiguous(DType::kBFloat16, std::move(sizes));
  for (int64_t i = 0; i < t.numel(); ++i) Put16(t, i, FloatToBf16(Draw(rng, scale)));
  return t;
}

HostTensor RandomFloat(std::mt19937_64& rng, DType dtype, std::vector<int64_t> sizes, float scale) {
  HostTensor t = HostTensor::Contiguous(dtype, std::move(sizes));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = Draw(rng, scale);
    if (dtype == DType::kFloat32) Put32(t, i, v);
    else if (dtype == DType::kBFloat16) Put16(t, i, FloatToBf16(v));
    else Put16(t, i, FloatToHalf(v));
  }
  return t;
}

HostTensor RandomPerTokenRecords(std::mt19937_64& rng, std::vector<int64_t> sizes) {
  HostTensor t = HostTensor::Contiguous(DType::kFloat8E4M3FN, std::move(sizes));
  const int64_t row = t.sizes.back();
  std::uniform_real_distribution<float> scale(1e-4f, 2.0f);
  for (int64_t r = 0; r < t.numel() / row; ++r) {
    uint8_t* p = t.storage.data() + r * row;
    for (int64_t i = 0; i < row - 2; ++i) p[i] = FiniteE4m3(rng);
    const uint16_t s = FloatToBf16(scale(rng));
    std::memcpy(p + row - 2, &s, 2);  // little-endian bf16 at bytes D..D+1
  }
  return t;
}

HostTensor RandomQkvRecords(std::mt19937_64& rng, std::vector<int64_t> sizes) {
  HostTensor t = HostTensor::Contiguous(DType::kFloat8E4M3FN, std::move(sizes));
  const int64_t row = t.sizes.back();
  std::uniform_real_distribution<float> scale(1e-6f, 2.0f);
  for (int64_t r = 0; r < t.numel() / row; ++r) {
    uint8_t* p = t.storage.data() + r * row;
    for (int64_t i = 0; i < row - 4; ++i) p[i] = FiniteE4m3(rng);
    const float s = scale(rng);
    std::memcpy(p + row - 4, &s, 4);  // fp32 scale at bytes D..D+3
  }
  return t;
}

HostTensor RandomLse(std::mt19937_64& rng, DType dtype, std::vector<int64_t> sizes, float offset,
                     bool with_specials, bool with_nan) {
  HostTensor t = HostTensor::Contiguous(dtype, std::move(sizes));
  std::uniform_int_distribution<int> pick(0, 99);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < t.numel(); ++i) {
    float v = normal(rng) + offset;
    if (with_specials) {
      const int p = pick(rng);
      if (p < 8) v = -inf;          // empty side
      else if (p < 12) v = inf;     // treated as empty
      else if (p < 16) v = offset + 120.0f;  // a gap of 100+ to the other side
      else if (with_nan && p < 18) v = std::numeric_limits<float>::quiet_NaN();
    }
    if (dtype == DType::kFloat32) Put32(t, i, v);
    else if (dtype == DType::kBFloat16) Put16(t, i, FloatToBf16(v));
    else Put16(t, i, FloatToHalf(v));
  }
  return t;
}

HostTensor AsHeadMajorLse(const HostTensor& lse) {
  // lse: contiguous [B, S, H, 1] -> storage [B, H, S], view strides [H*S, 1, S, 1].
  const int64_t B = lse.sizes[0], S = lse.sizes[1], H = lse.sizes[2];
  const int64_t item = lse.itemsize();
  HostTensor t;
  t.dtype = lse.dtype;
  t.sizes = lse.sizes;
  t.strides = {H * S, 1, S, 1};
  t.storage.assign(lse.storage.size(), 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(t.storage.data() + ((b * H + h) * S + s) * item,
                    lse.storage.data() + ((b * S + s) * H + h) * item, static_cast<size_t>(item));
  return t;
}

HostTensor AsBatchSeqTransposed(const HostTensor& x) {
  // x: contiguous [B, S, P, N, D] -> storage [S, B, P, N, D], view strides
  // [P*N*D, B*P*N*D, N*D, D, 1].
  const int64_t B = x.sizes[0], S = x.sizes[1], P = x.sizes[2], N = x.sizes[3], D = x.sizes[4];
  const int64_t item = x.itemsize();
  const int64_t block = P * N * D;
  HostTensor t;
  t.dtype = x.dtype;
  t.sizes = x.sizes;
  t.strides = {block, B * block, N * D, D, 1};
  t.storage.assign(x.storage.size(), 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(t.storage.data() + (s * B + b) * block * item, x.storage.data() + (b * S + s) * block * item,
                  static_cast<size_t>(block * item));
  return t;
}

Status BenchInputs(const std::string& op, const std::vector<int64_t>& shape, uint64_t seed,
                   std::vector<HostTensor>* inputs) {
  std::mt19937_64 rng(seed);
  inputs->clear();
  if (shape.empty()) return Status::InvalidArgument("empty shape");
  if (op == kQuant) {
    inputs->push_back(RandomBf16(rng, shape));
  } else if (op == kDequant) {
    inputs->push_back(RandomPerTokenRecords(rng, shape));
  } else if (op == kQkvQuant) {
    if (shape.size() != 5) return Status::InvalidArgument(op, " takes [B, S, P, N, D]");
    inputs->push_back(RandomBf16(rng, shape));
  } else if (op == kQkvDequant) {
    if (shape.size() != 4) return Status::InvalidArgument(op, " takes [S, B, N, D + 4]");
    inputs->push_back(RandomQkvRecords(rng, shape));
  } else if (op == kMerge) {
    if (shape.size() != 4) return Status::InvalidArgument(op, " takes [B, S, H, D]");
    std::vector<int64_t> lse_shape = {shape[0], shape[1], shape[2], 1};
    inputs->push_back(RandomBf16(rng, shape));
    inputs->push_back(RandomLse(rng, DType::kFloat32, lse_shape, 0.0f, false, false));
    inputs->push_back(RandomBf16(rng, shape));
    inputs->push_back(RandomLse(rng, DType::kFloat32, lse_shape, 0.5f, false, false));
  } else {
    return Status::InvalidArgument("unknown op ", op);
  }
  return Status::Ok();
}

}  // namespace cache_dit_opd::testing
