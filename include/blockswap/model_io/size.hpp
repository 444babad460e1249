// Byte sizes as people write them, for budgets on command lines and in messages.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace blockswap {

// "12GiB", "1.5 GiB", "12000MB", "12G", "4096": KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB
// and the one-letter K/M/G/T powers of 1024. Throws Error naming the text otherwise.
uint64_t parse_size(std::string_view text);
// "12.00 GiB", "512 B".
std::string format_bytes(uint64_t bytes);

} // namespace blockswap
