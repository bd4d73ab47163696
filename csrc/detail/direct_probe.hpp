// Whether a directory's file system takes O_DIRECT, and with which alignment (DiskTier's start-up
// probe, pykvtier._native.probe_direct). No Python objects here.
#pragma once

#include <cstdint>
#include <string>

namespace pykvtier {

struct DirectProbe {
  bool direct = false;
  uint32_t mem_align = 4096;
  uint32_t offset_align = 4096;
  bool dioalign_from_statx = false;
  std::string reason;
};

// Probes whether dir's file system takes O_DIRECT, and its alignment (statx STATX_DIOALIGN
// where the kernel reports it, else 4096). Leaves no file (an O_TMPFILE; else a named file
// removed at once, a taken name skipped; use_tmpfile=false: the named one, for tests). On a
// full file system (ENOSPC, EDQUOT) answers from an O_DIRECT read of an existing file under
// dir, else direct=false with the reason. Throws std::system_error when no file can be
// created in dir for another reason.
DirectProbe probe_direct(const std::string& dir, bool use_tmpfile = true);

}  // namespace pykvtier
