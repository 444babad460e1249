// The load pipeline's decode step (core/load_pipeline.hpp, Note [a decode step] in
// load_pipeline.cpp): blocks whose frozen bytes the host store keeps compressed (Note
// [compressed host copies] in host_store.cpp) are copied compressed into one of two device
// buffers on the copy stream and decoded from there into their slot on the decode stream.
#include <algorithm>
#include <span>
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
  BLOCKSWAP_CHECK(!decode_buffers_[0].memory, "[", label_,
                  "] the host copies are compressed already");
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
  // A staged block's new buffer may be pageable (it is staged anyway); no read ahead may read
  // a raw buffer the store frees (none is requested before the first pass, but compress() may
  // come late), and its reader reads the compressed bytes from then on.
  hold_around_all([&] {
    for (int64_t b = 0; b < store_.blocks(); ++b) {
      if (store_.compressed(b)) { // the caller's memory, compressed by its filler
        largest = std::max(largest, store_.stored_frozen_bytes(b));
        continue;
      }
      const bool staged_from_memory = staged(b) && store_.tier(b) != HostStore::Tier::file;
      if (store_.caller_memory() ||
          (!staged_from_memory && store_.tier(b) != HostStore::Tier::pinned)) {
        continue;
      }
      const bool shrank = model ? store_.model_compressed(b, modelled[b])
                                : store_.compress(b, ranges[b], staged_from_memory);
      if (!shrank) continue;
      largest = std::max(largest, store_.stored_frozen_bytes(b));
      if (staged_from_memory) {
        reader_->repoint(b, store_.buffer(b)->data(), store_.stored_frozen_bytes(b));
      }
    }
  });
  if (largest == 0) return;
  for (DecodeBuffer& buffer : decode_buffers_) { // the Device accounts for both
    buffer.memory = backend_->allocate_device(largest);
    buffer.copied = backend_->make_event();
    buffer.free = backend_->make_event(); // not recorded: the first copy into it waits for nothing
  }
}

bool LoadPipeline::replace_frozen(int64_t block, std::span<const std::byte> raw,
                                  std::span<const codec::Range> ranges) {
  bool compressed = false;
  hold_around(block, [&] {
    compressed = store_.replace_frozen(block, raw, ranges, decode_capacity());
    if (staged(block)) {
      reader_->repoint(block, store_.buffer(block)->data(), store_.stored_frozen_bytes(block));
    }
  });
  return compressed;
}

// Note [a decode step]: two buffers, used in turn, so that the copy of the next compressed load
// runs while this one decodes. The trainable bytes (raw) go straight into the slot, before the
// event the decode waits for: its load event, on the decode stream, follows them too.
void LoadPipeline::copy_compressed(int64_t block, std::byte* slot, const HostStore::Source& source,
                                   Event& loaded) {
  DecodeBuffer& buffer = decode_buffers_[next_decode_buffer_];
  BLOCKSWAP_ASSERT(buffer.memory.size() >= source.compressed_bytes, "block ", block,
                   " is compressed, but the decode buffer holds ", buffer.memory.size(), " bytes");
  backend_->wait(Stream::copy, *buffer.free); // the decode out of it before is done
  backend_->copy_to_device(buffer.memory.data(), source.frozen, source.compressed_bytes, block);
  if (source.trainable_bytes > 0) {
    backend_->copy_to_device(slot + source.frozen_bytes, source.trainable, source.trainable_bytes,
                             block);
  }
  backend_->record(*buffer.copied, Stream::copy);
  backend_->wait(Stream::decode, *buffer.copied);
  backend_->decode(slot, buffer.memory.data(), source.compressed_bytes, store_.parsed(block),
                   block);
  // The load's event first: a backend that hands a failed decode's error to the next event
  // recorded on its stream (the emulated device) hands it to this block's wait.
  backend_->record(loaded, Stream::decode);
  backend_->record(*buffer.free, Stream::decode);
  next_decode_buffer_ = (next_decode_buffer_ + 1) % kDecodeBuffers;
  counters_.decoded_bytes += source.frozen_bytes;
  counters_.compressed_bytes += source.compressed_bytes;
}

} // namespace blockswap
