// BlockIndex (include/pykvtier/block_index.hpp).
#include "pykvtier/block_index.hpp"

namespace pykvtier {

namespace {
bool indexed(BlockState s) { return s == BlockState::Present || s == BlockState::Writing || s == BlockState::Removing; }

// The table's hash of a digest: the low 32 bits of its first 8 bytes (BLAKE2b output: uniform).
uint32_t hash_of(const uint8_t* digest) {
  uint32_t v;
  std::memcpy(&v, digest, sizeof v);
  return v;
}
uint32_t slot_hash(uint64_t slot) { return uint32_t(slot >> 32); }
uint32_t slot_index(uint64_t slot) { return uint32_t(slot) - 1; }
}  // namespace

// ------------------------------------------------------------------------- the table

uint32_t BlockIndex::index_of(const uint8_t* digest) const {
  if (table_.empty()) return kNil;
  const uint32_t h = hash_of(digest);
  for (size_t i = h & mask_;; i = (i + 1) & mask_) {
    const uint64_t s = table_[i];
    if (s == 0) return kNil;
    if (slot_hash(s) == h && std::memcmp(entries_[slot_index(s)].digest.bytes.data(), digest, kDigestBytes) == 0)
      return slot_index(s);
  }
}

BlockIndex::Entry* BlockIndex::find(const uint8_t* digest) {
  const uint32_t i = index_of(digest);
  return i == kNil ? nullptr : &entries_[i];
}

const BlockIndex::Entry* BlockIndex::find(const uint8_t* digest) const {
  const uint32_t i = index_of(digest);
  return i == kNil ? nullptr : &entries_[i];
}

void BlockIndex::grow() {
  std::vector<uint64_t> old;
  old.swap(table_);
  table_.assign(old.empty() ? 64 : old.size() * 2, 0);
  mask_ = table_.size() - 1;
  for (uint64_t s : old) {
    if (s == 0) continue;
    size_t i = slot_hash(s) & mask_;
    while (table_[i] != 0) i = (i + 1) & mask_;
    table_[i] = s;
  }
}

uint32_t BlockIndex::insert(const uint8_t* digest) {
  if (2 * (used_ + 1) > table_.size()) grow();
  uint32_t idx;
  if (!free_.empty()) {
    idx = free_.back();
    free_.pop_back();
    entries_[idx] = Entry{};
  } else {
    idx = uint32_t(entries_.size());
    entries_.emplace_back();
  }
  entries_[idx].digest = Digest::of(digest);
  const uint32_t h = hash_of(digest);
  size_t i = h & mask_;
  while (table_[i] != 0) i = (i + 1) & mask_;
  table_[i] = (uint64_t(h) << 32) | (uint64_t(idx) + 1);
  ++used_;
  return idx;
}

void BlockIndex::erase(uint32_t idx) {
  lru_remove(idx);
  size_t i = hash_of(entries_[idx].digest.bytes.data()) & mask_;
  while (slot_index(table_[i]) != idx) i = (i + 1) & mask_;
  // Backward-shift deletion: later slots of the run that may live at i move up.
  for (size_t j = (i + 1) & mask_; table_[j] != 0; j = (j + 1) & mask_) {
    const size_t home = slot_hash(table_[j]) & mask_;
    // table_[j] may move to i unless its home lies cyclically in (i, j].
    const bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (stays) continue;
    table_[i] = table_[j];
    i = j;
  }
  table_[i] = 0;
  --used_;
  entries_[idx] = Entry{};
  free_.push_back(idx);
}

// ------------------------------------------------------------------------- the LRU list

void BlockIndex::lru_unlink(uint32_t idx) {
  Entry& e = entries_[idx];
  (e.prev == kNil ? head_ : entries_[e.prev].next) = e.next;
  (e.next == kNil ? tail_ : entries_[e.next].prev) = e.prev;
  e.prev = e.next = kNil;
}

void BlockIndex::lru_push_back(uint32_t idx) {
  Entry& e = entries_[idx];
  if (e.in_lru) {
    if (tail_ == idx) return;
    lru_unlink(idx);
  } else {
    e.in_lru = true;
    ++lru_size_;
  }
  e.prev = tail_;
  e.next = kNil;
  (tail_ == kNil ? head_ : entries_[tail_].next) = idx;
  tail_ = idx;
}

void BlockIndex::lru_push_front(uint32_t idx) {
  Entry& e = entries_[idx];
  if (e.in_lru) lru_unlink(idx);
  else ++lru_size_;
  e.in_lru = true;
  e.prev = kNil;
  e.next = head_;
  (head_ == kNil ? tail_ : entries_[head_].prev) = idx;
  head_ = idx;
}

void BlockIndex::lru_remove(uint32_t idx) {
  if (!entries_[idx].in_lru) return;
  lru_unlink(idx);
  entries_[idx].in_lru = false;
  --lru_size_;
}

void BlockIndex::to_tombstone(uint32_t idx) {
  lru_remove(idx);
  Entry& e = entries_[idx];
  if (indexed(e.state)) --blocks_;
  e.state = BlockState::Failed;
  e.readers = 0;
}

// ------------------------------------------------------------------------- the index

void BlockIndex::count(Answer a) {
  ++counts_.lookups;
  switch (a) {
    case Answer::Hit: ++counts_.hits; break;
    case Answer::Miss: ++counts_.misses; break;
    case Answer::Retry: ++counts_.retries; break;
    case Answer::HitPending: ++counts_.hit_pending; break;
    case Answer::Unknown: --counts_.lookups; break;
  }
}

Answer BlockIndex::lookup(const uint8_t* digest) {
  const Entry* e = find(digest);
  Answer a;
  if (e == nullptr) {
    a = unknown_is_miss_ ? Answer::Miss : Answer::Unknown;
  } else if (e->readers) {
    a = Answer::HitPending;
  } else if (e->failed) {
    a = Answer::Miss;
  } else {
    switch (e->state) {
      case BlockState::Present: a = Answer::Hit; break;
      case BlockState::Writing: a = Answer::Retry; break;
      case BlockState::Removing: a = Answer::Miss; break;
      default: a = unknown_is_miss_ ? Answer::Miss : Answer::Unknown; break;
    }
  }
  count(a);
  return a;
}

BlockState BlockIndex::state(const uint8_t* digest) const {
  const Entry* e = find(digest);
  return e ? e->state : BlockState::Absent;
}

uint32_t BlockIndex::readers(const uint8_t* digest) const {
  const Entry* e = find(digest);
  return e ? e->readers : 0;
}

bool BlockIndex::failed(const uint8_t* digest) const {
  const Entry* e = find(digest);
  return e && e->failed;
}

size_t BlockIndex::admit_loads(const uint8_t* digests, size_t n, uint8_t* codes) {
  size_t ok = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t idx = index_of(digests + i * kDigestBytes);
    Admit c;
    if (idx == kNil) {
      c = Admit::Absent;
    } else if (entries_[idx].failed) {
      c = Admit::Failed;
    } else {
      switch (entries_[idx].state) {
        case BlockState::Present: c = Admit::Ok; break;
        case BlockState::Writing: c = Admit::Writing; break;
        case BlockState::Removing: c = Admit::Removing; break;
        default: c = Admit::Absent; break;
      }
    }
    if (c == Admit::Ok) {
      ++entries_[idx].readers;
      lru_push_back(idx);
      ++ok;
    }
    codes[i] = uint8_t(c);
  }
  return ok;
}

size_t BlockIndex::finish_loads(const uint8_t* digests, size_t n) {
  size_t dropped = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t idx = index_of(digests + i * kDigestBytes);
    if (idx == kNil || entries_[idx].readers == 0) continue;
    Entry& e = entries_[idx];
    if (--e.readers == 0 && e.failed && e.state == BlockState::Present) {
      to_tombstone(idx);
      ++dropped;
    }
  }
  return dropped;
}

bool BlockIndex::mark_failed(const uint8_t* digest) {
  uint32_t idx = index_of(digest);
  if (idx == kNil) {
    idx = insert(digest);
    entries_[idx].state = BlockState::Failed;
  }
  Entry& e = entries_[idx];
  const bool was = e.failed;
  e.failed = true;
  return !was;
}

bool BlockIndex::drop_failed(const uint8_t* digest) {
  const uint32_t idx = index_of(digest);
  if (idx == kNil) return false;
  const Entry& e = entries_[idx];
  if (!e.failed || e.state != BlockState::Present || e.readers) return false;
  to_tombstone(idx);
  return true;
}

bool BlockIndex::set_removing(const uint8_t* digest) {
  const uint32_t idx = index_of(digest);
  if (idx == kNil || entries_[idx].state != BlockState::Present || entries_[idx].readers) return false;
  lru_remove(idx);
  entries_[idx].state = BlockState::Removing;
  return true;
}

size_t BlockIndex::admit_stores(const uint8_t* digests, size_t n, size_t max_new, uint8_t* codes) {
  size_t inserted = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* d = digests + i * kDigestBytes;
    const Entry* e = find(d);
    Admit c;
    if (e != nullptr && e->state == BlockState::Removing) {
      c = Admit::Removing;
    } else if (e != nullptr && indexed(e->state)) {
      c = Admit::Present;
    } else if (inserted < max_new) {
      insert_writing(d);  // (may move entries_: e is not used after)
      ++inserted;
      c = Admit::Ok;
    } else {
      c = Admit::NeedsRoom;
    }
    codes[i] = uint8_t(c);
  }
  return inserted;
}

bool BlockIndex::insert_writing(const uint8_t* digest) {
  uint32_t idx = index_of(digest);
  if (idx == kNil) idx = insert(digest);
  Entry& e = entries_[idx];
  if (indexed(e.state)) return false;
  e.state = BlockState::Writing;
  e.failed = false;
  e.readers = 0;
  ++blocks_;
  return true;
}

size_t BlockIndex::finish_stores(const uint8_t* digests, size_t n, const int64_t* results) {
  size_t ok = 0;
  for (size_t i = 0; i < n; ++i) {
    if (results[i] < 0) continue;
    const uint32_t idx = index_of(digests + i * kDigestBytes);
    if (idx == kNil || entries_[idx].state != BlockState::Writing) continue;
    entries_[idx].state = BlockState::Present;
    lru_push_back(idx);
    ++ok;
  }
  return ok;
}

bool BlockIndex::erase_writing(const uint8_t* digest) {
  const uint32_t idx = index_of(digest);
  if (idx == kNil || entries_[idx].state != BlockState::Writing) return false;
  erase(idx);
  --blocks_;
  return true;
}

bool BlockIndex::add_present(const uint8_t* digest) {
  uint32_t idx = index_of(digest);
  if (idx == kNil) {
    idx = insert(digest);
  } else if (indexed(entries_[idx].state) || entries_[idx].failed) {
    return false;
  }
  Entry& e = entries_[idx];
  e.state = BlockState::Present;
  e.readers = 0;
  ++blocks_;
  lru_push_back(idx);
  return true;
}

size_t BlockIndex::take_victims(size_t n, const std::unordered_set<Digest, DigestHash>& keep,
                                std::vector<uint8_t>& out) {
  size_t taken = 0;
  for (uint32_t idx = head_; idx != kNil && taken < n;) {
    Entry& e = entries_[idx];
    const uint32_t next = e.next;  // (the entry leaves the list below)
    if (!e.readers && !(!keep.empty() && keep.count(e.digest))) {
      lru_remove(idx);
      e.state = BlockState::Removing;
      out.insert(out.end(), e.digest.bytes.begin(), e.digest.bytes.end());
      ++taken;
    }
    idx = next;
  }
  return taken;
}

bool BlockIndex::forget_removed(const uint8_t* digest) {
  const uint32_t idx = index_of(digest);
  if (idx == kNil || entries_[idx].state != BlockState::Removing) return false;
  if (entries_[idx].failed) {
    to_tombstone(idx);
  } else {
    erase(idx);
    --blocks_;
  }
  return true;
}

bool BlockIndex::restore(const uint8_t* digest) {
  const uint32_t idx = index_of(digest);
  if (idx == kNil || entries_[idx].state != BlockState::Removing) return false;
  entries_[idx].state = BlockState::Present;
  lru_push_front(idx);
  return true;
}

void BlockIndex::touch(const uint8_t* digests, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t idx = index_of(digests + i * kDigestBytes);
    if (idx != kNil && entries_[idx].in_lru) lru_push_back(idx);
  }
}

std::vector<uint8_t> BlockIndex::lru_order() const {
  std::vector<uint8_t> out;
  out.reserve(lru_size_ * kDigestBytes);
  for (uint32_t idx = head_; idx != kNil; idx = entries_[idx].next)
    out.insert(out.end(), entries_[idx].digest.bytes.begin(), entries_[idx].digest.bytes.end());
  return out;
}

}  // namespace pykvtier
