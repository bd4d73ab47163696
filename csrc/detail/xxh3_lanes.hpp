// XXH3-64 (seed 0, default secret) of inputs longer than 240 bytes, written as eight independent
// 64-bit lanes so that a GPU can run it with one thread per lane (csrc/gds_verify.cu). The kernel's
// schedule (whole XXH3 blocks staged in 16 KiB chunks and read there as 64-bit words, the tail
// read from the input itself) is written here once, as __host__ __device__ functions, and run on
// the host by hash_long_lanes(): _native._xxh3_lanes, which tests/test_gpu_dispatch.py compares
// with xxhash's XXH3_64bits over lengths that cross every chunk and tail boundary. So only the
// kernel's staging copy, its barriers and its lane shuffle are left to the GPU tests.
//
// XXH3's long-input loop keeps 8 accumulators. A stripe is 64 input bytes: word w (8 bytes,
// little-endian) of a stripe adds itself to accumulator w^1 and the 32x32->64 product of its two
// halves (after xor with the secret) to accumulator w. After every 16 stripes (a 1024-byte
// "XXH3 block") each accumulator is scrambled. So lane w needs the words w and w^1 of each stripe
// and nothing of the other lanes until the final merge: the lanes run in parallel, the blocks in
// sequence. Only payloads > 240 bytes take this path (shorter ones use other XXH3 formulas).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PYKV_HD __host__ __device__ __forceinline__
#else
#define PYKV_HD inline
#endif
#if defined(__CUDA_ARCH__)  // (the device pass of nvcc; host compilers would warn)
#define PYKV_UNROLL _Pragma("unroll")
#else
#define PYKV_UNROLL
#endif

// Staged chunks are read as native 64-bit words: little-endian, as on x86-64, aarch64 and GPUs.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "xxh3_lanes.hpp reads staged input as little-endian 64-bit words"
#endif

namespace pykvtier::xxh3 {

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1ull;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77ull;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3Dull;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;

inline constexpr size_t kStripe = 64;
inline constexpr size_t kSecretSize = 192;
inline constexpr size_t kStripesPerBlock = (kSecretSize - kStripe) / 8;  // 16
inline constexpr size_t kBlock = kStripe * kStripesPerBlock;            // 1024
inline constexpr size_t kLastAccStart = 7;
inline constexpr size_t kMergeAccsStart = 11;
inline constexpr size_t kMinLength = 241;  // shorter inputs use other XXH3 formulas

// XXH3_kSecret (xxhash.h), the default 192-byte secret.
#define PYKV_XXH3_SECRET_BYTES                                                                   \
  {0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, \
   0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, \
   0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, \
   0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, \
   0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, \
   0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, \
   0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, \
   0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, \
   0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, \
   0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, \
   0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, \
   0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e}

// Little-endian 64-bit read from any address (byte by byte: alignment-free on host and device).
PYKV_HD uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

PYKV_HD uint64_t init_acc(unsigned lane) {
  switch (lane) {
    case 0: return kPrime32_3;
    case 1: return kPrime64_1;
    case 2: return kPrime64_2;
    case 3: return kPrime64_3;
    case 4: return kPrime64_4;
    case 5: return kPrime32_2;
    case 6: return kPrime64_5;
    default: return kPrime32_1;
  }
}

// One stripe for one lane: `own` is the stripe's word `lane`, `pair` its word `lane ^ 1`,
// `key` the secret's word at the stripe's secret offset + 8 * lane.
PYKV_HD uint64_t accumulate(uint64_t acc, uint64_t own, uint64_t pair, uint64_t key) {
  const uint64_t k = own ^ key;
  return acc + pair + (k & 0xFFFFFFFFull) * (k >> 32);
}

PYKV_HD uint64_t scramble(uint64_t acc, uint64_t key) {
  acc ^= acc >> 47;
  acc ^= key;
  return acc * kPrime32_1;
}

PYKV_HD uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

PYKV_HD uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  h ^= h >> 32;
  return h;
}

// Final merge of the 8 lanes' accumulators into the hash.
PYKV_HD uint64_t merge(const uint64_t acc[8], const uint8_t* secret, uint64_t len) {
  uint64_t r = len * kPrime64_1;
  const uint8_t* s = secret + kMergeAccsStart;
  for (int i = 0; i < 4; ++i)
    r += mul128_fold64(acc[2 * i] ^ read_le64(s + 16 * i), acc[2 * i + 1] ^ read_le64(s + 16 * i + 8));
  return avalanche(r);
}

// Number of whole XXH3 blocks that are followed by a scramble, and the stripes of the last
// partial block (before the special last stripe), for an input of len > 240 bytes.
PYKV_HD size_t full_blocks(size_t len) { return (len - 1) / kBlock; }
PYKV_HD size_t tail_stripes(size_t len) { return ((len - 1) - kBlock * full_blocks(len)) / kStripe; }

// --- The device kernel's schedule -------------------------------------------------------------
// The whole blocks are staged (copied) kChunkBlocks at a time into an aligned buffer (the kernel's
// shared memory) and read there as 64-bit words; chunk c holds blocks [16c, 16c + chunk_blocks).
inline constexpr size_t kChunkBlocks = 16;
inline constexpr size_t kChunkBytes = kChunkBlocks * kBlock;  // 16 KiB

PYKV_HD size_t chunk_count(size_t len) { return (full_blocks(len) + kChunkBlocks - 1) / kChunkBlocks; }
PYKV_HD size_t chunk_blocks(size_t len, size_t c) {
  const size_t left = full_blocks(len) - c * kChunkBlocks;
  return left < kChunkBlocks ? left : kChunkBlocks;
}

// The secret words one lane uses for every whole block: one per stripe, and the scramble key.
struct LaneKeys {
  uint64_t stripe[kStripesPerBlock];
  uint64_t scramble;
};

PYKV_HD void lane_keys(unsigned lane, const uint8_t* secret, LaneKeys& k) {
  PYKV_UNROLL
  for (size_t s = 0; s < kStripesPerBlock; ++s) k.stripe[s] = read_le64(secret + s * 8 + 8 * lane);
  k.scramble = read_le64(secret + kSecretSize - kStripe + 8 * lane);
}

// One lane over nb whole blocks staged as 64-bit words (each block followed by a scramble).
PYKV_HD uint64_t lane_staged_blocks(uint64_t acc, unsigned lane, const uint64_t* words, size_t nb,
                                    const LaneKeys& k) {
  constexpr size_t kWordsPerStripe = kStripe / 8, kWordsPerBlock = kBlock / 8;
  for (size_t b = 0; b < nb; ++b) {
    const uint64_t* blk = words + b * kWordsPerBlock;
    PYKV_UNROLL
    for (size_t s = 0; s < kStripesPerBlock; ++s)
      acc = accumulate(acc, blk[s * kWordsPerStripe + lane], blk[s * kWordsPerStripe + (lane ^ 1)], k.stripe[s]);
    acc = scramble(acc, k.scramble);
  }
  return acc;
}

// The tail of one lane: the last partial block's stripes and the last stripe.
PYKV_HD uint64_t lane_tail(uint64_t acc, unsigned lane, const uint8_t* in, size_t len,
                           const uint8_t* secret) {
  const uint8_t* blk = in + full_blocks(len) * kBlock;
  const size_t n = tail_stripes(len);
  for (size_t s = 0; s < n; ++s)
    acc = accumulate(acc, read_le64(blk + s * kStripe + 8 * lane),
                     read_le64(blk + s * kStripe + 8 * (lane ^ 1)), read_le64(secret + s * 8 + 8 * lane));
  const uint8_t* last = in + len - kStripe;
  const uint8_t* key = secret + kSecretSize - kStripe - kLastAccStart;
  return accumulate(acc, read_le64(last + 8 * lane), read_le64(last + 8 * (lane ^ 1)),
                    read_le64(key + 8 * lane));
}

// Host reference: the whole hash on one thread, on the kernel's schedule (chunks staged as the
// kernel's loaders do, then each lane over them, then the tails and the merge). len >= kMinLength.
inline uint64_t hash_long_lanes(const uint8_t* in, size_t len) {
  static const uint8_t secret[kSecretSize] = PYKV_XXH3_SECRET_BYTES;
  alignas(16) uint64_t stage[kChunkBytes / 8];
  uint64_t acc[8];
  LaneKeys keys[8];
  for (unsigned lane = 0; lane < 8; ++lane) {
    acc[lane] = init_acc(lane);
    lane_keys(lane, secret, keys[lane]);
  }
  for (size_t c = 0, n = chunk_count(len); c < n; ++c) {
    const size_t nb = chunk_blocks(len, c);
    std::memcpy(stage, in + c * kChunkBytes, nb * kBlock);
    for (unsigned lane = 0; lane < 8; ++lane) acc[lane] = lane_staged_blocks(acc[lane], lane, stage, nb, keys[lane]);
  }
  for (unsigned lane = 0; lane < 8; ++lane) acc[lane] = lane_tail(acc[lane], lane, in, len, secret);
  return merge(acc, secret, len);
}

}  // namespace pykvtier::xxh3
