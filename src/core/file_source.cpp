// The staging ring's sources (core/file_source.hpp): the model's file, read past the page cache,
// and pageable host memory; the default staging reader over them.
#include "blockswap/core/file_source.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

// Note [reading past the page cache]
// Read through the page cache, a file tier would fill host memory with the file's pages (the
// kernel keeps them until pressed) and its bandwidth would be memory's on a second pass. With
// O_DIRECT the disk's DMA writes into our memory and nothing is cached; it needs the file
// offset, the length and the buffer aligned to the logical block size (4096 covers every disk
// here), so reads go through aligned bounce parts and the block's tensors are copied out of
// them. Where the file system refuses O_DIRECT (tmpfs, some network file systems), reads are
// buffered and each part is dropped from the cache after it is read (posix_fadvise(DONTNEED)):
// the cache holds at most the parts in flight.
// The disk needs a deep queue: `dd bs=64M iflag=direct` keeps 64 MiB in flight (16 requests
// of 4 MiB here) and reads a third faster than with 32 MiB. So there are eight parts of 8 MiB,
// each read on a thread of its own as soon as it is free: while the oldest is copied out, the
// other seven are in flight, and a part's read starts again the moment its copy-out ends, so
// that the queue never drains within a block.
// Note [reading across blocks]
// Parts left over at the end of a block read the first parts of the block asked for next,
// before that block's staging buffer is free, so that the disk is not idle at the turn from one
// block to the next. They are that block's when its turn comes; if the order changed (cancel),
// they are waited for and dropped.
constexpr std::size_t kAlign = 4096;
constexpr std::size_t kPart = 8u << 20; // one read
constexpr std::size_t kParts = 8;       // the bounce parts
constexpr std::size_t kCopyThreads = 4; // a block copied from memory: its parts at once

uint64_t align_down(uint64_t x) {
  return x / kAlign * kAlign;
}
uint64_t align_up(uint64_t x) {
  return (x + kAlign - 1) / kAlign * kAlign;
}

// When the file's contents or its inode last changed: a rewrite that restores the mtime
// (touch -r, rsync -t) still changes the ctime. A file replaced by another under its name
// (unlinked: no links left) keeps its contents for us, though unlinking changed its ctime.
int64_t ns(const struct timespec& t) {
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// Each block's ranges in file order (file by file), as parts_of and read walk them.
std::vector<FileBlock> in_file_order(std::vector<FileBlock> blocks) {
  for (FileBlock& b : blocks) {
    std::sort(b.ranges.begin(), b.ranges.end(), [](const FileRange& x, const FileRange& y) {
      return x.file != y.file ? x.file < y.file : x.file_offset < y.file_offset;
    });
  }
  return blocks;
}

} // namespace

void FileSource::open(std::string path, CacheBypass bypass) {
  Opened file{std::move(path)};
  if (bypass == CacheBypass::direct) {
    file.fd = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT | O_NONBLOCK);
    file.direct = file.fd >= 0;
  }
  // O_NONBLOCK: opening a FIFO would wait for a writer; regular files read as without it.
  if (file.fd < 0) file.fd = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  BLOCKSWAP_CHECK(file.fd >= 0, "[", label_, "] cannot open '", file.path,
                  "': ", std::strerror(errno));
  struct stat s {};
  const bool stated = ::fstat(file.fd, &s) == 0;
  if (!stated || !S_ISREG(s.st_mode)) {
    const int error = stated ? 0 : errno;
    ::close(file.fd);
    throw Error(detail::concat("[", label_, "] cannot read blocks from '", file.path,
                               "': ", error != 0 ? std::strerror(error) : "not a regular file"));
  }
  file.size = static_cast<uint64_t>(s.st_size);
  file.modified_ns = ns(s.st_mtim);
  file.changed_ns = ns(s.st_ctim);
  files_.push_back(std::move(file));
}

FileSource::FileSource(std::vector<std::string> files, std::vector<FileBlock> blocks,
                       std::string label, CacheBypass bypass)
    : label_(std::move(label)), blocks_(in_file_order(std::move(blocks))) {
  try {
    for (std::string& path : files) open(std::move(path), bypass);
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      for (const FileRange& r : blocks_[b].ranges) {
        BLOCKSWAP_CHECK(r.file < files_.size(), "[", label_, "] block ", b, " needs file ", r.file,
                        " of ", files_.size(), " given");
        const Opened& f = files_[r.file];
        BLOCKSWAP_CHECK(r.file_offset <= f.size && r.bytes <= f.size - r.file_offset, "[", label_,
                        "] block ", b, " needs bytes ", r.file_offset, " to ",
                        r.file_offset + r.bytes, " of '", f.path, "', which has ", f.size);
        BLOCKSWAP_CHECK(r.to <= blocks_[b].bytes && r.bytes <= blocks_[b].bytes - r.to, "[", label_,
                        "] block ", b, ": a range of ", r.bytes, " bytes at ", r.to,
                        " does not fit its ", blocks_[b].bytes, " packed bytes (reading '", f.path,
                        "')");
      }
    }
    void* bounce = std::aligned_alloc(kAlign, kParts * kPart);
    if (bounce == nullptr) throw std::bad_alloc();
    bounce_ = {static_cast<std::byte*>(bounce), &std::free};
  } catch (...) {
    for (const Opened& f : files_) ::close(f.fd);
    throw;
  }
}

FileSource::~FileSource() {
  drop_reads();
  for (const Opened& f : files_) ::close(f.fd);
}

bool FileSource::direct() const {
  return std::all_of(files_.begin(), files_.end(), [](const Opened& f) { return f.direct; });
}

// A block in pageable host memory: one memcpy reaches about a third of a PCIe 4 link's
// bandwidth, so large blocks are copied in parts at once (as the file's are read).
void MemorySource::read(int64_t block, std::byte* into, const std::function<int64_t()>&) {
  const FileBlock& b = blocks_[block];
  const std::size_t parts = std::clamp<std::size_t>(b.bytes / kPart, 1, kCopyThreads);
  const std::size_t part = (b.bytes / parts + kAlign - 1) / kAlign * kAlign;
  auto copy = [&](std::size_t p) {
    const std::size_t begin = std::min(b.bytes, p * part);
    std::memcpy(into + begin, b.memory + begin, std::min(b.bytes, begin + part) - begin);
  };
  std::vector<std::thread> helpers;
  for (std::size_t p = 1; p < parts; ++p) helpers.emplace_back(copy, p);
  copy(0);
  for (std::thread& t : helpers) t.join();
}

void MemorySource::repoint(int64_t block, const std::byte* memory, std::size_t bytes) {
  BLOCKSWAP_CHECK(block >= 0 && static_cast<std::size_t>(block) < blocks_.size() &&
                      blocks_[block].memory != nullptr && memory != nullptr,
                  "block ", block,
                  " is not read from host memory: only such a block can be given a new place "
                  "to read from");
  blocks_[block].memory = memory;
  blocks_[block].bytes = bytes;
}

void FileSource::check_unchanged(int64_t block) const {
  std::size_t last = files_.size(); // the block's ranges are in file order: each file once
  for (const FileRange& r : blocks_[block].ranges) {
    if (r.file == last) continue;
    last = r.file;
    const Opened& f = files_[r.file];
    struct stat s {};
    BLOCKSWAP_CHECK(::fstat(f.fd, &s) == 0, "[", label_, "] cannot stat '", f.path,
                    "' to read block ", block, ": ", std::strerror(errno));
    const bool modified =
        ns(s.st_mtim) != f.modified_ns || (s.st_nlink > 0 && ns(s.st_ctim) != f.changed_ns);
    BLOCKSWAP_CHECK(static_cast<uint64_t>(s.st_size) == f.size && !modified, "[", label_, "] '",
                    f.path, "' changed while blockswap reads blocks from it (", f.size,
                    " bytes when opened, ", s.st_size, " now", modified ? ", modified since" : "",
                    ") before block ", block,
                    " was read: the blocks it holds cannot be trusted, and this offloader reads "
                    "no more from it; restore the file and build a new offloader (close() this "
                    "one), or load the model into host memory");
  }
}

// Reads the part's bytes of its file into `into` (fewer at the end of the file); a read error
// is an Error naming the block.
uint64_t FileSource::read_part(int64_t block, const Part& part, std::byte* into) const {
  const Opened& f = files_[part.file];
  uint64_t done = 0;
  while (done < part.want) {
    const ssize_t got =
        ::pread(f.fd, into + done, part.want - done, static_cast<off_t>(part.at + done));
    if (got < 0 && errno == EINTR) continue;
    BLOCKSWAP_CHECK(got >= 0, "[", label_, "] reading block ", block, " from '", f.path,
                    "' at byte ", part.at + done, ": ", std::strerror(errno));
    if (got == 0) break; // the end of the file
    done += static_cast<uint64_t>(got);
    if (f.direct && got % kAlign != 0) break; // a short O_DIRECT read: the end of the file
  }
  if (!f.direct) {
    ::posix_fadvise(f.fd, static_cast<off_t>(part.at), static_cast<off_t>(done),
                    POSIX_FADV_DONTNEED);
  }
  return done;
}

std::vector<FileSource::Part> FileSource::parts_of(int64_t block) const {
  std::vector<Part> parts;
  for (const FileRange& r : blocks_[block].ranges) { // in file order (in_file_order)
    uint64_t at = align_down(r.file_offset);
    if (!parts.empty() && parts.back().file == r.file) {
      at = std::max(at, parts.back().at + parts.back().want);
    }
    const uint64_t end = align_up(r.file_offset + r.bytes);
    for (; at < end; at += parts.back().want) {
      parts.push_back(Part{at, std::min<uint64_t>(kPart, end - at), r.file});
    }
  }
  return parts;
}

// Note [reading past the page cache]
void FileSource::issue(int64_t block, std::size_t part, Part stretch) {
  std::byte* const bounce = bounce_.get() + next_part_ * kPart;
  std::future<uint64_t> got = std::async(std::launch::async, [this, block, bounce, stretch] {
    return read_part(block, stretch, bounce);
  });
  in_flight_.push_back(InFlight{block, part, bounce, std::move(got)});
  next_part_ = (next_part_ + 1) % kParts;
}

void FileSource::drop_reads() {
  for (InFlight& f : in_flight_) f.got.wait();
  in_flight_.clear();
}

void FileSource::read(int64_t block, std::byte* into, const std::function<int64_t()>& next) {
  // Reads in flight are this block's first parts, read ahead, or the order changed.
  if (!in_flight_.empty() && (in_flight_.front().block != block || in_flight_.front().part != 0)) {
    drop_reads();
  }
  if (blocks_[block].ranges.empty()) return; // nothing of it in the file
  try {
    check_unchanged(block);
    const std::vector<FileRange>& ranges = blocks_[block].ranges;
    const std::vector<Part> parts = parts_of(block);
    std::size_t issued = in_flight_.size();
    int64_t after = -2; // the block asked for next, once looked up (-1: none, or not from the file)
    std::vector<Part> after_parts;
    std::size_t ahead = 0; // of after_parts, issued
    // One more read into the part just copied out: this block's next, else the next block's.
    auto top_up = [&] {
      if (in_flight_.size() >= kParts) return;
      if (issued < parts.size()) {
        issue(block, issued, parts[issued]);
        ++issued;
        return;
      }
      if (after == -2) {
        after = next();
        if (after >= 0 && after < static_cast<int64_t>(blocks_.size())) {
          after_parts = parts_of(after); // none for a block that is not in the file
        }
      }
      if (ahead < after_parts.size()) {
        issue(after, ahead, after_parts[ahead]);
        ++ahead;
      }
    };
    while (issued < parts.size() && in_flight_.size() < kParts) top_up();
    std::size_t first_range = 0;
    for (std::size_t p = 0; p < parts.size(); ++p) {
      InFlight read = std::move(in_flight_.front());
      in_flight_.pop_front();
      const uint64_t got = read.got.get(); // rethrows the read's failure
      const uint64_t begin = parts[p].at, end = begin + got;
      for (std::size_t i = first_range; i < ranges.size(); ++i) {
        const FileRange& r = ranges[i];
        if (r.file > parts[p].file) break; // later parts: the next file's
        if (r.file < parts[p].file) continue;
        if (r.file_offset >= begin + parts[p].want) break; // later parts
        const uint64_t from = std::max(begin, r.file_offset);
        const uint64_t to = std::min(begin + parts[p].want, r.file_offset + r.bytes);
        if (from >= to) continue;
        if (to > end) {
          check_unchanged(block); // truncated under the run: say so
          BLOCKSWAP_CHECK(false, "[", label_, "] reading block ", block, " from '",
                          files_[r.file].path, "': the file ended at byte ", end, " before byte ",
                          r.file_offset + r.bytes, " (truncated under the run?)");
        }
        std::memcpy(into + r.to + (from - r.file_offset), read.bounce + (from - begin), to - from);
        if (to == r.file_offset + r.bytes && i == first_range) ++first_range;
      }
      top_up(); // the part just copied out reads again
    }
    check_unchanged(block); // a change during the read
  } catch (...) {
    drop_reads(); // nothing read ahead outlives a failed block
    throw;
  }
}

FileReader::Sources FileReader::sources_of(std::vector<std::string> files,
                                           std::vector<FileBlock> blocks, const std::string& label,
                                           CacheBypass bypass) {
  Sources sources;
  bool reads_file = false, reads_memory = false;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const FileBlock& b = blocks[i];
    BLOCKSWAP_CHECK_ARGUMENT(b.memory == nullptr || b.ranges.empty(), "[", label, "] block ", i,
                             " is given both host memory and ranges of the file: a staged block "
                             "comes from memory or from the file, not both");
    sources.bytes.push_back(b.bytes);
    reads_file = reads_file || !b.ranges.empty();
    reads_memory = reads_memory || b.memory != nullptr;
  }
  std::shared_ptr<MemorySource> memory;
  if (reads_memory) memory = std::make_shared<MemorySource>(blocks);
  if (reads_file)
    sources.file = std::make_shared<FileSource>(std::move(files), blocks, label, bypass);
  for (const FileBlock& b : blocks) {
    sources.per_block.push_back(b.memory != nullptr ? std::shared_ptr<BlockSource>(memory)
                                : !b.ranges.empty() ? std::shared_ptr<BlockSource>(sources.file)
                                                    : nullptr);
  }
  return sources;
}

FileReader::FileReader(std::vector<std::string> files, std::vector<FileBlock> blocks,
                       const std::vector<std::shared_ptr<Buffer>>& staging, std::string label,
                       CacheBypass bypass, Backend* backend)
    : FileReader(sources_of(std::move(files), std::move(blocks), label, bypass), staging, label,
                 backend) {}

FileReader::FileReader(Sources sources, const std::vector<std::shared_ptr<Buffer>>& staging,
                       std::string label, Backend* backend)
    : StagingRing(std::move(sources.bytes), std::move(sources.per_block), staging, std::move(label),
                  backend),
      file_(std::move(sources.file)) {}

std::unique_ptr<StagingReader> Backend::make_staging_reader(StagingSpec spec) {
  return std::make_unique<FileReader>(std::move(spec.files), std::move(spec.blocks), spec.staging,
                                      std::move(spec.label), spec.bypass, this);
}

} // namespace blockswap
