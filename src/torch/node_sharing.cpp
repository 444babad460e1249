#include "node_sharing.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/log.hpp"

// Note [node sharing protocol]
// The keys are "blockswap/<host>/[group-<group>/]<label>/<n>/...": the node's ranks find each
// other by host name (and, when several groups of ranks share the store, by NodeSharing::group),
// and the n-th offloader of a label that a process builds meets the n-th of every other rank of
// its group on the node (every rank builds the same offloaders in the same order). Local rank 0
// sets "ticket" to "ok <fingerprint> <compressed sizes> <ticket>" once the memory is filled and
// sealed, or to "failed <why>"; each other local rank r sets "opened/<r>" to "ok" once it has
// mapped the memory, or to "failed <why>". Local rank 0 waits for every "opened/<r>" before its
// constructor returns: the others open the memory through its /proc entry, so it must live until
// they have. A rank that dies before setting its key makes the others' get() throw when the store's
// timeout runs out; a rank that dies later makes the job's next collective fail (Gloo, NCCL) while
// the others keep their mappings. The memory itself has no name anywhere (core/node_memory.hpp): it
// goes with the last process that maps it, however that ends.

namespace blockswap::torch_frontend {
namespace {

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

// The n-th offloader of this label that this process builds.
int64_t next_sequence(const std::string& label) {
  static std::mutex mutex;
  static std::map<std::string, int64_t> built;
  std::lock_guard lock(mutex);
  return built[label]++;
}

// What every rank's blocks must agree on: each tensor's name, place, shape and dtype.
std::string fingerprint(const std::vector<BlockLayout>& layouts) {
  std::ostringstream text;
  std::size_t bytes = 0;
  for (const BlockLayout& layout : layouts) {
    bytes += layout.bytes;
    text << layout.bytes << ';';
    for (const PackedTensor& t : layout.tensors) {
      text << t.name << '@' << t.offset << ':' << static_cast<int>(t.dtype);
      for (int64_t size : t.sizes) text << ',' << size;
      text << ';';
    }
  }
  std::uint64_t hash = 1469598103934665603ull; // FNV-1a
  for (unsigned char c : text.str()) hash = (hash ^ c) * 1099511628211ull;
  std::ostringstream out;
  out << layouts.size() << "-blocks-" << bytes << "-bytes-" << std::hex << hash;
  return out.str();
}

// Each block's part of the memory starts on a page of its own, so that pinning or unmapping
// one never touches another. `sizes`: each block's bytes as stored.
std::vector<std::size_t> block_offsets(const std::vector<std::size_t>& sizes, std::size_t& total) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<std::size_t> offsets;
  total = 0;
  for (const std::size_t size : sizes) {
    offsets.push_back(total);
    total += (std::max<std::size_t>(size, 1) + page - 1) / page * page;
  }
  return offsets;
}

// Each block's bytes as stored: compressed, or raw (its packed bytes).
std::vector<std::size_t> stored_sizes(const std::vector<BlockLayout>& layouts,
                                      const std::vector<std::size_t>& compressed) {
  std::vector<std::size_t> sizes;
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    sizes.push_back(!compressed.empty() && compressed[b] > 0 ? compressed[b] : layouts[b].bytes);
  }
  return sizes;
}

// The ticket's list of compressed sizes: "raw" for a copy that is not compressed, else each
// block's, comma-separated (0: stored raw).
std::string sizes_text(const std::vector<std::size_t>& compressed) {
  if (compressed.empty()) return "raw";
  std::ostringstream text;
  for (std::size_t b = 0; b < compressed.size(); ++b) text << (b ? "," : "") << compressed[b];
  return text.str();
}

std::vector<std::size_t> parse_sizes(const std::string& text, std::size_t blocks) {
  std::vector<std::size_t> sizes;
  if (text == "raw") return sizes;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    BLOCKSWAP_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos, "'",
                    text, "' is not a list of compressed sizes");
    sizes.push_back(std::stoull(item));
  }
  BLOCKSWAP_CHECK(sizes.size() == blocks, "'", text, "' gives ", sizes.size(),
                  " compressed sizes for ", blocks, " blocks");
  return sizes;
}

std::pair<std::string, std::string> split_word(const std::string& text) {
  const auto space = text.find(' ');
  if (space == std::string::npos) return {text, ""};
  return {text.substr(0, space), text.substr(space + 1)};
}

} // namespace

NodeShare::NodeShare(NodeSharing sharing, std::string label)
    : sharing_(std::move(sharing)), label_(std::move(label)) {
  BLOCKSWAP_CHECK(sharing_.set && sharing_.get, "[", label_,
                  "] Options::node_sharing needs both set and get (the job's store)");
  BLOCKSWAP_CHECK(sharing_.local_world_size >= 1 && sharing_.local_rank >= 0 &&
                      sharing_.local_rank < sharing_.local_world_size,
                  "[", label_, "] Options::node_sharing has local rank ", sharing_.local_rank,
                  " of ", sharing_.local_world_size,
                  ": give this process's rank among the node's ranks, from 0");
  const std::string group = sharing_.group.empty() ? "" : "group-" + sharing_.group + "/";
  prefix_ = detail::concat("blockswap/", host_name(), "/", group, label_, "/",
                           next_sequence(sharing_.group + "/" + label_), "/");
}

void NodeShare::open(const std::vector<BlockLayout>& layouts, bool compress,
                     const std::function<void(int64_t, std::byte*)>& pack) {
  compress_ = compress;
  fingerprint_ = fingerprint(layouts);
  if (fills()) {
    if (compress) {
      fill_compressed(layouts, pack);
    } else {
      std::size_t total = 0;
      block_offsets(stored_sizes(layouts, {}), total);
      memory_ = std::make_shared<NodeMemory>(NodeMemory::create(label_, total));
    }
    map_blocks(layouts);
    return;
  }
  // "ok <fingerprint> <compressed sizes> <ticket>" (Note [node sharing protocol])
  const std::string value = get("ticket", "local rank 0's node-shared weights");
  const auto [status, rest] = split_word(value);
  if (status != "ok") {
    throw Error(detail::concat("[", label_,
                               "] local rank 0 could not build its offloader, "
                               "so this rank has no weights to share: ",
                               rest.empty() ? value : rest));
  }
  const auto [their_fingerprint, sizes_and_ticket] = split_word(rest);
  if (their_fingerprint != fingerprint_) {
    fail("its blocks differ from local rank 0's");
    throw Error(detail::concat(
        "[", label_, "] this rank's blocks (", fingerprint_, ") differ from local rank 0's (",
        their_fingerprint,
        "): every rank of the node must build its offloaders over the same model, with the "
        "same frozen tensors, in the same order"));
  }
  const auto [sizes, ticket] = split_word(sizes_and_ticket);
  if ((sizes != "raw") != compress) { // local rank 0 compressed the copy, or did not
    fail(detail::concat("its compress option (", compress ? "on" : "off",
                        ") differs from local rank 0's"));
    throw Error(detail::concat("[", label_, "] this rank's compress option (",
                               compress ? "on" : "off", ") differs from local rank 0's (",
                               compress ? "off" : "on",
                               "): every rank of the node must pass the same compress option, "
                               "as local rank 0 compresses the node's one copy or not"));
  }
  try {
    compressed_ = parse_sizes(sizes, compress ? layouts.size() : 0);
    memory_ = std::make_shared<NodeMemory>(NodeMemory::open(NodeMemoryTicket::parse(ticket)));
    map_blocks(layouts);
  } catch (const Error& e) {
    fail(e.what());
    throw Error(detail::concat("[", label_, "] ", e.what()));
  }
}

// Note [compressed node-shared copy]
// With Options::compress on, the node's copy holds each block's bytes as codec::encode
// compresses them (Note [compressed host copies] in core/host_store.cpp): the node saves the
// ratio once for all its ranks, and each rank's loads decode them on its device. Local rank 0
// encodes them before its engine exists (the engine never writes the caller's memory): block by
// block, their packed bytes are written into one scratch buffer (BlockBinder::pack_block) and
// encoded; then the memory is created at the encoded sizes and each block copied in, its encoded
// bytes freed as it goes. The peak is the compressed copy and one raw block (the memory's pages
// are touched only as they are written), where the raw copy would be the whole model. A block
// that does not shrink is stored raw. The ticket carries each block's compressed size ("raw"
// for a copy not compressed): a rank whose compress option differs from local rank 0's is
// refused, as one whose blocks differ is. Nothing writes the copy after: a frozen
// weight changed after the offloader is built raises (BlockBinder::save_changes), as it does
// for the raw copy.
void NodeShare::fill_compressed(const std::vector<BlockLayout>& layouts,
                                const std::function<void(int64_t, std::byte*)>& pack) {
  BLOCKSWAP_ASSERT(pack, "the node's compressed copy needs its blocks' packer");
  std::size_t largest = 0;
  for (const BlockLayout& layout : layouts) largest = std::max(largest, layout.bytes);
  std::vector<std::byte> raw(largest);
  std::vector<std::vector<std::byte>> stored(layouts.size());
  compressed_.assign(layouts.size(), 0);
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    const std::span<const std::byte> block(raw.data(), layouts[b].bytes);
    pack(static_cast<int64_t>(b), raw.data());
    std::vector<std::byte> packed;
    if (!block.empty()) packed = codec::encode(block, frozen_ranges(layouts[b]));
    if (!block.empty() && layout::align_up(packed.size()) < layout::align_up(block.size())) {
      compressed_[b] = packed.size();
      stored[b] = std::move(packed);
    } else {
      stored[b].assign(block.begin(), block.end());
    }
  }
  std::size_t total = 0;
  const std::vector<std::size_t> offsets = block_offsets(stored_sizes(layouts, compressed_), total);
  memory_ = std::make_shared<NodeMemory>(NodeMemory::create(label_, total));
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    std::memcpy(memory_->data() + offsets[b], stored[b].data(), stored[b].size());
    std::vector<std::byte>().swap(stored[b]);
  }
}

void NodeShare::map_blocks(const std::vector<BlockLayout>& layouts) {
  std::size_t total = 0;
  const std::vector<std::size_t> sizes = stored_sizes(layouts, compressed_);
  const std::vector<std::size_t> offsets = block_offsets(sizes, total);
  BLOCKSWAP_CHECK(memory_->size() >= total, "[", label_,
                  "] local rank 0's node-shared memory holds ", memory_->size(),
                  " bytes, fewer than the ", total, " of its blocks");
  for (std::size_t b = 0; b < layouts.size(); ++b) {
    blocks_.push_back(std::make_shared<Buffer>(memory_->data() + offsets[b], sizes[b],
                                               [keep = memory_](std::byte*, std::size_t) {}));
  }
}

NodeShare::~NodeShare() {
  fail("it failed or ended before it could share the node's weights (its own error says why)");
}

std::string NodeShare::get(const std::string& name, const std::string& waiting_for) const {
  try {
    return sharing_.get(key(name));
  } catch (const std::exception& e) {
    throw Error(detail::concat("[", label_, "] local rank ", sharing_.local_rank, " of ",
                               sharing_.local_world_size, " waited for ", waiting_for, " in vain (",
                               e.what(),
                               "): every rank of the node must build the same offloaders, and "
                               "a rank that died cannot"));
  }
}

void NodeShare::publish() {
  if (published_) return;
  if (fills()) {
    memory_->seal();
    sharing_.set(key("ticket"), detail::concat("ok ", fingerprint_, " ", sizes_text(compressed_),
                                               " ", memory_->ticket().serialize()));
    published_ = true;
    for (int64_t r = 1; r < sharing_.local_world_size; ++r) {
      const std::string value =
          get(detail::concat("opened/", r), detail::concat("local rank ", r, " to map them"));
      const auto [status, why] = split_word(value);
      BLOCKSWAP_CHECK(status == "ok", "[", label_, "] local rank ", r,
                      " could not use the node-shared weights: ", why);
    }
  } else {
    sharing_.set(key(detail::concat("opened/", sharing_.local_rank)), "ok");
    published_ = true;
  }
}

void NodeShare::pin(Backend& backend) {
  pinned_ = backend.pin_host(memory_->data(), memory_->size());
}

void NodeShare::fail(const std::string& why) noexcept {
  if (published_) return;
  published_ = true;
  try {
    sharing_.set(key(fills() ? "ticket" : detail::concat("opened/", sharing_.local_rank)),
                 "failed " + why);
  } catch (const std::exception& e) {
    warn(label_, detail::concat("could not tell the node's other ranks that this one failed (",
                                e.what(), ")"));
  }
}

} // namespace blockswap::torch_frontend
