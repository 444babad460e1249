#include "blockswap/model_io/size.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "blockswap/core/error.hpp"

namespace blockswap {

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

} // namespace blockswap
