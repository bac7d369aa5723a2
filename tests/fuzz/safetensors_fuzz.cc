// safetensors_fuzz: the weight store's reader of .safetensors files
// (server/store/safetensors.h SafetensorsFile::Open and Read), on a whole
// file image: the input is written to a memfd and opened by path
// (/proc/self/fd/N), so every check of Open runs, the file-size ones too.
//
// Checks, on every input:
//   - a refusal is INVALID_ARGUMENT [BAD_ARGUMENT] (nothing else can go
//     wrong with a readable regular file);
//   - an accepted file's index is what the contract promises, computed here
//     independently: data_offset = 8 + the length word, the tensors in
//     offset order tile [data_offset, size) exactly, each one's byte count is
//     prod(shape) * element size (in 128-bit arithmetic), its dtype a wire
//     dtype, its rank <= 8, names unique and 1..1024 bytes;
//   - Find names each tensor; Read returns its bytes of the input exactly;
//   - round trip: the index written back as a header (nlohmann's DOM, another
//     writer) parses to the same index.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/store/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

namespace cache_dit_opd {
namespace {

using server::SafetensorsFile;
using server::SafetensorsIndex;

std::string Image(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((uint64_t{header.size()} >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string DTypeNameOf(DType d) {
#define CACHE_DIT_OPD_X(n, e) \
  if (d == DType::e) return n;
  CACHE_DIT_OPD_SAFETENSORS_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  return "?";
}

void CheckSameIndex(const SafetensorsIndex& a, const SafetensorsIndex& b) {
  OPD_FUZZ_CHECK(a.tensors.size() == b.tensors.size(), a.tensors.size(), " vs ", b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto &x = a.tensors[i], &y = b.tensors[i];
    OPD_FUZZ_CHECK(x.name == y.name && x.dtype == y.dtype && x.shape == y.shape && x.offset == y.offset &&
                       x.bytes == y.bytes,
                   "tensor ", i, ": '", x.name, "' vs '", y.name, "'");
  }
  auto sorted = [](auto m) { std::sort(m.begin(), m.end()); return m; };
  OPD_FUZZ_CHECK(sorted(a.metadata) == sorted(b.metadata), "metadata differs");
}

void Run(const uint8_t* data, size_t size) {
  static const int memfd = memfd_create("safetensors_fuzz", MFD_CLOEXEC);
  static const std::string path = "/proc/self/fd/" + std::to_string(memfd);
  OPD_FUZZ_CHECK(memfd >= 0 && ftruncate(memfd, 0) == 0);
  OPD_FUZZ_CHECK(size == 0 || pwrite(memfd, data, size, 0) == static_cast<ssize_t>(size));

  std::unique_ptr<SafetensorsFile> file;
  const Status s = SafetensorsFile::Open(path, &file);
  if (!s.ok()) {
    OPD_FUZZ_CHECK(s.reason() == Reason::kBadArgument && s.code() == StatusCode::kInvalidArgument, s.ToString());
    fuzz::Log("refused: ", s.message());
    return;
  }
  const SafetensorsIndex& ix = file->index();
  OPD_FUZZ_CHECK(size >= 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  OPD_FUZZ_CHECK(ix.data_offset == 8 + n && ix.data_offset + ix.data_bytes == size, ix.data_offset, " ", n);
  uint64_t at = ix.data_offset;
  std::set<std::string> names;
  for (const auto& t : ix.tensors) {
    OPD_FUZZ_CHECK(IsWireDType(static_cast<int64_t>(t.dtype)), t.name);
    OPD_FUZZ_CHECK(t.shape.size() <= v1::kMaxTensorDims, t.name);
    OPD_FUZZ_CHECK(!t.name.empty() && t.name.size() <= server::kMaxSafetensorsNameBytes && names.insert(t.name).second,
                   t.name);
    unsigned __int128 bytes = static_cast<unsigned __int128>(DTypeSize(t.dtype));
    for (int64_t d : t.shape) {
      OPD_FUZZ_CHECK(d >= 0, t.name);
      bytes *= static_cast<uint64_t>(d);
      if (bytes > size) bytes = size + 1;  // saturate: stays != t.bytes
    }
    OPD_FUZZ_CHECK(bytes == t.bytes && t.offset == at, t.name, " offset ", t.offset, " expected ", at);
    OPD_FUZZ_CHECK(file->Find(t.name) == &t, "Find('", t.name, "') is not its tensor");
    at += t.bytes;
    std::vector<std::byte> got(t.bytes);
    const Status r = file->Read(t, got);
    OPD_FUZZ_CHECK(r.ok(), r.ToString());
    OPD_FUZZ_CHECK(t.bytes == 0 || std::memcmp(got.data(), data + t.offset, t.bytes) == 0, t.name);
  }
  OPD_FUZZ_CHECK(at == size, at, " vs ", size);

  nlohmann::json header = nlohmann::json::object();
  for (const auto& t : ix.tensors) {
    header[t.name] = {{"dtype", DTypeNameOf(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {t.offset - ix.data_offset, t.offset - ix.data_offset + t.bytes}}};
  }
  if (!ix.metadata.empty()) {
    nlohmann::json meta = nlohmann::json::object();
    for (const auto& [k, v] : ix.metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  // Names and values are whatever UTF-8 the parser accepted; the DOM writer
  // must take them back (replace: a lone surrogate escape decodes to bytes
  // dump() would otherwise throw on).
  const std::string again = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  SafetensorsIndex reparsed;
  const Status p = server::ParseSafetensorsHeader(again, ix.data_offset, ix.data_bytes, &reparsed);
  if (p.ok()) {
    CheckSameIndex(ix, reparsed);
  } else {
    // Only a name the writer had to replace can come back different.
    OPD_FUZZ_CHECK(again.find("\xef\xbf\xbd") != std::string::npos, p.ToString());
  }
}

std::vector<std::string> Seeds() {
  std::vector<std::string> out;
  std::ifstream ref(OPD_REFERENCE_SAFETENSORS, std::ios::binary);
  out.emplace_back(std::istreambuf_iterator<char>(ref), std::istreambuf_iterator<char>());
  OPD_FUZZ_CHECK(out.back().size() > 8, OPD_REFERENCE_SAFETENSORS);
  out.push_back(Image("{}", ""));
  out.push_back(Image(R"({"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},"b":{"dtype":"F8_E5M2","shape":[],"data_offsets":[8,9]}})",
                      std::string(9, '\x11')));
  out.push_back(Image(R"({"__metadata__":{"k":"v"},"z":{"dtype":"I64","shape":[0],"data_offsets":[0,0]}}    )", ""));
  out.push_back(Image(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(7, '\0')));
  return out;
}

}  // namespace
}  // namespace cache_dit_opd

OPD_FUZZ_TARGET(cache_dit_opd::Seeds, cache_dit_opd::Run)
