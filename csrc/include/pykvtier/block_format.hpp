// The on-disk block file format of pykvtier, defined once (Python reads it from pykvtier._native:
// HEADER_BYTES, MAGIC, FORMAT_VERSIONS, parse_header).
//
//   offset 0     header (little-endian), zero padding to kHeaderBytes (one O_DIRECT unit)
//   offset 4096  payload, payload_bytes long
//
// Version 1 (56 bytes): magic, version, header_bytes, payload_bytes, key_digest, payload_xxh3,
//   header_xxh3 (XXH3-64 of the 48 bytes before it).
// Version 2 (64 bytes): version 1's fields up to payload_xxh3, then flags (u32), reserved (u32,
//   zero), header_xxh3 (XXH3-64 of the 56 bytes before it).
// A block whose flags are 0 is written as version 1 (byte-identical to earlier releases); version
// 2 carries flags, today only kFlagNoPayloadChecksum (stored with verify="header": payload_xxh3
// is 0 and no reader checks the payload). Readers accept both versions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

namespace pykvtier {

inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr char kMagic[8] = {'P', 'Y', 'K', 'V', 'T', 'B', 'L', 'K'};
inline constexpr uint32_t kFormatV1 = 1;
inline constexpr uint32_t kFormatV2 = 2;
inline constexpr uint32_t kFormatVersions[] = {kFormatV1, kFormatV2};
inline constexpr size_t kDigestBytes = 16;

// Header flags (version 2).
inline constexpr uint32_t kFlagNoPayloadChecksum = 1u << 0;
inline constexpr uint32_t kKnownFlags = kFlagNoPayloadChecksum;

struct BlockHeaderV1 {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t payload_bytes;
  uint8_t key_digest[kDigestBytes];
  uint64_t payload_xxh3;  // XXH3-64 of the payload
  uint64_t header_xxh3;   // XXH3-64 of every header byte before this field
};
static_assert(sizeof(BlockHeaderV1) == 56, "BlockHeaderV1 layout changed");

struct BlockHeaderV2 {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t payload_bytes;
  uint8_t key_digest[kDigestBytes];
  uint64_t payload_xxh3;  // 0 when flags has kFlagNoPayloadChecksum
  uint32_t flags;
  uint32_t reserved;      // 0
  uint64_t header_xxh3;   // XXH3-64 of every header byte before this field
};
static_assert(sizeof(BlockHeaderV2) == 64, "BlockHeaderV2 layout changed");

// Result codes beyond the errno range: a request's result is bytes moved (>= 0), -errno, or one
// of these (pykvtier._native.BlockError, and the ERR_* attributes).
enum class BlockError : int64_t {
  Short = -100001,        // file shorter than the block: truncated
  BadHeader = -100002,    // magic / version / header size / flags / header checksum wrong
  KeyMismatch = -100003,  // a whole block, but of another key
  Length = -100004,       // header says another payload length
  Checksum = -100005,     // payload checksum mismatch: corrupt bytes
};
inline constexpr int64_t kErrShort = int64_t(BlockError::Short);
inline constexpr int64_t kErrBadHeader = int64_t(BlockError::BadHeader);
inline constexpr int64_t kErrKeyMismatch = int64_t(BlockError::KeyMismatch);
inline constexpr int64_t kErrLength = int64_t(BlockError::Length);
inline constexpr int64_t kErrChecksum = int64_t(BlockError::Checksum);
inline bool is_block_error(int64_t r) { return r <= kErrShort && r >= kErrChecksum; }

// A header as read from a file, whatever its version (parse_block_header).
struct ParsedHeader {
  bool magic_ok = false;
  bool header_ok = false;  // magic, a known version, header_bytes, known flags, header checksum
  uint32_t version = 0;
  uint32_t header_bytes = 0;
  uint64_t payload_bytes = 0;
  uint8_t key_digest[kDigestBytes] = {};
  uint64_t payload_xxh3 = 0;
  uint32_t flags = 0;
  bool payload_checksum() const { return (flags & kFlagNoPayloadChecksum) == 0; }
};

// Parses the first bytes of a block file (len of them, at most kHeaderBytes are looked at).
inline ParsedHeader parse_block_header(const char* hdr, size_t len) {
  ParsedHeader p;
  if (len < sizeof(BlockHeaderV1)) return p;
  BlockHeaderV1 h1;
  std::memcpy(&h1, hdr, sizeof(h1));
  p.magic_ok = std::memcmp(h1.magic, kMagic, sizeof(kMagic)) == 0;
  p.version = h1.version;
  p.header_bytes = h1.header_bytes;
  p.payload_bytes = h1.payload_bytes;
  std::memcpy(p.key_digest, h1.key_digest, kDigestBytes);
  p.payload_xxh3 = h1.payload_xxh3;
  bool sum_ok = false;
  if (h1.version == kFormatV1) {
    sum_ok = h1.header_xxh3 == XXH3_64bits(&h1, offsetof(BlockHeaderV1, header_xxh3));
  } else if (h1.version == kFormatV2 && len >= sizeof(BlockHeaderV2)) {
    BlockHeaderV2 h2;
    std::memcpy(&h2, hdr, sizeof(h2));
    p.flags = h2.flags;
    sum_ok = h2.reserved == 0 && (h2.flags & ~kKnownFlags) == 0 &&
             h2.header_xxh3 == XXH3_64bits(&h2, offsetof(BlockHeaderV2, header_xxh3));
  }
  p.header_ok = p.magic_ok && sum_ok && p.header_bytes == kHeaderBytes;
  return p;
}

// Fills hdr (kHeaderBytes, zero padded) with the header of a block of payload_bytes bytes of the
// key whose digest is key_digest (kDigestBytes). flags 0: version 1 with payload_xxh3; else
// version 2 with flags (kFlagNoPayloadChecksum: payload_xxh3 is stored as 0).
inline void fill_block_header(char* hdr, const uint8_t* key_digest, uint64_t payload_bytes,
                              uint64_t payload_xxh3, uint32_t flags = 0) {
  std::memset(hdr, 0, kHeaderBytes);
  if (flags & kFlagNoPayloadChecksum) payload_xxh3 = 0;
  if (flags == 0) {
    BlockHeaderV1 h{};
    std::memcpy(h.magic, kMagic, sizeof(h.magic));
    h.version = kFormatV1;
    h.header_bytes = uint32_t(kHeaderBytes);
    h.payload_bytes = payload_bytes;
    std::memcpy(h.key_digest, key_digest, kDigestBytes);
    h.payload_xxh3 = payload_xxh3;
    h.header_xxh3 = XXH3_64bits(&h, offsetof(BlockHeaderV1, header_xxh3));
    std::memcpy(hdr, &h, sizeof(h));
    return;
  }
  BlockHeaderV2 h{};
  std::memcpy(h.magic, kMagic, sizeof(h.magic));
  h.version = kFormatV2;
  h.header_bytes = uint32_t(kHeaderBytes);
  h.payload_bytes = payload_bytes;
  std::memcpy(h.key_digest, key_digest, kDigestBytes);
  h.payload_xxh3 = payload_xxh3;
  h.flags = flags;
  h.header_xxh3 = XXH3_64bits(&h, offsetof(BlockHeaderV2, header_xxh3));
  std::memcpy(hdr, &h, sizeof(h));
}

// The checks of a header (kHeaderBytes read from a block file) that need no payload bytes:
// 0, or kErrBadHeader, kErrKeyMismatch, kErrLength. On 0 fills *out (payload_xxh3, flags).
inline int64_t check_block_header(const char* hdr, const uint8_t* key_digest, uint64_t payload_bytes,
                                  ParsedHeader* out) {
  *out = parse_block_header(hdr, kHeaderBytes);
  if (!out->header_ok) return kErrBadHeader;
  if (std::memcmp(out->key_digest, key_digest, kDigestBytes) != 0) return kErrKeyMismatch;
  if (out->payload_bytes != payload_bytes) return kErrLength;
  return 0;
}

// A block file's name under the root's blocks/ directory: "<first two hex digits>/<32 hex
// digits of key_digest>.kvb" (pykvtier.layout's block_path; a store's temporary is that name
// plus ".tmp.<pid>.<sequence>").
inline constexpr char kBlockSuffix[] = ".kvb";
inline std::string block_name(const uint8_t* key_digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(2 * kDigestBytes, '0');
  for (size_t i = 0; i < kDigestBytes; ++i) {
    hex[2 * i] = kHex[key_digest[i] >> 4];
    hex[2 * i + 1] = kHex[key_digest[i] & 15];
  }
  return hex.substr(0, 2) + "/" + hex + kBlockSuffix;
}

}  // namespace pykvtier
