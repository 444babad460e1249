#include "blockswap/model_io/safetensors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

using json = nlohmann::json;

// The safetensors format caps the header at 100 MB; a larger length is a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DType {
  std::string_view name;
  std::size_t size;
};
constexpr DType kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
    {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8},
};

uint64_t read_le64(const std::byte* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | std::to_integer<uint64_t>(p[i]);
  return value;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return text + "]";
}

uint64_t checked_uint(const json& value, const std::string& what) {
  BLOCKSWAP_CHECK(value.is_number_unsigned() ||
                      (value.is_number_integer() && value.get<int64_t>() >= 0),
                  what, " must be a non-negative integer, got ", value.dump());
  return value.get<uint64_t>();
}

TensorInfo parse_tensor(const std::string& name, const json& entry, uint64_t data_bytes) {
  const std::string where = "safetensors tensor '" + name + "'";
  BLOCKSWAP_CHECK(entry.is_object(), where, ": expected an object, got ", entry.type_name());
  TensorInfo info;
  info.name = name;
  BLOCKSWAP_CHECK(entry.contains("dtype") && entry["dtype"].is_string(), where,
                  ": missing string field 'dtype'");
  info.dtype = entry["dtype"].get<std::string>();
  const std::size_t element = dtype_size(info.dtype); // throws for an unknown dtype

  BLOCKSWAP_CHECK(entry.contains("shape") && entry["shape"].is_array(), where,
                  ": missing array field 'shape'");
  uint64_t elements = 1;
  for (const json& dim : entry["shape"]) {
    const uint64_t d = checked_uint(dim, where + " shape entry");
    BLOCKSWAP_CHECK(d == 0 || elements <= std::numeric_limits<uint64_t>::max() / d / element, where,
                    ": shape is too large");
    elements *= d;
    info.shape.push_back(static_cast<int64_t>(d));
  }

  BLOCKSWAP_CHECK(entry.contains("data_offsets") && entry["data_offsets"].is_array() &&
                      entry["data_offsets"].size() == 2,
                  where, ": 'data_offsets' must be an array [begin, end]");
  info.begin = checked_uint(entry["data_offsets"][0], where + " data_offsets begin");
  info.end = checked_uint(entry["data_offsets"][1], where + " data_offsets end");
  BLOCKSWAP_CHECK(info.begin <= info.end, where, ": data_offsets [", info.begin, ", ", info.end,
                  "] end before they begin");
  BLOCKSWAP_CHECK(info.end <= data_bytes, where, ": data_offsets [", info.begin, ", ", info.end,
                  "] lie outside the data, which has ", data_bytes, " bytes");
  BLOCKSWAP_CHECK(elements * element == info.bytes(), where, ": shape ", shape_text(info.shape),
                  " of ", info.dtype, " needs ", elements * element,
                  " bytes but its data_offsets span ", info.bytes());
  return info;
}

} // namespace

std::size_t dtype_size(std::string_view dtype) {
  for (const DType& d : kDTypes) {
    if (d.name == dtype) return d.size;
  }
  throw Error(detail::concat("unknown safetensors dtype '", dtype, "'"));
}

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> prefix, uint64_t file_size) {
  BLOCKSWAP_CHECK(file_size >= 8 && prefix.size() >= 8, "truncated safetensors file: ", file_size,
                  " bytes, less than the 8-byte header length");
  SafetensorsHeader header;
  header.header_bytes = read_le64(prefix.data());
  BLOCKSWAP_CHECK(header.header_bytes <= file_size - 8, "safetensors header length ",
                  header.header_bytes, " runs past the end of the file (", file_size, " bytes)");
  BLOCKSWAP_CHECK(header.header_bytes <= kMaxHeaderBytes, "safetensors header length ",
                  header.header_bytes, " is over the format's limit of ", kMaxHeaderBytes);
  BLOCKSWAP_CHECK(prefix.size() >= 8 + header.header_bytes,
                  "safetensors header is truncated: ", prefix.size() - 8, " of ",
                  header.header_bytes, " bytes available");
  header.data_bytes = file_size - 8 - header.header_bytes;

  const auto* text = reinterpret_cast<const char*>(prefix.data() + 8);
  json root;
  try {
    root = json::parse(text, text + header.header_bytes);
  } catch (const json::exception& e) {
    throw Error(detail::concat("safetensors header is not valid JSON: ", e.what()));
  }
  BLOCKSWAP_CHECK(root.is_object(), "safetensors header must be a JSON object, got ",
                  root.type_name());
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      BLOCKSWAP_CHECK(entry.is_object(), "safetensors __metadata__ must be an object");
      for (const auto& [key, value] : entry.items()) {
        BLOCKSWAP_CHECK(value.is_string(), "safetensors __metadata__ '", key, "' must be a string");
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    header.tensors.push_back(parse_tensor(name, entry, header.data_bytes));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  for (std::size_t i = 1; i < header.tensors.size(); ++i) {
    const TensorInfo& a = header.tensors[i - 1];
    const TensorInfo& b = header.tensors[i];
    BLOCKSWAP_CHECK(b.begin >= a.end || a.bytes() == 0 || b.bytes() == 0, "safetensors tensors '",
                    a.name, "' [", a.begin, ", ", a.end, ") and '", b.name, "' [", b.begin, ", ",
                    b.end, ") overlap");
  }
  return header;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::error_code error;
  const auto type = std::filesystem::status(path, error).type();
  // A FIFO or a device would make the open below wait, or read forever.
  BLOCKSWAP_CHECK(type != std::filesystem::file_type::directory, "'", path,
                  "' is a directory: give the model's .safetensors file in it");
  BLOCKSWAP_CHECK(error || type == std::filesystem::file_type::regular, "'", path,
                  "' is not a regular file: give the model's .safetensors file");
  std::ifstream file(path, std::ios::binary | std::ios::ate);
  BLOCKSWAP_CHECK(file.is_open(), "cannot open '", path, "'");
  const auto file_size = static_cast<uint64_t>(file.tellg());
  file.seekg(0);
  std::vector<std::byte> prefix(std::min<uint64_t>(file_size, 8));
  file.read(reinterpret_cast<char*>(prefix.data()), static_cast<std::streamsize>(prefix.size()));
  try {
    if (prefix.size() == 8) {
      const uint64_t length = read_le64(prefix.data());
      if (length <= file_size - 8 && length <= kMaxHeaderBytes) {
        prefix.resize(8 + length);
        file.read(reinterpret_cast<char*>(prefix.data() + 8), static_cast<std::streamsize>(length));
      }
    }
    BLOCKSWAP_CHECK(file.good() || file.eof(), "cannot read '", path, "'");
    return parse_safetensors_header(prefix, file_size);
  } catch (const Error& e) {
    throw Error(detail::concat(path, ": ", e.what()));
  }
}

void write_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json root = json::object();
  if (!metadata.empty()) root["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<uint64_t> sizes;
  for (const TensorData& t : tensors) {
    uint64_t bytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      BLOCKSWAP_CHECK(d >= 0, "tensor '", t.name, "' has a negative dimension");
      bytes *= static_cast<uint64_t>(d);
    }
    root[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string text = root.dump();
  text.append((8 - text.size() % 8) % 8, ' '); // the data starts 8-byte aligned
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  BLOCKSWAP_CHECK(file.is_open(), "cannot write '", path, "'");
  std::byte length[8];
  for (int i = 0; i < 8; ++i) length[i] = std::byte((text.size() >> (8 * i)) & 0xFF);
  file.write(reinterpret_cast<const char*>(length), 8);
  file.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    file.write(static_cast<const char*>(tensors[i].data), static_cast<std::streamsize>(sizes[i]));
  }
  BLOCKSWAP_CHECK(file.good(), "error while writing '", path, "'");
}

} // namespace blockswap
