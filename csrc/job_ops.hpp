// What a job does (its Op) and the clock its times are taken on: shared by every engine
// (io_uring, gds) and by the bindings that parse and report jobs.
#pragma once

#include <time.h>

#include <cstdint>

namespace pykvtier {

enum class Op : uint8_t {
  Read,        // read [offset, offset+length) of path into addr
  Write,       // write addr into path at offset (in place, or tmp + rename when target set)
  ReadBlock,   // read a block file: header checked, payload (length bytes) into addr
  WriteBlock,  // write a block file to path (a temporary), then rename to target
  Unlink,      // remove path
};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::Read: return "read";
    case Op::Write: return "write";
    case Op::ReadBlock: return "read_block";
    case Op::WriteBlock: return "write_block";
    case Op::Unlink: return "unlink";
  }
  return "?";
}

// Stores, and unlinks (which share the stores' budget: loads have priority).
inline bool op_is_write(Op op) { return op == Op::Write || op == Op::WriteBlock || op == Op::Unlink; }

// CLOCK_MONOTONIC in seconds.
inline double monotonic_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

}  // namespace pykvtier
