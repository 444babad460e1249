#include "blockswap/device/device.hpp"

#include "blockswap/core/file_source.hpp"

#include <algorithm>
#include <charconv>
#include <limits>
#include <map>
#include <mutex>

#include "blockswap/core/error.hpp"
#include "blockswap/device/emulated.hpp"
#include "host_memory.hpp"
#if BLOCKSWAP_HAS_CUDA
#include "blockswap/device/cuda.hpp"
#endif

namespace blockswap {

// Note [shared device]
// Every engine on a device copies on its one backend, so the copies of several offloaders form
// one queue in the order they are enqueued, which is the order their blocks compute. Each
// engine sees the backend through an Attached view that counts its slots against the device's
// budget and tags its copies, so that a copy observer (a trace) sees only its own engine's.
struct Device::State {
  std::shared_ptr<Backend> backend;
  std::size_t budget_bytes = 0;
  mutable std::mutex mutex;
  std::size_t held_bytes = 0; // every attached engine's device memory
  std::size_t peak_held_bytes = 0;
  std::map<std::string, std::size_t> held_by; // by label, for messages
  TransferStats transfers;                    // not block weights: offloaded activations
  // Note [exact host memory] in host_memory.cpp
  std::shared_ptr<device_detail::HostAccount> host = std::make_shared<device_detail::HostAccount>();
  std::shared_ptr<device_detail::HostPool> pool;
  int64_t next_id = 0;
  std::map<int64_t, CopyObserver> observers; // by attached id
  bool observing = false;

  // The tag a copy carries on the shared backend: the attached engine's id, then its own tag.
  static int64_t tag_of(int64_t id, int64_t tag) {
    return (id << 32) | static_cast<int64_t>(static_cast<uint32_t>(tag));
  }

  void observe(const CopyRecord& copy) {
    CopyObserver observer;
    {
      std::lock_guard lock(mutex);
      const auto it = observers.find(copy.tag >> 32);
      if (it == observers.end()) return;
      observer = it->second;
    }
    CopyRecord own = copy;
    own.tag = static_cast<int32_t>(static_cast<uint32_t>(copy.tag & 0xFFFFFFFF));
    observer(own);
  }

  std::string holders() const {
    std::string text;
    for (const auto& [label, bytes] : held_by) {
      if (bytes == 0) continue;
      text += detail::concat(text.empty() ? "" : ", ", label, ": ", bytes);
    }
    return text.empty() ? "none" : text;
  }
};

namespace {

class Attached final : public Backend {
public:
  Attached(std::shared_ptr<Device::State> state, std::string label)
      : state_(std::move(state)), label_(std::move(label)) {
    std::lock_guard lock(state_->mutex);
    id_ = state_->next_id++;
  }
  ~Attached() override { set_copy_observer(nullptr); }

  std::string name() const override { return state_->backend->name(); }
  Buffer allocate_host(std::size_t bytes) override {
    return state_->host->count(state_->backend->allocate_host(bytes), /*kept=*/true);
  }
  Buffer pin_host(std::byte* data, std::size_t bytes) override {
    Buffer pinned = state_->backend->pin_host(data, bytes);
    return pinned ? state_->host->count(std::move(pinned), /*kept=*/true) : Buffer();
  }
  std::unique_ptr<StagingReader> make_staging_reader(StagingSpec spec) override {
    return state_->backend->make_staging_reader(std::move(spec));
  }

  Buffer allocate_device(std::size_t bytes) override {
    {
      std::lock_guard lock(state_->mutex);
      const std::size_t budget = state_->budget_bytes;
      if (budget > 0 && state_->held_bytes + bytes > budget) {
        throw OutOfMemory(
            detail::concat("[", label_, "] ", state_->backend->name(), ": a slot of ", bytes,
                           " bytes does not fit the device budget of ", budget,
                           " bytes; held now: ", state_->held_bytes, " bytes (", state_->holders(),
                           "). Swap more blocks, or plan every block list together (the planner)"));
      }
      // Claimed before allocating, so that two engines cannot both take the last of the budget.
      state_->held_bytes += bytes;
      state_->held_by[label_] += bytes;
      account_->held += bytes;
      state_->peak_held_bytes = std::max(state_->peak_held_bytes, state_->held_bytes);
      account_->peak = std::max(account_->peak, account_->held);
    }
    Buffer memory;
    try {
      memory = state_->backend->allocate_device(bytes);
    } catch (...) {
      release(*state_, *account_, bytes);
      throw;
    }
    std::byte* data = memory.data();
    // The buffer may outlive this view and the device: its release shares their accounts.
    return Buffer(data, bytes,
                  [memory = std::make_shared<Buffer>(std::move(memory)), state = state_,
                   account = account_](std::byte*, std::size_t n) {
                    memory->reset();
                    release(*state, *account, n);
                  });
  }

  void copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                      int64_t tag) override {
    state_->backend->copy_to_device(device, host, bytes, Device::State::tag_of(id_, tag));
  }
  void copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                    int64_t tag) override {
    state_->backend->copy_to_host(host, device, bytes, Device::State::tag_of(id_, tag));
  }

  void set_copy_observer(CopyObserver observer) override {
    bool install = false;
    {
      std::lock_guard lock(state_->mutex);
      if (observer) {
        state_->observers[id_] = std::move(observer);
        install = !state_->observing;
        state_->observing = true;
      } else {
        state_->observers.erase(id_);
      }
    }
    if (install) {
      state_->backend->set_copy_observer(
          [weak = std::weak_ptr<Device::State>(state_)](const CopyRecord& copy) {
            if (auto state = weak.lock()) state->observe(copy);
          });
    }
  }

  void decode(std::byte* out, const std::byte* compressed, std::size_t bytes,
              const codec::Parsed& parsed, int64_t tag) override {
    state_->backend->decode(out, compressed, bytes, parsed, Device::State::tag_of(id_, tag));
  }
  bool can_decode() const override { return state_->backend->can_decode(); }
  bool holds_data() const override { return state_->backend->holds_data(); }
  void poison(std::byte* device, std::size_t bytes) override {
    state_->backend->poison(device, bytes);
  }
  std::unique_ptr<Event> make_event() override { return state_->backend->make_event(); }
  std::unique_ptr<Event> make_timed_event() override { return state_->backend->make_timed_event(); }
  // The engine times its stalls on the device through these (docs/performance.md).
  bool times_events() const override { return state_->backend->times_events(); }
  std::optional<double> elapsed_seconds(const Event& start, const Event& end) const override {
    return state_->backend->elapsed_seconds(start, end);
  }
  void record(Event& event, Stream stream) override { state_->backend->record(event, stream); }
  void wait(Stream stream, const Event& event) override { state_->backend->wait(stream, event); }
  void synchronize(const Event& event) override { state_->backend->synchronize(event); }
  void wait_host(Stream stream, std::function<void()> until) override {
    state_->backend->wait_host(stream, std::move(until));
  }

  MemoryStats memory() const override {
    MemoryStats stats = state_->backend->memory();
    std::lock_guard lock(state_->mutex);
    stats.device_bytes = account_->held;
    stats.peak_device_bytes = account_->peak;
    return stats;
  }

private:
  struct Account { // guarded by the device's mutex
    std::string label;
    std::size_t held = 0;
    std::size_t peak = 0;
  };

  static void release(Device::State& state, Account& account, std::size_t bytes) {
    std::lock_guard lock(state.mutex);
    state.held_bytes -= bytes;
    state.held_by[account.label] -= bytes;
    account.held -= bytes;
  }

  std::shared_ptr<Device::State> state_;
  std::string label_;
  std::shared_ptr<Account> account_ = std::make_shared<Account>(Account{label_});
  int64_t id_ = 0;
};

} // namespace

std::shared_ptr<Device> Device::open(std::string_view name, DeviceOptions options) {
  if (name == "emulated" || name == "cpu") {
    EmulatedDeviceOptions emulated;
    emulated.link_gbps = options.emulated_link_gbps;
    if (options.emulated_capacity_bytes > 0)
      emulated.capacity_bytes = options.emulated_capacity_bytes;
    if (options.emulated_pinnable_bytes) emulated.pinnable_bytes = *options.emulated_pinnable_bytes;
    return std::make_shared<Device>(std::make_shared<EmulatedDevice>(emulated),
                                    options.budget_bytes);
  }
  if (name == "cuda" || name.starts_with("cuda:")) {
    BLOCKSWAP_CHECK_ARGUMENT(options.emulated_link_gbps == 0 &&
                                 options.emulated_capacity_bytes == 0 &&
                                 !options.emulated_pinnable_bytes,
                             "device '", name,
                             "': the link, capacity and pinnable bytes are the emulated "
                             "device's; a GPU has its own");
#if BLOCKSWAP_HAS_CUDA
    CudaDeviceOptions cuda;
    if (name.size() > 5) {
      const std::string_view index = name.substr(5);
      const auto [end, ec] =
          std::from_chars(index.data(), index.data() + index.size(), cuda.device);
      BLOCKSWAP_CHECK(ec == std::errc() && end == index.data() + index.size() && cuda.device >= 0,
                      "device '", name, "': the index after 'cuda:' must be a number, e.g. cuda:0");
    }
    cuda.compute_stream = std::move(options.compute_stream);
    cuda.release_cached_memory = std::move(options.release_cached_memory);
    return std::make_shared<Device>(std::make_shared<CudaDevice>(std::move(cuda)),
                                    options.budget_bytes);
#endif
  }
  std::string known;
  for (const std::string& kind : kinds()) known += detail::concat(known.empty() ? "" : ", ", kind);
  // A build against a CUDA torch without a CUDA runtime of torch's major version has no CUDA
  // backend (cmake/BlockswapTorch.cmake warns at build time, where pip hides it).
  const bool cuda = name.substr(0, 4) == "cuda";
  throw Error(detail::concat(
      "device '", name, "' is not one this build of blockswap has (", known, ")",
      cuda ? ": it was built without its CUDA backend, for want of a CUDA runtime of torch's CUDA "
             "major version with its headers; docs/build.md says what to install, then build "
             "again (pip install -v shows the reason)"
           : ""));
}

std::vector<std::string> Device::kinds() {
#if BLOCKSWAP_HAS_CUDA
  return {"emulated", "cuda"};
#else
  return {"emulated"};
#endif
}

bool Device::present(std::string_view kind) {
  if (kind == "emulated" || kind == "cpu") return true;
#if BLOCKSWAP_HAS_CUDA
  if (kind == "cuda") return CudaDevice::available();
#endif
  return false;
}

Device::Device(std::shared_ptr<Backend> backend, std::size_t budget_bytes)
    : state_(std::make_shared<State>()) {
  BLOCKSWAP_CHECK(backend != nullptr, "a Device needs a backend");
  state_->backend = std::move(backend);
  state_->budget_bytes = budget_bytes;
  state_->pool = std::make_shared<device_detail::HostPool>(
      state_->host, [backend = state_->backend, host = state_->host](std::size_t bytes) {
        return host->count(backend->allocate_host(bytes), /*kept=*/false);
      });
}

Device::~Device() = default;

std::string Device::name() const {
  return state_->backend->name();
}

bool Device::is_cuda() const {
  return name().starts_with("cuda");
}

Backend& Device::backend() const {
  return *state_->backend;
}

std::size_t Device::budget_bytes() const {
  return state_->budget_bytes;
}

std::size_t Device::available_bytes() const {
  std::lock_guard lock(state_->mutex);
  if (state_->budget_bytes == 0) return std::numeric_limits<std::size_t>::max();
  return state_->budget_bytes - std::min(state_->budget_bytes, state_->held_bytes);
}

MemoryStats Device::memory() const {
  MemoryStats stats = state_->backend->memory();
  std::lock_guard lock(state_->mutex);
  stats.device_bytes = state_->held_bytes;
  stats.peak_device_bytes = state_->peak_held_bytes;
  return stats;
}

void Device::count_d2h(std::size_t bytes) {
  std::lock_guard lock(state_->mutex);
  TransferStats& t = state_->transfers;
  t.bytes_d2h += bytes;
  t.host_bytes += bytes;
  t.peak_host_bytes = std::max(t.peak_host_bytes, t.host_bytes);
}

void Device::count_h2d(std::size_t bytes) {
  std::lock_guard lock(state_->mutex);
  state_->transfers.bytes_h2d += bytes;
}

void Device::count_host_freed(std::size_t bytes) {
  std::lock_guard lock(state_->mutex);
  TransferStats& t = state_->transfers;
  t.host_bytes -= std::min(bytes, t.host_bytes); // called from destructors: never throws
}

TransferStats Device::transfers() const {
  std::lock_guard lock(state_->mutex);
  return state_->transfers;
}

HostMemoryStats Device::host_memory() const {
  return state_->host->stats();
}

Buffer Device::pooled_host(std::size_t bytes) {
  return state_->pool->take(bytes);
}

void Device::trim_host_pool() {
  state_->pool->trim();
}

std::shared_ptr<Backend> Device::attach(std::string label) {
  return std::make_shared<Attached>(state_, std::move(label));
}

} // namespace blockswap
