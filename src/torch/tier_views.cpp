#include "tier_views.hpp"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>

#include "blockswap/core/codec.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/log.hpp"

namespace blockswap::torch_frontend {

void TierViews::use_file(FileMap map, std::vector<bool> in_file,
                         std::function<void(int64_t, std::byte*)> read, std::string path) {
  file_map_ = std::move(map);
  in_file_ = std::move(in_file);
  read_ = std::move(read);
  file_path_ = std::move(path);
}

TierViews::Fill TierViews::fill_host_copy(int64_t block) {
  if (read_only(block)) return Fill::nothing;
  if (!read_) return Fill::everything;
  read_(block, hosts_[block]->data()); // built empty
  return Fill::all_but_frozen;
}

// Note [compressed frozen views]
// With Options::compress a block's frozen bytes exist in host memory only compressed (Note
// [compressed host copies] in core/host_store.cpp): no tensor can view them. Off the device, its
// frozen tensors have no elements, as with strict_residency: read them while the block is on
// the device (inside its forward, or with the offloader disabled), or turn compression off
// (docs/guide.md). At close, restore_to_host decodes them (decode_host_copy) into host memory
// of their own, so the module keeps its weights. A caller's change to such a tensor is encoded
// again, or refused: Note [changed compressed weights] in block_binder.cpp.
void TierViews::use_compressed(int64_t block, std::shared_ptr<Buffer> host,
                               std::size_t compressed_bytes) {
  const auto b = static_cast<std::size_t>(block);
  if (compressed_bytes_.empty()) {
    compressed_bytes_.assign(hosts_.size(), 0);
    decoded_.resize(hosts_.size());
  }
  hosts_[b] = std::move(host);
  compressed_bytes_[b] = compressed_bytes;
}

void TierViews::decode_host_copy(int64_t block, std::size_t frozen_bytes) {
  if (!compressed(block)) return;
  decoded_[static_cast<std::size_t>(block)] = decoded_frozen(block, frozen_bytes);
}

std::shared_ptr<Buffer> TierViews::decoded_frozen(int64_t block, std::size_t frozen_bytes) const {
  const auto b = static_cast<std::size_t>(block);
  BLOCKSWAP_ASSERT(compressed(block), "block ", block, " is not compressed");
  auto* data = static_cast<std::byte*>(std::aligned_alloc(
      layout::kAlignment, layout::align_up(std::max<std::size_t>(frozen_bytes, 1))));
  BLOCKSWAP_CHECK(data != nullptr, "[", label_, "] cannot allocate ", frozen_bytes,
                  " bytes of host memory to decode block ", block, "'s frozen weights into");
  auto decoded =
      std::make_shared<Buffer>(data, frozen_bytes, [](std::byte* p, std::size_t) { std::free(p); });
  codec::decode(std::span<const std::byte>(hosts_[b]->data(), compressed_bytes_[b]),
                std::span<std::byte>(decoded->data(), frozen_bytes));
  return decoded;
}

std::vector<std::pair<at::Tensor, at::Tensor>>
TierViews::frozen_values(int64_t block, const BlockLayout& layout) const {
  std::vector<std::pair<at::Tensor, at::Tensor>> values;
  if (!compressed(block)) return values;
  const std::shared_ptr<Buffer> decoded = decoded_frozen(block, layout.trainable_offset);
  for (const PackedTensor& t : layout.tensors) {
    if (t.role == Role::frozen)
      values.emplace_back(t.variable, view(decoded, t.offset, t, at::kCPU));
  }
  return values;
}

at::Tensor TierViews::frozen(int64_t block, const PackedTensor& t) const {
  // The view shares the buffer: the weights outlive the engine.
  if (!decoded_.empty() && decoded_[static_cast<std::size_t>(block)]) {
    return view(decoded_[static_cast<std::size_t>(block)], t.offset, t, at::kCPU);
  }
  if (compressed(block)) return at::empty({0}, at::TensorOptions().dtype(t.dtype));
  if (read_only(block)) {
    if (file_gone_) return at::empty({0}, at::TensorOptions().dtype(t.dtype));
    return view(file_map_.bytes.at(t.file), t.file_offset, t, at::kCPU);
  }
  return view(hosts_[block], t.offset, t, at::kCPU);
}

bool TierViews::check_sources() noexcept {
  if (file_map_.bytes.empty() || file_gone_ || mapping_intact(file_map_)) return false;
  file_gone_ = true;
  warn(label_, detail::concat("'", file_path_,
                              "' shrank under the run: the blocks read from it hold no "
                              "values off the device now (views of it would crash the process); "
                              "restore the file and build the model and the offloader again"));
  return true;
}

// Note [changes to the file tier]
// A block read from the model's file for each load has no host copy to save a caller's change
// to: its next load reads the file. A change to the file's own values (a checkpoint resumed,
// load_state_dict of the same weights) is kept as it is. Any other is dropped: the tensor takes
// the file's values again (its pages of the mapping reverted, or its slot rewritten: the
// binder's part), and once every tensor of the block has been seen, one Error names them; the
// offloader goes on.
bool TierViews::matches_source(int64_t block, const PackedTensor& t, const at::Tensor& now) {
  const at::Tensor file = frozen(block, t);
  // A copy first: a write into the tensor off the device wrote the mapping's own pages.
  const at::Tensor values = now.detach().to(at::kCPU).contiguous().clone();
  if (file_gone_) return false;
  revert_to_file(static_cast<std::byte*>(file.data_ptr()), file.nbytes());
  return std::memcmp(values.data_ptr(), file.data_ptr(), file.nbytes()) == 0;
}

void TierViews::dropped(int64_t block, const PackedTensor& t) {
  dropped_.push_back(detail::concat("'", t.name, "' of block ", block));
}

void TierViews::dropped_compressed(int64_t block, const PackedTensor& t) {
  dropped_compressed_.push_back(detail::concat("'", t.name, "' of block ", block));
}

namespace {
std::string names_of(const std::vector<std::string>& dropped) {
  std::string names = dropped.front();
  for (std::size_t i = 1; i < dropped.size() && i < 3; ++i) names += ", " + dropped[i];
  if (dropped.size() > 3) names += detail::concat(" and ", dropped.size() - 3, " more");
  return names;
}
} // namespace

void TierViews::raise_dropped() {
  if (!any_dropped()) return;
  std::string message;
  if (!dropped_.empty()) {
    message = detail::concat(
        "[", label_, "] frozen tensors ", names_of(dropped_),
        " were changed, but their blocks are read from the model's file for each load (the file "
        "tier, host_budget_bytes), so the changes cannot be kept: they hold the file's values "
        "again. Change weights before building the offloader and give the file they are saved "
        "in, or give the host budget room for these blocks");
  }
  if (!dropped_compressed_.empty()) {
    if (!message.empty()) message += "; and ";
    message += detail::concat(
        "[", label_, "] frozen tensors ", names_of(dropped_compressed_),
        " were written in place while their blocks were off the device, or given values "
        "computed from them there (param.data = param.data * 2), where their frozen weights "
        "are compressed in host memory (compress) and those tensors have no elements: the "
        "writes did nothing, and the tensors keep their true values. Write such weights by "
        "assigning tensors of their shape (computed from the true values state_dict() gives) "
        "(param.data = new, load_state_dict(), peft's "
        "merge_adapter()), or in place while the block is on the device (inside its forward, or "
        "with swapping disabled), or build the offloader with compress='off' (docs/guide.md, "
        "\"Compressed weights\")");
  }
  dropped_.clear();
  dropped_compressed_.clear();
  throw Error(message);
}

} // namespace blockswap::torch_frontend
