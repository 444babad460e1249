// The blockswap tool, run as a user runs it.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sys/wait.h>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Result {
  int exit_code = -1;
  std::string out, err;
};

fs::path scratch() {
  fs::path dir = fs::temp_directory_path() / ("blockswap_tool_test_" + std::to_string(getpid()));
  fs::create_directories(dir);
  return dir;
}

// Removes the scratch files (the sparse 24 GB models among them) when the tests end.
struct RemoveScratch {
  ~RemoveScratch() {
    std::error_code ignored;
    fs::remove_all(scratch(), ignored);
  }
} remove_scratch;

Result run_tool(const std::string& args) {
  const fs::path err = scratch() / "stderr.txt";
  const std::string command = std::string(BLOCKSWAP_TOOL) + " " + args + " 2>" + err.string();
  Result result;
  FILE* pipe = popen(command.c_str(), "r");
  char buffer[4096];
  for (std::size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;)
    result.out.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err);
  result.err.assign(std::istreambuf_iterator<char>(in), {});
  return result;
}

// A safetensors file with a real header and a sparse data section: a 24 GB model on disk
// without 24 GB of disk.
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
};

uint64_t write_sparse_model(const fs::path& path, const std::vector<Tensor>& tensors,
                            const std::string& dtype, int element) {
  json header = json::object();
  uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    uint64_t bytes = element;
    for (int64_t d : t.shape) bytes *= d;
    header[t.name] = {
        {"dtype", dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  const std::string text = header.dump();
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) file.put(static_cast<char>((length >> (8 * i)) & 0xFF));
  file << text;
  file.close();
  fs::resize_file(path, 8 + text.size() + offset);
  return offset;
}

void linear(std::vector<Tensor>& out, const std::string& name, int64_t o, int64_t i) {
  out.push_back({name + ".weight", {o, i}});
  out.push_back({name + ".bias", {o}});
}

// FLUX.1 [dev]: 19 double blocks, 38 single blocks, hidden 3072, bf16.
std::vector<Tensor> flux_tensors() {
  std::vector<Tensor> t;
  linear(t, "img_in", 3072, 64);
  linear(t, "txt_in", 3072, 4096);
  for (const char* e : {"time_in", "guidance_in"}) {
    linear(t, std::string(e) + ".in_layer", 3072, 256);
    linear(t, std::string(e) + ".out_layer", 3072, 3072);
  }
  linear(t, "vector_in.in_layer", 3072, 768);
  linear(t, "vector_in.out_layer", 3072, 3072);
  for (int i = 0; i < 19; ++i) {
    const std::string p = "double_blocks." + std::to_string(i) + ".";
    for (const std::string s : {"img", "txt"}) {
      linear(t, p + s + "_mod.lin", 18432, 3072);
      linear(t, p + s + "_attn.qkv", 9216, 3072);
      t.push_back({p + s + "_attn.norm.query_norm.scale", {128}});
      t.push_back({p + s + "_attn.norm.key_norm.scale", {128}});
      linear(t, p + s + "_attn.proj", 3072, 3072);
      linear(t, p + s + "_mlp.0", 12288, 3072);
      linear(t, p + s + "_mlp.2", 3072, 12288);
    }
  }
  for (int i = 0; i < 38; ++i) {
    const std::string p = "single_blocks." + std::to_string(i) + ".";
    linear(t, p + "linear1", 21504, 3072);
    linear(t, p + "linear2", 3072, 15360);
    t.push_back({p + "norm.query_norm.scale", {128}});
    t.push_back({p + "norm.key_norm.scale", {128}});
    linear(t, p + "modulation.lin", 9216, 3072);
  }
  linear(t, "final_layer.linear", 64, 3072);
  linear(t, "final_layer.adaLN_modulation.1", 6144, 3072);
  return t;
}

// Wan2.1 14B: 40 blocks, hidden 5120, FFN 13824, bf16.
std::vector<Tensor> wan_tensors() {
  std::vector<Tensor> t;
  t.push_back({"patch_embedding.weight", {5120, 16, 1, 2, 2}});
  t.push_back({"patch_embedding.bias", {5120}});
  linear(t, "text_embedding.0", 5120, 4096);
  linear(t, "text_embedding.2", 5120, 5120);
  linear(t, "time_embedding.0", 5120, 256);
  linear(t, "time_embedding.2", 5120, 5120);
  linear(t, "time_projection.1", 30720, 5120);
  for (int i = 0; i < 40; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    for (const std::string a : {"self_attn", "cross_attn"}) {
      for (const std::string w : {"q", "k", "v", "o"}) linear(t, p + a + "." + w, 5120, 5120);
      t.push_back({p + a + ".norm_q.weight", {5120}});
      t.push_back({p + a + ".norm_k.weight", {5120}});
    }
    linear(t, p + "ffn.0", 13824, 5120);
    linear(t, p + "ffn.2", 5120, 13824);
    t.push_back({p + "norm3.weight", {5120}});
    t.push_back({p + "norm3.bias", {5120}});
    t.push_back({p + "modulation", {1, 6, 5120}});
  }
  linear(t, "head.head", 64, 5120);
  t.push_back({"head.modulation", {1, 2, 5120}});
  return t;
}

uint64_t bytes_with_prefix(const std::vector<Tensor>& tensors, const std::string& prefix) {
  uint64_t total = 0;
  for (const Tensor& t : tensors) {
    if (t.name.rfind(prefix, 0) != 0) continue;
    uint64_t bytes = 2;
    for (int64_t d : t.shape) bytes *= d;
    total += bytes;
  }
  return total;
}

json plan_json(const fs::path& model, const std::string& budget, const std::string& mode) {
  const auto start = std::chrono::steady_clock::now();
  const Result r =
      run_tool("plan " + model.string() + " --budget " + budget + " --mode " + mode + " --json");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(seconds, 5.0) << "plan should read only the header";
  return json::parse(r.out);
}

TEST(Plan, FluxShapedModel) {
  const auto tensors = flux_tensors();
  const fs::path model = scratch() / "flux1-dev.safetensors";
  const uint64_t total = write_sparse_model(model, tensors, "BF16", 2);
  EXPECT_GT(total, 23'000'000'000u); // FLUX.1 [dev] is about 23.8 GB
  for (const std::string mode : {"train", "infer"}) {
    for (const std::string budget : {"24GiB", "12GiB", "8GiB", "12000MB"}) {
      const json plan = plan_json(model, budget, mode);
      ASSERT_EQ(plan["groups"].size(), 2u);
      const json& d = plan["groups"][0];
      const json& s = plan["groups"][1];
      EXPECT_EQ(d["name"], "double_blocks");
      EXPECT_EQ(d["blocks"], 19);
      EXPECT_EQ(d["total_bytes"], bytes_with_prefix(tensors, "double_blocks."));
      EXPECT_EQ(s["name"], "single_blocks");
      EXPECT_EQ(s["blocks"], 38);
      EXPECT_EQ(s["total_bytes"], bytes_with_prefix(tensors, "single_blocks."));
      EXPECT_EQ(plan["non_block_bytes"].get<uint64_t>() + d["total_bytes"].get<uint64_t>() +
                    s["total_bytes"].get<uint64_t>(),
                total);
      EXPECT_LE(plan["device_bytes"].get<uint64_t>(), plan["budget_bytes"].get<uint64_t>());
      uint64_t device = plan["non_block_bytes"];
      for (const json& g : plan["groups"]) {
        device += (g["blocks"].get<uint64_t>() - g["blocks_to_swap"].get<uint64_t>()) *
                  g["block_bytes"].get<uint64_t>();
      }
      EXPECT_EQ(device, plan["device_bytes"].get<uint64_t>());
    }
  }
  EXPECT_EQ(plan_json(model, "24GiB", "train")["groups"][0]["blocks_to_swap"], 0);
}

TEST(Plan, WanShapedModel) {
  const auto tensors = wan_tensors();
  const fs::path model = scratch() / "wan2.1-t2v-14b.safetensors";
  write_sparse_model(model, tensors, "BF16", 2);
  const json plan = plan_json(model, "12GiB", "train");
  ASSERT_EQ(plan["groups"].size(), 1u);
  const json& g = plan["groups"][0];
  EXPECT_EQ(g["name"], "blocks");
  EXPECT_EQ(g["blocks"], 40);
  EXPECT_EQ(g["total_bytes"], bytes_with_prefix(tensors, "blocks."));
  EXPECT_LE(plan["device_bytes"].get<uint64_t>(), 12ull << 30);
  // One block fewer swapped would not fit.
  EXPECT_GT(plan["device_bytes"].get<uint64_t>() + g["block_bytes"].get<uint64_t>(), 12ull << 30);
  const Result table = run_tool("plan " + model.string() + " --budget 12GiB");
  EXPECT_EQ(table.exit_code, 0);
  EXPECT_NE(table.out.find("blocks"), std::string::npos);
}

TEST(Plan, BudgetTooSmallNamesTheSmallestThatWorks) {
  const fs::path model = scratch() / "wan-small-budget.safetensors";
  write_sparse_model(model, wan_tensors(), "BF16", 2);
  const Result r = run_tool("plan " + model.string() + " --budget 1GiB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("the smallest budget that works is"), std::string::npos) << r.err;
  const Result bad = run_tool("plan " + model.string() + " --budget twelve");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("size 'twelve'"), std::string::npos) << bad.err;
}

void write_raw(const fs::path& path, const std::string& json_text, std::size_t data,
               uint64_t length_override = UINT64_MAX) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = length_override == UINT64_MAX ? json_text.size() : length_override;
  for (int i = 0; i < 8; ++i) file.put(static_cast<char>((length >> (8 * i)) & 0xFF));
  file << json_text << std::string(data, '\0');
}

TEST(Plan, MalformedFilesAreClearErrors) {
  const fs::path dir = scratch();
  const std::string one = R"({"blocks.0.w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  struct Case {
    std::string name, json;
    std::size_t data;
    uint64_t length;
    std::string message;
  };
  const std::vector<Case> cases{
      {"truncated", "", 0, UINT64_MAX, "truncated safetensors file"},
      {"length", one, 16, 1u << 20, "runs past the end of the file"},
      {"json", R"({"blocks.0.w": [)", 0, UINT64_MAX, "not valid JSON"},
      {"dtype", R"({"blocks.0.w":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}})", 4, UINT64_MAX,
       "unknown safetensors dtype 'Q4'"},
      {"shape", R"({"blocks.0.w":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}})", 16,
       UINT64_MAX, "needs 20 bytes but its data_offsets span 16"},
      {"outside", one, 8, UINT64_MAX, "lie outside the data"},
      {"overlap",
       R"({"blocks.0.w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
       R"("blocks.1.w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       16, UINT64_MAX, "overlap"},
  };
  for (const Case& c : cases) {
    const fs::path path = dir / (c.name + ".safetensors");
    if (c.name == "truncated") {
      std::ofstream(path, std::ios::binary) << "abc";
    } else {
      write_raw(path, c.json, c.data, c.length);
    }
    const Result r = run_tool("plan " + path.string() + " --budget 12GiB");
    EXPECT_NE(r.exit_code, 0) << c.name;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << c.name << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.name << ": one line";
  }
  const Result missing =
      run_tool("plan " + (dir / "missing.safetensors").string() + " --budget 1G");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("cannot open"), std::string::npos) << missing.err;
}

void expect_default_run(const std::string& mode) {
  const Result r = run_tool("run --mode " + mode + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  for (const char* key : {"mode", "blocks", "blocks_to_swap", "max_abs_diff"}) {
    EXPECT_TRUE(out.contains(key)) << key;
  }
  for (const char* key : {"step_seconds", "peak_device_bytes"}) {
    EXPECT_TRUE(out["baseline"].contains(key)) << key;
  }
  for (const char* key :
       {"step_seconds", "peak_device_bytes", "h2d_bytes", "d2h_bytes", "stall_seconds"}) {
    EXPECT_TRUE(out["swapped"].contains(key)) << key;
  }
  EXPECT_EQ(out["mode"], mode);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  EXPECT_LT(out["swapped"]["peak_device_bytes"].get<uint64_t>(),
            out["baseline"]["peak_device_bytes"].get<uint64_t>());
  EXPECT_GT(out["swapped"]["h2d_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(out["swapped"]["d2h_bytes"].get<uint64_t>(), 0u);
}

TEST(Run, DefaultInferenceIsExact) {
  expect_default_run("infer");
}
TEST(Run, DefaultTrainingIsExact) {
  expect_default_run("train");
}

TEST(Run, TableWithoutArguments) {
  const Result r = run_tool("run --blocks 4 --hidden 64 --heads 2 --tokens 16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("with blockswap"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("largest difference between the two results: 0 (identical)"),
            std::string::npos)
      << r.out;
}

TEST(Run, TraceHasComputeAndCopyTracks) {
  const fs::path trace = scratch() / "trace.json";
  const Result r =
      run_tool("run --mode train --blocks 4 --hidden 64 --heads 2 --tokens 16 --trace " +
               trace.string() + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(trace);
  const json events = json::parse(in)["traceEvents"];
  int compute = 0, copy = 0;
  for (const json& e : events) {
    if (e["ph"] != "X") continue;
    (e["tid"] == 1 ? compute : copy) += 1;
  }
  EXPECT_GE(compute, 4 * 4); // 4 blocks forward, 4 steps
  EXPECT_GE(copy, 4 * 4);    // 2K = 4 loads per step
}

TEST(Run, WeightsRoundTripThroughSafetensors) {
  const fs::path weights = scratch() / "reference.safetensors";
  const std::string size = " --blocks 3 --hidden 64 --heads 2 --tokens 8 --json";
  const Result saved = run_tool("run --mode train" + size + " --save-weights " + weights.string());
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  const Result loaded =
      run_tool("run --mode train --tokens 8 --json --weights " + weights.string());
  ASSERT_EQ(loaded.exit_code, 0) << loaded.err;
  const json out = json::parse(loaded.out);
  EXPECT_EQ(out["blocks"], 3);
  EXPECT_EQ(out["hidden"], 64);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
}

TEST(Run, BadArgumentsAreOneLineErrors) {
  const Result k = run_tool("run --blocks 4 --swap 4 --hidden 64 --heads 2");
  EXPECT_NE(k.exit_code, 0);
  EXPECT_NE(k.err.find("K=4 is out of range for N=4"), std::string::npos) << k.err;
  EXPECT_EQ(std::count(k.err.begin(), k.err.end(), '\n'), 1) << k.err;
  const Result mode = run_tool("run --mode fly");
  EXPECT_NE(mode.exit_code, 0);
  EXPECT_NE(mode.err.find("--mode must be infer or train"), std::string::npos) << mode.err;
}

} // namespace
