// The blocks' frozen weights in the model's safetensors file (Options::weights_file): where each
// tensor is, the file tier's ranges, reads into packed memory, and the file mapped for views of
// the blocks it holds. Implementer-only (src/torch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "block_layout.hpp"
#include "blockswap/core/file_source.hpp"

namespace blockswap::torch_frontend {

struct FileWeights {
  std::string path;
  std::string prefix;            // block b's tensor `name` is prefix + b + "." + name
  std::vector<FileBlock> blocks; // each block's frozen tensors: file ranges to packed offsets
};

// Finds every frozen tensor of every block in the file's header and sets its file_offset; with
// `prefix` empty, the one prefix under which all of them are. Throws Error naming the file and
// the tensor for one missing or of another shape or dtype, or naming the candidates when several
// prefixes fit. Reads the header only.
FileWeights locate_weights(const std::string& path, const std::string& prefix,
                           std::vector<BlockLayout>& layouts, const std::string& label);

// Reads block `block`'s frozen tensors from the file into its packed bytes at `packed`. Throws
// Error naming the file and the tensor on a failed or short read.
void read_frozen(const FileWeights& file, const BlockLayout& layout, int64_t block,
                 std::byte* packed, const std::string& label);

// Throws Error naming the first frozen tensor of the block that differs from its bytes in the
// file: the file tier would load the file's.
void check_same_as_file(const FileWeights& file, const BlockLayout& layout, int64_t block,
                        const std::string& label);

// The whole file mapped copy-on-write (reads come from the page cache on demand; a write
// changes only this process's pages): the memory that views of blocks in the file point into.
// It keeps the file open, so that whether the mapping can still be read is asked of the file
// it maps (mapping_intact), wherever its path now leads.
struct FileMap {
  std::shared_ptr<Buffer> bytes;
  int fd = -1; // the mapped file's, open while `bytes` lives
};
FileMap map_file(const std::string& path, const std::string& label);

// Whether the mapped file still has the bytes mapped (a mapping reads past the file's end, a
// SIGBUS, once it is shorter). A file deleted or renamed under the run keeps them: the mapping
// holds it.
bool mapping_intact(const FileMap& map);

// Drops this process's changes to `bytes` bytes of a map_file mapping from `data` on (the pages
// that hold them): they read the file's values again.
void revert_to_file(std::byte* data, std::size_t bytes);

} // namespace blockswap::torch_frontend
