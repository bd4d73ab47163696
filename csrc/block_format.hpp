// On-disk block file format of pykvtier.
//
// A block file is a 4096-byte header followed by the payload (the block's bytes):
//
//   offset 0     BlockHeader (56 bytes, little-endian), zero padding to 4096
//   offset 4096  payload, payload_bytes long
//
// The header is a whole O_DIRECT unit, so header and payload are read and written
// with aligned I/O. It proves that a file is whole (payload length, payload checksum)
// and that it is the block its name says (digest of the key), and carries the format
// version. Keep in sync with pykvtier/layout.py.
#pragma once

#include <cstdint>
#include <cstring>

namespace pykvtier {

inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr char kMagic[8] = {'P', 'Y', 'K', 'V', 'T', 'B', 'L', 'K'};
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr size_t kDigestBytes = 16;

struct BlockHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t payload_bytes;
  uint8_t key_digest[kDigestBytes];
  uint64_t payload_xxh3;  // XXH3-64 of the payload
  uint64_t header_xxh3;   // XXH3-64 of every header byte before this field
};
static_assert(sizeof(BlockHeader) == 56, "BlockHeader layout changed");

// Result codes beyond the errno range (results are bytes moved, -errno, or one of these).
inline constexpr int64_t kErrShort = -100001;        // file shorter than the block: truncated
inline constexpr int64_t kErrBadHeader = -100002;    // magic / version / header checksum wrong
inline constexpr int64_t kErrKeyMismatch = -100003;  // a whole block, but of another key
inline constexpr int64_t kErrLength = -100004;       // header says another payload length
inline constexpr int64_t kErrChecksum = -100005;     // payload checksum mismatch: corrupt bytes

}  // namespace pykvtier
