// A tier's block space: where its block files live (blocks_dir), how big a block's payload is, and
// the arena its slots are in. From a key digest and a slot it builds the Requests of the block
// ops (job.hpp) without Python: block_path, tmp_path, fill. No Python objects here.
//
//   block_path(d) = blocks_dir + "/" + block_name(d)    (block_format.hpp: "<2 hex>/<32 hex>.kvb")
//   tmp_path(d)   = block_path(d) + ".tmp." + pid + "." + next_tmp_sequence()
//   slot s        = [arena_addr + s * slot_bytes, + payload_bytes)
// Slots are apart (slot_bytes >= payload_bytes) or, for a spanning space, start every slot_bytes
// and overlap (a block covers ceil(payload_bytes / slot_bytes) consecutive slots; the caller
// keeps the slots of jobs in flight apart, e.g. with SlotClaims(span)).
#pragma once

#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "pykvtier/block_format.hpp"
#include "pykvtier/job.hpp"

namespace pykvtier {

// The process's temporary-name sequence: 1, 2, 3, ... (thread-safe). pykvtier._native's copy is
// the one every temporary name of the process draws from (Python's through _native.tmp_sequence;
// a BlockSpace keeps a pointer to the counter of the module that built it).
inline std::atomic<uint64_t>& tmp_sequence_counter() {
  static std::atomic<uint64_t> counter{1};
  return counter;
}
inline uint64_t next_tmp_sequence() { return tmp_sequence_counter().fetch_add(1, std::memory_order_relaxed); }

inline constexpr uint64_t kMaxBlockPayloadBytes = 1ull << 30;  // one request's limit (CQE results are int32)
// The longest tail tmp_path adds to blocks_dir: "/hh/" + 32 hex + ".kvb" + ".tmp." + pid (at most
// 10 digits) + "." + sequence (at most 20 digits). Every name fits PATH_MAX (4096, with its NUL).
inline constexpr size_t kTmpPathTailBytes = 4 + 2 * kDigestBytes + 4 + 5 + 10 + 1 + 20;
inline constexpr size_t kMaxBlocksDirBytes = 4095 - kTmpPathTailBytes;

struct BlockSpace {
  std::string blocks_dir;  // no trailing "/" added or removed: names are blocks_dir + "/" + ...
  uint64_t payload_bytes = 0;
  uint64_t arena_addr = 0;
  uint64_t slot_bytes = 0;
  uint64_t num_slots = 0;
  bool spanning = false;  // slots overlap: slot_bytes may be smaller than payload_bytes
  int64_t pid = 0;  // getpid() at construction: the temporaries' owner
  std::atomic<uint64_t>* tmp_sequence = nullptr;

  // Throws std::invalid_argument naming the argument: payload_bytes 0 or above 1 GiB, slot_bytes
  // < payload_bytes (unless spanning; slot_bytes 0 either way), arena_addr 0, num_slots 0, an
  // arena past the end of the address space, a blocks_dir that is empty, has a NUL byte, or is
  // longer than kMaxBlocksDirBytes.
  BlockSpace(std::string dir, uint64_t payload, uint64_t arena, uint64_t slot, uint64_t slots,
             bool span = false)
      : blocks_dir(std::move(dir)), payload_bytes(payload), arena_addr(arena), slot_bytes(slot),
        num_slots(slots), spanning(span), pid(::getpid()), tmp_sequence(&tmp_sequence_counter()) {
    auto bad = [](const std::string& what) { throw std::invalid_argument(what); };
    if (blocks_dir.empty()) bad("blocks_dir is empty");
    if (blocks_dir.find('\0') != std::string::npos) bad("blocks_dir contains a NUL byte");
    if (blocks_dir.size() > kMaxBlocksDirBytes)
      bad("blocks_dir is " + std::to_string(blocks_dir.size()) + " bytes, more than " +
          std::to_string(kMaxBlocksDirBytes) + ": its block files' names would not fit PATH_MAX (4096)");
    if (payload_bytes == 0) bad("payload_bytes is 0");
    if (payload_bytes > kMaxBlockPayloadBytes)
      bad("payload_bytes " + std::to_string(payload_bytes) + " exceeds the 1 GiB per-request limit");
    if (slot_bytes == 0) bad("slot_bytes is 0");
    if (!spanning && slot_bytes < payload_bytes)
      bad("slot_bytes " + std::to_string(slot_bytes) + " is smaller than payload_bytes " +
          std::to_string(payload_bytes));
    if (arena_addr == 0) bad("arena_addr is 0 (NULL)");
    if (num_slots == 0) bad("num_slots is 0");
    if (num_slots - 1 > (UINT64_MAX - arena_addr - payload_bytes) / slot_bytes ||
        num_slots > (UINT64_MAX - arena_addr) / slot_bytes)
      bad("the arena (num_slots " + std::to_string(num_slots) + " * slot_bytes " + std::to_string(slot_bytes) +
          " from arena_addr) runs past the end of the address space");
  }

  std::string block_path(const uint8_t* digest) const {
    std::string p;
    p.reserve(blocks_dir.size() + kTmpPathTailBytes);
    append_block_path(p, digest);
    return p;
  }

  // A fresh temporary name beside block_path(digest) (same directory: an atomic rename).
  std::string tmp_path(const uint8_t* digest) const { return tmp_path_of(block_path(digest)); }

  // block + ".tmp." + pid + "." + the next value of the sequence.
  std::string tmp_path_of(const std::string& block) const {
    std::string p;
    p.reserve(block.size() + 32);
    p += block;
    p += ".tmp.";
    append_number(p, uint64_t(pid));
    p += '.';
    append_number(p, tmp_sequence->fetch_add(1, std::memory_order_relaxed));
    return p;
  }

  uint64_t slot_addr(uint64_t slot) const { return arena_addr + slot * slot_bytes; }

  // r as op's request for the block of digest in slot (0 <= slot < num_slots, the caller's check;
  // unused for Unlink): ReadBlock path = block_path; WriteBlock path = tmp_path, target =
  // block_path; both length = payload_bytes, addr = slot_addr(slot), the digest; Unlink path =
  // block_path. Other ops: std::invalid_argument.
  // The names are built into r's strings in place (their capacity reused: a recycled Request
  // allocates nothing); r's other names are cleared.
  void fill(Op op, const uint8_t* digest, uint64_t slot, Request& r) const {
    r.recycle.clear();
    r.offset = r.length = r.addr = 0;
    r.result = 0;
    r.issue_time = r.done_time = 0;
    std::memset(r.digest, 0, kDigestBytes);
    switch (op) {
      case Op::ReadBlock:
        r.path.clear();
        append_block_path(r.path, digest);
        r.target.clear();
        break;
      case Op::WriteBlock:
        r.target.clear();
        append_block_path(r.target, digest);
        r.path.assign(r.target);
        r.path += ".tmp.";
        append_number(r.path, uint64_t(pid));
        r.path += '.';
        append_number(r.path, tmp_sequence->fetch_add(1, std::memory_order_relaxed));
        break;
      case Op::Unlink:
        r.path.clear();
        append_block_path(r.path, digest);
        r.target.clear();
        return;
      default:
        throw std::invalid_argument(std::string("a block space builds read_block, write_block and unlink "
                                                "requests, not ") + op_name(op));
    }
    r.length = payload_bytes;
    r.addr = slot_addr(slot);
    std::memcpy(r.digest, digest, kDigestBytes);
  }

 private:
  void append_block_path(std::string& p, const uint8_t* digest) const {
    static constexpr char kHex[] = "0123456789abcdef";
    char name[4 + 2 * kDigestBytes];  // "/hh/" + 32 hex, then kBlockSuffix: block_name()'s text
    name[0] = '/';
    name[1] = kHex[digest[0] >> 4];
    name[2] = kHex[digest[0] & 15];
    name[3] = '/';
    for (size_t i = 0; i < kDigestBytes; ++i) {
      name[4 + 2 * i] = kHex[digest[i] >> 4];
      name[5 + 2 * i] = kHex[digest[i] & 15];
    }
    p += blocks_dir;
    p.append(name, sizeof(name));
    p += kBlockSuffix;
  }

  static void append_number(std::string& p, uint64_t v) {
    char buf[20];
    const auto res = std::to_chars(buf, buf + sizeof(buf), v);
    p.append(buf, res.ptr);
  }
};

}  // namespace pykvtier
