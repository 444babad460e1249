// Reading and writing safetensors files (https://huggingface.co/docs/safetensors).
//
// A file is an 8-byte little-endian header length H, H bytes of JSON, then the data. The JSON
// maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the start of the data), plus an optional "__metadata__" object of strings.
// The reader validates everything and never reads past what it was given: every problem is an
// Error that names it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace blockswap {

struct TensorInfo {
  std::string name;
  std::string dtype; // "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0; // byte offsets into the data section
  uint64_t end = 0;
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;       // H
  uint64_t data_bytes = 0;         // file size - 8 - H
  std::vector<TensorInfo> tensors; // in file order of their data
  std::map<std::string, std::string> metadata;
  uint64_t data_offset() const { return 8 + header_bytes; }
};

// Bytes per element of a safetensors dtype; throws Error for an unknown one.
std::size_t dtype_size(std::string_view dtype);

// Parses a header from the first bytes of a file of `file_size` bytes. `prefix` must hold at
// least the 8-byte length and the JSON (or the whole file, if shorter).
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> prefix, uint64_t file_size);

// Reads only the header of the file at `path` (a 24 GB file is planned in milliseconds).
SafetensorsHeader read_safetensors_header(const std::string& path);

struct TensorData {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr; // shape's element count times dtype_size bytes
};

// Writes a safetensors file; throws Error when the file cannot be written.
void write_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

} // namespace blockswap
