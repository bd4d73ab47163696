// Job helpers shared by the host engines: see job.hpp.
#include "job.hpp"

#include <cstddef>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "checksum.hpp"

namespace pykvtier {

void fill_header(char* hdr, const Request& r) {
  std::memset(hdr, 0, kHeaderBytes);
  BlockHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(h.magic));
  h.version = kFormatVersion;
  h.header_bytes = uint32_t(kHeaderBytes);
  h.payload_bytes = r.length;
  std::memcpy(h.key_digest, r.digest, kDigestBytes);
  h.payload_xxh3 = payload_xxh3(reinterpret_cast<const void*>(r.addr), r.length);
  h.header_xxh3 = XXH3_64bits(&h, offsetof(BlockHeader, header_xxh3));
  std::memcpy(hdr, &h, sizeof(h));
}

int64_t verify_block(const char* hdr, const Request& r) {
  BlockHeader h;
  std::memcpy(&h, hdr, sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.version != kFormatVersion ||
      h.header_bytes != kHeaderBytes ||
      h.header_xxh3 != XXH3_64bits(&h, offsetof(BlockHeader, header_xxh3)))
    return kErrBadHeader;
  if (std::memcmp(h.key_digest, r.digest, kDigestBytes) != 0) return kErrKeyMismatch;
  if (h.payload_bytes != r.length) return kErrLength;
  if (h.payload_xxh3 != payload_xxh3(reinterpret_cast<const void*>(r.addr), r.length))
    return kErrChecksum;
  return 0;
}

FinishedJob make_finished(Job& job) {
  FinishedJob f;
  f.id = job.id;
  f.op = job.op;
  f.results.reserve(job.reqs.size());
  for (auto& r : job.reqs) f.results.push_back(r.result);
  f.submits = job.submits;
  f.queued_s = job.start_time > 0 ? job.start_time - job.submit_time : 0;
  f.transfer_s = job.start_time > 0 ? job.end_time - job.start_time : 0;
  return f;
}

}  // namespace pykvtier
