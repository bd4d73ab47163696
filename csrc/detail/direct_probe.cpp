// O_DIRECT probe: see direct_probe.hpp.
#include "direct_probe.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <vector>

#include "safe_path.hpp"

namespace pykvtier {

namespace {

// statx STATX_DIOALIGN of fd into out, where the kernel reports it.
void dio_align(int fd, DirectProbe& out) {
#ifdef STATX_DIOALIGN
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
      stx.stx_dio_mem_align > 0) {
    out.mem_align = stx.stx_dio_mem_align;
    out.offset_align = stx.stx_dio_offset_align;
    out.dioalign_from_statx = true;
  }
#else
  (void)fd;
  (void)out;
#endif
}

bool no_room(int err) { return err == ENOSPC || err == EDQUOT; }

// One aligned O_DIRECT transfer of a unit at offset 0 of fd: 0 or errno (-1: short).
int direct_io_once(int fd, const DirectProbe& out, bool write) {
  void* buf = nullptr;
  const size_t unit = std::max<size_t>(4096, out.offset_align);
  if (posix_memalign(&buf, std::max<size_t>(4096, out.mem_align), unit) != 0) return ENOMEM;
  std::memset(buf, 0, unit);
  const ssize_t n = write ? ::pwrite(fd, buf, unit, 0) : ::pread(fd, buf, unit, 0);
  const int err = n < 0 ? errno : (n == ssize_t(unit) ? 0 : -1);
  free(buf);
  return err;
}

// Whether fd's file system enforces O_DIRECT alignment (out.alignment_*): one unit moved at file
// offset 1 from aligned memory, then (where the memory alignment is above 1) at offset 0 from
// memory 1 byte past it. Refused with EINVAL: enforced; moved (any count): not; anything else
// (another errno) leaves it unknown. Either refusal makes it enforced (the other is told).
void probe_alignment(int fd, DirectProbe& out, bool write) {
  const size_t align = std::max<size_t>(4096, out.mem_align);
  const size_t unit = std::max<size_t>(4096, out.offset_align);
  void* mem = nullptr;
  if (posix_memalign(&mem, align, unit + align) != 0) {
    out.alignment_probe = "not probed: no memory";
    return;
  }
  std::memset(mem, 0, unit + align);
  char* buf = static_cast<char*>(mem);
  const char* verb = write ? "write" : "read";
  struct Try {
    const char* what;
    char* buf;
    off_t off;
  };
  std::vector<Try> tries{{"at file offset 1", buf, 1}};
  if (out.mem_align > 1) tries.push_back({"from memory 1 byte past its alignment", buf + 1, 0});
  int refused = 0, taken = 0;
  std::string said;
  for (const Try& t : tries) {
    const ssize_t n = write ? ::pwrite(fd, t.buf, unit, t.off) : ::pread(fd, t.buf, unit, t.off);
    const int err = n < 0 ? errno : 0;
    if (!said.empty()) said += "; ";
    said += std::string("an O_DIRECT ") + verb + " of " + std::to_string(unit) + " B " + t.what + ": ";
    if (n >= 0) {
      ++taken;
      said += "taken (" + std::to_string(n) + " B)";
    } else {
      if (err == EINVAL) ++refused;
      said += std::string(err == EINVAL ? "refused, " : "") + std::strerror(err);
    }
  }
  free(mem);
  out.alignment_enforced = refused > 0 ? 1 : taken == int(tries.size()) ? 0 : -1;
  out.alignment_probe = said;
}

// A full file system: the probe cannot write, so it reads. The first regular file of at least
// one O_DIRECT unit under dir (dir itself, then its subdirectories: blocks/ab/*.kvb), reached
// without following links, is read with O_DIRECT. Returns true when that answered.
bool probe_by_reading(const std::string& dir, int full_err, DirectProbe& out) {
  const std::string why = std::string("the file system is full (") + std::strerror(full_err) + ")";
  std::vector<std::string> dirs{dir};
  size_t seen = 0;
  for (size_t di = 0; di < dirs.size() && seen < 100000; ++di) {
    const int dfd = open_no_links(dirs[di], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) continue;
    DIR* d = fdopendir(dfd);
    if (!d) {
      ::close(dfd);
      continue;
    }
    while (dirent* e = readdir(d)) {
      if (++seen >= 100000) break;
      if (e->d_name[0] == '.' && (e->d_name[1] == 0 || (e->d_name[1] == '.' && e->d_name[2] == 0)))
        continue;
      struct stat st;
      if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (S_ISDIR(st.st_mode)) {
        if (di == 0) dirs.push_back(dirs[di] + "/" + e->d_name);  // one level down
        continue;
      }
      if (!S_ISREG(st.st_mode) || st.st_size < off_t(std::max<uint32_t>(4096, out.offset_align))) continue;
      const int fd = ::openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      const std::string name = dirs[di] + "/" + e->d_name;
      if (fd < 0) {
        if (errno != EINVAL) continue;
        out.reason = why + "; open(O_DIRECT) of " + name + " failed: " + std::strerror(EINVAL);
        closedir(d);
        return true;
      }
      dio_align(fd, out);
      const int err = direct_io_once(fd, out, false);
      if (err == 0) probe_alignment(fd, out, false);
      ::close(fd);
      out.direct = err == 0;
      out.reason = err == 0 ? "ok (" + why + ": an aligned O_DIRECT read of " + name + ")"
                            : why + "; aligned O_DIRECT read of " + name + " failed: " +
                                  (err < 0 ? "short read" : std::strerror(err));
      closedir(d);
      return true;
    }
    closedir(d);
  }
  out.direct = false;
  out.reason = "cannot probe O_DIRECT: " + why + " and no file under " + dir + " to read";
  return false;
}

}  // namespace

DirectProbe probe_direct(const std::string& dir, bool use_tmpfile) {
  DirectProbe out;
  // The probe file: an O_TMPFILE, which has no name to leave behind. Where the file system has
  // none, a named file, removed the moment it is open; a name already taken (a leftover of a
  // crashed process of the same pid, in a restarted container) is skipped for the next.
  int fd = -1, err = 0;
  if (use_tmpfile) {
    fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) err = errno;
  }
  if (fd < 0 && (!use_tmpfile || err == EOPNOTSUPP || err == EISDIR || err == EINVAL)) {
    const std::string stem = dir + "/.pykvtier-direct-probe-" + std::to_string(getpid());
    for (unsigned i = 0; i < 64; ++i) {
      const std::string path = i == 0 ? stem : stem + "-" + std::to_string(i);
      fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd >= 0) {
        ::unlink(path.c_str());  // (if this fails the file is a leftover, swept at start-up)
        break;
      }
      err = errno;
      if (err != EEXIST) break;
    }
  }
  if (fd < 0) {
    if (no_room(err)) {
      probe_by_reading(dir, err, out);
      return out;
    }
    // Not an O_DIRECT question: e.g. the directory does not exist or is not writable.
    throw std::system_error(err, std::generic_category(), "cannot create a file in " + dir);
  }
  // O_DIRECT on the open file: refused (EINVAL) where the file system cannot take it.
  if (::fcntl(fd, F_SETFL, O_DIRECT) != 0) {
    out.reason = std::string("open(O_DIRECT) failed: ") + std::strerror(errno);
    ::close(fd);
    return out;
  }
  dio_align(fd, out);
  const int werr = direct_io_once(fd, out, true);
  if (werr == 0) probe_alignment(fd, out, true);
  ::close(fd);
  if (werr == 0) {
    out.direct = true;
    out.reason = "ok";
  } else if (werr > 0 && no_room(werr)) {
    probe_by_reading(dir, werr, out);
  } else {
    out.reason = std::string("aligned O_DIRECT write failed: ") + (werr < 0 ? "short write" : std::strerror(werr));
  }
  return out;
}

}  // namespace pykvtier
