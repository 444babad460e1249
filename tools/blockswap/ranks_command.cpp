// `blockswap run --mode train --ranks R`: data-parallel LoRA training of the reference
// transformer over R processes of this machine. The launcher starts R copies of this executable
// (one rank each), waits for them, and reports; each rank trains its own adapters on its own
// data with blockswap, the gradients all-reduced by LibTorch's ProcessGroupGloo, the swapped
// weights read from the node's one host copy (Options::node_sharing), and runs the same
// data-parallel job without block swapping beside it to compare.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#ifdef BLOCKSWAP_HAVE_GLOO
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include "blockswap/core/error.hpp"
#include "blockswap/core/node_memory.hpp"
#include "blockswap/distributed.hpp"
#include "blockswap/model_io/size.hpp"
#include "blockswap/torch.hpp"
#include "commands.hpp"
#include "reference_transformer.hpp"
#include "workload.hpp"

extern char** environ;

namespace blockswap::tool {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using models::ReferenceTransformer;

constexpr const char* kJobDir = "BLOCKSWAP_JOB_DIR"; // set by the launcher in each rank
constexpr const char* kRank = "BLOCKSWAP_RANK";

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

std::string rank_file(const std::string& dir, int rank) {
  return detail::concat(dir, "/rank-", rank, ".json");
}

#ifdef BLOCKSWAP_HAVE_GLOO

// One rank: trains with and without blockswap, writes what it measured to its file.
void run_rank(const RunArgs& args, const std::string& dir, int rank) {
  const std::chrono::milliseconds timeout(static_cast<int64_t>(args.timeout_seconds * 1000));
  at::set_num_threads(args.threads);
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", args.ranks);
  store->setTimeout(timeout);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, args.ranks, gloo_options);

  models::TransformerConfig config{args.blocks, args.hidden, args.heads, args.lora_rank, 0};
  auto make_model = [&] {
    return args.weights.empty() ? ReferenceTransformer(config)
                                : ReferenceTransformer::load(args.weights, args.lora_rank);
  };
  ReferenceTransformer baseline_model = make_model(); // the same weights on every rank
  config = baseline_model.config();
  const int64_t k = blocks_to_swap(args, config.blocks, Mode::training);
  ReferenceTransformer swapped_model = make_model();
  torch::manual_seed(1000 + rank); // each rank its own data
  const torch::Tensor input = torch::randn({1, args.tokens, config.hidden});

  Options options;
  options.blocks_to_swap = k;
  options.supports_backward = true;
  options.device = c10::kCPU;
  options.emulated_link_gbps = args.link_gbps;
  // Node sharing among the ranks of this rank's node (--nodes), each node its own copy.
  const int per_node = args.ranks / args.nodes;
  options.node_sharing = node_sharing(store, rank % per_node, per_node);
  options.node_sharing.group = detail::concat("node", rank / per_node);
  options.offload_activations = args.offload_activations; // each rank its own, in its process
  options.activation_threshold_bytes = parse_size(args.activation_threshold);
  options.compress = parse_compress(args.compress); // the node's copy, compressed by its rank 0
  ModelOffloader offloader("blocks", swapped_model.modules(), options);

  int reductions = 0;
  const GradientReducer all_reduce = [&](std::vector<torch::Tensor>& grads) {
    // The baseline's and the swapped model's steps alternate, a warm-up step each first: the
    // fourth reduction is in the swapped model's second step, after its backward.
    if (++reductions == 4 && rank == args.kill_rank) raise(SIGKILL);
    try {
      for (auto& grad : grads) {
        std::vector<at::Tensor> one{grad};
        group->allreduce(one)->wait();
        grad.div_(args.ranks);
      }
    } catch (const std::exception& e) {
      throw Error(detail::concat("the gradients' all-reduce failed, so another rank has ended "
                                 "or failed (its own error says why): ",
                                 first_line(e.what())));
    }
  };
  const auto [baseline, swapped] =
      run_side_by_side(baseline_model, swapped_model, offloader, input, Work::train, args.steps,
                       all_reduce, args.offload_activations);
  // Every rank's adapters against rank 0's.
  double to_rank0 = 0;
  for (const auto& p : swapped_model.lora_parameters()) {
    std::vector<at::Tensor> theirs{p.detach().clone()};
    group->broadcast(theirs)->wait();
    to_rank0 = std::max(to_rank0, (theirs[0] - p.detach()).abs().max().item<double>());
  }
  group->barrier()->wait(); // every rank maps the node's memory now
  const NodeMemoryUse use = NodeMemory::use();
  group->barrier()->wait();

  const Stats stats = offloader.stats();
  const uint64_t steps = static_cast<uint64_t>(args.steps);
  nlohmann::json out{
      {"rank", rank},
      {"node", rank / per_node},
      {"blocks", config.blocks},
      {"hidden", config.hidden},
      {"blocks_to_swap", offloader.blocks_to_swap()},
      {"frozen_bytes", baseline_model.frozen_bytes()},
      {"baseline_step_seconds", baseline.step_seconds},
      {"step_seconds", swapped.step_seconds},
      {"peak_device_bytes", stats.peak_device_bytes},
      {"h2d_bytes", stats.h2d_bytes / steps},
      {"d2h_bytes", stats.d2h_bytes / steps},
      {"stall_seconds", stats.stall_seconds / double(steps)},
      {"private_host_bytes", use.private_bytes},
      {"shared_host_bytes", use.shared_bytes},
      {"proportional_host_bytes", use.proportional_bytes},
      {"max_abs_diff", max_abs_diff(baseline, swapped)},
      {"max_diff_to_rank0", to_rank0},
      {"compression_ratio", offloader.compression().ratio()},
  };
  if (args.offload_activations) {
    out["baseline_peak_activation_bytes"] = baseline.peak_activation_bytes;
    out["peak_activation_bytes"] = swapped.peak_activation_bytes;
  }
  const std::string path = rank_file(dir, rank);
  std::ofstream(path + ".tmp") << out.dump() << '\n';
  fs::rename(path + ".tmp", path);
}

#endif // BLOCKSWAP_HAVE_GLOO

std::string describe_end(int status) {
  if (WIFEXITED(status)) return detail::concat("failed (exit status ", WEXITSTATUS(status), ")");
  if (WIFSIGNALED(status)) {
    return detail::concat("was killed by signal ", WTERMSIG(status), " (",
                          strsignal(WTERMSIG(status)), ")");
  }
  return "ended abnormally";
}

struct Rank {
  pid_t pid = -1;
  bool ended = false;
  bool stopped = false; // killed by the launcher after another rank failed
  int status = 0;
  bool ok() const { return ended && !stopped && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// Starts the ranks and waits for all of them. After the first failure the others get the
// timeout (plus a margin) to fail on their own, clearly; then the launcher stops them.
std::vector<Rank> launch(const RunArgs& args, char** argv, const std::string& dir) {
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (entry.rfind(std::string(kJobDir) + "=", 0) != 0 &&
        entry.rfind(std::string(kRank) + "=", 0) != 0) {
      environment.push_back(entry);
    }
  }
  environment.push_back(detail::concat(kJobDir, "=", dir));
  std::vector<Rank> ranks(args.ranks);
  for (int r = 0; r < args.ranks; ++r) {
    std::vector<std::string> env = environment;
    env.push_back(detail::concat(kRank, "=", r));
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const int error =
        posix_spawn(&ranks[r].pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data());
    if (error != 0) {
      for (int s = 0; s < r; ++s) kill(ranks[s].pid, SIGKILL);
      for (int s = 0; s < r; ++s) waitpid(ranks[s].pid, nullptr, 0);
      throw Error(detail::concat("--ranks: cannot start rank ", r, ": ", std::strerror(error)));
    }
  }
  std::optional<Clock::time_point> deadline;
  const auto grace = std::chrono::duration<double>(args.timeout_seconds + 15);
  for (int left = args.ranks; left > 0;) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (Rank& rank : ranks) {
        if (rank.pid != pid) continue;
        rank.ended = true;
        rank.status = status;
        --left;
        if (!rank.ok() && !deadline) {
          deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(grace);
        }
      }
      continue;
    }
    if (deadline && Clock::now() > *deadline) {
      for (Rank& rank : ranks) {
        if (rank.ended || rank.stopped) continue;
        kill(rank.pid, SIGKILL);
        rank.stopped = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ranks;
}

void print_table(const RunArgs& args, const std::vector<nlohmann::json>& results, double diff) {
  const nlohmann::json& first = results.front();
  const uint64_t frozen = first["frozen_bytes"];
  const int64_t blocks = first["blocks"];
  std::printf("blockswap run: reference transformer, %lld blocks of %s, hidden %lld, %lld tokens, "
              "LoRA training, data-parallel over %d ranks (Gloo, %d node%s)\n",
              static_cast<long long>(blocks), format_bytes(frozen / uint64_t(blocks)).c_str(),
              static_cast<long long>(first["hidden"].get<int64_t>()),
              static_cast<long long>(args.tokens), args.ranks, args.nodes,
              args.nodes == 1 ? "" : "s");
  std::printf("device: emulated (link %g GB/s, %d thread%s per rank); %lld of %lld blocks swapped "
              "on each rank; %d measured steps\n\n",
              args.link_gbps, args.threads, args.threads == 1 ? "" : "s",
              static_cast<long long>(first["blocks_to_swap"].get<int64_t>()),
              static_cast<long long>(blocks), args.steps);
  std::printf("%-5s %13s %15s %13s %14s %13s %13s %10s\n", "rank", "without swap", "with blockswap",
              "host->device", "private host", "shared host", "host (Pss)", "max diff");
  uint64_t private_sum = 0, proportional_sum = 0;
  for (const auto& r : results) {
    private_sum += r["private_host_bytes"].get<uint64_t>();
    proportional_sum += r["proportional_host_bytes"].get<uint64_t>();
    std::printf("%-5d %13s %15s %13s %14s %13s %13s %10g\n", r["rank"].get<int>(),
                milliseconds(r["baseline_step_seconds"]).c_str(),
                milliseconds(r["step_seconds"]).c_str(), format_bytes(r["h2d_bytes"]).c_str(),
                format_bytes(r["private_host_bytes"]).c_str(),
                format_bytes(r["shared_host_bytes"]).c_str(),
                format_bytes(r["proportional_host_bytes"]).c_str(),
                std::max(r["max_abs_diff"].get<double>(), r["max_diff_to_rank0"].get<double>()));
  }
  std::printf("\n(host memory: the swapped weights each rank maps, from /proc/self/smaps; time and "
              "bytes per step)\n");
  std::printf("swapped weights: %s per copy; the %s %s of them for %d rank%s (%s private), "
              "where a copy per rank would be %s\n",
              format_bytes(frozen).c_str(),
              args.nodes == 1 ? "node holds" : detail::concat(args.nodes, " nodes hold").c_str(),
              format_bytes(proportional_sum).c_str(), args.ranks, args.ranks == 1 ? "" : "s",
              format_bytes(private_sum).c_str(), format_bytes(frozen * args.ranks).c_str());
  std::printf("largest difference against the same job without block swapping, and between "
              "ranks: %g%s\n",
              diff, diff == 0 ? " (identical)" : "  <-- MISMATCH");
}

// The host memory each node holds for its ranks: the sum of their proportional shares.
std::vector<uint64_t> node_host_bytes(const RunArgs& args,
                                      const std::vector<nlohmann::json>& ranks) {
  std::vector<uint64_t> bytes(static_cast<std::size_t>(args.nodes), 0);
  for (const auto& r : ranks) {
    bytes.at(r["node"].get<std::size_t>()) += r["proportional_host_bytes"].get<uint64_t>();
  }
  return bytes;
}

void print_json(const RunArgs& args, const std::vector<nlohmann::json>& results, double diff) {
  const nlohmann::json& first = results.front();
  nlohmann::json out{
      {"mode", args.mode},
      {"device", "emulated"},
      {"link_gbps", args.link_gbps},
      {"blocks", first["blocks"]},
      {"hidden", first["hidden"]},
      {"tokens", args.tokens},
      {"steps", args.steps},
      {"blocks_to_swap", first["blocks_to_swap"]},
      {"baseline", {{"step_seconds", first["baseline_step_seconds"]}}},
      {"swapped",
       {{"step_seconds", first["step_seconds"]},
        {"peak_device_bytes", first["peak_device_bytes"]},
        {"h2d_bytes", first["h2d_bytes"]},
        {"d2h_bytes", first["d2h_bytes"]},
        {"stall_seconds", first["stall_seconds"]}}},
      {"max_abs_diff", diff},
      {"ranks", args.ranks},
      {"nodes", args.nodes},
      {"node_host_bytes", node_host_bytes(args, results)},
      {"swapped_weight_bytes", first["frozen_bytes"]},
      {"rank_stats", results},
  };
  std::cout << out.dump(2) << '\n';
}

} // namespace

int ranks_command(const RunArgs& args, char** argv) {
  if (const char* dir = std::getenv(kJobDir)) {
    const int rank = std::atoi(std::getenv(kRank) != nullptr ? std::getenv(kRank) : "-1");
    try {
#ifdef BLOCKSWAP_HAVE_GLOO
      BLOCKSWAP_CHECK(rank >= 0 && rank < args.ranks, kRank, " is ", rank, " of ", args.ranks);
      run_rank(args, dir, rank);
#endif
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "blockswap: rank %d: error: %s\n", rank, first_line(e.what()).c_str());
      return 1;
    }
  }
#ifndef BLOCKSWAP_HAVE_GLOO
  throw Error("--ranks needs LibTorch's ProcessGroupGloo, and this build found no Gloo headers "
              "(Debian: libgloo-dev; scripts/setup-deps installs it): rebuild with them");
#else
  BLOCKSWAP_CHECK(args.mode == "train",
                  "--ranks runs data-parallel LoRA training: use --mode "
                  "train (got --mode ",
                  args.mode, ")");
  BLOCKSWAP_CHECK(args.device.empty() || args.device == "cpu",
                  "--ranks runs on the emulated "
                  "device (Gloo between processes on CPUs): use --device cpu or leave it out");
  BLOCKSWAP_CHECK(args.trace.empty() && args.save_weights.empty(),
                  "--trace and --save-weights are for one process: leave them out with --ranks");
  BLOCKSWAP_CHECK(!args.weights.empty() || args.hidden % args.heads == 0, "--hidden ", args.hidden,
                  " is not divisible by --heads ", args.heads);
  check_shape_agrees_with_weights(args);
  BLOCKSWAP_CHECK(args.ranks % args.nodes == 0, "--nodes ", args.nodes, " does not divide --ranks ",
                  args.ranks, ": every node runs as many ranks");
  BLOCKSWAP_CHECK(args.kill_rank < args.ranks, "--kill-rank ", args.kill_rank,
                  " is not a rank of --ranks ", args.ranks);
  BLOCKSWAP_CHECK(args.steps >= 2 || args.kill_rank < 0,
                  "--kill-rank kills a rank in its second step: use --steps 2 or more");
  // Each job its own directory: its store (so two jobs never meet), the ranks' results.
  std::string pattern = (fs::temp_directory_path() / "blockswap-job-XXXXXX").string();
  BLOCKSWAP_CHECK(mkdtemp(pattern.data()) != nullptr, "cannot make a directory for the job in ",
                  fs::temp_directory_path().string(), ": ", std::strerror(errno));
  const std::string dir = pattern;
  const std::vector<Rank> ranks = launch(args, argv, dir);
  std::vector<nlohmann::json> results;
  std::string failures;
  for (int r = 0; r < args.ranks; ++r) {
    if (!ranks[r].ok()) {
      failures += detail::concat(failures.empty() ? "" : "; ", "rank ", r, " ",
                                 ranks[r].stopped
                                     ? detail::concat("was stopped ", args.timeout_seconds + 15,
                                                      " s after another rank failed")
                                     : describe_end(ranks[r].status));
      continue;
    }
    std::ifstream in(rank_file(dir, r));
    results.push_back(nlohmann::json::parse(in));
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  if (!failures.empty()) {
    std::fprintf(stderr, "blockswap: error: the %d-rank job failed: %s\n", args.ranks,
                 failures.c_str());
    return 1;
  }
  double diff = 0;
  for (const auto& r : results) {
    diff = std::max({diff, r["max_abs_diff"].get<double>(), r["max_diff_to_rank0"].get<double>()});
  }
  if (args.json) {
    print_json(args, results, diff);
  } else {
    print_table(args, results, diff);
  }
  if (diff != 0) {
    std::fprintf(stderr, "blockswap: error: the ranks' results differ by %g\n", diff);
    return 1;
  }
  return 0;
#endif
}

} // namespace blockswap::tool
