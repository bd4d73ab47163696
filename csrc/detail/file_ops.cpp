// detail/file_ops.hpp.
#include "file_ops.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "checksum.hpp"
#include "safe_path.hpp"

namespace pykvtier::detail {

int64_t io_full(bool write, int fd, const iovec* iov0, int cnt0, uint64_t offset, uint64_t total,
                uint64_t unit) {
  uint64_t done = 0;
  while (done < total) {
    const uint64_t pos = done - done % unit;
    iovec iov[2];
    int cnt = 0;
    uint64_t skip = pos;
    for (int i = 0; i < cnt0; ++i) {
      if (skip >= iov0[i].iov_len) {
        skip -= iov0[i].iov_len;
        continue;
      }
      iov[cnt++] = {static_cast<char*>(iov0[i].iov_base) + skip, iov0[i].iov_len - skip};
      skip = 0;
    }
    const off_t at = off_t(offset + pos);
    const ssize_t n = write ? ::pwritev(fd, iov, cnt, at) : ::preadv(fd, iov, cnt, at);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (pos + uint64_t(n) <= done) break;  // nothing new: the end of the file (or no room)
    done = pos + uint64_t(n);
  }
  return int64_t(done);
}

int link_into_place(int ffd, const char* from, int tfd, const char* to) {
  return ::linkat(ffd, from, tfd, to, 0) == 0 ? 0 : -errno;
}

int rename_into_place(int ffd, const char* from, int tfd, const char* to, bool* from_left) {
  if (::renameat2(ffd, from, tfd, to, RENAME_NOREPLACE) == 0) {
    *from_left = false;
    return 0;
  }
  const int e = errno;
  *from_left = true;
  return noreplace_unsupported(e) ? link_into_place(ffd, from, tfd, to) : -e;
}

bool reusable_victim(mode_t mode, uint64_t nlink, uint64_t size, uint64_t length) {
  return S_ISREG(mode) && nlink == 1 && size <= kHeaderBytes + length;
}

int set_mode(const std::string& path, bool no_links, uint32_t mode) {
  const int flags = O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC;
  const int fd = no_links ? open_no_links(path, flags) : ::open(path.c_str(), flags);
  if (fd < 0) return -errno;
  const int rc = ::fchmod(fd, mode_t(mode)) == 0 ? 0 : -errno;
  ::close(fd);
  return rc;
}

int open_dir_for_sync(const std::string& dir, bool no_links) {
  const int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
  const int fd = no_links ? open_no_links(dir, flags) : ::open(dir.c_str(), flags);
  return fd < 0 ? -errno : fd;
}

std::vector<std::string> renamed_dirs(const Job& job) {
  std::vector<std::string> out;
  if (!job.fsync || !op_is_write(job.op) || job.op == Op::Unlink) return out;
  std::unordered_set<std::string> seen;
  for (const auto& r : job.reqs) {
    if (r.result < 0 || r.target.empty()) continue;
    std::string d = dir_of(r.target);
    if (seen.insert(d).second) out.push_back(std::move(d));
  }
  return out;
}

void apply_dir_errors(Job& job, const std::vector<std::string>& dirs, const std::vector<int>& err, Stats& stats) {
  std::unordered_map<std::string, int> failed;
  for (size_t i = 0; i < dirs.size(); ++i)
    if (err[i] < 0) failed.emplace(dirs[i], err[i]);
  if (failed.empty()) return;
  for (auto& r : job.reqs) {
    if (r.result < 0 || r.target.empty()) continue;
    auto it = failed.find(dir_of(r.target));
    if (it == failed.end()) continue;
    stats.bytes_written -= r.length;
    stats.requests_ok--;
    stats.requests_failed++;
    r.result = it->second;
  }
}

void sync_renamed_dirs(Job& job, Stats& stats) {
  const std::vector<std::string> dirs = renamed_dirs(job);
  std::vector<int> err(dirs.size(), 0);
  for (size_t i = 0; i < dirs.size(); ++i) {
    const int fd = open_dir_for_sync(dirs[i], op_is_block(job.op));
    if (fd < 0) {
      err[i] = fd;
      continue;
    }
    stats.dir_fsyncs++;
    if (::fsync(fd) != 0) err[i] = -errno;
    ::close(fd);
  }
  apply_dir_errors(job, dirs, err, stats);
}

void fill_header(char* hdr, const Job& job, const Request& r) {
  if (job.verify == Verify::Header) {
    fill_block_header(hdr, r.digest, r.length, 0, kFlagNoPayloadChecksum);
    return;
  }
  fill_block_header(hdr, r.digest, r.length, payload_xxh3(reinterpret_cast<const void*>(r.addr), r.length));
}

int64_t verify_block(const char* hdr, const Job& job, const Request& r, Stats& stats) {
  ParsedHeader h;
  if (int64_t e = check_block_header(hdr, r.digest, r.length, &h)) return e;
  if (job.verify == Verify::Header) return 0;
  if (!h.payload_checksum()) {
    stats.loads_unchecked_payload++;
    return 0;
  }
  if (h.payload_xxh3 != payload_xxh3(reinterpret_cast<const void*>(r.addr), r.length)) return kErrChecksum;
  return 0;
}

std::string result_text(int64_t result) {
  if (result >= 0) return "ok (" + std::to_string(result) + " bytes)";
  switch (result) {
    case kErrShort: return "block file is truncated (short read)";
    case kErrBadHeader: return "block header is corrupt (magic, version or header checksum)";
    case kErrKeyMismatch: return "block file belongs to another key";
    case kErrLength: return "block file has another payload length";
    case kErrChecksum: return "payload checksum mismatch (corrupt bytes)";
    default: break;
  }
  if (result < -4095) return "unknown result " + std::to_string(result);
  const int e = int(-result);
  const char* name = strerrorname_np(e);
  return std::string(name ? name : "E?") + ": " + std::strerror(e);
}

}  // namespace pykvtier::detail
