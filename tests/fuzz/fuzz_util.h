// File: tests/fuzz/fuzz_util.h
//
// What the libFuzzer targets of tests/fuzz/ share. Plain C++ (no torch,
// gRPC, protobuf or spdlog headers), so targets of either SIDE include it.
//
//   OPD_FUZZ_CHECK(cond, parts...)  the invariant of a target: on violation
//       prints the parts to stderr and traps, so libFuzzer keeps the input as
//       a crash artifact. A violated check is a finding, like a sanitizer
//       report.
//   CallDifference(a, b)            "" when two calls are equal field by
//       field (floats compared by bits, so NaN payloads and -0.0 count),
//       else the first difference, for the check's message.
//   WireLimitsHold(call)            "" when every argument is within the
//       limits both transports enforce (wire.h), else what is not.
//   RingPayloadBytes(args)          the bytes layout v1 needs for `args`
//       (ring.h), the oracle of the encoder's "does it fit".
//   MakeRecord(args, header)        one ring record: header + arguments, as
//       the client's ring producer publishes it.
//   Log(parts...)                   prints with OPD_FUZZ_VERBOSE=1 set.
//   OPD_FUZZ_TARGET(seeds, run)     the target's entry points: `run(data,
//       size)` for each input, and a `--write-seeds=DIR` mode: the binary
//       writes the inputs `seeds` returns (std::vector<std::string>) as
//       DIR/seed-NN and exits, before libFuzzer starts. The committed
//       corpora (tests/fuzz/corpus/<target>/) are made this way.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "cache_dit_opd/v1/ring.h"
#include "common/call.h"
#include "common/ring_encode.h"

namespace cache_dit_opd::fuzz {

template <typename... A>
[[noreturn]] inline void Fail(const char* file, int line, const char* cond, const A&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  std::fprintf(stderr, "\n==== fuzz invariant violated at %s:%d: %s\n     %s\n", file, line, cond,
               os.str().c_str());
  std::fflush(stderr);
  __builtin_trap();
}

#define OPD_FUZZ_CHECK(cond, ...)                                                        \
  do {                                                                                   \
    if (!(cond)) ::cache_dit_opd::fuzz::Fail(__FILE__, __LINE__, #cond, "" __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

// OPD_FUZZ_VERBOSE=1 in the environment: targets print what they decided
// (for reading a crash input: `OPD_FUZZ_VERBOSE=1 ./target crash-...`).
inline bool Verbose() {
  static const bool verbose = [] {
    const char* v = std::getenv("OPD_FUZZ_VERBOSE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return verbose;
}

template <typename... A>
void Log(const A&... parts) {
  if (!Verbose()) return;
  std::ostringstream os;
  (os << ... << parts);
  std::fprintf(stderr, "%s\n", os.str().c_str());
}

template <typename T>
uint64_t Bits(T v) {
  static_assert(sizeof(T) <= 8);
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

inline std::string ArgDifference(const Arg& a, const Arg& b) {
  if (a.index() != b.index()) {
    return "kinds " + std::to_string(a.index()) + " and " + std::to_string(b.index());
  }
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        const T& y = std::get<T>(b);
        if constexpr (std::is_same_v<T, NoneArg>) {
          return "";
        } else if constexpr (std::is_same_v<T, TensorRef>) {
          if (x.region_id != y.region_id) return "region ids";
          if (x.byte_offset != y.byte_offset) return "byte offsets";
          if (x.sizes != y.sizes) return "sizes";
          if (x.strides != y.strides) return "strides";
          if (x.dtype != y.dtype) return "dtypes";
          return "";
        } else if constexpr (std::is_same_v<T, double>) {
          return Bits(x) == Bits(y) ? "" : "float bits";
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          if (x.size() != y.size()) return "float list lengths";
          for (size_t i = 0; i < x.size(); ++i) {
            if (Bits(x[i]) != Bits(y[i])) return "float list bits at " + std::to_string(i);
          }
          return "";
        } else {
          return x == y ? "" : "values";
        }
      },
      a);
}

inline std::string CallDifference(const CallRequest& a, const CallRequest& b) {
  if (a.op != b.op) return "op '" + a.op + "' vs '" + b.op + "'";
  if (a.overload != b.overload) return "overload '" + a.overload + "' vs '" + b.overload + "'";
  if (a.lane != b.lane) return "lane";
  if (a.seq != b.seq) return "seq";
  if (a.host_ordered != b.host_ordered) return "host_ordered";
  if (a.args.size() != b.args.size()) {
    return "argument counts " + std::to_string(a.args.size()) + " vs " + std::to_string(b.args.size());
  }
  for (size_t i = 0; i < a.args.size(); ++i) {
    if (std::string d = ArgDifference(a.args[i], b.args[i]); !d.empty()) {
      return "argument " + std::to_string(i) + ": " + d;
    }
  }
  return "";
}

inline std::string WireLimitsHold(const CallRequest& c) {
  if (c.args.size() > static_cast<size_t>(kMaxArgs)) return "more than kMaxArgs arguments";
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    const std::string at = "argument " + std::to_string(i) + ": ";
    if (const auto* t = std::get_if<TensorRef>(&a)) {
      if (t->sizes.size() > static_cast<size_t>(kMaxTensorDims)) return at + "more than kMaxTensorDims dims";
      if (t->sizes.size() != t->strides.size()) return at + "sizes and strides of different ranks";
      if (!IsWireDType(static_cast<int32_t>(t->dtype))) return at + "a dtype outside protocol v1";
    } else if (const auto* il = std::get_if<std::vector<int64_t>>(&a)) {
      if (il->size() > static_cast<size_t>(kMaxListLength)) return at + "an int list past kMaxListLength";
    } else if (const auto* fl = std::get_if<std::vector<double>>(&a)) {
      if (fl->size() > static_cast<size_t>(kMaxListLength)) return at + "a float list past kMaxListLength";
    } else if (const auto* bl = std::get_if<std::vector<bool>>(&a)) {
      if (bl->size() > static_cast<size_t>(kMaxListLength)) return at + "a bool list past kMaxListLength";
    }
  }
  return "";
}

// Layout v1's bytes for `args` (each: an 8-byte header, then its payload),
// computed from ring.h's table, not from the encoder.
inline uint64_t RingPayloadBytes(const std::vector<Arg>& args) {
  uint64_t total = 0;
  for (const Arg& a : args) {
    total += sizeof(v1::RingArgHeader);
    if (const auto* t = std::get_if<TensorRef>(&a)) {
      total += 24 + 16 * uint64_t{t->sizes.size()};
    } else if (const auto* il = std::get_if<std::vector<int64_t>>(&a)) {
      total += 8 * uint64_t{il->size()};
    } else if (const auto* fl = std::get_if<std::vector<double>>(&a)) {
      total += 8 * uint64_t{fl->size()};
    } else if (const auto* bl = std::get_if<std::vector<bool>>(&a)) {
      total += 8 * uint64_t{bl->size()};
    } else if (!std::holds_alternative<NoneArg>(a)) {
      total += 8;  // int, float, bool
    }
  }
  return total;
}

struct RecordFields {
  uint64_t ticket = 0;
  uint64_t seq = 1;
  uint32_t lane = 0;
  uint32_t op_index = 0;
  uint32_t flags = 0;
};

inline std::string MakeRecord(const client::RecordArgs& args, const RecordFields& f) {
  v1::RecordHeader h{};
  h.magic = v1::kRecordMagic;
  h.record_bytes = static_cast<uint32_t>(sizeof(h) + args.size());
  h.ticket = f.ticket;
  h.seq = f.seq;
  h.lane = f.lane;
  h.op_index = f.op_index;
  h.nargs = args.count();
  h.flags = f.flags;
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  out.append(reinterpret_cast<const char*>(args.data()), args.size());
  return out;
}

template <typename T>
void Append(std::string* out, const T& v) {
  static_assert(std::is_trivially_copyable_v<T>);
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// The --write-seeds=DIR mode (see the file comment). Returns when the flag
// is absent.
template <typename Fn>
void MaybeWriteSeeds(int argc, char** argv, Fn seeds) {
  constexpr std::string_view kFlag = "--write-seeds=";
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a.substr(0, kFlag.size()) != kFlag) continue;
    const std::string dir(a.substr(kFlag.size()));
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      std::fprintf(stderr, "cannot create %s: %s\n", dir.c_str(), std::strerror(errno));
      std::exit(2);
    }
    const std::vector<std::string> inputs = seeds();
    for (size_t n = 0; n < inputs.size(); ++n) {
      char name[32];
      std::snprintf(name, sizeof(name), "/seed-%02zu", n);
      const std::string path = dir + name;
      FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr || std::fwrite(inputs[n].data(), 1, inputs[n].size(), f) != inputs[n].size() ||
          std::fclose(f) != 0) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        std::exit(2);
      }
    }
    std::fprintf(stderr, "wrote %zu seeds to %s\n", inputs.size(), dir.c_str());
    std::exit(0);
  }
}

}  // namespace cache_dit_opd::fuzz

// In a target: OPD_FUZZ_TARGET(MySeeds, MyRun) defines LLVMFuzzerInitialize,
// which libFuzzer calls with its argv before it parses its own flags (it
// ignores flags that start with "--"), and LLVMFuzzerTestOneInput.
#define OPD_FUZZ_TARGET(seeds, run)                                         \
  extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {            \
    ::cache_dit_opd::fuzz::MaybeWriteSeeds(*argc, *argv, seeds);            \
    return 0;                                                               \
  }                                                                         \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
    run(data, size);                                                        \
    return 0;                                                               \
  }
