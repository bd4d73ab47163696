// Writing and checking a block file's header (block_format.hpp), shared by every engine so the
// format is written down once. Header-only: XXH3 is used inline (XXH_INLINE_ALL).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include "block_format.hpp"

namespace pykvtier {

// Fills hdr (kHeaderBytes, zero padded) with the header of a block of payload_bytes bytes of the
// key whose digest is key_digest (kDigestBytes) and whose payload hashes to payload_xxh3.
inline void fill_block_header(char* hdr, const uint8_t* key_digest, uint64_t payload_bytes,
                              uint64_t payload_xxh3) {
  std::memset(hdr, 0, kHeaderBytes);
  BlockHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(h.magic));
  h.version = kFormatVersion;
  h.header_bytes = uint32_t(kHeaderBytes);
  h.payload_bytes = payload_bytes;
  std::memcpy(h.key_digest, key_digest, kDigestBytes);
  h.payload_xxh3 = payload_xxh3;
  h.header_xxh3 = XXH3_64bits(&h, offsetof(BlockHeader, header_xxh3));
  std::memcpy(hdr, &h, sizeof(h));
}

// The checks of a header read from a block file that need no payload bytes: 0, or kErrBadHeader
// (magic, version, size or header checksum wrong), kErrKeyMismatch, kErrLength. On 0 sets
// *payload_xxh3 to the checksum the payload must have.
inline int64_t check_block_header(const char* hdr, const uint8_t* key_digest, uint64_t payload_bytes,
                                  uint64_t* payload_xxh3) {
  BlockHeader h;
  std::memcpy(&h, hdr, sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.version != kFormatVersion ||
      h.header_bytes != kHeaderBytes || h.header_xxh3 != XXH3_64bits(&h, offsetof(BlockHeader, header_xxh3)))
    return kErrBadHeader;
  if (std::memcmp(h.key_digest, key_digest, kDigestBytes) != 0) return kErrKeyMismatch;
  if (h.payload_bytes != payload_bytes) return kErrLength;
  *payload_xxh3 = h.payload_xxh3;
  return 0;
}

}  // namespace pykvtier
