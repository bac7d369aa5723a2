#include "common/ring_decode.h"

#include <cstring>
#include <ios>
#include <utility>

namespace cache_dit_opd {
namespace {

using v1::RingArgKind;

static_assert(v1::kSlotBytes % 8 == 0);
static_assert(kMaxArgs == 32 && kMaxTensorDims == 8 && kMaxListLength == 64,
              "ring layout v1 is sized from these limits (ring.h)");

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Fixed part of a tensor payload: region_id u64, byte_offset u64, dtype i32, pad i32.
constexpr size_t kTensorFixedBytes = 24;

const char* KindName(uint32_t kind) {
  switch (static_cast<RingArgKind>(kind)) {
    case RingArgKind::kNone: return "none";
    case RingArgKind::kTensor: return "tensor";
    case RingArgKind::kInt: return "int";
    case RingArgKind::kFloat: return "float";
    case RingArgKind::kBool: return "bool";
    case RingArgKind::kIntList: return "int_list";
    case RingArgKind::kFloatList: return "float_list";
    case RingArgKind::kBoolList: return "bool_list";
  }
  return "unknown";
}

// Payload bytes of an argument, once its count is known to be in range.
Status PayloadBytes(int index, uint32_t kind, uint32_t count, size_t* bytes) {
  switch (static_cast<RingArgKind>(kind)) {
    case RingArgKind::kNone:
      if (count != 0) return Status::Rejected(Reason::kMalformed, "argument ", index, ": none count ", count, " is not 0");
      *bytes = 0;
      return Status::Ok();
    case RingArgKind::kTensor:
      if (count > static_cast<uint32_t>(kMaxTensorDims)) {
        return Status::Rejected(Reason::kMalformed, "argument ", index, ": tensor ndim ", count, " exceeds ", kMaxTensorDims);
      }
      *bytes = kTensorFixedBytes + size_t{count} * 2 * sizeof(int64_t);
      return Status::Ok();
    case RingArgKind::kInt:
    case RingArgKind::kFloat:
    case RingArgKind::kBool:
      if (count != 1) {
        return Status::Rejected(Reason::kMalformed, "argument ", index, ": ", KindName(kind), " count ", count, " is not 1");
      }
      *bytes = 8;
      return Status::Ok();
    case RingArgKind::kIntList:
    case RingArgKind::kFloatList:
    case RingArgKind::kBoolList:
      if (count > static_cast<uint32_t>(kMaxListLength)) {
        return Status::Rejected(Reason::kMalformed, "argument ", index, ": ", KindName(kind), " of ", count,
                                       " values exceeds ", kMaxListLength);
      }
      *bytes = size_t{count} * 8;
      return Status::Ok();
  }
  return Status::Rejected(Reason::kMalformed, "argument ", index, ": unknown kind ", kind);
}

Status ReadBool(int index, int element, const uint8_t* p, bool* out) {
  const int64_t v = Load<int64_t>(p);
  if (v != 0 && v != 1) {
    if (element < 0) return Status::Rejected(Reason::kMalformed, "argument ", index, ": bool value ", v, " is not 0 or 1");
    return Status::Rejected(Reason::kMalformed, "argument ", index, ": bool_list value ", v, " at index ", element,
                                   " is not 0 or 1");
  }
  *out = v == 1;
  return Status::Ok();
}

// Decodes one argument whose payload [p, p + payload) lies inside the record.
Status DecodeArg(int index, uint32_t kind, uint32_t count, const uint8_t* p, Arg* out) {
  switch (static_cast<RingArgKind>(kind)) {
    case RingArgKind::kNone:
      *out = NoneArg{};
      return Status::Ok();
    case RingArgKind::kTensor: {
      TensorRef t;
      t.region_id = Load<uint64_t>(p);
      t.byte_offset = Load<uint64_t>(p + 8);
      const int32_t dtype = Load<int32_t>(p + 16);
      // p + 20: pad, ignored.
      if (!IsWireDType(dtype)) {
        return Status::Rejected(Reason::kMalformed, "argument ", index, ": dtype ", dtype, " is not a protocol v1 dtype");
      }
      t.dtype = static_cast<DType>(dtype);
      const uint8_t* sizes = p + kTensorFixedBytes;
      const uint8_t* strides = sizes + size_t{count} * sizeof(int64_t);
      t.sizes.resize(count);
      t.strides.resize(count);
      for (uint32_t d = 0; d < count; ++d) {
        t.sizes[d] = Load<int64_t>(sizes + d * sizeof(int64_t));
        t.strides[d] = Load<int64_t>(strides + d * sizeof(int64_t));
      }
      *out = std::move(t);
      return Status::Ok();
    }
    case RingArgKind::kInt:
      *out = Load<int64_t>(p);
      return Status::Ok();
    case RingArgKind::kFloat:
      *out = Load<double>(p);
      return Status::Ok();
    case RingArgKind::kBool: {
      bool b = false;
      OPD_RETURN_IF_ERROR(ReadBool(index, -1, p, &b));
      *out = b;
      return Status::Ok();
    }
    case RingArgKind::kIntList: {
      std::vector<int64_t> v(count);
      for (uint32_t i = 0; i < count; ++i) v[i] = Load<int64_t>(p + i * 8);
      *out = std::move(v);
      return Status::Ok();
    }
    case RingArgKind::kFloatList: {
      std::vector<double> v(count);
      for (uint32_t i = 0; i < count; ++i) v[i] = Load<double>(p + i * 8);
      *out = std::move(v);
      return Status::Ok();
    }
    case RingArgKind::kBoolList: {
      std::vector<bool> v(count);
      for (uint32_t i = 0; i < count; ++i) {
        bool b = false;
        OPD_RETURN_IF_ERROR(ReadBool(index, static_cast<int>(i), p + i * 8, &b));
        v[i] = b;
      }
      *out = std::move(v);
      return Status::Ok();
    }
  }
  return Status::Rejected(Reason::kMalformed, "argument ", index, ": unknown kind ", kind);
}

Status Decode(const uint8_t* bytes, size_t n, const std::vector<OpInfo>& catalog, CallRequest* out,
              RecordIds* ids) {
  constexpr size_t kHeader = sizeof(v1::RecordHeader);
  if (bytes == nullptr || n < kHeader) {
    return Status::Rejected(Reason::kMalformed, "record is ", bytes == nullptr ? 0 : n, " bytes, shorter than its ", kHeader,
                                   "-byte header");
  }
  const v1::RecordHeader h = Load<v1::RecordHeader>(bytes);  // read once
  ids->ticket = h.ticket;
  ids->lane = h.lane;
  ids->seq = h.seq;
  if (h.magic != v1::kRecordMagic) {
    return Status::Rejected(Reason::kMalformed, "record magic 0x", std::hex, h.magic, " is not 0x", v1::kRecordMagic);
  }
  ids->header_usable = true;
  if (h.record_bytes < kHeader) {
    return Status::Rejected(Reason::kMalformed, "record_bytes ", h.record_bytes, " is less than the ", kHeader, "-byte header");
  }
  if (h.record_bytes > v1::kSlotBytes) {
    return Status::Rejected(Reason::kMalformed, "record_bytes ", h.record_bytes, " exceeds the ", v1::kSlotBytes,
                                   "-byte slot");
  }
  if (h.record_bytes % 8 != 0) {
    return Status::Rejected(Reason::kMalformed, "record_bytes ", h.record_bytes, " is not a multiple of 8");
  }
  if (h.record_bytes > n) {
    return Status::Rejected(Reason::kMalformed, "record_bytes ", h.record_bytes, " exceeds the ", n, " bytes given");
  }
  if (h.nargs > static_cast<uint32_t>(kMaxArgs)) {
    return Status::Rejected(Reason::kMalformed, "nargs ", h.nargs, " exceeds ", kMaxArgs);
  }
  if (h.op_index >= catalog.size()) {
    return Status::Rejected(Reason::kMalformed, "op_index ", h.op_index, " is out of range: the catalog has ", catalog.size(),
                                   " op(s)");
  }
  const size_t end = h.record_bytes;  // <= kSlotBytes: no sum below can overflow
  size_t at = kHeader;
  out->args.reserve(h.nargs);
  for (uint32_t i = 0; i < h.nargs; ++i) {
    const int index = static_cast<int>(i);
    if (end - at < sizeof(v1::RingArgHeader)) {
      return Status::Rejected(Reason::kMalformed, "argument ", index, ": header at byte ", at, " runs past record_bytes ", end);
    }
    const v1::RingArgHeader ah = Load<v1::RingArgHeader>(bytes + at);
    at += sizeof(v1::RingArgHeader);
    size_t payload = 0;
    OPD_RETURN_IF_ERROR(PayloadBytes(index, ah.kind, ah.count, &payload));
    if (end - at < payload) {
      return Status::Rejected(Reason::kMalformed, "argument ", index, ": ", KindName(ah.kind), " payload of ", payload,
                                     " bytes at byte ", at, " runs past record_bytes ", end);
    }
    Arg arg;
    OPD_RETURN_IF_ERROR(DecodeArg(index, ah.kind, ah.count, bytes + at, &arg));
    out->args.push_back(std::move(arg));
    at += payload;
  }
  if (at != end) {
    return Status::Rejected(Reason::kMalformed, "arguments end at byte ", at, " but record_bytes is ", end);
  }
  out->op = catalog[h.op_index].name;
  out->overload = catalog[h.op_index].overload;
  out->lane = h.lane;
  out->seq = h.seq;
  return Status::Ok();
}

}  // namespace

Status DecodeRecord(const uint8_t* bytes, size_t n, const std::vector<OpInfo>& catalog, CallRequest* out,
                    RecordIds* ids) {
  *ids = RecordIds{};
  *out = CallRequest{};
  Status s = Decode(bytes, n, catalog, out, ids);
  if (!s.ok()) *out = CallRequest{};
  return s;
}

}  // namespace cache_dit_opd
