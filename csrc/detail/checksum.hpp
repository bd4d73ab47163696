// Block payload checksum: XXH3-64 (xxHash), with the widest vector unit this CPU has.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pykvtier {

// XXH3-64 of [data, data+len). Picks the AVX2 build of xxHash at run time where the CPU
// has AVX2 (about 1.6x the SSE2 baseline), else the baseline. Same value either way.
uint64_t payload_xxh3(const void* data, size_t len);

// The vector unit payload_xxh3 uses: "avx2" or "sse2".
const char* payload_xxh3_impl();

}  // namespace pykvtier
