// io_uring capability probe for `pykvtier doctor` (see uring_probe.cpp).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace pykvtier {

struct ProbeCheck {
  std::string name;
  bool ok;
  std::string detail;
};

struct UringProbe {
  bool available = false;
  std::string error;  // why io_uring_setup failed
  std::vector<std::pair<std::string, bool>> setup_flags;
  std::vector<std::string> features;
  std::vector<std::pair<std::string, bool>> ops;
  std::vector<ProbeCheck> checks;  // operations really run (in dir where given)
};

// Never throws; dir may be empty (no file operations are tried then).
UringProbe probe_uring(const std::string& dir);

}  // namespace pykvtier
