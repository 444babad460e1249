#include "blockswap/core/node_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

// The first page holds the header; the data starts on the next page (pinnable, aligned).
constexpr char kMagic[] = "blockswap node memory 1";
constexpr std::size_t kNonceBytes = 16;
// Every node memory's name starts so (use() finds them by it).
const std::string kNamePrefix = "blockswap-";

struct Header {
  char magic[sizeof(kMagic)];
  char nonce[2 * kNonceBytes + 1];
  std::uint64_t bytes;
};

std::size_t page_size() {
  return static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

std::size_t round_up(std::size_t bytes, std::size_t to) {
  return (bytes + to - 1) / to * to;
}

std::string system_error(const char* what) {
  return detail::concat(what, ": ", std::strerror(errno));
}

std::string random_nonce() {
  unsigned char random[kNonceBytes];
  std::size_t got = 0;
  while (got < sizeof(random)) {
    const ssize_t n = getrandom(random + got, sizeof(random) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    BLOCKSWAP_CHECK(n > 0, system_error("node memory: getrandom"));
    got += static_cast<std::size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : random) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

} // namespace

std::string NodeMemoryTicket::serialize() const {
  return detail::concat("blockswap-node-memory ", pid, " ", fd, " ", nonce, " ", bytes);
}

NodeMemoryTicket NodeMemoryTicket::parse(const std::string& text) {
  std::istringstream in(text);
  std::string tag;
  NodeMemoryTicket t;
  in >> tag >> t.pid >> t.fd >> t.nonce >> t.bytes;
  BLOCKSWAP_CHECK(in && tag == "blockswap-node-memory" && t.pid > 0 && t.fd >= 0 &&
                      t.nonce.size() == 2 * kNonceBytes,
                  "'", text, "' is not a ticket for node-shared memory");
  return t;
}

NodeMemory NodeMemory::create(const std::string& label, std::size_t bytes) {
  NodeMemory m;
  m.fd_ = memfd_create((kNamePrefix + label).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  BLOCKSWAP_CHECK(m.fd_ >= 0, system_error("node memory: memfd_create"));
  m.mapped_ = page_size() + round_up(bytes, page_size());
  BLOCKSWAP_CHECK(ftruncate(m.fd_, static_cast<off_t>(m.mapped_)) == 0,
                  system_error(detail::concat("node memory: sizing ", bytes, " bytes").c_str()));
  void* p = mmap(nullptr, m.mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd_, 0);
  BLOCKSWAP_CHECK(p != MAP_FAILED, system_error("node memory: mmap"));
  m.mapping_ = static_cast<std::byte*>(p);
  m.data_ = m.mapping_ + page_size();
  m.bytes_ = bytes;
  m.writable_ = true;
  m.ticket_ = NodeMemoryTicket{static_cast<int64_t>(getpid()), m.fd_, random_nonce(), bytes};
  auto* header = reinterpret_cast<Header*>(m.mapping_);
  std::memcpy(header->magic, kMagic, sizeof(kMagic));
  std::memcpy(header->nonce, m.ticket_.nonce.c_str(), m.ticket_.nonce.size() + 1);
  header->bytes = bytes;
  return m;
}

NodeMemory NodeMemory::open(const NodeMemoryTicket& ticket) {
  const std::string path = detail::concat("/proc/", ticket.pid, "/fd/", ticket.fd);
  NodeMemory m;
  m.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (m.fd_ < 0) {
    const int error = errno;
    BLOCKSWAP_CHECK(error != ENOENT, "the process that holds the node's shared weights (pid ",
                    ticket.pid, ") has ended or closed them (", path,
                    " does not exist): it must live until every rank of the node has opened them");
    throw Error(detail::concat("cannot open the node's shared weights at ", path, ": ",
                               std::strerror(error),
                               " (the ranks of a node must run as one user, with /proc mounted)"));
  }
  struct stat st {};
  const std::size_t needed = page_size() + round_up(ticket.bytes, page_size());
  const bool sized = fstat(m.fd_, &st) == 0 && static_cast<std::size_t>(st.st_size) == needed;
  // Note [copy on write]
  void* p =
      sized ? mmap(nullptr, needed, PROT_READ | PROT_WRITE, MAP_PRIVATE, m.fd_, 0) : MAP_FAILED;
  if (p != MAP_FAILED) {
    m.mapping_ = static_cast<std::byte*>(p);
    m.mapped_ = needed;
  }
  const auto* header = reinterpret_cast<const Header*>(m.mapping_);
  BLOCKSWAP_CHECK(m.mapping_ != nullptr &&
                      std::memcmp(header->magic, kMagic, sizeof(kMagic)) == 0 &&
                      ticket.nonce == std::string(header->nonce, 2 * kNonceBytes) &&
                      header->bytes == ticket.bytes,
                  "the ticket '", ticket.serialize(),
                  "' does not describe memory that process holds: a ticket left by an earlier "
                  "job (its store reused?) is never used; start the job with a fresh store");
  m.data_ = m.mapping_ + page_size();
  m.bytes_ = ticket.bytes;
  m.ticket_ = ticket;
  return m;
}

// Note [copy on write]
// Once sealed, every process maps the memory private and writable: it reads the node's one copy
// of each page until it writes the page, which then becomes its own (the kernel copies it). A
// rank that writes a weight changes its own model only, and never faults; blockswap refuses such
// writes where it sees them (the front end), since they cost the sharing they touch. The file
// itself is sealed against writes, so no process can change what the others read.
NodeMemoryUse NodeMemory::use() {
  std::ifstream smaps("/proc/self/smaps");
  BLOCKSWAP_CHECK(smaps.good(), "cannot read /proc/self/smaps to measure node memory");
  NodeMemoryUse use;
  bool ours = false;
  std::string line;
  while (std::getline(smaps, line)) {
    const auto colon = line.find(':');
    const auto space = line.find(' ');
    if (colon == std::string::npos || (space != std::string::npos && space < colon)) {
      // A mapping's first line: "start-end perms offset dev inode   name".
      ours = line.find("/memfd:" + kNamePrefix) != std::string::npos;
      continue;
    }
    if (!ours) continue;
    const std::string field = line.substr(0, colon);
    const std::size_t bytes = std::strtoull(line.c_str() + colon + 1, nullptr, 10) * 1024;
    if (field == "Private_Clean" || field == "Private_Dirty") use.private_bytes += bytes;
    if (field == "Shared_Clean" || field == "Shared_Dirty") use.shared_bytes += bytes;
    if (field == "Pss") use.proportional_bytes += bytes;
  }
  return use;
}

void NodeMemory::seal() {
  if (!writable_) return;
  void* p = mmap(mapping_, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd_, 0);
  BLOCKSWAP_CHECK(p == mapping_, system_error("node memory: mapping it copy-on-write"));
  BLOCKSWAP_CHECK(
      fcntl(fd_, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) == 0,
      system_error("node memory: sealing"));
  writable_ = false;
}

NodeMemory::~NodeMemory() {
  release();
}

NodeMemory::NodeMemory(NodeMemory&& other) noexcept
    : mapping_(std::exchange(other.mapping_, nullptr)), mapped_(std::exchange(other.mapped_, 0)),
      data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)),
      fd_(std::exchange(other.fd_, -1)), writable_(std::exchange(other.writable_, false)),
      ticket_(std::move(other.ticket_)) {}

NodeMemory& NodeMemory::operator=(NodeMemory&& other) noexcept {
  if (this != &other) {
    release();
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapped_ = std::exchange(other.mapped_, 0);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    fd_ = std::exchange(other.fd_, -1);
    writable_ = std::exchange(other.writable_, false);
    ticket_ = std::move(other.ticket_);
  }
  return *this;
}

void NodeMemory::release() noexcept {
  if (mapping_ != nullptr) munmap(mapping_, mapped_);
  if (fd_ >= 0) ::close(fd_);
  mapping_ = nullptr;
  data_ = nullptr;
  fd_ = -1;
}

} // namespace blockswap
