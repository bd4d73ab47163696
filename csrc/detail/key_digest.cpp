// The key digest through libb2: unkeyed BLAKE2b with a kDigestBytes-byte output.
#include "key_digest.hpp"

#include <blake2.h>

namespace pykvtier::detail {

static_assert(kDigestBytes >= 1 && kDigestBytes <= BLAKE2B_OUTBYTES);

void key_digest(const void* data, size_t len, uint8_t out[kDigestBytes]) {
  // libb2 refuses only a null out, a null data with len > 0, or an output length outside
  // 1..BLAKE2B_OUTBYTES: none is open to a caller of this function's contract.
  blake2b(out, data, nullptr, kDigestBytes, len, 0);
}

}  // namespace pykvtier::detail
