// The engine's construction, modes, accessors and stats. The residency (prepare, enter and
// leave; slots, waits, moves, evictions, loads through the LoadPipeline) is
// engine_residency.cpp; what training adds (the backward's placement, changed blocks written
// back, the host step's copies) is engine_training.cpp; the state they share is engine_impl.hpp.
#include "blockswap/core/engine.hpp"

#include "engine_impl.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>

#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/log.hpp"
#include "blockswap/core/planner.hpp"

namespace blockswap {
namespace {

using Clock = Engine::Impl::Clock;

void check_backend(const std::shared_ptr<Backend>& backend, const std::string& label) {
  BLOCKSWAP_CHECK(backend != nullptr, "[", label, "] the engine needs a backend");
}

ScheduleOptions schedule_options(std::size_t blocks, const EngineOptions& options, Mode mode) {
  // K is checked against the mode the engine can reach with the tightest bound first, so that
  // a K too large for training is reported as a training error.
  if (options.supports_backward) {
    Schedule::check(static_cast<int64_t>(blocks), options.blocks_to_swap, Mode::training);
  }
  return ScheduleOptions{static_cast<int64_t>(blocks), options.blocks_to_swap, mode,
                         mode == Mode::training ? options.training_rotating_slots
                                                : options.rotating_slots,
                         options.algorithm};
}

// Where scarce host memory goes first (core/planner.hpp, host_priority): the blocks the mode the
// engine starts in moves (training, when it supports backward), then those the other mode
// moves, then the others. The file tier's budget, and pinned memory where the system caps it
// (the load pipeline's staging ring).
std::vector<int64_t> host_priority(std::size_t blocks, const EngineOptions& options) {
  if (options.file && !options.file->priority.empty()) { // the caller's (FileTier::priority)
    const std::vector<int64_t>& given = options.file->priority;
    std::vector<bool> seen(blocks, false);
    for (int64_t b : given) {
      BLOCKSWAP_CHECK_ARGUMENT(b >= 0 && static_cast<std::size_t>(b) < blocks && !seen[b],
                               "the file tier's priority must name each of the ", blocks,
                               " blocks once; it names ", b);
      seen[b] = true;
    }
    BLOCKSWAP_CHECK_ARGUMENT(given.size() == blocks, "the file tier's priority names ",
                             given.size(), " of the ", blocks, " blocks: name each once");
    return given;
  }
  std::vector<Schedule> schedules;
  if (options.supports_backward) {
    schedules.emplace_back(schedule_options(blocks, options, Mode::training));
  }
  schedules.emplace_back(schedule_options(blocks, options, Mode::forward_only));
  std::vector<const Schedule*> pointers;
  for (const Schedule& schedule : schedules) pointers.push_back(&schedule);
  return blockswap::host_priority(static_cast<int64_t>(blocks), pointers);
}

std::vector<bool> blocks_in_file(const std::vector<std::size_t>& bytes,
                                 const std::vector<int64_t>& priority,
                                 const EngineOptions& options) {
  if (!options.file) return {};
  std::size_t left = options.file->host_budget_bytes;
  return file_tier(bytes, priority, left);
}

} // namespace

Engine::Impl::Impl(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
                   EngineOptions options, std::string label)
    : backend_(std::move(backend)), options_(std::move(options)), label_(std::move(label)),
      forward_only_(schedule_options(block_bytes.size(), options_, Mode::forward_only)),
      is_forward_only_(!options_.supports_backward), slot_bytes_(layout::slot_bytes(block_bytes)),
      priority_((check_backend(backend_, label_), host_priority(block_bytes.size(), options_))),
      store_(backend_, block_bytes, options_.trainable_bytes, options_.host_memory, label_,
             blocks_in_file(block_bytes, priority_, options_), priority_,
             options_.host_memory_compressed),
      loads_(backend_, store_, options_.file, priority_, slot_bytes_, label_, [this] {
        if (listener_ != nullptr) listener_->on_file_failed();
      }) {
  BLOCKSWAP_CHECK(!(store_.caller_memory() || options_.file) ||
                      options_.algorithm != Algorithm::seed,
                  "[", label_,
                  "] the seed's replay copies every block back to host memory, which "
                  "EngineOptions::host_memory and the file tier do not allow");
  BLOCKSWAP_CHECK(options_.compress != Compress::on || options_.algorithm != Algorithm::seed, "[",
                  label_,
                  "] the seed's replay copies every block back to host memory, which compressed "
                  "host copies do not allow: turn compression off");
  BLOCKSWAP_CHECK(options_.compress != Compress::on || !backend_->holds_data() ||
                      options_.frozen_ranges.size() == block_bytes.size(),
                  "[", label_, "] compression needs the frozen ranges of each of the ",
                  block_bytes.size(), " blocks (EngineOptions::frozen_ranges), got ",
                  options_.frozen_ranges.size());
  BLOCKSWAP_CHECK(options_.compress != Compress::on || backend_->holds_data() ||
                      options_.modelled_compressed_bytes.size() == block_bytes.size(),
                  "[", label_, "] ", backend_->name(),
                  " holds no bytes to compress (it models time): compression there needs each of "
                  "the ",
                  block_bytes.size(),
                  " blocks' compressed size (EngineOptions::modelled_compressed_bytes), got ",
                  options_.modelled_compressed_bytes.size());
  BLOCKSWAP_CHECK(options_.compress == Compress::on ||
                      std::all_of(options_.host_memory_compressed.begin(),
                                  options_.host_memory_compressed.end(),
                                  [](std::size_t bytes) { return bytes == 0; }),
                  "[", label_,
                  "] EngineOptions::host_memory_compressed says blocks are compressed, which "
                  "only compress on decodes: turn it on");
  BLOCKSWAP_CHECK(options_.compress != Compress::on || backend_->can_decode(), "[", label_, "] ",
                  backend_->name(),
                  " cannot decode compressed weights (a CUDA build without nvcc has no decoder): "
                  "turn compression off");
  if (options_.supports_backward) {
    training_.emplace(schedule_options(block_bytes.size(), options_, Mode::training));
  }
  blocks_.resize(block_bytes.size());
  if (training_.has_value()) {
    const auto n = static_cast<int64_t>(block_bytes.size());
    for (int64_t b = 0; b < n; ++b) {
      if (training_->initial_slots()[b] < 0) blocks_[b].evicted_by_forward = true;
      for (const Move& m : training_->after_forward(b)) blocks_[m.out].evicted_by_forward = true;
    }
  }
  for (BlockState& block : blocks_) block.loaded = backend_->make_event();
  copies_done_ = backend_->make_event();
  decodes_done_ = backend_->make_event();
  if (options_.slots_at_construction) ensure_slots(current().slots());
  loads_.plan(current());
  if (options_.trace) {
    backend_->set_copy_observer([trace = options_.trace](const CopyRecord& copy) {
      trace->add(detail::concat(copy.to_device ? "load block " : "write back block ", copy.tag),
                 Track::copy, copy.start, copy.end);
    });
  }
}

Engine::Impl::~Impl() {
  try {
    std::lock_guard lock(mutex_);
    synchronize_locked();
    if (options_.trace) backend_->set_copy_observer(nullptr);
  } catch (const std::exception& e) {
    log(detail::concat("[", label_, "] a copy failed while shutting down: ", e.what()));
  }
}

const Schedule& Engine::Impl::current() const {
  return is_forward_only_ ? forward_only_ : *training_;
}

const Schedule& Engine::schedule() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->current();
}

void Engine::Impl::check_block(int64_t block) const {
  detail::check_block_index(label_, block, blocks());
}

std::byte* Engine::host_data(int64_t block) const {
  impl_->check_block(block);
  const std::shared_ptr<Buffer>& buffer = impl_->store_.buffer(block);
  return buffer ? buffer->data() : nullptr; // a block in the file has no host copy
}

std::shared_ptr<Buffer> Engine::host_buffer(int64_t block) const {
  impl_->check_block(block);
  return impl_->store_.buffer(block);
}

HostRegion Engine::host_trainable(int64_t block) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  return impl_->store_.trainable(block);
}

bool Engine::in_file(int64_t block) const {
  impl_->check_block(block);
  return impl_->store_.tier(block) == HostStore::Tier::file;
}

std::size_t Engine::block_bytes(int64_t block) const {
  impl_->check_block(block);
  return impl_->store_.bytes(block);
}

const char* compress_name(Compress compress) {
  switch (compress) {
  case Compress::off:
    return "off";
  case Compress::on:
    return "on";
  case Compress::automatic:
    return "auto";
  }
  return "?";
}

Compress parse_compress(const std::string& name) {
  for (Compress c : {Compress::off, Compress::on, Compress::automatic}) {
    if (name == compress_name(c)) return c;
  }
  throw Error(detail::concat("compress must be one of off, on, auto; got '", name, "'"));
}

// automatic is off here: the builder chooses (EngineOptions::compress).
void Engine::Impl::compress_once() {
  if (compressed_) return;
  compressed_ = true;
  if (options_.compress == Compress::on) {
    loads_.compress(options_.frozen_ranges, options_.modelled_compressed_bytes);
  }
}

void Engine::compress() {
  std::lock_guard lock(impl_->mutex_);
  impl_->compress_once();
}

bool Engine::compressed(int64_t block) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  return impl_->store_.compressed(block);
}

std::size_t Engine::host_frozen_bytes(int64_t block) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  return impl_->store_.stored_frozen_bytes(block);
}

bool Engine::replace_frozen(int64_t block, std::span<const std::byte> raw) {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  HostStore& store = impl_->store_;
  BLOCKSWAP_CHECK(store.compressed(block) && impl_->backend_->holds_data(), "[", impl_->label_,
                  "] block ", block, "'s frozen bytes are not stored compressed");
  BLOCKSWAP_CHECK(!store.caller_memory(), "[", impl_->label_, "] block ", block,
                  "'s host copy is the caller's (EngineOptions::host_memory), which the engine "
                  "never writes: change its frozen bytes where it was filled");
  BLOCKSWAP_CHECK(raw.size() == store.frozen_bytes(block), "[", impl_->label_, "] block ", block,
                  " has ", store.frozen_bytes(block), " frozen bytes, not ", raw.size());
  // Note [changed compressed weights]: no copy may read the old buffer or write it.
  try {
    impl_->backend_->synchronize(*impl_->blocks_[block].loaded);
    if (store.pending(block)) impl_->backend_->synchronize(store.written(block));
  } catch (...) {
    impl_->copy_failed(std::current_exception());
  }
  ++impl_->encoded_again_;
  return impl_->loads_.replace_frozen(block, raw, impl_->options_.frozen_ranges[block]);
}

CompressionStats Engine::compression() const {
  std::lock_guard lock(impl_->mutex_);
  CompressionStats stats;
  for (int64_t b = 0; b < impl_->blocks(); ++b) {
    if (!impl_->store_.compressed(b)) continue;
    ++stats.blocks;
    stats.raw_bytes += impl_->store_.frozen_bytes(b);
    stats.compressed_bytes += impl_->store_.stored_frozen_bytes(b);
  }
  stats.decode_buffer_bytes = impl_->loads_.decode_buffer_bytes();
  stats.encoded_again = impl_->encoded_again_;
  stats.on = impl_->options_.compress == Compress::on;
  return stats;
}

std::size_t Engine::host_bytes() const {
  std::lock_guard lock(impl_->mutex_);
  std::size_t bytes = 0;
  for (int64_t b = 0; b < impl_->blocks(); ++b) bytes += impl_->store_.host_bytes(b);
  return bytes;
}

void Engine::synchronize() {
  std::lock_guard lock(impl_->mutex_);
  impl_->synchronize_locked();
}

void Engine::disable() {
  std::lock_guard lock(impl_->mutex_);
  impl_->enabled_ = false;
}

void Engine::enable() {
  std::lock_guard lock(impl_->mutex_);
  impl_->enabled_ = true;
}

bool Engine::enabled() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->enabled_;
}

void Engine::set_forward_only(bool forward_only) {
  std::lock_guard lock(impl_->mutex_);
  BLOCKSWAP_CHECK(forward_only || impl_->training_.has_value(), "[", impl_->label_,
                  "] cannot leave forward-only mode: the engine was built without "
                  "supports_backward");
  if (impl_->is_forward_only_ != forward_only) impl_->switched_since_prepare_ = true;
  impl_->is_forward_only_ = forward_only;
  impl_->loads_.plan(impl_->current());
}

bool Engine::forward_only() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->is_forward_only_;
}

void Engine::set_listener(ResidencyListener* listener) {
  std::lock_guard lock(impl_->mutex_);
  impl_->listener_ = listener;
}

bool Engine::is_resident(int64_t block) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  return impl_->blocks_[block].slot >= 0;
}

bool Engine::is_ready(int64_t block) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  return impl_->blocks_[block].ready;
}

std::byte* Engine::device_data(int64_t block) const {
  return device_buffer(block)->data();
}

std::shared_ptr<Buffer> Engine::device_buffer(int64_t block) const {
  std::lock_guard lock(impl_->mutex_);
  impl_->check_block(block);
  const Impl::BlockState& state = impl_->blocks_[block];
  BLOCKSWAP_CHECK(state.ready, "[", impl_->label_, "] block ", block,
                  state.slot >= 0 ? " is still loading: call wait_for_block() before using it"
                                  : " is not on the device");
  return impl_->slots_[state.slot].memory;
}

Stats Engine::stats() const {
  std::lock_guard lock(impl_->mutex_);
  impl_->collect_stalls();
  Stats stats = impl_->stats_;
  stats.disk_bytes = impl_->loads_.counters().disk_bytes;
  stats.staged_bytes = impl_->loads_.counters().staged_bytes;
  stats.decoded_bytes = impl_->loads_.counters().decoded_bytes;
  stats.compressed_bytes = impl_->loads_.counters().compressed_bytes;
  // The decode buffer is held from compress() to the end, beside every slot the engine holds.
  const uint64_t decode_buffer = impl_->loads_.decode_buffer_bytes();
  stats.device_bytes += decode_buffer;
  stats.peak_device_bytes += decode_buffer;
  return stats;
}

void Engine::reset_stats() {
  std::lock_guard lock(impl_->mutex_);
  // Stalls still in flight belong to before the reset: their timers are reused unread.
  for (Impl::StallTimer& timer : impl_->stall_timers_)
    impl_->spare_timers_.push_back(std::move(timer));
  impl_->stall_timers_.clear();
  const uint64_t device_bytes = impl_->stats_.device_bytes;
  impl_->stats_ = Stats{};
  impl_->loads_.reset_counters();
  impl_->stats_.device_bytes = device_bytes;
  impl_->stats_.peak_device_bytes = device_bytes;
}

void Engine::Impl::log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    log_line(line);
  }
}

Engine::Engine(std::shared_ptr<Backend> backend, std::vector<std::size_t> block_bytes,
               EngineOptions options, std::string label)
    : impl_(std::make_unique<Impl>(std::move(backend), std::move(block_bytes), std::move(options),
                                   std::move(label))) {}
Engine::~Engine() = default;

int64_t Engine::blocks() const {
  return impl_->blocks();
}
const std::string& Engine::label() const {
  return impl_->label_;
}
std::size_t Engine::slot_bytes() const {
  return impl_->slot_bytes_;
}
// Without the engine's lock: a worker thread waits while the engine goes on.
void Engine::wait(const Event& event) {
  impl_->backend_->synchronize(event);
}

} // namespace blockswap
