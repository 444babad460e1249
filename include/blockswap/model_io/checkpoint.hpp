// A model's weights as users have them: one .safetensors file, a sharded set (diffusers' and
// transformers' `*.safetensors.index.json`, `{"metadata": ..., "weight_map": {tensor: shard}}`,
// or the folder that holds it), or a folder with exactly one .safetensors file. Only the
// headers are read: a sharded 24 GB checkpoint opens in milliseconds.
//
// Every problem is an Error that names the index, the shard and the tensor concerned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "blockswap/model_io/safetensors.hpp"

namespace blockswap {

struct CheckpointTensor {
  TensorInfo info;      // name, dtype, shape; begin and end in its file's data section
  std::size_t file = 0; // its shard: an index into Checkpoint::files
  uint64_t offset = 0;  // its first byte in that file
};

struct Checkpoint {
  std::string source;             // what was given: a file, an index JSON or a folder
  std::string index;              // the index JSON read ("" for one file)
  std::vector<std::string> files; // the files the tensors are in (one for a single file)
  std::map<std::string, CheckpointTensor> tensors; // by name
  // Every tensor, shards one after another, each in its file's order (for group_blocks).
  std::vector<TensorInfo> tensor_infos() const;
  // "'<file>'" for one file, "'<shard>' of '<index>'" for a shard.
  std::string where(std::size_t file) const;
};

// Opens `path`: a .safetensors file, an index JSON, or a folder holding one index JSON or one
// .safetensors file. Throws Error naming the path (a folder: what it holds), the index (bad
// JSON, no weight_map), the shard (missing, not a safetensors file) or the tensor (named by the
// index but not in its shard).
Checkpoint open_checkpoint(const std::string& path);

} // namespace blockswap
