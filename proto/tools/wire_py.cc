// opd_wire_py: prints python/cache_dit_opd/_wire.py, the Python client's copy
// of the contract's numbers (wire.h, session_memory.h, ring.h): constants,
// struct sizes, field offsets and struct formats, all taken from the headers
// by the compiler (sizeof, offsetof), none written twice by hand.
//
//   build/proto/opd_wire_py > python/cache_dit_opd/_wire.py
//
// The file is committed (a pure-Python install needs no compiler);
// tests/python/test_client_wire.py runs this program and checks the committed
// file is what it prints.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cache_dit_opd/v1/ring.h"
#include "cache_dit_opd/v1/session_memory.h"
#include "cache_dit_opd/v1/wire.h"

namespace v1 = cache_dit_opd::v1;

namespace {

// The struct-module format of one field.
template <typename T>
std::string Format() {
  if constexpr (std::is_array_v<T> && std::is_same_v<std::remove_extent_t<T>, int64_t>) {
    return std::to_string(std::extent_v<T>) + "q";  // unpacks to that many values
  } else if constexpr (std::is_array_v<T> && std::is_same_v<std::remove_extent_t<T>, uint64_t>) {
    return std::to_string(std::extent_v<T>) + "Q";
  } else if constexpr (std::is_array_v<T>) {
    static_assert(sizeof(std::remove_extent_t<T>) == 1, "an array wire_py does not know");
    return std::to_string(std::extent_v<T>) + "s";
  } else if constexpr (std::is_same_v<T, uint32_t>) {
    return "I";
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return "i";
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    return "Q";
  } else {
    static_assert(sizeof(T) == 0, "a field type wire_py does not know");
  }
}

void Const(const char* name, uint64_t value, const char* comment) {
  std::printf("%s = %llu  # %s\n", name, static_cast<unsigned long long>(value), comment);
}

void Hex(const char* name, uint64_t value, const char* comment) {
  std::printf("%s = 0x%llX  # %s\n", name, static_cast<unsigned long long>(value), comment);
}

// Prints NAME_SIZE and NAME_FIELDS = {"field": (offset, "<fmt"), ...} for a
// struct whose members are listed in order with FIELD(...), its explicit
// padding with PAD(...). The contract's structs have no implicit padding, so a
// member left out of the list is a gap this program refuses to print past.
struct Fields {
  Fields(const char* py, const char* c, size_t size) : c_(c), size_(size) {
    std::printf("\n# struct %s\n%s_SIZE = %zu\n%s_FIELDS = {\n", c, py, size, py);
  }
  template <typename T>
  void Add(const char* name, size_t offset, bool print) {
    Expect(offset, name);
    end_ = offset + sizeof(T);
    if (print) std::printf("    \"%s\": (%zu, \"<%s\"),\n", name, offset, Format<T>().c_str());
  }
  ~Fields() {
    Expect(size_, "the end");
    std::printf("}\n");
  }

 private:
  void Expect(size_t offset, const char* what) const {
    if (offset == end_) return;
    std::fprintf(stderr, "opd_wire_py: %s has bytes [%zu, %zu) before %s that no FIELD or PAD lists\n", c_, end_,
                 offset, what);
    std::exit(1);
  }
  const char* c_;
  size_t size_;
  size_t end_ = 0;
};

#define FIELD(f, S, m) (f).Add<decltype(S::m)>(#m, offsetof(S, m), true)
#define PAD(f, S, m) (f).Add<decltype(S::m)>(#m, offsetof(S, m), false)

}  // namespace

int main() {
  std::printf(
      "\"\"\"The contract's numbers for the Python client: GENERATED, do not edit.\n"
      "\n"
      "Written by proto/tools/wire_py.cc from proto/cache_dit_opd/v1/{wire,session_memory,ring}.h\n"
      "(build/proto/opd_wire_py > python/cache_dit_opd/_wire.py); tests/python/test_client_wire.py\n"
      "checks that this file is what the headers say. Offsets and sizes are the compiler's.\n"
      "\"\"\"\n\n");

  std::printf("# ---- wire.h\n");
  std::printf("# torch dtype name -> wire DType value (opd.proto DTYPE_<NAME>)\nDTYPE_IDS = {\n");
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto) std::printf("    \"%s\": %d,\n", name, v);
  CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  std::printf("}\n# wire DType value -> bytes per element\nDTYPE_SIZES = {\n");
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto) std::printf("    %d: %d,\n", v, bytes);
  CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  std::printf("}\n");
  Const("DTYPE_COUNT", v1::kDTypeCount, "kDTypeCount: valid values are 1 .. DTYPE_COUNT - 1");
  Const("MAX_TENSOR_DIMS", v1::kMaxTensorDims, "kMaxTensorDims");
  Const("MAX_ARGS", v1::kMaxArgs, "kMaxArgs");
  Const("MAX_LIST_LENGTH", v1::kMaxListLength, "kMaxListLength");
  Const("MAX_STORE_NAME_BYTES", v1::kMaxStoreNameBytes, "kMaxStoreNameBytes");
  Const("NO_REGION", v1::kNoRegion, "kNoRegion: the region id of an empty view (no memory)");
  std::printf("# ClientAction: what a client does about an error (wire.h)\nACTIONS = {\n");
#define CACHE_DIT_OPD_X(e, v, name) std::printf("    \"%s\": %d,\n", name, v);
  CACHE_DIT_OPD_CLIENT_ACTIONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  std::printf("}\n# Reason: name -> (value, google.rpc.Code, action)\nREASONS = {\n");
#define CACHE_DIT_OPD_X(e, v, proto, code, action) \
  std::printf("    \"%s\": (%d, %d, %u),\n", #proto, v, code, static_cast<unsigned>(v1::ClientAction::action));
  CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  std::printf("}\n# google.rpc.Code -> action, for an error without a reason (others: fail)\nCODE_ACTIONS = {\n");
#define CACHE_DIT_OPD_X(code, action) \
  std::printf("    %d: %u,\n", code, static_cast<unsigned>(v1::ClientAction::action));
  CACHE_DIT_OPD_CODE_ACTIONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  std::printf("}\nREASON_METADATA_KEY = \"%s\"  # kReasonMetadataKey\n", v1::kReasonMetadataKey);

  std::printf("\n# ---- session_memory.h\n");
  Const("PROTOCOL_VERSION", v1::kProtocolVersion, "kProtocolVersion");
  Const("LAYOUT_VERSION", v1::kLayoutVersion, "kLayoutVersion");
  Hex("SESSION_MEMORY_MAGIC", v1::kSessionMemoryMagic, "kSessionMemoryMagic");
  Hex("BIND_REQUEST_MAGIC", v1::kBindRequestMagic, "kBindRequestMagic");
  Hex("STORE_ATTACH_MAGIC", v1::kStoreAttachMagic, "kStoreAttachMagic");
  Hex("VMM_REGION_MAGIC", v1::kVmmRegionMagic, "kVmmRegionMagic");
  Const("MAX_VMM_CHUNKS", v1::kMaxVmmChunks, "kMaxVmmChunks");
  Const("TOKEN_BYTES", v1::kTokenBytes, "kTokenBytes");
  Const("LANES_OFFSET", v1::kLanesOffset, "kLanesOffset");
  {
    Fields f("BIND_REQUEST", "BindRequest", sizeof(v1::BindRequest));
    FIELD(f, v1::BindRequest, magic);
    FIELD(f, v1::BindRequest, protocol_version);
    FIELD(f, v1::BindRequest, session_id);
    FIELD(f, v1::BindRequest, token);
  }
  {
    Fields f("BIND_REPLY", "BindReply", sizeof(v1::BindReply));
    FIELD(f, v1::BindReply, status_code);
    FIELD(f, v1::BindReply, layout_version);
    FIELD(f, v1::BindReply, shared_memory_bytes);
    FIELD(f, v1::BindReply, reason);
    FIELD(f, v1::BindReply, message);
  }
  {
    Fields f("STORE_ATTACH_REQUEST", "StoreAttachRequest", sizeof(v1::StoreAttachRequest));
    FIELD(f, v1::StoreAttachRequest, magic);
    FIELD(f, v1::StoreAttachRequest, protocol_version);
    FIELD(f, v1::StoreAttachRequest, session_id);
    FIELD(f, v1::StoreAttachRequest, token);
    FIELD(f, v1::StoreAttachRequest, name_bytes);
    FIELD(f, v1::StoreAttachRequest, reserved);
    FIELD(f, v1::StoreAttachRequest, name);
  }
  {
    Fields f("STORE_ATTACH_REPLY", "StoreAttachReply", sizeof(v1::StoreAttachReply));
    FIELD(f, v1::StoreAttachReply, status_code);
    FIELD(f, v1::StoreAttachReply, reason);
    FIELD(f, v1::StoreAttachReply, region_id);
    FIELD(f, v1::StoreAttachReply, daemon_instance);
    FIELD(f, v1::StoreAttachReply, block_id);
    FIELD(f, v1::StoreAttachReply, block_bytes);
    FIELD(f, v1::StoreAttachReply, offset);
    FIELD(f, v1::StoreAttachReply, bytes);
    FIELD(f, v1::StoreAttachReply, dtype);
    FIELD(f, v1::StoreAttachReply, ndim);
    FIELD(f, v1::StoreAttachReply, shape);
    FIELD(f, v1::StoreAttachReply, message);
  }
  {
    Fields f("VMM_REGION_REQUEST", "VmmRegionRequest", sizeof(v1::VmmRegionRequest));
    FIELD(f, v1::VmmRegionRequest, magic);
    FIELD(f, v1::VmmRegionRequest, protocol_version);
    FIELD(f, v1::VmmRegionRequest, session_id);
    FIELD(f, v1::VmmRegionRequest, token);
    FIELD(f, v1::VmmRegionRequest, client_base);
    FIELD(f, v1::VmmRegionRequest, chunk_count);
    FIELD(f, v1::VmmRegionRequest, reserved);
    FIELD(f, v1::VmmRegionRequest, chunk_bytes);
    FIELD(f, v1::VmmRegionRequest, chunk_ids);
  }
  {
    Fields f("VMM_REGION_REPLY", "VmmRegionReply", sizeof(v1::VmmRegionReply));
    FIELD(f, v1::VmmRegionReply, status_code);
    FIELD(f, v1::VmmRegionReply, reason);
    FIELD(f, v1::VmmRegionReply, region_id);
    FIELD(f, v1::VmmRegionReply, mapped_bytes);
    FIELD(f, v1::VmmRegionReply, message);
  }
  {
    Fields f("SESSION_HEADER", "SessionMemoryHeader", sizeof(v1::SessionMemoryHeader));
    FIELD(f, v1::SessionMemoryHeader, magic);
    FIELD(f, v1::SessionMemoryHeader, layout_version);
    FIELD(f, v1::SessionMemoryHeader, total_bytes);
    FIELD(f, v1::SessionMemoryHeader, session_id);
    FIELD(f, v1::SessionMemoryHeader, lane_count);
    FIELD(f, v1::SessionMemoryHeader, lane_stride);
    FIELD(f, v1::SessionMemoryHeader, lanes_offset);
    FIELD(f, v1::SessionMemoryHeader, ring_offset);
    FIELD(f, v1::SessionMemoryHeader, ring_bytes);
    FIELD(f, v1::SessionMemoryHeader, daemon_pid);
    FIELD(f, v1::SessionMemoryHeader, daemon_heartbeat);
    PAD(f, v1::SessionMemoryHeader, reserved);
  }
  {
    Fields f("LANE", "LaneSemaphores", sizeof(v1::LaneSemaphores));
    FIELD(f, v1::LaneSemaphores, inputs_ready);
    PAD(f, v1::LaneSemaphores, pad0);
    FIELD(f, v1::LaneSemaphores, done);
    PAD(f, v1::LaneSemaphores, pad1);
  }

  std::printf("\n# ---- ring.h\n");
  Const("RING_VERSION", v1::kRingVersion, "kRingVersion");
  Const("RING_CONTROL_BYTES", v1::kRingControlBytes, "kRingControlBytes");
  Const("SLOT_BYTES", v1::kSlotBytes, "kSlotBytes");
  Const("COMPLETION_BYTES", v1::kCompletionBytes, "kCompletionBytes");
  Const("DEFAULT_RING_CAPACITY", v1::kDefaultRingCapacity, "kDefaultRingCapacity");
  Hex("RECORD_MAGIC", v1::kRecordMagic, "kRecordMagic");
  Const("DOORBELL_AWAKE", v1::kDoorbellAwake, "kDoorbellAwake");
  Const("DOORBELL_SLEEPING", v1::kDoorbellSleeping, "kDoorbellSleeping");
  std::printf("# RingArgKind\nARG_KINDS = {\n");
  const std::pair<const char*, v1::RingArgKind> kinds[] = {
      {"none", v1::RingArgKind::kNone},         {"tensor", v1::RingArgKind::kTensor},
      {"int", v1::RingArgKind::kInt},           {"float", v1::RingArgKind::kFloat},
      {"bool", v1::RingArgKind::kBool},         {"int_list", v1::RingArgKind::kIntList},
      {"float_list", v1::RingArgKind::kFloatList}, {"bool_list", v1::RingArgKind::kBoolList},
  };
  for (const auto& [name, kind] : kinds) std::printf("    \"%s\": %u,\n", name, static_cast<unsigned>(kind));
  std::printf("}\n");
  {
    Fields f("RING_CONTROL", "RingControl", sizeof(v1::RingControl));
    FIELD(f, v1::RingControl, version);
    FIELD(f, v1::RingControl, capacity);
    FIELD(f, v1::RingControl, slot_bytes);
    FIELD(f, v1::RingControl, completion_bytes);
    PAD(f, v1::RingControl, pad0);
    FIELD(f, v1::RingControl, sq_tail);
    PAD(f, v1::RingControl, pad1);
    FIELD(f, v1::RingControl, sq_head);
    PAD(f, v1::RingControl, pad2);
    FIELD(f, v1::RingControl, doorbell);
    PAD(f, v1::RingControl, pad3);
  }
  {
    Fields f("ARG_HEADER", "RingArgHeader", sizeof(v1::RingArgHeader));
    FIELD(f, v1::RingArgHeader, kind);
    FIELD(f, v1::RingArgHeader, count);
  }
  {
    Fields f("RECORD_HEADER", "RecordHeader", sizeof(v1::RecordHeader));
    FIELD(f, v1::RecordHeader, magic);
    FIELD(f, v1::RecordHeader, record_bytes);
    FIELD(f, v1::RecordHeader, ticket);
    FIELD(f, v1::RecordHeader, seq);
    FIELD(f, v1::RecordHeader, lane);
    FIELD(f, v1::RecordHeader, op_index);
    FIELD(f, v1::RecordHeader, nargs);
    FIELD(f, v1::RecordHeader, flags);
    FIELD(f, v1::RecordHeader, reserved);
  }
  {
    Fields f("COMPLETION", "CompletionRecord", sizeof(v1::CompletionRecord));
    FIELD(f, v1::CompletionRecord, done_ticket);
    FIELD(f, v1::CompletionRecord, ticket);
    FIELD(f, v1::CompletionRecord, seq);
    FIELD(f, v1::CompletionRecord, lane);
    FIELD(f, v1::CompletionRecord, status_code);
    FIELD(f, v1::CompletionRecord, reason);
    FIELD(f, v1::CompletionRecord, message);
  }
  return 0;
}
