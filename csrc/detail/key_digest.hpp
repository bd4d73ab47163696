// The key digest: BLAKE2b with a 16-byte output (libb2), the digest that names a block's file and
// is stored in its header. Equal to Python's hashlib.blake2b(key, digest_size=16).digest().
#pragma once

#include <cstddef>
#include <cstdint>

#include "pykvtier/block_format.hpp"

namespace pykvtier::detail {

// Writes the kDigestBytes-byte digest of [data, data+len) to out. Thread-safe, no allocation.
void key_digest(const void* data, size_t len, uint8_t out[kDigestBytes]);

}  // namespace pykvtier::detail
