// BlockIndex (include/pykvtier/block_index.hpp).
#include "pykvtier/block_index.hpp"

namespace pykvtier {

namespace {
bool indexed(BlockState s) { return s == BlockState::Present || s == BlockState::Writing || s == BlockState::Removing; }
}  // namespace

BlockIndex::Entry* BlockIndex::find(const uint8_t* digest) {
  auto it = map_.find(Digest::of(digest));
  return it == map_.end() ? nullptr : &it->second;
}

const BlockIndex::Entry* BlockIndex::find(const uint8_t* digest) const {
  auto it = map_.find(Digest::of(digest));
  return it == map_.end() ? nullptr : &it->second;
}

void BlockIndex::lru_push_back(Map::iterator it) {
  Entry& e = it->second;
  if (e.in_lru) {
    lru_.splice(lru_.end(), lru_, e.lru);
  } else {
    e.lru = lru_.insert(lru_.end(), it->first);
    e.in_lru = true;
  }
}

void BlockIndex::lru_remove(Entry& e) {
  if (!e.in_lru) return;
  lru_.erase(e.lru);
  e.in_lru = false;
}

void BlockIndex::to_tombstone(Entry& e) {
  lru_remove(e);
  if (indexed(e.state)) --blocks_;
  e.state = BlockState::Failed;
  e.readers = 0;
}

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
    auto it = map_.find(Digest::of(digests + i * kDigestBytes));
    Admit c;
    if (it == map_.end()) {
      c = Admit::Absent;
    } else if (it->second.failed) {
      c = Admit::Failed;
    } else {
      switch (it->second.state) {
        case BlockState::Present: c = Admit::Ok; break;
        case BlockState::Writing: c = Admit::Writing; break;
        case BlockState::Removing: c = Admit::Removing; break;
        default: c = Admit::Absent; break;
      }
    }
    if (c == Admit::Ok) {
      ++it->second.readers;
      lru_push_back(it);
      ++ok;
    }
    codes[i] = uint8_t(c);
  }
  return ok;
}

size_t BlockIndex::finish_loads(const uint8_t* digests, size_t n) {
  size_t dropped = 0;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = find(digests + i * kDigestBytes);
    if (e == nullptr || e->readers == 0) continue;
    if (--e->readers == 0 && e->failed && e->state == BlockState::Present) {
      to_tombstone(*e);
      ++dropped;
    }
  }
  return dropped;
}

bool BlockIndex::mark_failed(const uint8_t* digest) {
  auto [it, inserted] = map_.try_emplace(Digest::of(digest));
  Entry& e = it->second;
  if (inserted) e.state = BlockState::Failed;
  const bool was = e.failed;
  e.failed = true;
  return !was;
}

bool BlockIndex::drop_failed(const uint8_t* digest) {
  Entry* e = find(digest);
  if (e == nullptr || !e->failed || e->state != BlockState::Present || e->readers) return false;
  to_tombstone(*e);
  return true;
}

bool BlockIndex::set_removing(const uint8_t* digest) {
  Entry* e = find(digest);
  if (e == nullptr || e->state != BlockState::Present || e->readers) return false;
  lru_remove(*e);
  e->state = BlockState::Removing;
  return true;
}

size_t BlockIndex::admit_stores(const uint8_t* digests, size_t n, size_t max_new, uint8_t* codes) {
  size_t inserted = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* d = digests + i * kDigestBytes;
    Entry* e = find(d);
    Admit c;
    if (e != nullptr && e->state == BlockState::Removing) {
      c = Admit::Removing;
    } else if (e != nullptr && indexed(e->state)) {
      c = Admit::Present;
    } else if (inserted < max_new) {
      insert_writing(d);
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
  Entry& e = map_[Digest::of(digest)];
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
    auto it = map_.find(Digest::of(digests + i * kDigestBytes));
    if (it == map_.end() || it->second.state != BlockState::Writing) continue;
    it->second.state = BlockState::Present;
    lru_push_back(it);
    ++ok;
  }
  return ok;
}

bool BlockIndex::erase_writing(const uint8_t* digest) {
  auto it = map_.find(Digest::of(digest));
  if (it == map_.end() || it->second.state != BlockState::Writing) return false;
  lru_remove(it->second);
  map_.erase(it);
  --blocks_;
  return true;
}

bool BlockIndex::add_present(const uint8_t* digest) {
  auto [it, inserted] = map_.try_emplace(Digest::of(digest));
  Entry& e = it->second;
  if (!inserted && (indexed(e.state) || e.failed)) return false;
  e.state = BlockState::Present;
  e.readers = 0;
  ++blocks_;
  lru_push_back(it);
  return true;
}

size_t BlockIndex::take_victims(size_t n, const std::unordered_set<Digest, DigestHash>& keep,
                                std::vector<uint8_t>& out) {
  size_t taken = 0;
  for (auto it = lru_.begin(); it != lru_.end() && taken < n;) {
    const Digest d = *it++;  // (the entry leaves the list below)
    Entry& e = map_.find(d)->second;
    if (e.readers || keep.count(d)) continue;
    lru_remove(e);
    e.state = BlockState::Removing;
    out.insert(out.end(), d.bytes.begin(), d.bytes.end());
    ++taken;
  }
  return taken;
}

bool BlockIndex::forget_removed(const uint8_t* digest) {
  auto it = map_.find(Digest::of(digest));
  if (it == map_.end() || it->second.state != BlockState::Removing) return false;
  if (it->second.failed) {
    to_tombstone(it->second);
  } else {
    lru_remove(it->second);
    map_.erase(it);
    --blocks_;
  }
  return true;
}

bool BlockIndex::restore(const uint8_t* digest) {
  auto it = map_.find(Digest::of(digest));
  if (it == map_.end() || it->second.state != BlockState::Removing) return false;
  Entry& e = it->second;
  e.state = BlockState::Present;
  e.lru = lru_.insert(lru_.begin(), it->first);
  e.in_lru = true;
  return true;
}

void BlockIndex::touch(const uint8_t* digests, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    auto it = map_.find(Digest::of(digests + i * kDigestBytes));
    if (it != map_.end() && it->second.in_lru) lru_push_back(it);
  }
}

std::vector<uint8_t> BlockIndex::lru_order() const {
  std::vector<uint8_t> out;
  out.reserve(lru_.size() * kDigestBytes);
  for (const Digest& d : lru_) out.insert(out.end(), d.bytes.begin(), d.bytes.end());
  return out;
}

}  // namespace pykvtier
