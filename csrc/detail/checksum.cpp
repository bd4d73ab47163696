// Baseline XXH3 and the run-time choice; the AVX2 build is in checksum_avx2.cpp.
#include "checksum.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace pykvtier {

#if defined(__x86_64__) && defined(PYKVTIER_HAVE_AVX2_TU)
uint64_t payload_xxh3_avx2(const void* data, size_t len);
static const bool kUseAvx2 = __builtin_cpu_supports("avx2");
#else
static const bool kUseAvx2 = false;
#endif

uint64_t payload_xxh3(const void* data, size_t len) {
#if defined(__x86_64__) && defined(PYKVTIER_HAVE_AVX2_TU)
  if (kUseAvx2) return payload_xxh3_avx2(data, len);
#endif
  return XXH3_64bits(data, len);
}

const char* payload_xxh3_impl() { return kUseAvx2 ? "avx2" : "sse2"; }

}  // namespace pykvtier
