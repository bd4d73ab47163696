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
  // Whether the file system refuses unaligned O_DIRECT transfers (EINVAL), as a file system
  // that hands O_DIRECT to the block layer does: 1 refused, 0 taken, -1 unknown (no O_DIRECT,
  // or an answer that is neither). Taken means O_DIRECT there is not the block layer's direct
  // path: FUSE, tmpfs and NFS take any alignment (through the FUSE daemon, the page cache, the
  // server); btrfs takes an unaligned transfer by falling back to buffered I/O for it alone.
  int alignment_enforced = -1;
  std::string alignment_probe;  // what was tried, and what each answered
};

// Probes whether dir's file system takes O_DIRECT, and its alignment (statx STATX_DIOALIGN
// where the kernel reports it, else 4096), then whether it enforces alignment: an O_DIRECT
// transfer of one unit at file offset 1 from aligned memory, and one at offset 0 from memory
// 1 byte past the alignment (that one only where the memory alignment is above 1). Leaves no
// file (an O_TMPFILE; else a named file removed at once, a taken name skipped;
// use_tmpfile=false: the named one, for tests). On a full file system (ENOSPC, EDQUOT) answers
// from O_DIRECT reads of an existing file under dir, else direct=false with the reason. Throws
// std::system_error when no file can be created in dir for another reason.
DirectProbe probe_direct(const std::string& dir, bool use_tmpfile = true);

}  // namespace pykvtier
