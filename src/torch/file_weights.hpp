// The blocks' frozen weights in the model's checkpoint (Options::weights_file: one safetensors
// file, or a sharded set; model_io/checkpoint.hpp), under the module's names or through a name
// map (Options::weights_layout, weights_map; model_io/name_map.hpp): where each tensor is, the
// file tier's ranges, reads into packed memory, and the files mapped for views of the blocks
// they hold. Implementer-only (src/torch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "block_layout.hpp"
#include "blockswap/core/file_source.hpp"
#include "blockswap/model_io/name_map.hpp"

namespace blockswap::torch_frontend {

struct FileWeights {
  std::string path;               // as given: a file, an index JSON or a folder
  std::vector<std::string> files; // the files read (PackedTensor::file, FileRange::file)
  std::string prefix; // block b's tensor `name` is prefix + b + "." + name (before the name map)
  std::vector<FileBlock> blocks; // each block's frozen tensors: file ranges to packed offsets
  // Each block's frozen tensors' names in the file, by index into BlockLayout::tensors ("" for
  // the others), for messages: "'double_blocks.0.img_attn.qkv.weight' rows [0, 32)".
  std::vector<std::vector<std::string>> sources;
};

// Finds every frozen tensor of every block in the checkpoint's headers and sets its file and
// file_offset: through `map` when given (names prefix + b + "." + name), else through `layout`
// (model_io/name_map.hpp: "" or "auto", "diffusers", "flux"); with `prefix` empty, the one
// prefix under which all of them are. Throws Error naming the file and the tensor for one
// missing, of another shape or dtype, or needing a transform that is not a row slice, or
// naming the candidates when several prefixes fit. Reads the headers only.
FileWeights locate_weights(const std::string& path, const std::string& prefix,
                           const std::string& layout, const NameMap& map,
                           std::vector<BlockLayout>& layouts, const std::string& label);

// Reads block `block`'s frozen tensors from the file into its packed bytes at `packed`. Throws
// Error naming the file and the tensor on a failed or short read.
void read_frozen(const FileWeights& file, const BlockLayout& layout, int64_t block,
                 std::byte* packed, const std::string& label);

// Throws Error naming the first frozen tensor of the block that differs from its bytes in the
// file: the file tier would load the file's.
void check_same_as_file(const FileWeights& file, const BlockLayout& layout, int64_t block,
                        const std::string& label);

// The whole files mapped copy-on-write (reads come from the page cache on demand; a write
// changes only this process's pages): the memory that views of blocks in the files point into,
// one mapping per file (a sharded checkpoint's shards). Each keeps its file open, so that
// whether the mapping can still be read is asked of the file it maps (mapping_intact),
// wherever its path now leads.
struct FileMap {
  std::vector<std::shared_ptr<Buffer>> bytes; // by file
  std::vector<int> fds;                       // the mapped files', open while their `bytes` live
};
FileMap map_files(const std::vector<std::string>& paths, const std::string& label);

// Whether every mapped file still has the bytes mapped (a mapping reads past the file's end, a
// SIGBUS, once it is shorter). A file deleted or renamed under the run keeps them: the mapping
// holds it.
bool mapping_intact(const FileMap& map);

// Drops this process's changes to `bytes` bytes of a map_file mapping from `data` on (the pages
// that hold them): they read the file's values again.
void revert_to_file(std::byte* data, std::size_t bytes);

} // namespace blockswap::torch_frontend
