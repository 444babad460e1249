// TimedDevice: a device modelled in time only, for measuring the engine and its schedules the
// same on any machine.
//
// It has real streams (a compute thread, a copy thread and a decode thread, each running its
// work in order; LinkModel::decode_stream false runs the decodes on the copy thread) and real
// events between them and the host, so the engine's own synchronisation runs as it
// does on a GPU. What the work costs is modelled, not measured: a computation enqueued with
// compute() occupies the compute stream for the time it is given, and a copy occupies the copy
// stream for LinkModel::seconds(bytes). No byte is copied and no memory bus is shared, so the
// CPU it runs on does not change what it measures.
//
// Time is device time, in seconds from the device's creation: each stream keeps its own clock
// (work starts when the stream is free and the host has enqueued it; an event a stream waits
// for moves its clock to the event's time), and the host's clock advances by the CPU time the
// host thread spends between its calls into the device (the engine's overhead counts; the
// operating system running other work does not) and jumps to an event's time when the host
// waits for it (a wait costs its model time, not a thread's wake-up).
//
// Its memory is address space only: it holds no data, and reading or writing it faults. It is
// for drivers that compute nothing (time_step below, the benchmarks), not for tensors.
//
// The file tier's disk is modelled too (make_staging_reader): a block read from the file
// occupies the disk for LinkModel::disk_seconds(bytes), reads one after another in the order
// asked, each starting once it is asked for, the disk is free and a staging buffer is (the copy
// out of its last block ended). The copy out of a block waits for its read on the copy stream
// (copy_after), and the host waits for it (wait) only when the block is about to be computed,
// as on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blockswap/core/backend.hpp"
#include "blockswap/core/file_source.hpp"
#include "blockswap/core/simulator.hpp"

namespace blockswap {

class Engine;

struct TimedDeviceOptions {
  LinkModel link;
  std::size_t capacity_bytes = std::numeric_limits<std::size_t>::max();
};

// A computation the compute stream ran.
struct ComputeRecord {
  int64_t tag = -1;
  double start = 0, end = 0; // device seconds
  double idle_before = 0;    // the stream waited this long before it (for a load, or the host)
};

class TimedDevice final : public Backend {
public:
  explicit TimedDevice(TimedDeviceOptions options = {});
  ~TimedDevice() override; // finishes the work already enqueued, then stops the threads

  // not copyable, not movable: the threads refer to this object's state
  TimedDevice(const TimedDevice&) = delete;
  TimedDevice& operator=(const TimedDevice&) = delete;

  std::string name() const override;
  Buffer allocate_host(std::size_t bytes) override;
  Buffer allocate_device(std::size_t bytes) override;
  void copy_to_device(std::byte* device, const std::byte* host, std::size_t bytes,
                      int64_t tag) override;
  void copy_to_host(std::byte* host, const std::byte* device, std::size_t bytes,
                    int64_t tag) override;
  void set_copy_observer(CopyObserver observer) override;
  // the decode stream busy for LinkModel::decode_seconds of the decoded bytes (the copy stream
  // where !LinkModel::decode_stream)
  void decode(std::byte* out, const std::byte* compressed, std::size_t bytes,
              const codec::Parsed& parsed, int64_t tag) override;
  bool can_decode() const override;
  bool holds_data() const override { return false; }
  void poison(std::byte* device, std::size_t bytes) override; // nothing to poison
  std::unique_ptr<Event> make_event() override;
  std::unique_ptr<Event> make_timed_event() override;
  void record(Event& event, Stream stream) override;
  void wait(Stream stream, const Event& event) override;
  void synchronize(const Event& event) override;
  bool times_events() const override { return true; }
  std::optional<double> elapsed_seconds(const Event& start, const Event& end) const override;
  MemoryStats memory() const override;
  // A modelled disk (above); nothing is read. Throws Error when the link has no disk bandwidth.
  std::unique_ptr<StagingReader> make_staging_reader(StagingSpec spec) override;
  // Device seconds the disk has spent reading.
  double disk_busy_seconds() const;

  // Enqueues `seconds` of computation on the compute stream; `tag` names it in the log.
  void compute(double seconds, int64_t tag = -1);
  // The host's clock now, in device seconds.
  double now() const;
  // Blocks the host until every stream has run everything enqueued; returns the device time
  // the last of that work ended (and moves the host's clock there).
  double finish();
  // The computations run since the last call, in order.
  std::vector<ComputeRecord> take_compute_log();
  // Device seconds the copy stream has spent copying.
  double link_busy_seconds() const;
  // Device seconds spent decoding compressed weights (Backend::decode), on the decode stream,
  // or the copy stream where !LinkModel::decode_stream (not in link_busy_seconds either way).
  double decode_busy_seconds() const;

  // Offloaded activations (Note [offloaded activations] in core/activation_rule.hpp):
  // `bytes` copied device->host once the compute stream has run what is enqueued, on a
  // device->host channel of their own when the link is duplex (LinkModel::duplex), else on the
  // copy stream. Returns the event at the copy's end.
  std::unique_ptr<Event> copy_out_after_compute(std::size_t bytes);
  // `bytes` copied back host->device on the copy stream once `out` is done and the compute
  // stream has run what is enqueued; compute waits for the returned event before reading them.
  std::unique_ptr<Event> copy_in_after(std::size_t bytes, const Event& out);
  // Device seconds the device->host channel has spent on activations (duplex links only).
  double activations_out_busy_seconds() const;

  struct State;

private:
  std::shared_ptr<State> state_;
};

// One block list of a step on a timed device: an engine on the device (directly or attached
// through a blockswap::Device) and its blocks' costs (with BlockTiming::activation_bytes, a
// training step offloads each block's activations as the front end does).
struct TimedList {
  Engine* engine = nullptr;
  const BlockTiming* timing = nullptr;
};

struct TimedStep {
  // As Simulation::step_seconds: training, one step (with the file tier, the mean step of a
  // sequence); forward-only, the mean pass of a sequence.
  double step_seconds = 0;
  double stall_seconds = 0;                // the compute stream idle before the step's computations
  double link_busy_seconds = 0;            // per step
  double activations_out_busy_seconds = 0; // per step: the device->host channel
  std::vector<ComputeRecord> computations; // of the (measured) step(s), in order
};

// Runs the engines the way the LibTorch front end drives them, with modelled computations:
// prepare every list; each list's blocks forward in order (enter, compute, leave); in training,
// then each list's blocks backward in the reverse order (acquire_for_backward with the slot the
// forward ran in, compute forward × backward_factor). Training: one step from the steady state;
// when a list reads from the file (its reader reads the next step's first loads during the
// backward), `warmup_passes` steps, then kPassesPerChunk measured ones, in sequence.
// Forward-only: `warmup_passes` passes, then kPassesPerChunk measured ones, in sequence
// (simulator.hpp; Simulation::warmup_passes is the number the steady state needs). Tags in
// `computations` are the block index. The engines must run on `device` (directly, or attached
// through a blockswap::Device over it). Throws Error when a list does not match its engine, or
// the engines are not all in the same mode.
TimedStep time_step(TimedDevice& device, std::span<const TimedList> lists,
                    int warmup_passes = kPassesPerChunk);

// A pipeline stage's step on a timed device: its micro-batches' halves in the order given
// (pipeline_halves in core/schedule.hpp), each forward a pass of every list (prepare, then the
// blocks), each backward the oldest pending micro-batch's, from the steady state to the end of
// the last half. The stage's own time: it never waits for its neighbours' activations or
// gradients. Throws Error for engines not in training, or a backward with no forward pending.
TimedStep time_halves(TimedDevice& device, std::span<const TimedList> lists,
                      std::span<const Op::Kind> halves);

} // namespace blockswap
