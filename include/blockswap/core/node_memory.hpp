// Host memory the processes of one node share: one host copy of the frozen weights for all the
// ranks of a data-parallel job (DESIGN.md section 10).
//
// The memory is an anonymous memory file (memfd): it has no name in any file system, so nothing
// is left behind when the last process that maps it ends, however it ends (killed included).
// The process that creates it publishes a Ticket through the job's rendezvous (the c10d store);
// the others open the file through /proc/<pid>/fd/<fd> while the creator lives, map it
// copy-on-write (what a process writes stays its own; the shared pages never change), and check the
// ticket's nonce in its header, so a ticket left in a store by an earlier job (whose process and
// descriptor numbers may since be reused) is refused, never used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace blockswap {

// What another process of the node needs to map the memory.
struct NodeMemoryTicket {
  int64_t pid = 0;       // the creator
  int fd = -1;           // its descriptor of the memory file
  std::string nonce;     // random, written in the memory's header
  std::size_t bytes = 0; // usable bytes

  std::string serialize() const;
  // Throws Error naming `text` when it is not a serialized ticket.
  static NodeMemoryTicket parse(const std::string& text);
};

// What this process maps of node memory (every NodeMemory of its own or of others), read from
// /proc/self/smaps: pages only this process maps, pages others map too, and this process's
// proportional share of all of them. Pages never touched count nowhere.
struct NodeMemoryUse {
  std::size_t private_bytes = 0;
  std::size_t shared_bytes = 0;
  std::size_t proportional_bytes = 0; // smaps' Pss
};

class NodeMemory {
public:
  // Throws Error when /proc/self/smaps cannot be read.
  static NodeMemoryUse use();

  // `bytes` of zeroed, writable memory; `label` names it in /proc/<pid>/maps
  // ("/memfd:blockswap-<label>").
  // Throws Error when the system refuses (no memfd, no memory).
  static NodeMemory create(const std::string& label, std::size_t bytes);
  // The memory of another process of this node, copy-on-write. Throws Error when the creator has
  // ended, when /proc does not let this process open its descriptor, or when what it opens is
  // not the memory the ticket describes (a stale ticket from an earlier job).
  static NodeMemory open(const NodeMemoryTicket& ticket);

  NodeMemory() = default;
  ~NodeMemory();
  NodeMemory(NodeMemory&& other) noexcept;
  NodeMemory& operator=(NodeMemory&& other) noexcept;
  NodeMemory(const NodeMemory&) = delete;
  NodeMemory& operator=(const NodeMemory&) = delete;

  std::byte* data() const { return data_; } // page-aligned
  std::size_t size() const { return bytes_; }
  // Whether writes reach the other processes (the creator, before seal()).
  bool writable() const { return writable_; }
  // Valid while this (creating) object lives.
  const NodeMemoryTicket& ticket() const { return ticket_; }
  // The creator, once it has filled the memory: the shared pages never change from now on; the
  // creator's mapping becomes copy-on-write like the others'. writable() is false after it.
  void seal();

private:
  void release() noexcept;

  std::byte* mapping_ = nullptr; // header page, then the data
  std::size_t mapped_ = 0;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  int fd_ = -1;
  bool writable_ = false;
  NodeMemoryTicket ticket_;
};

} // namespace blockswap
