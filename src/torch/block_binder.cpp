#include "block_binder.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>

#include "blockswap/core/error.hpp"
#include "blockswap/core/log.hpp"
#include "torch_compat.hpp"

namespace blockswap::torch_frontend {

BlockBinder::BlockBinder(std::vector<BlockLayout> layouts, std::string label, c10::Device device,
                         bool strict)
    : layouts_(std::move(layouts)), label_(std::move(label)), views_(label_), device_(device),
      strict_(strict) {
  for (const BlockLayout& layout : layouts_) bound_.emplace_back(layout.tensors.size());
}

at::Tensor BlockBinder::host_view(int64_t block, const PackedTensor& t) const {
  // The view shares the buffer: the weights outlive the engine. Trainable tensors are where
  // the block's trainable bytes are now.
  if (t.role == Role::frozen) return views_.frozen(block, t);
  const HostRegion& trainable = trainable_hosts_[block];
  return view(trainable.buffer, trainable.offset + (t.offset - layouts_[block].trainable_offset), t,
              at::kCPU);
}

// Note [device change]
// On a real device, set_data from a host copy to a slot (or back) changes the parameter's
// device, and autograd then forgets its gradient accumulator: the next forward makes a new one,
// without the hooks on the old (VariableHooks::set_data). The emulated device's slots are host
// memory too, so the binder does what set_data does there, and every test on the emulated
// device sees what a GPU does. Whoever hooks an accumulator (the fused step, Note [fused step])
// hooks the new one in `rebound_hook`, which runs after every bind of a trainable tensor.
void BlockBinder::bind(int64_t block, std::size_t index, const at::Tensor& data, bool on_device) {
  PackedTensor& t = layouts_[block].tensors[index];
  Binding& bound = bound_[block][index];
  t.variable.set_data(data);
  if (device_.is_cpu() && bound.on_device != on_device && t.variable.requires_grad()) {
    compat::forget_grad_accumulator(t.variable);
  }
  bound = Binding{t.variable.data_ptr(), storage_of(t.variable), t.variable._version(), on_device};
  if (t.role == Role::trainable && rebound_hook) rebound_hook(block, index);
}

// Note [inference mode]
// Blocks move during passes that may run under c10::InferenceMode. A tensor made there is an
// inference tensor, which autograd refuses to save; the module's tensors must stay normal
// ones, so every view is made with inference mode off.

// Once a source of frozen views is lost (the mapped file shrank), the tensors off the device
// that viewed it are bound to what TierViews gives now: tensors with no elements.
void BlockBinder::rebind_lost_views() noexcept {
  if (!views_.check_sources()) return;
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    if (views_.viewable(static_cast<int64_t>(b))) continue;
    for (std::size_t i = 0; i < layouts_[b].tensors.size(); ++i) {
      const PackedTensor& t = layouts_[b].tensors[i];
      if (t.role == Role::frozen && !bound_[b][i].on_device) {
        bind(static_cast<int64_t>(b), i, host_view(static_cast<int64_t>(b), t), false);
      }
    }
  }
}

void BlockBinder::on_file_failed() noexcept {
  rebind_lost_views();
}

// Note [padding bytes]
// Each tensor of a packed block starts at an aligned offset (core/layout.hpp): the bytes between
// them are no tensor's. They are zeroed, never left as the allocator gave them: compressed host
// copies encode every frozen byte (Note [compressed host copies] in core/host_store.cpp), and
// their sizes, the decode buffer and the plan must be the same from run to run.
void BlockBinder::zero_padding(const BlockLayout& layout, std::byte* packed) {
  std::vector<std::pair<std::size_t, std::size_t>> used; // [begin, end) of each tensor
  for (const PackedTensor& t : layout.tensors) {
    const auto elements = static_cast<std::size_t>(c10::multiply_integers(t.sizes));
    used.emplace_back(t.offset, t.offset + elements * c10::elementSize(t.dtype));
  }
  std::sort(used.begin(), used.end());
  std::size_t at = 0;
  for (const auto& [begin, end] : used) {
    if (begin > at) std::memset(packed + at, 0, begin - at);
    at = std::max(at, end);
  }
  if (layout.bytes > at) std::memset(packed + at, 0, layout.bytes - at);
}

void BlockBinder::pack_block(int64_t block, std::byte* into, TierViews::Fill fill) const {
  zero_padding(layouts_[block], into);
  for (const PackedTensor& t : layouts_[block].tensors) {
    if (fill == TierViews::Fill::all_but_frozen && t.role == Role::frozen) continue;
    if (t.role == Role::state) { // zeros, like the optimizers' state before their first step
      std::memset(into + t.offset, 0, c10::multiply_integers(t.sizes) * c10::elementSize(t.dtype));
      continue;
    }
    const at::Tensor source = t.variable.detach().to(at::kCPU).contiguous();
    std::memcpy(into + t.offset, source.data_ptr(), source.numel() * source.element_size());
  }
}

void BlockBinder::pack(Engine& engine, HostCopies copies) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  shared_ = copies != HostCopies::own;
  engine_ = &engine;
  std::vector<std::shared_ptr<Buffer>> hosts;
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    hosts.push_back(engine.host_buffer(static_cast<int64_t>(b)));
    trainable_hosts_.push_back(HostRegion{hosts.back(), layouts_[b].trainable_offset});
  }
  views_.use_host_copies(hosts);
  for (std::size_t b = 0; b < layouts_.size(); ++b) { // compressed by their filler
    const auto block = static_cast<int64_t>(b);
    if (copies == HostCopies::shared_filled && engine.compressed(block)) {
      views_.use_compressed(block, hosts[b], engine.host_frozen_bytes(block));
    }
  }
  // First the copies, which may fail: nothing the caller sees changes until they are done.
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    if (copies == HostCopies::shared_filled) continue;
    const TierViews::Fill fill = views_.fill_host_copy(static_cast<int64_t>(b));
    if (fill == TierViews::Fill::nothing) continue;
    pack_block(static_cast<int64_t>(b), hosts[b]->data(), fill);
  }
  claim(layouts_);
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    for (std::size_t i = 0; i < layouts_[b].tensors.size(); ++i) {
      const PackedTensor& t = layouts_[b].tensors[i];
      bind(static_cast<int64_t>(b), i,
           strict_ ? at::empty({0}, at::TensorOptions().dtype(t.dtype).device(device_))
                   : host_view(static_cast<int64_t>(b), t),
           false);
    }
  }
}

void BlockBinder::use_compressed_copies(const Engine& engine) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    const auto block = static_cast<int64_t>(b);
    if (!engine.compressed(block)) continue;
    views_.use_compressed(block, engine.host_buffer(block), engine.host_frozen_bytes(block));
    trainable_hosts_[b] = engine.host_trainable(block);
    for (std::size_t i = 0; i < layouts_[b].tensors.size(); ++i) {
      if (bound_[b][i].on_device) continue;
      const PackedTensor& t = layouts_[b].tensors[i];
      bind(block, i,
           strict_ ? at::empty({0}, at::TensorOptions().dtype(t.dtype).device(device_))
                   : host_view(block, t),
           false);
    }
  }
}

// Note [changed tensors]
// A block's weights are the caller's too: weights loaded with copy_ or torch::load (which
// rebinds them with set_), a checkpoint restored while blocks are swapped. Each time blockswap
// points a tensor somewhere it notes the address and autograd's version counter, which every
// in-place write through the tensor bumps; when either differs at the next move, the tensor's
// current values are copied into the host copy (which is authoritative) before the slot can be
// reused, and into the slot when the block becomes ready. Such writes cost a synchronous copy
// of that tensor; frozen weights that nobody writes cost a comparison. Writes that bypass the
// version counter (through .data() or data_ptr()) cannot be seen: docs/guide.md says so.
// (Buffers, which forward may update without bumping it, are not packed at all.)
// Whether the caller rebound the tensor or wrote it in place since blockswap last bound it.
bool BlockBinder::caller_changed(int64_t block, std::size_t index) const {
  const at::Tensor& variable = layouts_[block].tensors[index].variable;
  const Binding& bound = bound_[block][index];
  return variable.data_ptr() != bound.data || storage_of(variable) != bound.storage ||
         variable._version() != bound.version;
}

// Note [changed compressed weights]
// A compressed block's frozen tensors have no elements off the device (Note [compressed frozen
// views] in tier_views.cpp), and no raw host copy exists to write a change into. What the
// caller changes is still kept exactly where its values can be had:
// - a tensor rebound to one of its shape and dtype (param.data = new; load_state_dict, which the
//   Python package binds to the true values first; peft's merges, Note [peft merges]), or
//   written in place while its block is on the device (its slot holds every value): the block's
//   frozen bytes are decoded on the host, take the new values, and are encoded again as a whole
//   (Engine::replace_frozen, Note [changed compressed weights] in core/host_store.cpp), once per
//   block and move, after every tensor of it was seen;
// - a write into the tensor with no elements (mul_ under no_grad: it does nothing; copy_ of a
//   full tensor raises torch's own shape error at once) cannot be: the tensor is bound again to
//   what it was (its true values, wherever the block is), and one Error names every such
//   tensor of the block and says what to do. The offloader goes on with the true weights.
// Returns whether it took the change.
bool BlockBinder::compressed_change(int64_t block, PackedTensor& t) {
  if (t.role != Role::frozen || !views_.compressed(block) || engine_ == nullptr) return false;
  const at::Tensor& now = t.variable;
  const auto index = static_cast<std::size_t>(&t - layouts_[block].tensors.data());
  // The node's copy (shared_) is never written: a change to it is the caller's Error
  // (save_changes), the same values again are none.
  if (now.sizes().vec() != t.sizes || now.scalar_type() != t.dtype) {
    if (bound_[block][index].on_device || now.numel() != 0) return false; // replaced: raised
    bind(block, index, host_view(block, t), false);                       // its true values again
    if (shared_) return false;
    views_.dropped_compressed(block, t);
    return true;
  }
  if (changed_block_ != block) {
    changed_frozen_ = views_.decoded_frozen(block, layouts_[block].trainable_offset);
    changed_block_ = block;
    changed_values_ = false;
  }
  const at::Tensor values = now.detach().to(at::kCPU).contiguous();
  // The same values again (the checkpoint the model was built from, loaded to resume) are not
  // encoded again.
  std::byte* into = changed_frozen_->data() + t.offset;
  if (std::memcmp(into, values.data_ptr(), values.nbytes()) != 0) {
    if (shared_) return false;
    std::memcpy(into, values.data_ptr(), values.nbytes());
    changed_values_ = true;
  }
  return true;
}

void BlockBinder::encode_changes(int64_t block) {
  if (changed_block_ != block) return;
  const std::shared_ptr<Buffer> raw = std::exchange(changed_frozen_, nullptr);
  changed_block_ = -1;
  if (!changed_values_) { // its tensors are bound to its true values again, the block stays
    rebind_frozen_off_device(block);
    return;
  }
  const bool compressed = engine_->replace_frozen(
      block, std::span<const std::byte>(raw->data(), layouts_[block].trainable_offset));
  views_.use_compressed(block, engine_->host_buffer(block),
                        compressed ? engine_->host_frozen_bytes(block) : 0);
  rebind_frozen_off_device(block);
  // A load of the block made before (the last pass's prefetch) carried the old values: its
  // next on_ready writes the new ones into its slot.
  if (std::any_of(bound_[block].begin(), bound_[block].end(),
                  [](const Binding& b) { return !b.on_device; })) {
    stale_slot_.resize(layouts_.size());
    stale_slot_[block] = true;
  }
  // The trainable bytes of the packed region moved with the buffer: their tensors off the
  // device follow them (what on_written_back does).
  const HostRegion trainable = engine_->host_trainable(block);
  if (trainable.buffer != trainable_hosts_[block].buffer ||
      trainable.offset != trainable_hosts_[block].offset) {
    on_written_back(block, trainable);
  }
}

void BlockBinder::rebind_frozen_off_device(int64_t block) {
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    const PackedTensor& t = layouts_[block].tensors[i];
    if (t.role == Role::frozen && !bound_[block][i].on_device) {
      bind(block, i,
           strict_ ? at::empty({0}, at::TensorOptions().dtype(t.dtype).device(device_))
                   : host_view(block, t),
           false);
    }
  }
}

std::vector<std::pair<at::Tensor, at::Tensor>> BlockBinder::frozen_values(int64_t block) const {
  std::vector<std::pair<at::Tensor, at::Tensor>> values =
      views_.frozen_values(block, layouts_[block]);
  std::erase_if(values, [&](const std::pair<at::Tensor, at::Tensor>& value) {
    for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
      const PackedTensor& t = layouts_[block].tensors[i];
      if (t.variable.is_same(value.first)) {
        return caller_changed(block, i) && t.variable.sizes().vec() == t.sizes;
      }
    }
    return false;
  });
  return values;
}

void BlockBinder::save_changes(int64_t block, PackedTensor& t) {
  const at::Tensor& now = t.variable;
  if (compressed_change(block, t)) return;
  BLOCKSWAP_CHECK(!shared_ || t.role != Role::frozen, "[", label_, "] frozen tensor '", t.name,
                  "' of block ", block,
                  " was changed, but its host copy is the node's, shared by every rank "
                  "(Options::node_sharing): load or change frozen weights before building the "
                  "offloader (on local rank 0, whose weights every rank reads); with "
                  "DistributedDataParallel, which broadcasts every parameter when it is built, "
                  "make it ignore the swapped ones (docs/distributed.md)");
  BLOCKSWAP_CHECK(now.sizes().vec() == t.sizes && now.scalar_type() == t.dtype, "[", label_,
                  "] tensor '", t.name, "' of block ", block, " was replaced by one of shape ",
                  now.sizes(), " and dtype ", now.scalar_type(), " where the block has ",
                  at::IntArrayRef(t.sizes), " and ", t.dtype,
                  ": a swapped block's tensors keep their shape and dtype");
  // Note [changes to the file tier] in tier_views.cpp
  if (views_.read_only(block) && t.role == Role::frozen) {
    const auto index = static_cast<std::size_t>(&t - layouts_[block].tensors.data());
    Binding& bound = bound_[block][index];
    if (views_.matches_source(block, t, now)) {
      bound.data = now.data_ptr(); // the file's values again (a checkpoint resumed): kept
      bound.storage = storage_of(now);
      bound.version = now._version();
      return;
    }
    const at::Tensor file = host_view(block, t);
    if (!bound.on_device) {
      bind(block, index, file, false);
    } else if (now.data_ptr() == bound.data && views_.viewable(block)) { // in place, in its slot
      at::NoGradGuard no_grad;
      now.detach().copy_(file.to(now.device()));
      bound.version = now._version();
    }
    views_.dropped(block, t);
    return;
  }
  const at::Tensor host = host_view(block, t);
  if (now.data_ptr() != host.data_ptr()) {
    at::NoGradGuard no_grad;
    host.copy_(now.detach());
  }
}

// The changes the views dropped, and any other of a read-only block's: one Error.
void BlockBinder::raise_dropped_changes() {
  if (!views_.any_dropped()) return;
  check_read_only_writes(); // the other blocks in the file too: many written, one error
}

void BlockBinder::check_read_only_writes() {
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    if (!views_.read_only(static_cast<int64_t>(b))) continue;
    for (std::size_t i = 0; i < layouts_[b].tensors.size(); ++i) {
      PackedTensor& t = layouts_[b].tensors[i];
      if (t.role == Role::frozen && caller_changed(static_cast<int64_t>(b), i) &&
          t.variable.sizes().vec() == t.sizes && t.variable.scalar_type() == t.dtype) {
        save_changes(static_cast<int64_t>(b), t);
      }
    }
  }
  views_.raise_dropped();
}

void BlockBinder::check_still_frozen() const {
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    for (const PackedTensor& t : layouts_[b].tensors) {
      if (t.role != Role::frozen) continue;
      BLOCKSWAP_CHECK(!t.variable.requires_grad(), "[", label_, "] parameter '", t.name,
                      "' of block ", b,
                      " was made trainable after the ModelOffloader was built, which swaps it "
                      "as a frozen weight: choose which parameters train before building it");
    }
  }
}

void BlockBinder::save_caller_changes(int64_t block) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    if (!caller_changed(block, i)) continue;
    PackedTensor& t = layouts_[block].tensors[i];
    save_changes(block, t);
    bound_[block][i].data = t.variable.data_ptr();
    bound_[block][i].storage = storage_of(t.variable);
    bound_[block][i].version = t.variable._version();
  }
  encode_changes(block);
  raise_dropped_changes();
}

void BlockBinder::written_by_blockswap(int64_t block, std::size_t index) {
  bound_[block][index].version = layouts_[block].tensors[index].variable._version();
}

void BlockBinder::on_ready(int64_t block, const std::shared_ptr<Buffer>& slot) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  at::NoGradGuard no_grad;
  if (static_cast<std::size_t>(block) < stale_slot_.size() && stale_slot_[block]) {
    // Note [changed compressed weights]: the frozen bytes encoded again since its load began.
    const std::shared_ptr<Buffer> decoded =
        views_.compressed(block) ? views_.decoded_frozen(block, layouts_[block].trainable_offset)
                                 : nullptr;
    for (const PackedTensor& t : layouts_[block].tensors) {
      if (t.role != Role::frozen) continue;
      view(slot, t.offset, t, device_)
          .copy_(decoded ? view(decoded, t.offset, t, at::kCPU) : host_view(block, t));
    }
    stale_slot_[block] = false;
  }
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    PackedTensor& t = layouts_[block].tensors[i];
    const bool changed = caller_changed(block, i);
    // Note [changed compressed weights]: the tensor holds the values it keeps, if any.
    const bool compressed = t.role == Role::frozen && views_.compressed(block);
    if (changed) save_changes(block, t);
    const at::Tensor on_slot = view(slot, t.offset, t, device_);
    if (changed && !compressed) {
      on_slot.copy_(host_view(block, t)); // the load may have carried older values
    } else if (changed && t.variable.sizes().vec() == t.sizes) {
      on_slot.copy_(t.variable.detach());
    }
    bind(block, i, on_slot, true);
  }
  encode_changes(block);
  raise_dropped_changes();
}

void BlockBinder::on_evicted(int64_t block) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    if (caller_changed(block, i)) save_changes(block, layouts_[block].tensors[i]);
  }
  encode_changes(block);
  raise_dropped_changes(); // the block stays, its tensors on its slot
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    const PackedTensor& t = layouts_[block].tensors[i];
    bind(block, i,
         strict_ ? at::empty({0}, at::TensorOptions().dtype(t.dtype).device(device_))
                 : host_view(block, t),
         false);
  }
}

void BlockBinder::on_written_back(int64_t block, const HostRegion& trainable) {
  const c10::InferenceMode normal(false); // Note [inference mode]
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> old_views;
  for (const PackedTensor& t : layouts_[block].tensors) {
    old_views.push_back(t.role == Role::frozen ? at::Tensor() : host_view(block, t));
  }
  trainable_hosts_[block] = trainable;
  for (std::size_t i = 0; i < layouts_[block].tensors.size(); ++i) {
    PackedTensor& t = layouts_[block].tensors[i];
    if (t.role == Role::frozen || bound_[block][i].data != old_views[i].data_ptr()) {
      continue; // on the device
    }
    const at::Tensor on_host = host_view(block, t);
    // What the caller wrote into the old region since is theirs: it goes with the tensor.
    if (caller_changed(block, i) && t.variable.sizes().vec() == t.sizes) {
      on_host.copy_(t.variable.detach());
    }
    bind(block, i, on_host, false);
  }
}

void BlockBinder::restore_to_host() {
  const c10::InferenceMode normal(false); // Note [inference mode]
  rebind_lost_views();
  for (std::size_t b = 0; b < layouts_.size(); ++b) { // Note [compressed frozen views]
    try {
      views_.decode_host_copy(static_cast<int64_t>(b), layouts_[b].trainable_offset);
    } catch (const std::exception& e) {
      warn("", detail::concat("[", label_, "] block ", b, ": ", e.what(),
                              "; its frozen weights are left with no elements"));
    }
  }
  for (std::size_t b = 0; b < layouts_.size() && b < trainable_hosts_.size(); ++b) {
    for (std::size_t i = 0; i < layouts_[b].tensors.size(); ++i) {
      PackedTensor& t = layouts_[b].tensors[i];
      try {
        // What changed on the device stays: a trainable block that never left it was never
        // written back.
        const bool on_device = t.variable.sizes().vec() == t.sizes; // not strict's placeholder
        if (caller_changed(static_cast<int64_t>(b), i) || (t.role != Role::frozen && on_device)) {
          save_changes(static_cast<int64_t>(b), t);
        }
      } catch (const std::exception& e) {
        warn("", detail::concat(e.what(), "; the weights keep their earlier values"));
      }
      bind(static_cast<int64_t>(b), i, host_view(static_cast<int64_t>(b), t), false);
    }
  }
  try {
    raise_dropped_changes();
  } catch (const std::exception& e) {
    warn("", e.what());
  }
  release_claims(layouts_);
}

} // namespace blockswap::torch_frontend
