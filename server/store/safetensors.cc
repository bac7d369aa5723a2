#include "server/store/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "common/view_extent.h"

namespace cache_dit_opd::server {
namespace {

using json = nlohmann::json;

Status Bad(auto&&... a) { return Status::Rejected(Reason::kBadArgument, a...); }

// A SAX consumer that accepts exactly the safetensors header shape. The
// parser calls it token by token; the first unexpected token stops the parse
// with `error` set, so nothing past it is ever built (no DOM: a header is at
// most 100 MB of JSON, and a DOM of it would take several times that).
class HeaderSax {
 public:
  explicit HeaderSax(SafetensorsIndex* out) : out_(out) {}

  Status error;

  bool null() { return Fail("null"); }
  bool boolean(bool) { return Fail("a boolean"); }
  bool number_integer(json::number_integer_t v) {
    if (v >= 0) return number_unsigned(static_cast<json::number_unsigned_t>(v));
    return Fail("the negative number ", v);
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (state_ == kShape) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return Fail("the dimension ", v);
      if (tensor_.shape.size() == v1::kMaxTensorDims) {
        return Fail("a shape of more than ", v1::kMaxTensorDims, " dimensions (the most a call's view has)");
      }
      tensor_.shape.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (state_ == kOffsets) {
      if (offsets_.size() == 2) return Fail("data_offsets of more than 2 numbers");
      offsets_.push_back(v);
      return true;
    }
    return Fail("the number ", v);
  }
  bool number_float(json::number_float_t, const std::string& s) { return Fail("the number ", s); }
  bool binary(json::binary_t&) { return Fail("binary data"); }

  bool string(std::string& s) {
    if (state_ == kMetadata) {
      out_->metadata.emplace_back(std::move(key_), std::move(s));
      key_.clear();
      return true;
    }
    if (state_ == kTensor && key_ == "dtype") {
      tensor_.dtype = SafetensorsDType(s);
      if (tensor_.dtype == DType::kUnspecified) {
        std::string known;
#define CACHE_DIT_OPD_X(name, e) known += known.empty() ? name : ", " name;
        CACHE_DIT_OPD_SAFETENSORS_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
        return Fail("dtype '", s, "', which the daemon does not store (one of: ", known, ")");
      }
      return true;
    }
    return Fail("the string '", s.substr(0, 64), "'");
  }

  bool start_object(size_t) {
    switch (state_) {
      case kStart: state_ = kTop; return true;
      case kTop:
        if (name_ == "__metadata__") {  // once: key() refuses a name twice
          state_ = kMetadata;
          return true;
        }
        tensor_ = SafetensorsTensor();
        tensor_.name = name_;
        key_.clear();
        offsets_.clear();
        seen_ = 0;
        state_ = kTensor;
        return true;
      default: return Fail("an object");
    }
  }
  bool end_object() {
    switch (state_) {
      case kTop: state_ = kDone; return true;
      case kMetadata: state_ = kTop; return true;
      case kTensor: {
        key_.clear();
        if (seen_ != 7) return Fail("no '", (seen_ & 1) == 0 ? "dtype" : (seen_ & 2) == 0 ? "shape" : "data_offsets", "'");
        if (offsets_.size() != 2) return Fail("data_offsets of ", offsets_.size(), " numbers (2: begin, end)");
        if (offsets_[0] > offsets_[1]) return Fail("data_offsets [", offsets_[0], ", ", offsets_[1], "] (begin > end)");
        // The begin is relative to the data section here; Finish() checks it
        // against the section's size and makes it absolute.
        tensor_.offset = offsets_[0];
        tensor_.bytes = offsets_[1] - offsets_[0];
        uint64_t want = 0;  // the shape's sizes are non-negative (number_unsigned)
        if (!DenseBytes(tensor_.shape, static_cast<uint64_t>(DTypeSize(tensor_.dtype)), &want)) {
          return Fail("a shape whose byte count overflows 64 bits");
        }
        if (want != tensor_.bytes) {
          return Fail("data_offsets [", offsets_[0], ", ", offsets_[1], "]: ", tensor_.bytes, " bytes, but its dtype and shape take ", want);
        }
        out_->tensors.push_back(std::move(tensor_));
        state_ = kTop;
        return true;
      }
      default: return Fail("the end of an object");
    }
  }
  bool start_array(size_t) {
    if (state_ == kTensor && key_ == "shape") { state_ = kShape; return true; }
    if (state_ == kTensor && key_ == "data_offsets") { state_ = kOffsets; return true; }
    return Fail("an array");
  }
  bool end_array() {
    if (state_ == kShape || state_ == kOffsets) { state_ = kTensor; return true; }
    return Fail("the end of an array");
  }

  bool key(std::string& k) {
    if (state_ == kTop) {
      if (k.empty() || k.size() > kMaxSafetensorsNameBytes) {
        error = Bad("the header names a tensor with ", k.size(), " bytes (1 to ", kMaxSafetensorsNameBytes, ")");
        return false;
      }
      if (!names_.insert(k).second) {
        error = Bad("the header names tensor '", k, "' twice");
        return false;
      }
      name_ = k;
      key_.clear();
      return true;
    }
    if (state_ == kMetadata) {
      if (!metadata_keys_.insert(k).second) {
        error = Bad("__metadata__ has the key '", k.substr(0, 64), "' twice");
        return false;
      }
      key_ = std::move(k);
      return true;
    }
    if (state_ == kTensor) {
      int bit = k == "dtype" ? 1 : k == "shape" ? 2 : k == "data_offsets" ? 4 : 0;
      if (bit == 0) return Fail("the key '", k.substr(0, 64), "' (a tensor has dtype, shape, data_offsets)");
      if (seen_ & bit) return Fail("a second '", k, "'");
      seen_ |= bit;
      key_ = std::move(k);
      return true;
    }
    return Fail("a key");
  }

  bool parse_error(size_t position, const std::string& token, const nlohmann::detail::exception& e) {
    if (error.ok()) error = Bad("the header is not JSON at byte ", position, " (near '", token.substr(0, 32), "'): ", e.what());
    return false;
  }

  bool done() const { return state_ == kDone; }

 private:
  enum State { kStart, kTop, kMetadata, kTensor, kShape, kOffsets, kDone };

  // Stops the parse with an error that says where the unexpected token is.
  template <typename... A>
  bool Fail(A&&... a) {
    if (!error.ok()) return false;
    switch (state_) {
      case kStart: error = Bad("the header is not a JSON object: it holds ", a...); break;
      case kTop: error = Bad("the header holds ", a..., " as tensor '", name_, "' (a tensor is an object)"); break;
      case kMetadata: error = Bad("__metadata__ holds ", a..., " (its values are strings)"); break;
      case kTensor: case kShape: case kOffsets:
        error = Bad("tensor '", tensor_.name, "': ", a..., key_.empty() ? "" : " (at '", key_, key_.empty() ? "" : "')");
        break;
      case kDone: error = Bad("the header holds ", a..., " after its object"); break;
    }
    return false;
  }

  SafetensorsIndex* out_;
  State state_ = kStart;
  std::unordered_set<std::string> names_;
  std::unordered_set<std::string> metadata_keys_;
  std::string name_;  // the current top-level key
  std::string key_;   // the current key inside a tensor or the metadata
  SafetensorsTensor tensor_;
  std::vector<uint64_t> offsets_;
  int seen_ = 0;  // dtype 1, shape 2, data_offsets 4
};

// pread() of exactly dst.size() bytes at `offset`; the count read when the
// file ends first.
Status ReadFully(int fd, uint64_t offset, std::span<std::byte> dst, size_t* got) {
  *got = 0;
  while (*got < dst.size()) {
    ssize_t n = ::pread(fd, dst.data() + *got, dst.size() - *got, static_cast<off_t>(offset + *got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Bad("pread: ", std::strerror(errno));
    if (n == 0) break;
    *got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

DType SafetensorsDType(std::string_view name) {
#define CACHE_DIT_OPD_X(n, e) \
  if (name == n) return DType::e;
  CACHE_DIT_OPD_SAFETENSORS_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  return DType::kUnspecified;
}

Status ParseSafetensorsHeader(std::string_view header, uint64_t data_offset, uint64_t data_bytes,
                              SafetensorsIndex* out) {
  *out = SafetensorsIndex();
  out->data_offset = data_offset;
  out->data_bytes = data_bytes;
  if (header.size() > kMaxSafetensorsHeaderBytes) {
    return Bad("a header of ", header.size(), " bytes (at most ", kMaxSafetensorsHeaderBytes, ")");
  }
  // safetensors' own reader demands the object right at the start.
  if (header.empty() || header.front() != '{') return Bad("the header does not start with '{'");
  HeaderSax sax(out);
  bool parsed = json::sax_parse(header.begin(), header.end(), &sax, nlohmann::detail::input_format_t::json,
                                /*strict=*/true);
  if (!sax.error.ok()) return sax.error;
  if (!parsed || !sax.done()) return Bad("the header ends inside its object");

  std::sort(out->tensors.begin(), out->tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
            });
  uint64_t end = 0;
  for (SafetensorsTensor& t : out->tensors) {
    if (t.offset != end) {
      return Bad("tensor '", t.name, "' begins at data byte ", t.offset, ", but the tensor before it ends at ", end,
                 t.offset > end ? " (a hole)" : " (they overlap)");
    }
    end = t.offset + t.bytes;  // no overflow: t.bytes = end_offset - begin_offset of two uint64 values
    t.offset += data_offset;
    if (t.offset < data_offset) return Bad("tensor '", t.name, "' lies past 2^64");
  }
  if (end != data_bytes) {
    return Bad("the tensors end at data byte ", end, ", but the file holds ", data_bytes, " data bytes",
               end > data_bytes ? " (it is truncated, or the header lies about sizes)" : " (bytes no tensor owns)");
  }
  return Status::Ok();
}

Status SafetensorsFile::Open(const std::string& path, std::unique_ptr<SafetensorsFile>* out) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; a regular file
  // ignores the flag.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    int e = errno;
    std::string why = std::strerror(e);
    if (e == EACCES || e == EPERM) return Bad("safetensors file ", path, ": the daemon may not read it (", why, ")");
    return Bad("safetensors file ", path, ": ", why);
  }
  return Open(fd, path, out);
}

Status SafetensorsFile::Open(int fd, const std::string& path, std::unique_ptr<SafetensorsFile>* out) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile(path, fd));
  auto bad = [&](const Status& s) { return s.Annotated("safetensors file " + path + ": "); };
  struct stat st {};
  if (::fstat(fd, &st) != 0) return bad(Bad("fstat: ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) return bad(Bad("not a regular file"));
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) return bad(Bad(size, " bytes: shorter than the 8-byte header length"));
  std::byte len_bytes[8];
  size_t got = 0;
  if (Status s = ReadFully(fd, 0, len_bytes, &got); !s.ok() || got != 8) {
    return bad(s.ok() ? Bad("shorter than the 8-byte header length") : s);
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(len_bytes[i]);
  if (n > kMaxSafetensorsHeaderBytes) return bad(Bad("a header length of ", n, " bytes (at most ", kMaxSafetensorsHeaderBytes, ")"));
  if (n > size - 8) return bad(Bad("a header of ", n, " bytes in a file of ", size, " (truncated)"));
  std::string header(n, '\0');
  if (Status s = ReadFully(fd, 8, std::as_writable_bytes(std::span(header)), &got); !s.ok() || got != n) {
    return bad(s.ok() ? Bad("the header was cut short while reading") : s);
  }
  if (Status s = ParseSafetensorsHeader(header, 8 + n, size - 8 - n, &file->index_); !s.ok()) return bad(s);
  for (const SafetensorsTensor& t : file->index_.tensors) file->by_name_.push_back(&t);
  std::sort(file->by_name_.begin(), file->by_name_.end(), [](auto* a, auto* b) { return a->name < b->name; });
  *out = std::move(file);
  return Status::Ok();
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [](const SafetensorsTensor* t, std::string_view n) { return t->name < n; });
  return it != by_name_.end() && (*it)->name == name ? *it : nullptr;
}

Status SafetensorsFile::Read(const SafetensorsTensor& tensor, std::span<std::byte> dst) const {
  if (dst.size() != tensor.bytes) {
    return Status::Internal("Read of tensor '", tensor.name, "': a buffer of ", dst.size(), " bytes for ", tensor.bytes);
  }
  size_t got = 0;
  if (Status s = ReadFully(fd_, tensor.offset, dst, &got); !s.ok()) {
    return s.Annotated("safetensors file " + path_ + ", tensor '" + tensor.name + "': ");
  }
  if (got != dst.size()) {
    return Bad("safetensors file ", path_, ", tensor '", tensor.name, "': ", dst.size() - got,
               " of its bytes are missing (the file shrank after it was opened)");
  }
  return Status::Ok();
}

}  // namespace cache_dit_opd::server
