#include "file_weights.hpp"

#include <ATen/core/Tensor.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/checkpoint.hpp"
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

// Why the blocks' frozen tensors are not all found under `prefix` through `map` (nothing: they
// are), and how many were found before the one that was not: of several candidates', the
// reason of the one that came furthest is the one to tell.
struct Mismatch {
  std::string why;
  std::size_t found = 0;
};
Mismatch mismatch(const Checkpoint& checkpoint, const NameMap& map, const std::string& prefix,
                  const std::vector<BlockLayout>& layouts) {
  std::size_t found = 0;
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    for (const PackedTensor& t : layouts[b].tensors) {
      if (t.role != Role::frozen) continue;
      const std::string name = prefix + std::to_string(b) + "." + file_name(t.name);
      const Located at = locate_tensor(checkpoint, map, name, safetensors_dtype(t.dtype), t.sizes);
      if (!at.tensor) {
        return {detail::concat(at.why, " (tensor '", t.name, "' of block ", b, ")"), found};
      }
      ++found;
    }
  }
  return {};
}

// The prefixes under which block 0's first frozen tensor is in the file under its own name.
std::vector<std::string> prefixes_in(const Checkpoint& checkpoint,
                                     const std::vector<BlockLayout>& layouts) {
  std::set<std::string> candidates;
  for (std::size_t b = 0; b < layouts.size() && candidates.empty(); ++b) {
    for (const PackedTensor& t : layouts[b].tensors) {
      if (t.role != Role::frozen) continue;
      const std::string tail = std::to_string(b) + "." + file_name(t.name);
      for (const auto& [name, info] : checkpoint.tensors) {
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
  return {candidates.begin(), candidates.end()};
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
                           const std::string& layout_text, const NameMap& map,
                           std::vector<BlockLayout>& layouts, const std::string& label) {
  Checkpoint checkpoint;
  WeightsLayout layout = WeightsLayout::automatic;
  try {
    layout = parse_weights_layout(layout_text);
    checkpoint = open_checkpoint(path);
  } catch (const Error& e) {
    throw Error(detail::concat("[", label, "] weights_file: ", e.what()));
  }
  // The maps to try, in turn, each with the prefixes to try it with: the user's map; else the
  // module's own names, then (automatic, in a file of that layout) FLUX's.
  struct Attempt {
    NameMap map;
    std::vector<std::string> prefixes;
    std::string_view said; // for messages
  };
  std::vector<Attempt> attempts;
  const auto given = [&](std::vector<std::string> found) {
    return prefix.empty() ? std::move(found) : std::vector<std::string>{prefix};
  };
  if (map) {
    attempts.push_back({map, {prefix}, "weights_map"});
  } else {
    if (layout != WeightsLayout::flux) {
      attempts.push_back({nullptr, given(prefixes_in(checkpoint, layouts)), ""});
    }
    if (layout == WeightsLayout::flux ||
        (layout == WeightsLayout::automatic && in_flux_layout(checkpoint))) {
      attempts.push_back({layout_map(WeightsLayout::flux),
                          given(layout_prefixes(WeightsLayout::flux)), "weights_layout 'flux'"});
    }
  }
  Mismatch furthest{"has none of the blocks' tensors under any prefix", 0};
  std::string_view furthest_said;
  for (const Attempt& attempt : attempts) {
    std::vector<std::string> fit;
    for (const std::string& candidate : attempt.prefixes) {
      Mismatch wrong = mismatch(checkpoint, attempt.map, candidate, layouts);
      if (wrong.why.empty()) {
        fit.push_back(candidate);
      } else if (wrong.found >= furthest.found) {
        furthest = std::move(wrong);
        furthest_said = attempt.said;
      }
    }
    BLOCKSWAP_CHECK(fit.size() <= 1, "[", label, "] weights_file '", path,
                    "' holds the blocks' tensors under several prefixes ('", fit[0], "', '", fit[1],
                    "'): say which with weights_prefix");
    if (fit.empty()) continue;
    FileWeights file{path, checkpoint.files, fit[0], {}, {}};
    for (std::size_t b = 0; b < layouts.size(); ++b) {
      FileBlock block;
      block.bytes = layouts[b].bytes;
      std::vector<std::string> sources(layouts[b].tensors.size());
      for (std::size_t i = 0; i < layouts[b].tensors.size(); ++i) {
        PackedTensor& t = layouts[b].tensors[i];
        if (t.role != Role::frozen) continue;
        const LocatedTensor at =
            *locate_tensor(checkpoint, attempt.map,
                           file.prefix + std::to_string(b) + "." + file_name(t.name),
                           safetensors_dtype(t.dtype), t.sizes)
                 .tensor;
        t.file = at.file;
        t.file_offset = at.offset;
        block.ranges.push_back(
            FileRange{at.offset, static_cast<std::size_t>(at.bytes), t.offset, at.file});
        sources[i] = at.source + (checkpoint.files.size() > 1 ? " in " + checkpoint.where(at.file)
                                                              : std::string());
      }
      file.blocks.push_back(std::move(block));
      file.sources.push_back(std::move(sources));
    }
    return file;
  }
  throw Error(detail::concat(
      "[", label, "] weights_file '", path, "' ", furthest.why,
      prefix.empty() ? "" : detail::concat(" (weights_prefix '", prefix, "')"),
      furthest_said.empty() ? "" : detail::concat(" (through ", furthest_said, ")")));
}

namespace {

// The files a block's frozen tensors are in, opened once each.
class Opened {
public:
  Opened(const FileWeights& file, const std::string& label) : file_(file), label_(label) {}
  const File& operator[](std::size_t f) {
    if (opened_.size() <= f) opened_.resize(f + 1);
    if (!opened_[f]) opened_[f] = std::make_unique<File>(file_.files.at(f), label_);
    return *opened_[f];
  }

private:
  const FileWeights& file_;
  const std::string& label_;
  std::vector<std::unique_ptr<File>> opened_;
};

} // namespace

void read_frozen(const FileWeights& file, const BlockLayout& layout, int64_t block,
                 std::byte* packed, const std::string& label) {
  Opened opened(file, label);
  for (const PackedTensor& t : layout.tensors) {
    if (t.role != Role::frozen) continue;
    const std::size_t bytes =
        static_cast<std::size_t>(t.variable.numel()) * t.variable.element_size();
    opened[t.file].read(packed + t.offset, t.file_offset, bytes,
                        detail::concat("tensor '", t.name, "' of block ", block));
  }
}

void check_same_as_file(const FileWeights& file, const BlockLayout& layout, int64_t block,
                        const std::string& label) {
  Opened opened(file, label);
  for (std::size_t i = 0; i < layout.tensors.size(); ++i) {
    const PackedTensor& t = layout.tensors[i];
    if (t.role != Role::frozen) continue;
    const at::Tensor values = t.variable.detach().to(at::kCPU).contiguous();
    const std::size_t bytes = static_cast<std::size_t>(values.numel()) * values.element_size();
    std::vector<std::byte> in_file(bytes);
    opened[t.file].read(in_file.data(), t.file_offset, bytes,
                        detail::concat("tensor '", t.name, "' of block ", block));
    BLOCKSWAP_CHECK(std::memcmp(in_file.data(), values.data_ptr(), bytes) == 0, "[", label,
                    "] tensor '", t.name, "' of block ", block, " differs from ",
                    file.sources[static_cast<std::size_t>(block)][i], " in '", file.path,
                    "', and the file tier would load the file's: save the model's weights to a "
                    "file and give that one, or leave host_budget_bytes unset");
  }
}

namespace {

void map_file(FileMap& map, const std::string& path, const std::string& label) {
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
  map.bytes.push_back(std::make_shared<Buffer>(static_cast<std::byte*>(data), bytes,
                                               [fd](std::byte* p, std::size_t n) {
                                                 ::munmap(p, n);
                                                 ::close(fd);
                                               }));
  map.fds.push_back(fd);
}

} // namespace

FileMap map_files(const std::vector<std::string>& paths, const std::string& label) {
  FileMap map; // the mappings made before a failure go with it
  for (const std::string& path : paths) map_file(map, path, label);
  return map;
}

bool mapping_intact(const FileMap& map) {
  for (std::size_t f = 0; f < map.fds.size(); ++f) {
    struct stat s {};
    if (::fstat(map.fds[f], &s) != 0 ||
        static_cast<std::size_t>(s.st_size) < map.bytes[f]->size()) {
      return false;
    }
  }
  return true;
}

void revert_to_file(std::byte* data, std::size_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) / page * page;
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED); // private pages dropped
}

} // namespace blockswap::torch_frontend
