#include "blockswap/model_io/checkpoint.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool ends_with(const std::string& text, std::string_view tail) {
  return text.size() >= tail.size() &&
         text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

// The one index JSON, else the one .safetensors file, in `folder`.
std::string file_in(const fs::path& folder) {
  std::vector<std::string> indexes, files;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(folder, error)) {
    const std::string name = entry.path().filename().string();
    if (ends_with(name, ".safetensors.index.json")) indexes.push_back(entry.path().string());
    if (ends_with(name, ".safetensors")) files.push_back(entry.path().string());
  }
  BLOCKSWAP_CHECK(!error, "cannot list the folder '", folder.string(), "': ", error.message());
  std::sort(indexes.begin(), indexes.end());
  auto names = [](const std::vector<std::string>& paths) {
    std::string text;
    for (const std::string& p : paths) {
      text += (text.empty() ? "'" : ", '") + fs::path(p).filename().string() + "'";
    }
    return text;
  };
  BLOCKSWAP_CHECK(indexes.size() <= 1, "the folder '", folder.string(), "' holds several indexes (",
                  names(indexes), "): give the one to read");
  if (indexes.size() == 1) return indexes[0];
  BLOCKSWAP_CHECK(!files.empty(), "the folder '", folder.string(),
                  "' holds no .safetensors file and no *.safetensors.index.json");
  std::sort(files.begin(), files.end());
  BLOCKSWAP_CHECK(files.size() == 1, "the folder '", folder.string(), "' holds ", files.size(),
                  " .safetensors files (", names(files),
                  ") and no *.safetensors.index.json that says which tensor is in which: give "
                  "the file to read");
  return files[0];
}

void add_file(Checkpoint& checkpoint, const std::string& path) {
  const SafetensorsHeader header = read_safetensors_header(path);
  checkpoint.files.push_back(path);
  for (const TensorInfo& info : header.tensors) {
    checkpoint.tensors[info.name] = CheckpointTensor{info, 0, header.data_offset() + info.begin};
  }
}

void add_index(Checkpoint& checkpoint, const std::string& index) {
  json root;
  {
    std::ifstream in(index);
    BLOCKSWAP_CHECK(in.is_open(), "cannot open the index '", index, "'");
    try {
      root = json::parse(in);
    } catch (const json::exception& e) {
      throw Error(detail::concat("the index '", index, "' is not valid JSON: ", e.what()));
    }
  }
  BLOCKSWAP_CHECK(root.is_object() && root.contains("weight_map") && root["weight_map"].is_object(),
                  "the index '", index,
                  "' has no \"weight_map\" object (tensor name -> shard file name)");
  checkpoint.index = index;
  const fs::path folder = fs::path(index).parent_path();
  std::map<std::string, std::size_t> shard_of; // shard file name -> index into files
  std::vector<std::vector<std::string>> wanted;
  for (const auto& [name, shard] : root["weight_map"].items()) {
    BLOCKSWAP_CHECK(shard.is_string(), "the index '", index, "' gives tensor '", name,
                    "' the shard ", shard.dump(), ", not a file name");
    const std::string file = shard.get<std::string>();
    const auto [at, added] = shard_of.emplace(file, checkpoint.files.size());
    if (added) {
      checkpoint.files.push_back((folder / file).string());
      wanted.emplace_back();
    }
    wanted[at->second].push_back(name);
  }
  BLOCKSWAP_CHECK(!checkpoint.files.empty(), "the index '", index, "' names no tensor");
  for (std::size_t f = 0; f < checkpoint.files.size(); ++f) {
    const std::string& path = checkpoint.files[f];
    std::error_code error;
    BLOCKSWAP_CHECK(fs::exists(path, error), "the shard '", path, "' that the index '", index,
                    "' names for tensor '", wanted[f].front(), "' is missing");
    SafetensorsHeader header;
    try {
      header = read_safetensors_header(path);
    } catch (const Error& e) {
      throw Error(detail::concat("the shard '", path, "' of the index '", index, "': ", e.what()));
    }
    std::map<std::string, const TensorInfo*> in_shard;
    for (const TensorInfo& info : header.tensors) in_shard[info.name] = &info;
    for (const std::string& name : wanted[f]) {
      const auto found = in_shard.find(name);
      BLOCKSWAP_CHECK(found != in_shard.end(), "the index '", index, "' puts tensor '", name,
                      "' in the shard '", path, "', which has no such tensor");
      const TensorInfo& info = *found->second;
      checkpoint.tensors[name] = CheckpointTensor{info, f, header.data_offset() + info.begin};
    }
  }
}

} // namespace

std::vector<TensorInfo> Checkpoint::tensor_infos() const {
  std::vector<const CheckpointTensor*> order;
  for (const auto& [name, t] : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const CheckpointTensor* a, const CheckpointTensor* b) {
    return a->file != b->file ? a->file < b->file : a->offset < b->offset;
  });
  std::vector<TensorInfo> infos;
  std::transform(order.begin(), order.end(), std::back_inserter(infos),
                 [](const CheckpointTensor* t) { return t->info; });
  return infos;
}

std::string Checkpoint::where(std::size_t file) const {
  if (index.empty()) return detail::concat("'", files.at(file), "'");
  return detail::concat("'", files.at(file), "' of '", index, "'");
}

Checkpoint open_checkpoint(const std::string& path) {
  Checkpoint checkpoint;
  checkpoint.source = path;
  std::error_code error;
  std::string file = path;
  if (fs::is_directory(path, error)) file = file_in(path);
  if (ends_with(file, ".json")) {
    add_index(checkpoint, file);
  } else {
    add_file(checkpoint, file);
  }
  return checkpoint;
}

} // namespace blockswap
