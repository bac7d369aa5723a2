// opd_ring_decode: decodes one call-ring record with the daemon's own decoder
// (common/ring_decode.h) and prints the result as one JSON object, so that
// another implementation of the record layout (the Python client's encoder)
// can be tested against the daemon without a daemon.
//
//   opd_ring_decode RECORD_FILE CATALOG_FILE
//
// RECORD_FILE holds the record's bytes (a whole slot or just record_bytes).
// CATALOG_FILE lists the op catalog in OpenSessionReply order, one
// "name overload" per line ("name" alone for the default overload); blank
// lines are skipped. Output on stdout, exit status 0:
//   {"ok": true, "ticket": T, "lane": L, "seq": S, "op": "name", "overload": "out",
//    "args": [{"kind": "tensor", "region_id": R, "byte_offset": O, "sizes": [..],
//              "strides": [..], "dtype": N}, {"kind": "int", "value": V},
//             {"kind": "float", "value": F}, {"kind": "bool", "value": true},
//             {"kind": "int_list", "values": [..]}, {"kind": "float_list", ...},
//             {"kind": "bool_list", ...}, {"kind": "none"}]}
// A record the daemon rejects: {"ok": false, "code": 3, "message": "..."},
// exit status 1. Floats print with 17 significant digits (NaN and
// +/-Infinity as Python's json module reads them). Usage or I/O errors: a
// line on stderr, exit status 2.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <variant>
#include <vector>

#include "common/ring_decode.h"

namespace cache_dit_opd {
namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string Float(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

template <typename T, typename F>
std::string List(const std::vector<T>& v, F format) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    out += format(v[i]);
  }
  return out + "]";
}

std::string Int(int64_t v) { return std::to_string(v); }
std::string Bool(bool v) { return v ? "true" : "false"; }

std::string ArgJson(const Arg& a) {
  if (std::holds_alternative<NoneArg>(a)) return "{\"kind\": \"none\"}";
  if (const auto* t = std::get_if<TensorRef>(&a)) {
    return "{\"kind\": \"tensor\", \"region_id\": " + std::to_string(t->region_id) +
           ", \"byte_offset\": " + std::to_string(t->byte_offset) + ", \"sizes\": " + List(t->sizes, Int) +
           ", \"strides\": " + List(t->strides, Int) + ", \"dtype\": " + std::to_string(static_cast<int>(t->dtype)) +
           "}";
  }
  if (const auto* i = std::get_if<int64_t>(&a)) return "{\"kind\": \"int\", \"value\": " + Int(*i) + "}";
  if (const auto* f = std::get_if<double>(&a)) return "{\"kind\": \"float\", \"value\": " + Float(*f) + "}";
  if (const auto* b = std::get_if<bool>(&a)) return "{\"kind\": \"bool\", \"value\": " + Bool(*b) + "}";
  if (const auto* l = std::get_if<std::vector<int64_t>>(&a)) {
    return "{\"kind\": \"int_list\", \"values\": " + List(*l, Int) + "}";
  }
  if (const auto* l = std::get_if<std::vector<double>>(&a)) {
    return "{\"kind\": \"float_list\", \"values\": " + List(*l, Float) + "}";
  }
  const auto& l = std::get<std::vector<bool>>(a);
  std::string out = "[";
  for (size_t i = 0; i < l.size(); ++i) out += (i ? ", " : "") + Bool(l[i]);
  return "{\"kind\": \"bool_list\", \"values\": " + out + "]}";
}

bool ReadCatalog(const char* path, std::vector<OpInfo>* catalog) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    OpInfo op;
    const size_t space = line.find(' ');
    op.name = line.substr(0, space);
    if (space != std::string::npos) {
      op.overload = line.substr(space + 1);
      while (!op.overload.empty() && (op.overload.back() == ' ' || op.overload.back() == '\t')) op.overload.pop_back();
    }
    catalog->push_back(std::move(op));
  }
  return true;
}

int Main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: opd_ring_decode RECORD_FILE CATALOG_FILE\n");
    return 2;
  }
  std::ifstream rf(argv[1], std::ios::binary);
  if (!rf) {
    std::fprintf(stderr, "opd_ring_decode: cannot read %s\n", argv[1]);
    return 2;
  }
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(rf)), std::istreambuf_iterator<char>());
  std::vector<OpInfo> catalog;
  if (!ReadCatalog(argv[2], &catalog)) {
    std::fprintf(stderr, "opd_ring_decode: cannot read %s\n", argv[2]);
    return 2;
  }
  CallRequest req;
  RecordIds ids;
  Status s = DecodeRecord(bytes.data(), bytes.size(), catalog, &req, &ids);
  if (!s.ok()) {
    std::printf("{\"ok\": false, \"code\": %d, \"message\": %s}\n", static_cast<int>(s.code()),
                Quote(s.message()).c_str());
    return 1;
  }
  std::string args = "[";
  for (size_t i = 0; i < req.args.size(); ++i) args += (i ? ", " : "") + ArgJson(req.args[i]);
  args += "]";
  std::printf("{\"ok\": true, \"ticket\": %" PRIu64 ", \"lane\": %" PRIu32 ", \"seq\": %" PRIu64
              ", \"op\": %s, \"overload\": %s, \"args\": %s}\n",
              ids.ticket, ids.lane, ids.seq, Quote(req.op).c_str(), Quote(req.overload).c_str(), args.c_str());
  return 0;
}

}  // namespace
}  // namespace cache_dit_opd

int main(int argc, char** argv) { return cache_dit_opd::Main(argc, argv); }
