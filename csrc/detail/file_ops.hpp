// File semantics every engine shares, written once: the full-I/O loop, rename into place with its
// one fallback, how temporaries are opened, the recycle victim check, the directory fsyncs of a
// durable job, block headers of a job's requests, and the text of a result. No Python objects.
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pykvtier/job.hpp"

namespace pykvtier::detail {

// The open flags of a store's temporary in every engine: always a new file (O_EXCL: never one a
// crashed writer or another process left at that name), never through a symlink.
inline constexpr int kTemporaryOpenFlags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW;

// preadv/pwritev of total bytes (iov0: cnt0 buffers, at most 2) at file offset offset until all
// are moved, EOF or an error, retrying EINTR. After a short transfer the next one starts where the
// last ended, rounded down to unit bytes (O_DIRECT: its alignment; else 1). Returns the bytes
// moved or -errno.
int64_t io_full(bool write, int fd, const iovec* iov0, int cnt0, uint64_t offset, uint64_t total,
                uint64_t unit);

// The O_DIRECT unit of a job's transfers: max(4096, job.align) where direct, else 1.
inline uint64_t io_unit(const Job& job) { return job.direct ? (job.align > 4096 ? job.align : 4096) : 1; }

// Whether a file system refused RENAME_NOREPLACE itself (not the rename): then link + unlink.
inline bool noreplace_unsupported(int err) { return err == EINVAL || err == ENOSYS; }

// The fallback of rename into place where RENAME_NOREPLACE is unsupported: a hard link of
// (ffd, from) at (tfd, to), which never replaces a file there either. 0 or -errno (-EEXIST: a
// file is there). from stays: the caller removes it.
int link_into_place(int ffd, const char* from, int tfd, const char* to);

// Moves (ffd, from) to (tfd, to) without replacing a file there: renameat2(RENAME_NOREPLACE), or
// link_into_place where the file system has no RENAME_NOREPLACE. Returns 0 or -errno (-EEXIST: a
// file is at to, kept). *from_left: from still exists (after any failure, or the link fallback):
// the caller removes it.
int rename_into_place(int ffd, const char* from, int tfd, const char* to, bool* from_left);

// Whether an evicted file may be overwritten by a store of length payload bytes: a regular file
// of one link, no longer than a block (anything else is put back and removed after the store).
bool reusable_victim(mode_t mode, uint64_t nlink, uint64_t size, uint64_t length);

// Sets path's permission bits to mode without following a link (opened, then fchmod); block
// paths (no_links) are opened with open_no_links. 0 or -errno.
int set_mode(const std::string& path, bool no_links, uint32_t mode);

// Opens directory dir for fsync (open_no_links where no_links). A descriptor or -errno.
int open_dir_for_sync(const std::string& dir, bool no_links);

// Distinct directories of the rename targets of job's requests that succeeded (result >= 0), in
// first-seen order: what an fsync=True store job fsyncs before it is reported.
std::vector<std::string> renamed_dirs(const Job& job);
// After the directory fsyncs: the requests renamed into dirs[i] whose fsync failed (err[i] < 0)
// fail with that error (their rename is not durable). Counters adjusted.
void apply_dir_errors(Job& job, const std::vector<std::string>& dirs, const std::vector<int>& err, Stats& stats);
// The directory fsyncs of an fsync=True store job, for engines that sync with plain system calls
// (posix, gds): each of renamed_dirs(job) opened (open_dir_for_sync, no links for block ops) and
// fsync'ed once (stats.dir_fsyncs), then apply_dir_errors.
void sync_renamed_dirs(Job& job, Stats& stats);

// Fills hdr (kHeaderBytes) with the header of the block r writes (r.length payload bytes at host
// address r.addr, key r.digest): with its payload XXH3 (job.verify Payload), or version 2 flagged
// kFlagNoPayloadChecksum (Header).
void fill_header(char* hdr, const Job& job, const Request& r);
// Checks hdr (kHeaderBytes read from a block file) and the payload read to host address r.addr:
// 0 if the block is whole and r's key, else a BlockError code. The payload is checked when
// job.verify is Payload and the header has a payload checksum; a block stored without one is
// loaded on its header checks and counted in stats.loads_unchecked_payload.
int64_t verify_block(const char* hdr, const Job& job, const Request& r, Stats& stats);

// A request result as text: "ok (N bytes)", an errno's name and message, or what a BlockError means.
std::string result_text(int64_t result);

}  // namespace pykvtier::detail
