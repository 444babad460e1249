#include "file_weights.hpp"

#include <ATen/core/Tensor.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/safetensors.hpp"

namespace blockswap::torch_frontend {
namespace {

std::string safetensors_dtype(c10::ScalarType dtype) {
  switch (dtype) {
  case c10::ScalarType::Bool:
    return "BOOL";
  case c10::ScalarType::Byte:
    return "U8";
  case c10::ScalarType::Char:
    return "I8";
  case c10::ScalarType::Float8_e5m2:
    return "F8_E5M2";
  case c10::ScalarType::Float8_e4m3fn:
    return "F8_E4M3";
  case c10::ScalarType::Short:
    return "I16";
  case c10::ScalarType::Half:
    return "F16";
  case c10::ScalarType::BFloat16:
    return "BF16";
  case c10::ScalarType::Int:
    return "I32";
  case c10::ScalarType::Float:
    return "F32";
  case c10::ScalarType::Long:
    return "I64";
  case c10::ScalarType::Double:
    return "F64";
  default:
    return c10::toString(dtype);
  }
}

// A block's tensor name as a model file has it: peft's adapter wrappers add ".base_layer".
std::string file_name(std::string name) {
  const std::string wrapper = ".base_layer";
  for (std::size_t at; (at = name.find(wrapper + ".")) != std::string::npos;) {
    name.erase(at, wrapper.size());
  }
  return name;
}

// Why the blocks' frozen tensors are not all under `prefix`, or nothing.
std::string mismatch(const std::map<std::string, const TensorInfo*>& tensors,
                     const std::string& prefix, const std::vector<BlockLayout>& layouts) {
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    for (const PackedTensor& t : layouts[b].tensors) {
      if (t.role != Role::frozen) continue;
      const std::string name = prefix + std::to_string(b) + "." + file_name(t.name);
      const auto found = tensors.find(name);
      if (found == tensors.end()) {
        return detail::concat("has no tensor '", name, "' (tensor '", t.name, "' of block ", b,
                              ")");
      }
      const TensorInfo& info = *found->second;
      if (info.shape != t.sizes || info.dtype != safetensors_dtype(t.dtype)) {
        return detail::concat("has '", name, "' as ", info.dtype, " ", at::IntArrayRef(info.shape),
                              ", but the block's tensor is ", safetensors_dtype(t.dtype), " ",
                              at::IntArrayRef(t.sizes),
                              info.shape != t.sizes
                                  ? ": another model's file, or another block list's (set "
                                    "weights_prefix)"
                                  : ": the file tier copies the file's bytes as they are, so the "
                                    "model must have the file's dtypes (cast after loading is "
                                    "not possible)");
      }
    }
  }
  return {};
}

class File {
public:
  File(const std::string& path, const std::string& label) : path_(path), label_(label) {
    // O_NONBLOCK: a FIFO would wait for a writer (read_safetensors_header names it first).
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    BLOCKSWAP_CHECK(fd_ >= 0, "[", label, "] cannot open '", path, "': ", std::strerror(errno));
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  int fd() const { return fd_; }

  // Reads `bytes` at `offset` (buffered, then dropped from the page cache).
  void read(std::byte* into, uint64_t offset, std::size_t bytes, const std::string& what) const {
    std::size_t done = 0;
    while (done < bytes) {
      const ssize_t got =
          ::pread(fd_, into + done, bytes - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      BLOCKSWAP_CHECK(got >= 0, "[", label_, "] reading ", what, " from '", path_,
                      "': ", std::strerror(errno));
      BLOCKSWAP_CHECK(got > 0, "[", label_, "] reading ", what, " from '", path_,
                      "': the file ended at byte ", offset + done, " (truncated?)");
      done += static_cast<std::size_t>(got);
    }
    ::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                    POSIX_FADV_DONTNEED);
  }

private:
  std::string path_, label_;
  int fd_ = -1;
};

} // namespace

FileWeights locate_weights(const std::string& path, const std::string& prefix,
                           std::vector<BlockLayout>& layouts, const std::string& label) {
  SafetensorsHeader header;
  try {
    header = read_safetensors_header(path);
  } catch (const Error& e) {
    throw Error(detail::concat("[", label, "] weights_file: ", e.what()));
  }
  std::map<std::string, const TensorInfo*> tensors;
  for (const TensorInfo& info : header.tensors) tensors[info.name] = &info;
  FileWeights file{path, prefix, {}};
  if (prefix.empty()) { // the prefixes under which block 0's first frozen tensor is
    std::set<std::string> candidates;
    for (std::size_t b = 0; b < layouts.size() && candidates.empty(); ++b) {
      for (const PackedTensor& t : layouts[b].tensors) {
        if (t.role != Role::frozen) continue;
        const std::string tail = std::to_string(b) + "." + file_name(t.name);
        for (const auto& [name, info] : tensors) {
          if (name.size() < tail.size() ||
              name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
            continue;
          }
          const std::string before = name.substr(0, name.size() - tail.size());
          if (before.empty() || before.back() == '.') candidates.insert(before);
        }
        break;
      }
    }
    std::vector<std::string> fit;
    std::string why = "has none of the blocks' tensors under any prefix";
    for (const std::string& candidate : candidates) {
      const std::string wrong = mismatch(tensors, candidate, layouts);
      if (wrong.empty()) {
        fit.push_back(candidate);
      } else {
        why = wrong;
      }
    }
    BLOCKSWAP_CHECK(!fit.empty(), "[", label, "] weights_file '", path, "' ", why);
    BLOCKSWAP_CHECK(fit.size() == 1, "[", label, "] weights_file '", path,
                    "' holds the blocks' tensors under several prefixes ('", fit[0], "', '", fit[1],
                    "'): say which with weights_prefix");
    file.prefix = fit[0];
  } else {
    const std::string wrong = mismatch(tensors, prefix, layouts);
    BLOCKSWAP_CHECK(wrong.empty(), "[", label, "] weights_file '", path, "' ", wrong,
                    " (weights_prefix '", prefix, "')");
  }
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    FileBlock block;
    block.bytes = layouts[b].bytes;
    for (PackedTensor& t : layouts[b].tensors) {
      if (t.role != Role::frozen) continue;
      const TensorInfo& info =
          *tensors.at(file.prefix + std::to_string(b) + "." + file_name(t.name));
      t.file_offset = header.data_offset() + info.begin;
      block.ranges.push_back(
          FileRange{t.file_offset, static_cast<std::size_t>(info.bytes()), t.offset});
    }
    file.blocks.push_back(std::move(block));
  }
  return file;
}

void read_frozen(const FileWeights& file, const BlockLayout& layout, int64_t block,
                 std::byte* packed, const std::string& label) {
  const File opened(file.path, label);
  for (const PackedTensor& t : layout.tensors) {
    if (t.role != Role::frozen) continue;
    const std::size_t bytes =
        static_cast<std::size_t>(t.variable.numel()) * t.variable.element_size();
    opened.read(packed + t.offset, t.file_offset, bytes,
                detail::concat("tensor '", t.name, "' of block ", block));
  }
}

void check_same_as_file(const FileWeights& file, const BlockLayout& layout, int64_t block,
                        const std::string& label) {
  const File opened(file.path, label);
  for (const PackedTensor& t : layout.tensors) {
    if (t.role != Role::frozen) continue;
    const at::Tensor values = t.variable.detach().to(at::kCPU).contiguous();
    const std::size_t bytes = static_cast<std::size_t>(values.numel()) * values.element_size();
    std::vector<std::byte> in_file(bytes);
    opened.read(in_file.data(), t.file_offset, bytes,
                detail::concat("tensor '", t.name, "' of block ", block));
    BLOCKSWAP_CHECK(std::memcmp(in_file.data(), values.data_ptr(), bytes) == 0, "[", label,
                    "] tensor '", t.name, "' of block ", block, " differs from '", file.prefix,
                    block, ".", file_name(t.name), "' in '", file.path,
                    "', and the file tier would load the file's: save the model's weights to a "
                    "file and give that one, or leave host_budget_bytes unset");
  }
}

FileMap map_file(const std::string& path, const std::string& label) {
  const File opened(path, label);
  struct stat s {};
  BLOCKSWAP_CHECK(::fstat(opened.fd(), &s) == 0 && s.st_size > 0, "[", label, "] cannot map '",
                  path, "': ", std::strerror(errno));
  const auto bytes = static_cast<std::size_t>(s.st_size);
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, opened.fd(), 0);
  BLOCKSWAP_CHECK(data != MAP_FAILED, "[", label, "] cannot map '", path,
                  "': ", std::strerror(errno));
  const int fd = ::fcntl(opened.fd(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    const int error = errno;
    ::munmap(data, bytes);
    throw Error(
        detail::concat("[", label, "] cannot keep '", path, "' open: ", std::strerror(error)));
  }
  auto mapped = std::make_shared<Buffer>(static_cast<std::byte*>(data), bytes,
                                         [fd](std::byte* p, std::size_t n) {
                                           ::munmap(p, n);
                                           ::close(fd);
                                         });
  return FileMap{std::move(mapped), fd};
}

bool mapping_intact(const FileMap& map) {
  struct stat s {};
  return ::fstat(map.fd, &s) == 0 && static_cast<std::size_t>(s.st_size) >= map.bytes->size();
}

void revert_to_file(std::byte* data, std::size_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) / page * page;
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED); // private pages dropped
}

} // namespace blockswap::torch_frontend
