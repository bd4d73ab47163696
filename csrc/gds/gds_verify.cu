// XXH3-64 of device buffers on the GPU (see gds/gds_verify.hpp and detail/xxh3_lanes.hpp).
//
// One CUDA block per buffer, 256 threads. Warps 1..7 stage the buffer through shared memory in
// 16 KiB chunks (16 XXH3 blocks), double-buffered, with 16-byte loads; threads 0..7 of warp 0 are
// the 8 XXH3 lanes and run the accumulate/scramble loop over the staged chunk while the next one
// loads. The tail (the last partial XXH3 block and the last stripe, < 1088 bytes) is read straight
// from global memory, then the lanes' accumulators are merged by lane 0. The arithmetic and the
// chunk schedule are xxh3_lanes.hpp's, which the host runs too (hash_long_lanes, tested on the CPU
// against xxhash); what is only here is the staging copy, the barriers and the shuffle.
#include <cuda_runtime.h>

#include "gds/gds_verify.hpp"
#include "detail/xxh3_lanes.hpp"

namespace pykvtier::gds {

namespace {

using namespace pykvtier::xxh3;

constexpr unsigned kThreads = 256;
constexpr unsigned kLoaders = kThreads - 32;
static_assert(kChunkBytes % sizeof(uint4) == 0 && kBlock % sizeof(uint4) == 0);
static_assert(2 * kChunkBytes <= 48 * 1024, "static shared memory is limited to 48 KiB");

__constant__ __align__(16) uint8_t c_secret[kSecretSize] = PYKV_XXH3_SECRET_BYTES;

// The loaders' share of copying nbytes (a multiple of 16) from src (16-byte aligned) to dst.
__device__ __forceinline__ void load_chunk(uint8_t* dst, const uint8_t* src, size_t nbytes, unsigned loader) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const size_t nvec = nbytes / sizeof(uint4);
  for (size_t i = loader; i < nvec; i += kLoaders) d[i] = s[i];
}

__global__ void __launch_bounds__(kThreads) xxh3_long_kernel(const HashTask* tasks, uint64_t* out) {
  __shared__ __align__(16) uint8_t buf[2][kChunkBytes];
  const HashTask t = tasks[blockIdx.x];
  const unsigned tid = threadIdx.x;
  const size_t len = t.len;
  const size_t nchunks = chunk_count(len);

  uint64_t acc = 0;
  LaneKeys keys{};
  if (tid < 8) {
    acc = init_acc(tid);
    lane_keys(tid, c_secret, keys);
  }
  if (nchunks > 0 && tid >= 32) load_chunk(buf[0], t.ptr, chunk_blocks(len, 0) * kBlock, tid - 32);
  __syncthreads();
  for (size_t c = 0; c < nchunks; ++c) {
    // Loaders fill the other buffer with chunk c + 1 (its last readers finished before the
    // barrier that ended step c - 1) while the lanes read chunk c.
    if (tid >= 32 && c + 1 < nchunks)
      load_chunk(buf[(c + 1) & 1], t.ptr + (c + 1) * kChunkBytes, chunk_blocks(len, c + 1) * kBlock, tid - 32);
    if (tid < 8)
      acc = lane_staged_blocks(acc, tid, reinterpret_cast<const uint64_t*>(buf[c & 1]), chunk_blocks(len, c), keys);
    __syncthreads();
  }
  if (tid < 8) {
    acc = lane_tail(acc, tid, t.ptr, len, c_secret);
    uint64_t all[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) all[i] = __shfl_sync(0xFFu, acc, i);
    if (tid == 0) out[blockIdx.x] = merge(all, c_secret, len);
  }
}

}  // namespace

int launch_xxh3_long(const HashTask* tasks, uint64_t* out, unsigned n, void* stream) {
  if (n == 0) return 0;
  xxh3_long_kernel<<<n, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(tasks, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pykvtier::gds
