// Node-shared host memory between real processes (fork): what one fills, another reads without
// a copy; stale and dead tickets are refused; nothing outlives the processes.
#include "blockswap/core/node_memory.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

// Runs `child` in a forked process; returns its exit status (or 128 + the signal).
int in_child(const std::function<int()>& child) {
  const pid_t pid = fork();
  if (pid == 0) {
    int code = 1;
    try {
      code = child();
    } catch (...) {
      code = 2;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void fill(NodeMemory& m) {
  for (std::size_t i = 0; i < m.size(); ++i) m.data()[i] = static_cast<std::byte>(i * 7 + 3);
}

bool holds_the_pattern(const NodeMemory& m) {
  for (std::size_t i = 0; i < m.size(); ++i) {
    if (m.data()[i] != static_cast<std::byte>(i * 7 + 3)) return false;
  }
  return true;
}

TEST(NodeMemory, AnotherProcessReadsWhatTheCreatorWroteThroughItsTicket) {
  NodeMemory memory = NodeMemory::create("test", 3 * 4096 + 100);
  ASSERT_TRUE(memory.writable());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(memory.data()) % 4096, 0u);
  fill(memory);
  memory.seal();
  EXPECT_FALSE(memory.writable());
  const std::string ticket = memory.ticket().serialize();
  EXPECT_EQ(in_child([&] {
              const NodeMemory other = NodeMemory::open(NodeMemoryTicket::parse(ticket));
              if (other.writable() || other.size() != 3 * 4096 + 100) return 3;
              return holds_the_pattern(other) ? 0 : 4;
            }),
            0);
}

// What another process writes stays its own (copy on write): no fault, and neither the creator
// nor a third process sees it. After seal(), the creator's writes stay its own too.
TEST(NodeMemory, WritesStayInTheProcessThatMadeThem) {
  NodeMemory memory = NodeMemory::create("test", 2 * 4096);
  fill(memory);
  memory.seal();
  const NodeMemoryTicket ticket = memory.ticket();
  EXPECT_EQ(in_child([&] {
              const NodeMemory other = NodeMemory::open(ticket);
              other.data()[5] = std::byte{0xee};
              return other.data()[5] == std::byte{0xee} ? 0 : 3;
            }),
            0);
  EXPECT_TRUE(holds_the_pattern(memory));
  memory.data()[7] = std::byte{0xdd};
  EXPECT_EQ(in_child([&] {
              const NodeMemory other = NodeMemory::open(ticket);
              return holds_the_pattern(other) ? 0 : 4;
            }),
            0);
}

// A ticket whose nonce is not in the memory's header (an earlier job's ticket left in a reused
// store, its pid and descriptor numbers reused since) is refused.
TEST(NodeMemory, AStaleTicketIsRefused) {
  NodeMemory memory = NodeMemory::create("test", 4096);
  NodeMemoryTicket stale = memory.ticket();
  stale.nonce[0] = stale.nonce[0] == 'a' ? 'b' : 'a';
  try {
    NodeMemory::open(stale);
    FAIL() << "a stale ticket was used";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("earlier job"), std::string::npos) << e.what();
  }
  NodeMemoryTicket other_size = memory.ticket();
  other_size.bytes = 3 * 4096;
  EXPECT_THROW(NodeMemory::open(other_size), Error);
  // A descriptor of this process that is not node memory at all.
  NodeMemoryTicket not_memory = memory.ticket();
  not_memory.fd = 0;
  EXPECT_THROW(NodeMemory::open(not_memory), Error);
}

TEST(NodeMemory, ATicketOfAProcessThatEndedIsAClearError) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    const NodeMemory memory = NodeMemory::create("test", 4096);
    const std::string ticket = memory.ticket().serialize();
    (void)!write(pipe_fds[1], ticket.c_str(), ticket.size() + 1);
    _exit(0);
  }
  char buffer[256] = {};
  ASSERT_GT(read(pipe_fds[0], buffer, sizeof(buffer) - 1), 0);
  int status = 0;
  waitpid(pid, &status, 0);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  try {
    NodeMemory::open(NodeMemoryTicket::parse(buffer));
    FAIL() << "the memory of an ended process was opened";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has ended"), std::string::npos) << e.what();
  }
}

// No name in any file system: a creator killed while another process maps the memory leaves
// nothing behind (no /dev/shm entry), and the other keeps reading until it unmaps.
TEST(NodeMemory, AKilledCreatorLeavesNothingBehind) {
  const auto shm_entries = [] {
    std::size_t n = 0;
    if (!std::filesystem::exists("/dev/shm")) return n;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
      n += e.path().filename().string().find("blockswap") != std::string::npos;
    }
    return n;
  };
  const std::size_t before = shm_entries();
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t creator = fork();
  if (creator == 0) {
    NodeMemory memory = NodeMemory::create("test", 2 * 4096);
    fill(memory);
    const std::string ticket = memory.ticket().serialize();
    (void)!write(pipe_fds[1], ticket.c_str(), ticket.size() + 1);
    pause(); // until killed
    _exit(0);
  }
  char buffer[256] = {};
  ASSERT_GT(read(pipe_fds[0], buffer, sizeof(buffer) - 1), 0);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  const NodeMemory mapped = NodeMemory::open(NodeMemoryTicket::parse(buffer));
  EXPECT_EQ(shm_entries(), before);
  kill(creator, SIGKILL);
  int status = 0;
  waitpid(creator, &status, 0);
  EXPECT_TRUE(holds_the_pattern(mapped)); // still mapped here
  EXPECT_EQ(shm_entries(), before);
}

// use() reads /proc/self/smaps: the creator alone holds the pages privately; once another
// process maps and reads them they are shared, each holding half (Pss); what a process writes is
// its own again.
TEST(NodeMemory, UseTellsSharedFromPrivatePages) {
  constexpr std::size_t kBytes = 64 * 4096;
  const NodeMemoryUse before = NodeMemory::use();
  NodeMemory memory = NodeMemory::create("test", kBytes);
  fill(memory);
  memory.seal();
  ASSERT_TRUE(holds_the_pattern(memory)); // touches every page through the new mapping
  const NodeMemoryUse alone = NodeMemory::use();
  EXPECT_GE(alone.private_bytes - before.private_bytes, kBytes);
  EXPECT_EQ(alone.shared_bytes, before.shared_bytes);
  const NodeMemoryTicket ticket = memory.ticket();
  EXPECT_EQ(in_child([&] {
              NodeMemory other = NodeMemory::open(ticket);
              if (!holds_the_pattern(other)) return 3;
              const NodeMemoryUse both = NodeMemory::use();
              // The parent's own memory of this kind (before) is mapped here too, by fork; the
              // header page, which open() read, may be mapped by this process alone.
              if (both.shared_bytes < kBytes) return 4;
              if (both.private_bytes > 4096 + before.private_bytes + before.shared_bytes) return 5;
              other.data()[0] = std::byte{1}; // one page becomes this process's own
              const NodeMemoryUse wrote = NodeMemory::use();
              return wrote.private_bytes >= both.private_bytes + 4096 ? 0 : 6;
            }),
            0);
}

TEST(NodeMemory, AMalformedTicketIsAClearError) {
  try {
    NodeMemoryTicket::parse("12 34");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'12 34' is not a ticket"), std::string::npos);
  }
}

} // namespace
} // namespace blockswap
