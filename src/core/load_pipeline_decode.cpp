// The load pipeline's decode step (core/load_pipeline.hpp, Note [a decode step] in
// load_pipeline.cpp): blocks whose frozen bytes the host store keeps compressed (Note
// [compressed host copies] in host_store.cpp) are copied compressed into a device buffer and
// decoded from there into their slot, on the copy stream.
#include <algorithm>
#include <string>

#include "blockswap/core/error.hpp"
#include "blockswap/core/load_pipeline.hpp"

namespace blockswap {

void Backend::decode(std::byte* /*out*/, const std::byte* /*compressed*/, std::size_t /*bytes*/,
                     const codec::Parsed& /*parsed*/, int64_t /*tag*/) {
  throw Error(detail::concat(name(), ": this backend cannot decode compressed weights"));
}

void LoadPipeline::compress(const std::vector<std::vector<codec::Range>>& ranges,
                            const std::vector<std::size_t>& modelled) {
  BLOCKSWAP_CHECK(!decode_buffer_, "[", label_, "] the host copies are compressed already");
  const bool model = !backend_->holds_data();
  const std::size_t given = model ? modelled.size() : ranges.size();
  BLOCKSWAP_CHECK(
      given == staged_.size(), "[", label_, "] compression has ",
      model ? "modelled sizes" : "ranges", " for ", given, " blocks of ", staged_.size(),
      ": give one per block",
      model ? detail::concat(" (", backend_->name(), " holds no bytes to compress: it models time)")
            : std::string());
  BLOCKSWAP_CHECK(backend_->can_decode(), "[", label_, "] ", backend_->name(),
                  " cannot decode compressed weights (a CUDA build without nvcc has no decoder): "
                  "turn compression off");
  std::size_t largest = 0;
  for (int64_t b = 0; b < store_.blocks(); ++b) {
    if (store_.caller_memory() || staged(b) || store_.tier(b) != HostStore::Tier::pinned) continue;
    const bool shrank =
        model ? store_.model_compressed(b, modelled[b]) : store_.compress(b, ranges[b]);
    if (shrank) largest = std::max(largest, store_.stored_frozen_bytes(b));
  }
  if (largest > 0) decode_buffer_ = backend_->allocate_device(largest);
}

// One buffer is enough: the copy into it, the decode out of it and the next copy into it are
// on the copy stream, in order. The trainable bytes (raw) go straight into the slot.
void LoadPipeline::copy_compressed(int64_t block, std::byte* slot,
                                   const HostStore::Source& source) {
  BLOCKSWAP_ASSERT(decode_buffer_.size() >= source.compressed_bytes, "block ", block,
                   " is compressed, but the decode buffer holds ", decode_buffer_.size(), " bytes");
  backend_->copy_to_device(decode_buffer_.data(), source.frozen, source.compressed_bytes, block);
  backend_->decode(slot, decode_buffer_.data(), source.compressed_bytes, store_.parsed(block),
                   block);
  if (source.trainable_bytes > 0) {
    backend_->copy_to_device(slot + source.frozen_bytes, source.trainable, source.trainable_bytes,
                             block);
  }
  counters_.decoded_bytes += source.frozen_bytes;
  counters_.compressed_bytes += source.compressed_bytes;
}

} // namespace blockswap
