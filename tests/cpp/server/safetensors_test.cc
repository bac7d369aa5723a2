// server/store/safetensors.h: a file the reference writer made is read right;
// every way a file can be wrong is refused with the value named.
#include "server/store/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "test_util.h"

namespace cache_dit_opd::server {
namespace {

using testing::SafetensorsImage;
using testing::TempDir;


std::string Write(const TempDir& dir, const std::string& bytes, const std::string& name = "t.safetensors") {
  std::ofstream(dir.File(name), std::ios::binary) << bytes;
  return dir.File(name);
}

Status OpenImage(const std::string& bytes, std::unique_ptr<SafetensorsFile>* file = nullptr) {
  TempDir dir;
  std::unique_ptr<SafetensorsFile> f;
  Status s = SafetensorsFile::Open(Write(dir, bytes), &f);
  if (file) *file = std::move(f);
  return s;
}

// The message of a refused header, which must be INVALID_ARGUMENT [BAD_ARGUMENT].
std::string Refusal(const std::string& header, uint64_t data_bytes) {
  SafetensorsIndex index;
  Status s = ParseSafetensorsHeader(header, 8 + header.size(), data_bytes, &index);
  EXPECT_FALSE(s.ok()) << header;
  EXPECT_EQ(s.reason(), Reason::kBadArgument) << s.ToString();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  return s.message();
}

TEST(SafetensorsTest, ReadsTheFileTheReferenceWriterMade) {
  // tests/data/reference.safetensors: written by PyPI safetensors 0.8.0
  // (tests/data/README.md says how), padded header, seven dtypes, a scalar
  // and an empty tensor.
  std::unique_ptr<SafetensorsFile> f;
  ASSERT_TRUE(SafetensorsFile::Open(OPD_REFERENCE_SAFETENSORS, &f).ok());
  const SafetensorsIndex& ix = f->index();
  EXPECT_EQ(ix.data_offset, 8u + 528u);
  EXPECT_EQ(ix.data_bytes, 119u);
  ASSERT_EQ(ix.tensors.size(), 7u);
  ASSERT_EQ(ix.metadata.size(), 2u);
  EXPECT_EQ(ix.metadata[0], std::make_pair(std::string("format"), std::string("pt")));
  EXPECT_EQ(ix.metadata[1].second, "safetensors 0.8.0");

  struct Want { const char* name; DType dtype; std::vector<int64_t> shape; uint64_t begin, bytes; };
  const Want want[] = {
      {"empty", DType::kInt64, {0, 3}, 0, 0},           {"scale", DType::kFloat64, {}, 0, 8},
      {"blocks.0.ff.wscales", DType::kBFloat16, {2, 6}, 8, 24},
      {"blocks.0.ff.bias", DType::kFloat16, {6}, 32, 12}, {"codes", DType::kFloat8E4M3FN, {8}, 44, 8},
      {"blocks.0.ff.qweight", DType::kInt8, {4, 16}, 52, 64}, {"mask", DType::kBool, {3}, 116, 3},
  };
  for (const Want& w : want) {
    const SafetensorsTensor* t = f->Find(w.name);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->dtype, w.dtype) << w.name;
    EXPECT_EQ(t->shape, w.shape) << w.name;
    EXPECT_EQ(t->offset, ix.data_offset + w.begin) << w.name;
    EXPECT_EQ(t->bytes, w.bytes) << w.name;
  }
  EXPECT_EQ(f->Find("blocks.0.ff"), nullptr);

  // The bytes: qweight is arange(-8, 8) four times, mask is [1, 0, 1].
  std::vector<std::byte> q(64);
  ASSERT_TRUE(f->Read(*f->Find("blocks.0.ff.qweight"), q).ok());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(static_cast<int8_t>(q[i]), -8 + i % 16) << i;
  std::vector<std::byte> m(3);
  ASSERT_TRUE(f->Read(*f->Find("mask"), m).ok());
  EXPECT_EQ(std::vector<int>({int(m[0]), int(m[1]), int(m[2])}), std::vector<int>({1, 0, 1}));
}

TEST(SafetensorsTest, AcceptsTheFormatsCorners) {
  SafetensorsIndex ix;
  // No tensor at all, no data: a valid (empty) file.
  EXPECT_TRUE(ParseSafetensorsHeader("{}", 10, 0, &ix).ok());
  EXPECT_TRUE(ix.tensors.empty());
  // Order in the header is not offset order; JSON whitespace and escapes.
  ASSERT_TRUE(ParseSafetensorsHeader(
                  R"({ "b" : {"data_offsets":[4,8],"shape":[2],"dtype":"F16"},
                       "a\u00e9" : {"dtype":"U8","shape":[2,2],"data_offsets":[0,4]} }   )",
                  100, 8, &ix)
                  .ok());
  ASSERT_EQ(ix.tensors.size(), 2u);
  EXPECT_EQ(ix.tensors[0].name, "a\xc3\xa9");
  EXPECT_EQ(ix.tensors[0].offset, 100u);
  EXPECT_EQ(ix.tensors[1].name, "b");
  EXPECT_EQ(ix.tensors[1].offset, 104u);
  // Eight dimensions, the most a call's view has.
  EXPECT_TRUE(ParseSafetensorsHeader(R"({"x":{"dtype":"I32","shape":[1,1,1,1,1,1,1,2],"data_offsets":[0,8]}})",
                                     8, 8, &ix)
                  .ok());
}

TEST(SafetensorsTest, RefusesEveryHeaderThatBreaksTheFormatNamingTheValue) {
  const std::string x = R"("x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case { std::string header; uint64_t data; const char* says; };
  const Case cases[] = {
      {"", 0, "does not start with '{'"},
      {" {}", 0, "does not start with '{'"},
      {"[1]", 0, "does not start with '{'"},
      {"{" + x, 8, "not JSON at byte"},
      {"{" + x + "}}", 8, "not JSON at byte"},
      {"{" + x + "} x", 8, "not JSON at byte"},
      {R"({"x":5})", 0, "the number 5 as tensor 'x'"},
      {R"({"x":[]})", 0, "an array as tensor 'x'"},
      {R"({"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", 0, "a tensor with 0 bytes"},
      {"{\"" + std::string(1025, 'n') + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", 0, "1025 bytes"},
      {"{" + x + "," + x + "}", 16, "names tensor 'x' twice"},
      {R"({"x":{"dtype":"F32","shape":[2]}})", 8, "tensor 'x': no 'data_offsets'"},
      {R"({"x":{"shape":[2],"data_offsets":[0,8]}})", 8, "tensor 'x': no 'dtype'"},
      {R"({"x":{"dtype":"F32","data_offsets":[0,8]}})", 8, "tensor 'x': no 'shape'"},
      {R"({"x":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "a second 'dtype'"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", 8, "the key 'extra'"},
      {R"({"x":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}})", 4, "dtype 'I16', which the daemon does not store"},
      {R"({"x":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", 8, "tensor 'x': the number 7 (at 'dtype')"},
      {R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "the negative number -2"},
      {R"({"x":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8, "the number 2.0"},
      {R"({"x":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", 8, "an array"},
      {R"({"x":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8, "the dimension 9223372036854775808"},
      {R"({"x":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})", 1, "more than 8 dimensions"},
      {R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8, "overflows 64 bits"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "data_offsets of 1 numbers"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", 8, "data_offsets of more than 2"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "(begin > end)"},
      {R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "8 bytes, but its dtype and shape take 12"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"a":1}})", 8, "__metadata__ holds the number 1"},
      {R"({"__metadata__":{"a":{}}})", 0, "__metadata__ holds an object"},
      {R"({"__metadata__":{"a":"1","a":"2"}})", 0, "__metadata__ has the key 'a' twice"},
      {R"({"__metadata__":{},"__metadata__":{}})", 0, "names tensor '__metadata__' twice"},
      {R"({"x":null})", 0, "null as tensor 'x'"},
      {R"({"x":{"dtype":true}})", 0, "a boolean"},
      // The tiling of the data section.
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "begins at data byte 4, but the tensor before it ends at 0 (a hole)"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "'y' begins at data byte 4, but the tensor before it ends at 8 (they overlap)"},
      {"{" + x + "}", 4, "end at data byte 8, but the file holds 4 data bytes (it is truncated, or the header lies"},
      {"{" + x + "}", 9, "end at data byte 8, but the file holds 9 data bytes (bytes no tensor owns)"},
  };
  for (const Case& c : cases) {
    std::string message = Refusal(c.header, c.data);
    EXPECT_NE(message.find(c.says), std::string::npos) << c.header.substr(0, 120) << "\n  said: " << message;
  }
}

TEST(SafetensorsTest, RefusesFilesThatAreMissingTruncatedOrNotFiles) {
  TempDir dir;
  std::unique_ptr<SafetensorsFile> f;
  Status s = SafetensorsFile::Open(dir.File("missing.safetensors"), &f);
  EXPECT_EQ(s.reason(), Reason::kBadArgument);
  EXPECT_NE(s.message().find(dir.File("missing.safetensors") + ": No such file or directory"), std::string::npos)
      << s.message();

  s = SafetensorsFile::Open(dir.path(), &f);
  EXPECT_NE(s.message().find("not a regular file"), std::string::npos) << s.message();
  ASSERT_EQ(mkfifo(dir.File("fifo").c_str(), 0600), 0);
  s = SafetensorsFile::Open(dir.File("fifo"), &f);  // returns at once: no writer is waited for
  EXPECT_NE(s.message().find("not a regular file"), std::string::npos) << s.message();

  const std::string good = SafetensorsImage(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  ASSERT_TRUE(OpenImage(good, &f).ok());
  EXPECT_NE(OpenImage(good.substr(0, 5)).message().find("5 bytes: shorter than the 8-byte header length"), std::string::npos);
  EXPECT_NE(OpenImage(good.substr(0, 20)).message().find("in a file of 20 (truncated)"), std::string::npos);
  EXPECT_NE(OpenImage(good.substr(0, good.size() - 1)).message().find("holds 7 data bytes (it is truncated"),
            std::string::npos);
  std::string huge = good;
  huge[5] = 1;  // a header length of 2^40 + ...
  EXPECT_NE(OpenImage(huge).message().find("at most 100000000"), std::string::npos) << OpenImage(huge).message();
  s = OpenImage(SafetensorsImage("{\"x\"", 0));
  EXPECT_NE(s.message().find("t.safetensors: the header is not JSON"), std::string::npos) << s.message();
  EXPECT_EQ(s.reason(), Reason::kBadArgument);

  if (geteuid() != 0) {  // root reads any file
    std::string path = Write(dir, good, "locked.safetensors");
    ASSERT_EQ(chmod(path.c_str(), 0), 0);
    s = SafetensorsFile::Open(path, &f);
    EXPECT_EQ(s.reason(), Reason::kBadArgument);
    EXPECT_NE(s.message().find("the daemon may not read it"), std::string::npos) << s.message();
  }
}

TEST(SafetensorsTest, AFileThatShrinksAfterOpenIsAnErrorNamingTheTensor) {
  TempDir dir;
  std::string path = Write(dir, SafetensorsImage(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8));
  std::unique_ptr<SafetensorsFile> f;
  ASSERT_TRUE(SafetensorsFile::Open(path, &f).ok());
  ASSERT_EQ(truncate(path.c_str(), static_cast<off_t>(f->index().data_offset + 3)), 0);
  std::vector<std::byte> dst(8);
  Status s = f->Read(f->index().tensors[0], dst);
  EXPECT_EQ(s.reason(), Reason::kBadArgument);
  EXPECT_NE(s.message().find("tensor 'x': 5 of its bytes are missing"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace cache_dit_opd::server
