// `blockswap bench` on the emulated device: the sweep of K for every mode (inference, LoRA
// training, full fine-tuning with the step on the device and on the host), real compute and
// real copies on this machine. The timed-device half is timed_bench.hpp.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

#include "commands.hpp"
#include "timed_bench.hpp"

namespace blockswap::tool {

// The rows of the sweep; its facts and summary go into `info`. Prints its table unless --json.
std::vector<BenchRow> emulated_bench(const BenchArgs& args, nlohmann::json& info);

} // namespace blockswap::tool
