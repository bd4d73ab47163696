// (stub: libb2 implementation to come)
#include "key_digest.hpp"

#include <cstring>

namespace pykvtier::detail {

void key_digest(const void*, size_t, uint8_t out[kDigestBytes]) { std::memset(out, 0, kDigestBytes); }

}  // namespace pykvtier::detail
