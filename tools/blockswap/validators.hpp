// Checks for the tool's options, as CLI11 validators. CLI11 reports a failure as one line that
// names the option ("--blocks: '0' is out of range: ..."), and main() prefixes it with
// "blockswap: error: ".
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "blockswap/core/error.hpp"

namespace blockswap::tool {

// The slowest emulated link the tool accepts: below it a step of even a small model takes hours
// (and a bandwidth like 1e-300 GB/s overflows the throttle's arithmetic).
inline constexpr double kMinLinkGbps = 0.001;

// A decimal integer, whole text, in [lo, hi].
template <typename T> CLI::Validator integer_in(T lo, T hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        const bool is_integer = ptr == end && ec != std::errc::invalid_argument;
        if (!is_integer) {
          return detail::concat("'", text, "' is not an integer: expected ", lo, " to ", hi);
        }
        if (ec == std::errc::result_out_of_range || value < lo || value > hi) {
          return detail::concat("'", text, "' is out of range: expected ", lo, " to ", hi);
        }
        return {};
      },
      detail::concat("INT in [", lo, "..", hi, "]"));
}

// A decimal integer of type T, whole text, any value; the caller checks the range (it depends on
// other options).
template <typename T> CLI::Validator integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (ptr != end || ec != std::errc())
          return detail::concat("'", text, "' is not an integer");
        return {};
      },
      "INT");
}

// An emulated link bandwidth in GB/s: 0 (unlimited) or finite and at least kMinLinkGbps.
inline CLI::Validator link_bandwidth() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        const bool is_number = ptr == end && ec != std::errc::invalid_argument;
        const std::string expected = detail::concat(
            "expected 0 (unlimited) or a finite bandwidth of at least ", kMinLinkGbps, " GB/s");
        if (!is_number) return detail::concat("'", text, "' is not a number: ", expected);
        if (ec == std::errc::result_out_of_range || !std::isfinite(value) || value < 0 ||
            (value > 0 && value < kMinLinkGbps)) {
          return detail::concat("'", text, "' GB/s is out of range: ", expected);
        }
        return {};
      },
      "");
}

// A finite decimal number in [lo, hi] (no hex, no trailing letters, no nan or inf).
inline CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double value = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value, std::chars_format::general);
        const std::string expected = detail::concat("expected a number from ", lo, " to ", hi);
        if (ptr != end || ec == std::errc::invalid_argument) {
          return detail::concat("'", text, "' is not a number: ", expected);
        }
        if (ec == std::errc::result_out_of_range || !std::isfinite(value) || value < lo ||
            value > hi) {
          return detail::concat("'", text, "' is out of range: ", expected);
        }
        return {};
      },
      "NUMBER");
}

// cpu (the emulated device), cuda or cuda:N. Whether CUDA is present is checked when running.
inline CLI::Validator device_name() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        bool ok = text == "cpu" || text == "cuda";
        if (!ok && text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() <= 7) {
          ok = text.find_first_not_of("0123456789", 5) == std::string::npos;
        }
        if (ok) return {};
        return detail::concat("'", text,
                              "' is not a device blockswap runs on: expected cpu (the "
                              "emulated device), cuda or cuda:N");
      },
      "cpu|cuda|cuda:N");
}

// Opens `path` for writing as the command will later, so that an output file that cannot be
// written fails before the work rather than after it. Removes the file again if it made it.
inline void check_writable(const std::string& option, const std::string& path) {
  std::error_code ignored;
  const bool existed = std::filesystem::exists(path, ignored);
  errno = 0;
  std::ofstream file(path, std::ios::app);
  BLOCKSWAP_CHECK(file.is_open(), option, " ", path, ": cannot open for writing",
                  errno != 0 ? detail::concat(" (", std::strerror(errno), ")") : std::string());
  file.close();
  if (!existed) std::filesystem::remove(path, ignored);
}

} // namespace blockswap::tool
