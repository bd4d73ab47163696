// The block index of one tier root: which blocks it holds, in which state, and their
// least-recently-used order; the per-key bookkeeping of DiskTier's lookups, loads, stores and
// evictions (docs/design.md, "The index"). No Python objects and no I/O here. Not thread-safe:
// one tier's calling thread uses it.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <unordered_set>
#include <vector>

#include "pykvtier/block_format.hpp"

namespace pykvtier {

struct Digest {
  std::array<uint8_t, kDigestBytes> bytes{};
  static Digest of(const uint8_t* p) {
    Digest d;
    std::memcpy(d.bytes.data(), p, kDigestBytes);
    return d;
  }
  bool operator==(const Digest&) const = default;
};

// Key digests are BLAKE2b output: any 8 of their bytes are a uniform hash.
struct DigestHash {
  size_t operator()(const Digest& d) const noexcept {
    uint64_t v;
    std::memcpy(&v, d.bytes.data(), sizeof v);
    return size_t(v);
  }
};

enum class BlockState : uint8_t {
  Absent = 0,
  Present = 1,   // its file is in place: loadable (unless marked failed)
  Writing = 2,   // a store of it is in flight
  Removing = 3,  // evicted: its file is being removed (or recycled)
  Failed = 4,    // not indexed; a load of it failed: MISS until stored again (a tombstone)
};

// A lookup's answer (pykvtier.tier.LookupResult's members), plus Unknown: not indexed (a shared
// tier probes it).
enum class Answer : uint8_t { Hit = 0, Miss = 1, Retry = 2, HitPending = 3, Unknown = 4 };

// Per key of admit_loads / admit_stores.
enum class Admit : uint8_t {
  Ok = 0,         // admitted (a load: one more reader; a store: now Writing)
  Failed = 1,     // load: an earlier load of the block failed
  Absent = 2,     // load: not in the tier
  Writing = 3,    // load: a store of it is in flight
  Removing = 4,   // load or store: being evicted
  Present = 5,    // store: present or being written already (counts as stored)
  NeedsRoom = 6,  // store: new, beyond max_new (not inserted)
};

struct LookupCounts {
  uint64_t lookups = 0, hits = 0, misses = 0, retries = 0, hit_pending = 0;
};

class BlockIndex {
 public:
  // unknown_is_miss: lookups of keys not indexed answer Miss (false: Unknown, for a shared tier).
  explicit BlockIndex(bool unknown_is_miss) : unknown_is_miss_(unknown_is_miss) {}

  // Answer for the digest, counted in counts(): HitPending while loads read it, Miss for a
  // failed or removing block, Hit for a present one, Retry while it is written; not indexed:
  // Miss or Unknown (see the constructor; Unknown is not counted).
  Answer lookup(const uint8_t* digest);
  const LookupCounts& counts() const { return counts_; }
  // Counts a lookup answered outside the index (a shared tier's probe path).
  void count(Answer a);

  BlockState state(const uint8_t* digest) const;
  uint32_t readers(const uint8_t* digest) const;
  bool failed(const uint8_t* digest) const;  // marked failed (indexed or a tombstone)
  size_t size() const { return blocks_; }    // Present + Writing + Removing blocks
  size_t present() const { return lru_size_; }  // Present blocks

  // --- loads
  // For each of n digests (kDigestBytes each, back to back) writes an Admit code; an admitted
  // one (Present, not failed) gets one more reader and becomes the most recently used. Returns
  // the number admitted.
  size_t admit_loads(const uint8_t* digests, size_t n, uint8_t* codes);
  // One reader less for each digest (a finished load); a failed block left without readers is
  // dropped (a tombstone). Returns the number dropped (their file bytes stop counting).
  size_t finish_loads(const uint8_t* digests, size_t n);
  // Marks the block failed (a tombstone if not indexed). True if it was not marked before.
  bool mark_failed(const uint8_t* digest);
  // A failed Present block without readers becomes a tombstone. True if dropped.
  bool drop_failed(const uint8_t* digest);
  // A Present block without readers becomes Removing (out of the LRU order). True if it did.
  bool set_removing(const uint8_t* digest);

  // --- stores
  // For each digest an Admit code: Present (indexed Present/Writing: skipped), Removing, or a new
  // block: Ok (inserted Writing, its failed mark cleared) for the first max_new of them, else
  // NeedsRoom (not inserted). A digest given twice: the second sees the first. Returns the
  // number inserted.
  size_t admit_stores(const uint8_t* digests, size_t n, size_t max_new, uint8_t* codes);
  // A new block Writing (absent or a tombstone; failed mark cleared). False if indexed.
  bool insert_writing(const uint8_t* digest);
  // Writing blocks whose results[i] >= 0 become Present, most recently used. Returns how many.
  size_t finish_stores(const uint8_t* digests, size_t n, const int64_t* results);
  // Forgets a Writing block (its store failed). True if it was Writing.
  bool erase_writing(const uint8_t* digest);

  // --- found on disk, evictions
  // A block found on disk (start-up scan, a shared tier's probe): Present, most recently used,
  // unless indexed or failed. True if added.
  bool add_present(const uint8_t* digest);
  // Up to n least recently used Present blocks without readers, not in keep, become Removing;
  // their digests are appended to out (kDigestBytes each). Returns how many.
  size_t take_victims(size_t n, const std::unordered_set<Digest, DigestHash>& keep,
                      std::vector<uint8_t>& out);
  // A Removing block's file is gone: forgotten (a tombstone if marked failed). True if it was
  // Removing.
  bool forget_removed(const uint8_t* digest);
  // A Removing block whose file was not touched: Present again, least recently used. True if it
  // was Removing.
  bool restore(const uint8_t* digest);
  // Present blocks among the digests become the most recently used.
  void touch(const uint8_t* digests, size_t n);
  // Present blocks, least recently used first (kDigestBytes each).
  std::vector<uint8_t> lru_order() const;

 private:
  // Entries live in entries_ (stable indexes, reused through free_); table_ is an open-addressing
  // table (linear probing, at most half full, backward-shift deletion) of slots
  // (low 32 bits of the digest's first 8 bytes << 32 | entry index + 1; 0: empty), so a find
  // touches one table slot and one entry. The LRU list links entries by index.
  static constexpr uint32_t kNil = UINT32_MAX;
  struct Entry {
    Digest digest;
    uint32_t prev = kNil, next = kNil;  // LRU neighbours (in_lru)
    uint32_t readers = 0;
    BlockState state = BlockState::Absent;
    bool failed = false;
    bool in_lru = false;
  };

  uint32_t index_of(const uint8_t* digest) const;  // kNil if not indexed
  Entry* find(const uint8_t* digest);
  const Entry* find(const uint8_t* digest) const;
  uint32_t insert(const uint8_t* digest);  // a new entry (the digest must be absent)
  void erase(uint32_t idx);
  void grow();
  void lru_push_back(uint32_t idx);
  void lru_push_front(uint32_t idx);
  void lru_unlink(uint32_t idx);
  void lru_remove(uint32_t idx);
  void to_tombstone(uint32_t idx);

  std::vector<Entry> entries_;
  std::vector<uint32_t> free_;
  std::vector<uint64_t> table_;
  size_t mask_ = 0, used_ = 0;  // table_.size() - 1; entries in the table
  uint32_t head_ = kNil, tail_ = kNil;  // LRU: least recently used first
  size_t lru_size_ = 0;
  size_t blocks_ = 0;
  bool unknown_is_miss_;
  LookupCounts counts_;
};

}  // namespace pykvtier
