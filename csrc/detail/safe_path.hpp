// Opening block files and their directories without following symbolic links, shared by the
// host engines (io_uring, posix) and the O_DIRECT probe. Header-only. No Python objects here.
//
// A block path is absolute and, at start-up, free of symlinks (Layout resolves the root with
// realpath). A link found anywhere in it later -- planted at a block's name or in place of a
// fan-out directory -- makes the open fail with ELOOP: never a read, write, rename or removal of
// whatever the link points to.
#pragma once

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace pykvtier {

// The resolve flags of every block-file open: no symlink, no /proc magic link, anywhere.
inline constexpr uint64_t kResolveNoLinks = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;

// Tests only: when set, openat2 is treated as missing (ENOSYS), so the component walk of
// open_no_links runs on this kernel too.
inline std::atomic<bool>& openat2_disabled_for_tests() {
  static std::atomic<bool> disabled{false};
  return disabled;
}

inline int sys_openat2(int dfd, const char* path, uint64_t flags, uint64_t mode, uint64_t resolve) {
  if (openat2_disabled_for_tests().load(std::memory_order_relaxed)) {
    errno = ENOSYS;
    return -1;
  }
  open_how how{};
  how.flags = flags;
  how.mode = (flags & (O_CREAT | __O_TMPFILE)) ? mode : 0;  // openat2 refuses a mode otherwise
  how.resolve = resolve;
  int fd;
  do {
    fd = int(syscall(SYS_openat2, dfd, path, &how, sizeof(how)));
  } while (fd < 0 && errno == EINTR);
  return fd;
}

inline std::string dir_of(const std::string& path) {
  const size_t i = path.rfind('/');
  if (i == std::string::npos) return ".";
  return i == 0 ? std::string("/") : path.substr(0, i);
}

inline std::string base_of(const std::string& path) {
  const size_t i = path.rfind('/');
  return i == std::string::npos ? path : path.substr(i + 1);
}

namespace detail {

// ELOOP for a symlink at name in dfd, else err (an O_DIRECTORY|O_NOFOLLOW open of a symlink
// fails ENOTDIR, not ELOOP).
inline int link_errno(int dfd, const char* name, int err) {
  struct stat st;
  if ((err == ENOTDIR || err == ELOOP) && ::fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      S_ISLNK(st.st_mode))
    return ELOOP;
  return err;
}

// The component walk for kernels without openat2 (< 5.6): each directory of path opened with
// openat(O_PATH | O_DIRECTORY | O_NOFOLLOW) from the one before, the last component opened
// with O_NOFOLLOW. Returns the descriptor or -1 with errno.
inline int open_walk(const std::string& path, int flags, mode_t mode) {
  int cur = ::open(path.size() && path[0] == '/' ? "/" : ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (cur < 0) return -1;
  size_t pos = 0;
  std::string comp;
  for (;;) {
    while (pos < path.size() && path[pos] == '/') ++pos;
    const size_t end = path.find('/', pos);
    comp = path.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    size_t after = end == std::string::npos ? path.size() : end;
    while (after < path.size() && path[after] == '/') ++after;
    const bool last = after >= path.size();
    if (comp.empty()) comp = ".";  // the path was "/" or ended in '/'
    int fd;
    if (last) {
      fd = ::openat(cur, comp.c_str(), flags | O_NOFOLLOW, mode);
    } else {
      fd = ::openat(cur, comp.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
      const int e = link_errno(cur, comp.c_str(), errno);
      ::close(cur);
      errno = e;
      return -1;
    }
    ::close(cur);
    if (last) return fd;
    cur = fd;
    pos = after;
  }
}

}  // namespace detail

// open(2) of path (flags, mode as open's) that follows no symbolic link anywhere in it:
// openat2 with RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS; where the kernel has no openat2
// (ENOSYS, remembered) or a seccomp profile refuses it (EPERM: older container runtimes), the
// component walk, equally link-free. A link: -1, errno ELOOP (with O_PATH | O_NOFOLLOW a link
// as the last component is opened itself, as open(2) does). Else -1 with open's errno.
inline int open_no_links(const std::string& path, int flags, mode_t mode = 0) {
  static std::atomic<bool> no_openat2{false};
  if (!no_openat2.load(std::memory_order_relaxed)) {
    const int fd = sys_openat2(AT_FDCWD, path.c_str(), uint64_t(flags), mode, kResolveNoLinks);
    if (fd >= 0 || (errno != ENOSYS && errno != EPERM)) return fd;
    if (errno == ENOSYS && !openat2_disabled_for_tests().load()) no_openat2 = true;
  }
  return detail::open_walk(path, flags, mode);
}

// A directory descriptor for the *at() calls on the entry `path` names: path's directory
// opened with open_no_links (O_PATH) when no_links, else AT_FDCWD and the whole path.
class ParentDir {
 public:
  ParentDir() = default;
  ParentDir(const ParentDir&) = delete;
  ParentDir& operator=(const ParentDir&) = delete;
  ~ParentDir() { reset(); }

  // Returns 0 or -errno (ELOOP: a link in the directory's path).
  int open(const std::string& path, bool no_links) {
    reset();
    if (!no_links) {
      fd_ = AT_FDCWD;
      name_ = path;
      return 0;
    }
    name_ = base_of(path);
    fd_ = open_no_links(dir_of(path), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd_ < 0) {
      const int e = errno;
      fd_ = -1;
      return -e;
    }
    own_ = true;
    return 0;
  }
  int fd() const { return fd_; }
  const char* name() const { return name_.c_str(); }
  void reset() {
    if (own_ && fd_ >= 0) ::close(fd_);
    own_ = false;
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool own_ = false;
  std::string name_;
};

// The process umask, from /proc/self/status (reading it with umask(2) would change it for
// every thread meanwhile). 0777 when unknown: then every created file's mode is set after
// creation.
inline mode_t current_umask() {
  FILE* f = std::fopen("/proc/self/status", "re");
  if (!f) return 0777;
  char line[256];
  mode_t out = 0777;
  while (std::fgets(line, sizeof(line), f)) {
    unsigned v;
    if (std::sscanf(line, "Umask: %o", &v) == 1) {
      out = mode_t(v);
      break;
    }
  }
  std::fclose(f);
  return out;
}

// Whether a file created with file_mode must have its mode set after creation to have exactly
// file_mode: always when it has group or other bits (no umask assumed, any may take them),
// else when the process umask read once (the first call: reading it costs tens of
// microseconds) takes owner bits.
inline bool mode_needs_fix(uint32_t file_mode) {
  static const mode_t first_umask = current_umask();
  return (file_mode & 0077u) != 0 || (file_mode & first_umask) != 0;
}

}  // namespace pykvtier
