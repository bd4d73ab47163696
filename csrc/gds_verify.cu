// XXH3-64 of device buffers on the GPU (see gds_verify.hpp and xxh3_lanes.hpp).
//
// One CUDA block per buffer, 256 threads. Warps 1..7 stage the buffer through shared memory in
// 16 KiB chunks (16 XXH3 blocks), double-buffered, with 16-byte loads; threads 0..7 of warp 0 are
// the 8 XXH3 lanes and run the accumulate/scramble loop over the staged chunk while the next one
// loads. The tail (the last partial XXH3 block and the last stripe, < 1088 bytes) is read straight
// from global memory, then the lanes' accumulators are merged by lane 0.
#include <cuda_runtime.h>

#include "gds_verify.hpp"
#include "xxh3_lanes.hpp"

namespace pykvtier::gds {

namespace {

using namespace pykvtier::xxh3;

constexpr unsigned kThreads = 256;
constexpr unsigned kLoaders = kThreads - 32;
constexpr size_t kChunkBlocks = 16;
constexpr size_t kChunkBytes = kChunkBlocks * kBlock;

__constant__ __align__(16) uint8_t c_secret[kSecretSize] = PYKV_XXH3_SECRET_BYTES;

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
  const size_t nblk = full_blocks(t.len);
  const size_t nchunks = (nblk + kChunkBlocks - 1) / kChunkBlocks;

  uint64_t acc = 0, keys[kStripesPerBlock], scramble_key = 0;
  if (tid < 8) {
    acc = init_acc(tid);
    const uint64_t* sec = reinterpret_cast<const uint64_t*>(c_secret);
#pragma unroll
    for (size_t s = 0; s < kStripesPerBlock; ++s) keys[s] = sec[s + tid];
    scramble_key = sec[(kSecretSize - kStripe) / 8 + tid];
  }
  auto chunk_blocks = [&](size_t c) {
    const size_t first = c * kChunkBlocks;
    return nblk - first < kChunkBlocks ? nblk - first : kChunkBlocks;
  };
  if (nchunks > 0 && tid >= 32) load_chunk(buf[0], t.ptr, chunk_blocks(0) * kBlock, tid - 32);
  __syncthreads();
  for (size_t c = 0; c < nchunks; ++c) {
    if (tid >= 32 && c + 1 < nchunks)
      load_chunk(buf[(c + 1) & 1], t.ptr + (c + 1) * kChunkBytes, chunk_blocks(c + 1) * kBlock, tid - 32);
    if (tid < 8) {
      const uint64_t* words = reinterpret_cast<const uint64_t*>(buf[c & 1]);
      const size_t nb = chunk_blocks(c);
      for (size_t b = 0; b < nb; ++b) {
#pragma unroll
        for (size_t s = 0; s < kStripesPerBlock; ++s) {
          const size_t w = (b * kBlock + s * kStripe) / 8;
          acc = accumulate(acc, words[w + tid], words[w + (tid ^ 1)], keys[s]);
        }
        acc = scramble(acc, scramble_key);
      }
    }
    __syncthreads();
  }
  if (tid < 8) {
    acc = lane_tail(acc, tid, t.ptr, t.len, c_secret);
    uint64_t all[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) all[i] = __shfl_sync(0xFFu, acc, i);
    if (tid == 0) out[blockIdx.x] = merge(all, c_secret, t.len);
  }
}

}  // namespace

int launch_xxh3_long(const HashTask* tasks, uint64_t* out, unsigned n, void* stream) {
  if (n == 0) return 0;
  xxh3_long_kernel<<<n, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(tasks, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pykvtier::gds
