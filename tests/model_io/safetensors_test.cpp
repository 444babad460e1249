#include "blockswap/model_io/safetensors.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

std::vector<std::byte> file_bytes(const std::string& json, std::size_t data_bytes,
                                  uint64_t length_override = UINT64_MAX) {
  const uint64_t length = length_override == UINT64_MAX ? json.size() : length_override;
  std::vector<std::byte> bytes(8 + json.size() + data_bytes);
  for (int i = 0; i < 8; ++i) bytes[i] = std::byte((length >> (8 * i)) & 0xFF);
  std::memcpy(bytes.data() + 8, json.data(), json.size());
  return bytes;
}

SafetensorsHeader parse(const std::vector<std::byte>& bytes) {
  return parse_safetensors_header(bytes, bytes.size());
}

void expect_error(const std::vector<std::byte>& bytes, const std::string& part) {
  try {
    parse(bytes);
    ADD_FAILURE() << "no error; expected '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

const std::string kGood =
    R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]},)"
    R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";

TEST(Safetensors, ParsesAValidHeader) {
  const auto header = parse(file_bytes(kGood, 28));
  ASSERT_EQ(header.tensors.size(), 2u);
  EXPECT_EQ(header.tensors[0].name, "a"); // sorted by data offset
  EXPECT_EQ(header.tensors[1].dtype, "BF16");
  EXPECT_EQ(header.tensors[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(header.tensors[1].bytes(), 12u);
  EXPECT_EQ(header.metadata.at("format"), "pt");
  EXPECT_EQ(header.data_bytes, 28u);
  EXPECT_EQ(header.data_offset(), 8 + kGood.size());
}

TEST(Safetensors, TruncatedFile) {
  expect_error(std::vector<std::byte>(5), "truncated safetensors file: 5 bytes");
}

TEST(Safetensors, HeaderLengthPastTheEnd) {
  expect_error(file_bytes(kGood, 28, 1'000'000), "header length 1000000 runs past the end");
}

TEST(Safetensors, InvalidJson) {
  expect_error(file_bytes(R"({"a": {"dtype": )", 0), "not valid JSON");
  expect_error(file_bytes(R"([1, 2])", 0), "must be a JSON object");
}

TEST(Safetensors, UnknownDtype) {
  expect_error(file_bytes(R"({"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}})", 4),
               "unknown safetensors dtype 'F99'");
}

TEST(Safetensors, ShapeDisagreesWithOffsets) {
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16),
               "shape [3] of F32 needs 12 bytes but its data_offsets span 16");
}

TEST(Safetensors, OffsetsOutsideTheData) {
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
               "lie outside the data, which has 8 bytes");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8),
               "end before they begin");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 8),
               "non-negative integer");
}

TEST(Safetensors, OverlappingTensors) {
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                          16),
               "overlap");
}

TEST(Safetensors, MalformedEntries) {
  expect_error(file_bytes(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), "'dtype'");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4), "'shape'");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[1]}})", 4), "data_offsets");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
               "data_offsets");
  expect_error(file_bytes(R"({"a":7})", 4), "expected an object");
  expect_error(file_bytes(R"({"__metadata__":{"k":1}})", 0), "must be a string");
  expect_error(file_bytes(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],)"
                          R"("data_offsets":[0,4]}})",
                          4),
               "too large");
}

TEST(Safetensors, WriteThenReadRoundTrips) {
  const auto path = std::filesystem::temp_directory_path() / "blockswap_roundtrip.safetensors";
  const std::vector<float> a{1, 2, 3, 4};
  const std::vector<uint16_t> b{7, 8, 9};
  write_safetensors(path, {{"x.a", "F32", {2, 2}, a.data()}, {"x.b", "BF16", {3}, b.data()}},
                    {{"note", "test"}});
  const auto header = read_safetensors_header(path);
  ASSERT_EQ(header.tensors.size(), 2u);
  EXPECT_EQ(header.tensors[0].name, "x.a");
  EXPECT_EQ(header.tensors[1].begin, 16u);
  EXPECT_EQ(header.data_offset() % 8, 0u);
  EXPECT_EQ(header.metadata.at("note"), "test");
  EXPECT_EQ(std::filesystem::file_size(path), header.data_offset() + 22);
  std::filesystem::remove(path);
}

TEST(Safetensors, ReadingAMissingFileNamesIt) {
  try {
    read_safetensors_header("/nonexistent/model.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model.safetensors"), std::string::npos);
  }
}

TEST(Safetensors, ADirectoryIsNamedAsOne) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  try {
    read_safetensors_header(dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + dir + "' is a directory"), std::string::npos)
        << e.what();
  }
}

} // namespace
} // namespace blockswap
