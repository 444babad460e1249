// Keeps a block's module tensors pointing at the right memory as the engine moves blocks: the
// block's slot while it is ready, its host copy (or the view tier_views.hpp gives) otherwise; and
// sees what the caller wrote into them between moves. Implementer-only (src/torch).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "block_layout.hpp"
#include "blockswap/core/engine.hpp"
#include "tier_views.hpp"

namespace blockswap::torch_frontend {

// Keeps the modules' tensors pointing at the right memory as the engine moves blocks: a view
// of its slot while a block is ready, a view of its host copy otherwise (for a frozen tensor the
// view TierViews gives: the host copy or the model's file), or, when `strict`, a tensor with no
// elements, so that computing with it fails.
class BlockBinder final : public ResidencyListener {
public:
  // `label` prefixes its messages.
  BlockBinder(std::vector<BlockLayout> layouts, std::string label, c10::Device device, bool strict);

  const std::vector<BlockLayout>& layouts() const { return layouts_; }
  // Before pack(): for setting where each frozen tensor is in the model's file.
  std::vector<BlockLayout>& layouts_to_locate() { return layouts_; }
  // Before pack(): where each frozen tensor's view off the device comes from (the host copy or
  // the model's file: tier_views.hpp).
  TierViews& views() { return views_; }
  // A read from the model's file failed: if the file shrank (TierViews::check_sources, asked
  // again at restore_to_host), the frozen tensors of its blocks off the device become tensors
  // with no elements.
  void on_file_failed() noexcept override;
  // Where the host copies are: the engine's own, which pack() fills; node-shared memory
  // (Options::node_sharing) that this process fills, or that another rank of the node filled
  // and pack() only binds to. The caller's writes into node-shared frozen weights raise.
  enum class HostCopies { own, shared_fill, shared_filled };
  // Copies every block's tensors into the engine's host buffers (unless `copies` is
  // shared_filled), then points them at those copies and claims them. All or nothing: when it
  // throws, no tensor has changed.
  void pack(Engine& engine, HostCopies copies = HostCopies::own);
  // Block i's packed bytes, as pack() writes them into its host copy (`fill`: which of its
  // tensors), written into `into` (the block's bytes long): for whoever fills host memory
  // before the engine exists (the node-shared copy, compressed: node_sharing.hpp).
  void pack_block(int64_t block, std::byte* into,
                  TierViews::Fill fill = TierViews::Fill::everything) const;
  // After Engine::compress: the blocks it compressed have new host copies (Note [compressed
  // frozen views] in tier_views.cpp); their tensors are bound again (frozen ones to tensors with
  // no elements).
  void use_compressed_copies(const Engine& engine);
  // Saves what the caller changed, points every packed tensor at its host copy (sharing the
  // buffer, which outlives the engine) and releases the claims. Never throws.
  void restore_to_host();

  // Throws Error naming a packed frozen parameter that was made trainable after packing: its
  // optimizer's updates would bypass what blockswap can see.
  void check_still_frozen() const;
  // The tensor of block `block` at `index` (its variable: reads true values wherever the block
  // is), and notes that blockswap itself wrote it in place (an optimizer step), which is not a
  // change of the caller's to copy anywhere.
  const PackedTensor& tensor(int64_t block, std::size_t index) const {
    return layouts_[block].tensors[index];
  }
  void written_by_blockswap(int64_t block, std::size_t index);
  // Copies what the caller wrote into block `block`'s tensors since blockswap bound them into
  // their host copy (which a step on the host is about to change).
  void save_caller_changes(int64_t block);
  // Throws the Error of Note [changes to the file tier] (tier_views.cpp) when the caller changed a
  // frozen tensor of a TierViews::read_only block (one in the file), wherever it is (at a pass's
  // start: a block that never moves, K = 0, is seen by no move); the tensors hold the file's
  // values again.
  void check_read_only_writes();
  // Each frozen tensor of compressed block `block` (its variable) with its true values decoded
  // into host memory of their own (TierViews::frozen_values), but for those the caller changed
  // since: they hold their values themselves.
  std::vector<std::pair<at::Tensor, at::Tensor>> frozen_values(int64_t block) const;
  // The host copy of that tensor (where it is now), whatever the tensor is bound to.
  at::Tensor host_copy(int64_t block, std::size_t index) const {
    return host_view(block, layouts_[block].tensors[index]);
  }
  // Called before a block is loaded from its host copy (ResidencyListener::before_load).
  std::function<void(int64_t)> before_load_hook;
  // Called after each bind of a trainable tensor (index into the block's tensors): its
  // gradient accumulator may be a new one (Note [device change] in the .cpp).
  std::function<void(int64_t, std::size_t)> rebound_hook;
  void before_load(int64_t block) override {
    if (before_load_hook) before_load_hook(block);
  }

  void on_ready(int64_t block, const std::shared_ptr<Buffer>& slot) override;
  void on_evicted(int64_t block) override;
  void on_written_back(int64_t block, const HostRegion& trainable) override;

  // What blockswap last bound tensor `index` of block `block` to.
  const void* bound_data(int64_t block, std::size_t index) const {
    return bound_[block][index].data;
  }

private:
  // What blockswap last pointed a tensor at, to see the caller's writes (Note [changed tensors]
  // in the .cpp), and whether that is a slot (Note [device change]).
  struct Binding {
    const void* data = nullptr;
    // The tensor's storage: a tensor with no elements (a compressed block's frozen tensor off
    // the device) has no data address, so only this tells it rebound (p.data = p.data * 2).
    const void* storage = nullptr;
    int64_t version = 0;
    bool on_device = false;
  };
  static const void* storage_of(const at::Tensor& t) {
    return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  }
  bool caller_changed(int64_t block, std::size_t index) const;
  static void zero_padding(const BlockLayout& layout, std::byte* packed); // Note [padding bytes]
  // Note [changed compressed weights] in the .cpp.
  bool compressed_change(int64_t block, PackedTensor& t);
  void encode_changes(int64_t block);
  void rebind_frozen_off_device(int64_t block); // to the views of its host copy
  at::Tensor host_view(int64_t block, const PackedTensor& t) const;
  void save_changes(int64_t block, PackedTensor& t);
  void bind(int64_t block, std::size_t index, const at::Tensor& data, bool on_device);

  std::vector<BlockLayout> layouts_;
  std::vector<std::vector<Binding>> bound_; // [block][tensor]
  std::string label_;
  TierViews views_;
  // Where each block's trainable bytes are in host memory (Note [atomic write-back]), from pack().
  std::vector<HostRegion> trainable_hosts_;
  c10::Device device_;
  bool strict_ = false;
  bool shared_ = false;      // node-shared host copies (pack)
  Engine* engine_ = nullptr; // pack()'s
  // A compressed block's frozen bytes with the caller's changes, before they are encoded again.
  std::shared_ptr<Buffer> changed_frozen_;
  int64_t changed_block_ = -1;
  bool changed_values_ = false;  // whether changed_frozen_ differs from the block's bytes
  std::vector<bool> stale_slot_; // [block]: its slot's frozen bytes are older than its host copy
  void raise_dropped_changes();
  void rebind_lost_views() noexcept;
};

} // namespace blockswap::torch_frontend
