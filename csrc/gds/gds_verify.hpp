// Device-side payload checksums for the gds engine: XXH3-64 of many device buffers in one kernel
// launch (gds/gds_verify.cu, built when CMake has a CUDA compiler: PYKVTIER_DEVICE_VERIFY=1).
#pragma once

#include <cstdint>

namespace pykvtier::gds {

struct HashTask {
  const uint8_t* ptr;  // device address, 16-byte aligned
  uint64_t len;        // > 240 bytes (xxh3::kMinLength)
};

// Hashes tasks[i] into out[i] (both device arrays of n entries) on `stream` (a cudaStream_t).
// Returns the cudaError_t of the launch (0: launched; completion is the stream's).
int launch_xxh3_long(const HashTask* tasks, uint64_t* out, unsigned n, void* stream);

}  // namespace pykvtier::gds
