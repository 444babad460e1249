#include "blockswap/model_plan.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>

#include "blockswap/error.hpp"

namespace blockswap {
namespace {

constexpr uint64_t kSlotAlignment = 256;

uint64_t slot_size(uint64_t bytes) {
  return (bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
}

bool is_block_list(std::string_view part) {
  return part == "blocks" || part == "layers" || part == "h" ||
         (part.size() > 7 && part.substr(part.size() - 7) == "_blocks") ||
         (part.size() > 7 && part.substr(part.size() - 7) == "_layers");
}

bool is_index(std::string_view part) {
  return !part.empty() && part.size() < 10 &&
         std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Host-to-device bytes per step for a group with K swapped (Schedule::loads_per_pass).
uint64_t moved_bytes(const BlockGroup& group, int64_t k, Mode mode) {
  const auto n = static_cast<int64_t>(group.block_bytes.size());
  if (k == 0) return 0;
  const int64_t loads = mode == Mode::training ? 2 * k : k + std::min<int64_t>(2, n - k);
  return static_cast<uint64_t>(loads) * (group.total_bytes() / static_cast<uint64_t>(n));
}

} // namespace

uint64_t parse_size(std::string_view text) {
  const std::string original(text);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())))
    text.remove_suffix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front())))
    text.remove_prefix(1);
  std::size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  BLOCKSWAP_CHECK(digits > 0, "size '", original, "' does not start with a number (e.g. 12GiB)");
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + digits, value);
  BLOCKSWAP_CHECK(ec == std::errc() && end == text.data() + digits, "size '", original,
                  "' is not a number");
  std::string unit(text.substr(digits));
  unit.erase(std::remove_if(unit.begin(), unit.end(),
                            [](char c) { return std::isspace(static_cast<unsigned char>(c)); }),
             unit.end());
  std::transform(unit.begin(), unit.end(), unit.begin(), [](char c) {
    return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  });
  static const std::map<std::string, double> kUnits{
      {"", 1.0},     {"b", 1.0},      {"k", 0x1p10},   {"m", 0x1p20},   {"g", 0x1p30},
      {"t", 0x1p40}, {"kib", 0x1p10}, {"mib", 0x1p20}, {"gib", 0x1p30}, {"tib", 0x1p40},
      {"kb", 1e3},   {"mb", 1e6},     {"gb", 1e9},     {"tb", 1e12},
  };
  const auto unit_it = kUnits.find(unit);
  BLOCKSWAP_CHECK(
      unit_it != kUnits.end(), "size '", original, "' has an unknown unit '", unit,
      "' (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or K, M, G, T for powers of 1024)");
  const double bytes = value * unit_it->second;
  BLOCKSWAP_CHECK(bytes < 0x1p63, "size '", original, "' is too large");
  return static_cast<uint64_t>(std::llround(bytes));
}

std::string format_bytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  if (unit == 0) {
    std::snprintf(text, sizeof text, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(text, sizeof text, "%.2f %s", value, kUnits[unit]);
  }
  return text;
}

uint64_t BlockGroup::total_bytes() const {
  uint64_t total = 0;
  for (uint64_t b : block_bytes) total += b;
  return total;
}

uint64_t BlockGroup::largest_bytes() const {
  return block_bytes.empty() ? 0 : *std::max_element(block_bytes.begin(), block_bytes.end());
}

ModelLayout group_blocks(const std::vector<TensorInfo>& tensors) {
  ModelLayout layout;
  std::map<std::string, std::map<int64_t, uint64_t>> groups; // prefix -> index -> bytes
  std::vector<std::string> order;
  for (const TensorInfo& t : tensors) {
    std::vector<std::string_view> parts;
    std::string_view rest = t.name;
    for (std::size_t dot; (dot = rest.find('.')) != std::string_view::npos;
         rest.remove_prefix(dot + 1)) {
      parts.push_back(rest.substr(0, dot));
    }
    parts.push_back(rest);
    bool grouped = false;
    for (std::size_t i = 0; i + 2 < parts.size() && !grouped; ++i) {
      if (!is_block_list(parts[i]) || !is_index(parts[i + 1])) continue;
      const std::string prefix(t.name.substr(
          0, static_cast<std::size_t>(parts[i].data() - t.name.data()) + parts[i].size()));
      if (!groups.contains(prefix)) order.push_back(prefix);
      groups[prefix][std::stoll(std::string(parts[i + 1]))] += t.bytes();
      grouped = true;
    }
    if (!grouped) layout.non_block_bytes += t.bytes();
  }
  for (const std::string& name : order) {
    BlockGroup group{name, {}};
    for (const auto& [index, bytes] : groups[name]) group.block_bytes.push_back(bytes);
    layout.groups.push_back(std::move(group));
  }
  return layout;
}

ModelPlan plan_model(const ModelLayout& layout, uint64_t budget_bytes, Mode mode) {
  BLOCKSWAP_CHECK(!layout.groups.empty(),
                  "no blocks found: tensor names must look like blocks.N.…, double_blocks.N.…, "
                  "single_blocks.N.… or layers.N.…");
  const std::size_t g = layout.groups.size();
  std::vector<int64_t> max_k(g);
  uint64_t smallest = layout.non_block_bytes;
  for (std::size_t i = 0; i < g; ++i) {
    const auto n = static_cast<int64_t>(layout.groups[i].block_bytes.size());
    max_k[i] = Schedule::max_blocks_to_swap(n, mode);
    smallest += static_cast<uint64_t>(n - max_k[i]) * slot_size(layout.groups[i].largest_bytes());
  }
  BLOCKSWAP_CHECK(budget_bytes >= smallest, "a device budget of ", format_bytes(budget_bytes), " (",
                  budget_bytes, " bytes) cannot hold this model in ", to_string(mode),
                  " mode: the smallest budget that works is ", format_bytes(smallest), " (",
                  smallest, " bytes)");

  // A handful of groups with tens of blocks each: search every combination of K.
  std::vector<int64_t> k(g, 0), best;
  uint64_t best_moved = UINT64_MAX, best_device = 0;
  auto search = [&](auto&& self, std::size_t i, uint64_t device, uint64_t moved) -> void {
    if (device > budget_bytes || moved > best_moved) return;
    if (i == g) {
      if (moved < best_moved || (moved == best_moved && device > best_device)) {
        best = k;
        best_moved = moved;
        best_device = device;
      }
      return;
    }
    const BlockGroup& group = layout.groups[i];
    const auto n = static_cast<int64_t>(group.block_bytes.size());
    for (k[i] = 0; k[i] <= max_k[i]; ++k[i]) {
      self(self, i + 1, device + static_cast<uint64_t>(n - k[i]) * slot_size(group.largest_bytes()),
           moved + moved_bytes(group, k[i], mode));
    }
  };
  search(search, 0, layout.non_block_bytes, 0);
  BLOCKSWAP_ASSERT(!best.empty(), "no plan although the budget covers the smallest one");

  ModelPlan plan{mode, budget_bytes, layout.non_block_bytes, layout.non_block_bytes, 0, {}};
  for (std::size_t i = 0; i < g; ++i) {
    const BlockGroup& group = layout.groups[i];
    const auto n = static_cast<int64_t>(group.block_bytes.size());
    GroupPlan p{group.name,
                n,
                slot_size(group.largest_bytes()),
                group.total_bytes(),
                best[i],
                static_cast<uint64_t>(n - best[i]) * slot_size(group.largest_bytes()),
                moved_bytes(group, best[i], mode)};
    plan.device_bytes += p.device_bytes;
    plan.moved_bytes += p.moved_bytes;
    plan.groups.push_back(p);
  }
  return plan;
}

} // namespace blockswap
