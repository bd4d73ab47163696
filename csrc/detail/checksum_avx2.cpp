// xxHash's XXH3 compiled for AVX2 (this file alone is built with -mavx2; called only where
// the CPU has AVX2, see checksum.cpp).
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace pykvtier {

uint64_t payload_xxh3_avx2(const void* data, size_t len) { return XXH3_64bits(data, len); }

}  // namespace pykvtier
