// The io_uring engine: batched block I/O, one ring per worker thread.
//
// Each load opens its file inside the ring into a fixed-file slot, moves its bytes and closes
// the slot, as one chain of linked SQEs (Phase::Main). Each store opens its file inside the ring
// into a regular descriptor (Phase::Open: a close of a fixed-file slot never reaches the file
// system's ->flush, see prep_store_open), then writes and closes it as one chain (Phase::Main),
// then renames its temporary into place (Phase::Rename) or removes it. A job's requests are
// prepared together and handed to the kernel with one io_uring_submit where the ring has room
// (a store's chain follows in a later one, once its open is in). Results as job.hpp says.
#pragma once

#include <liburing.h>
#include <linux/openat2.h>
#include <sys/stat.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "job_queue.hpp"

namespace pykvtier {

struct EngineConfig {
  unsigned queue_depth = 64;                   // requests in flight per ring
  uint64_t max_inflight_bytes = 256ull << 20;  // payload bytes in flight per ring
  unsigned workers = 1;                        // background rings for submit()
  double store_share = 0.5;                    // share of slots and bytes stores may hold
};

struct BufferRegion {
  uint64_t addr;
  uint64_t len;
};

class UringEngine;

// What one SQE of a request does (the low bits of its user_data).
enum Stage : uint8_t {
  kOpen = 0,
  kHeader = 1,
  kData = 2,
  kFsync = 3,
  kClose = 4,
  kRename = 5,
  kUnlink = 6,
  kRecycle = 7,  // rename of a victim to the temporary name (not an error of the request)
  kStatx = 8,    // statx of the temporary after that rename: is it a reusable block file?
  kRestore = 9,  // rename of a victim that is no reusable block file back to its name
  kLinks = 11,   // read_block: statx of the opened path (a hard-linked block file is refused)
  kReread = 12,  // a read's re-read of what a short read left out
  kDirSync = 13, // fsync=True: fsync of one directory of the job's renames (sub: which)
};

// What a request's slot is waiting for; the next step is chosen when all its CQEs are in.
enum class Phase : uint8_t {
  Open,           // a store's open into a regular descriptor (its chain needs the number)
  Main,           // open -> [statx] -> [header] -> data -> [fsync] -> close (a store's from Open)
  RecycleProbe,   // write_block with a victim: rename it to the temporary name, statx that
  RestoreVictim,  // a victim that is no reusable block file: renamed back to its name
  Reread,         // reopen + read of what a short read left out
  Rename,         // the written temporary into place
  RemoveTemp,     // unlink of our temporary after a failure
  RemoveDupTemp,  // unlink of our temporary once the block is in place (another's, or linked)
  RemoveVictim,   // unlink of a victim that stayed at its name
  DirSync,        // the job's directory fsyncs (in its last request's slot)
};

// One io_uring with its fixed-file table, header buffers and registered buffers. Used by
// exactly one thread.
class Ring {
 public:
  Ring(UringEngine& engine, unsigned depth, int wake_fd, bool single_issuer);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Prepares as many of job's pending requests as fit; returns how many.
  unsigned issue(Job& job);
  // Hands prepared SQEs to the kernel (one io_uring_submit); waits for wait_nr CQEs.
  void submit(unsigned wait_nr);
  // Waits for at least one CQE (if wait), then handles all ready CQEs. Jobs whose last request
  // finished are appended to finished.
  void reap(bool wait, std::vector<Job*>& finished);
  // submit(1) then reap whatever is ready, or a plain waiting reap when nothing is prepared.
  void submit_and_reap(std::vector<Job*>& finished);
  void sync_buffers();  // re-register the engine's fixed buffers if they changed (idle only)
  uint64_t buffers_generation() const { return buffers_generation_; }

  unsigned inflight() const { return inflight_; }
  bool can_take_whole(const Job& job) const;
  bool store_batch_ready(const Job& job) const;  // a store job's next batch fits (see .cpp)

 private:
  static constexpr uint8_t kNoErrorStage = 0xff;
  struct Ctx {
    Job* job = nullptr;
    uint32_t index = 0;
    uint8_t pending = 0;  // CQEs still to come for the current phase
    Phase phase = Phase::Main;
    bool reuse = false;        // the main chain overwrites the victim at path (no O_EXCL)
    bool open_failed = false;  // the main chain's open failed: nothing reached the destination
    int flags = 0;             // the main chain's open flags (a re-read opens the same way)
    int fd = -1;               // a store's regular descriptor: from its open's CQE to its close's
    int32_t recycle_res = 0;   // renaming the victim to the temporary name
    int32_t stat_res = 0;      // the statx of the temporary (RecycleProbe)
    int32_t check_res[2] = {0, 0};  // RecycleProbe: -errno opening the directory of the victim, the temporary
    int32_t pre_res = 0;       // the -errno a stand-in NOP reports for an op never issued
    int32_t rename_res = 0;    // Rename
    int32_t unlink_res = 0;    // RemoveVictim
    struct statx stx {};
    open_how how = {};         // of the open being submitted (the kernel copies it then)
    bool merged = false;       // header and payload written by one WRITEV (a new file)
    iovec iov[2] = {};         // its iovecs (live until the request finishes)
    int64_t err = 0;           // the request's error: that of the earliest stage that failed
    uint8_t err_stage = kNoErrorStage;
    uint64_t hdr_got = 0, data_got = 0;  // reads: header / payload bytes read so far
    uint64_t reread_pos = 0;   // Reread: where it starts in its part
    bool reread_header = false;  // Reread re-reads the header (else the payload)
    uint8_t rereads = 0;
    std::vector<std::string> sync_dirs;  // DirSync
    std::vector<int> sync_fds, sync_err;
    char* header = nullptr;
  };
  using Finished = std::vector<Job*>;

  // preparing
  io_uring_sqe* get_sqe();
  void mark(uint32_t slot, io_uring_sqe* sqe, Stage st, unsigned flags, uint32_t sub = 0);
  void prep_request(uint32_t slot);
  void prep_unlink(uint32_t slot);
  void prep_read(uint32_t slot);
  void prep_read_block(uint32_t slot);
  void prep_store_open(uint32_t slot);
  void prep_store_chain(uint32_t slot);
  int file_of(uint32_t slot) const;        // the descriptor SQEs of the slot's request name
  unsigned file_flag(uint32_t slot) const;  // IOSQE_FIXED_FILE, or 0 for a store's descriptor
  void prep_payload(uint32_t slot, bool write, uint64_t file_off);
  void prep_sync_and_close(uint32_t slot, bool write);
  bool prep_open(uint32_t slot, int flags);  // false: not issued (a NOP reports why)
  int main_open_flags(const Job& job, const Request& r, bool reuse) const;
  void prep_recycle(uint32_t slot);
  void prep_reread(uint32_t slot);
  void prep_rename(uint32_t slot, Phase phase, Stage st, const std::string& from, const std::string& to);
  void prep_remove(uint32_t slot, Phase phase, const std::string& path);
  bool start_dirsync(uint32_t slot);
  void prep_failed(uint32_t slot, Stage stage, int err);
  int at(const Job& job, const std::string& path, int* dfd, const char** name);
  int dir_fd(const std::string& dir);
  void arm_wake();
  int fixed_index(uint64_t addr, uint64_t len) const;
  void start_request(Job& job, uint32_t slot, double now);

  // completing: record each CQE, then choose the next step once the phase's CQEs are in
  void on_cqe(uint64_t user_data, int32_t res, uint32_t flags, Finished& finished);
  void drain_wake(uint32_t flags);
  void record(Ctx& c, Stage st, uint32_t sub, int32_t res);
  void record_transfer(Ctx& c, Stage st, int32_t res);
  void record_error(Ctx& c, Stage stage, int64_t err);
  void next_step(uint32_t slot, Finished& finished);
  void after_open(uint32_t slot, Finished& finished);
  void after_main(uint32_t slot, Finished& finished);
  bool wants_reread(const Ctx& c) const;
  void after_rename(uint32_t slot, Finished& finished);
  void after_recycle_probe(uint32_t slot);
  void after_remove_victim(uint32_t slot, Finished& finished);
  void after_store(uint32_t slot, Finished& finished);
  void finish(uint32_t slot, Finished& finished);
  void release(uint32_t slot, Finished& finished);

  bool has_capacity(uint64_t len, bool store) const;
  uint64_t byte_budget(bool store) const;
  unsigned slot_budget(bool store) const;

  UringEngine& engine_;
  io_uring ring_{};
  unsigned depth_;
  int wake_fd_;
  std::vector<Ctx> ctx_;
  std::vector<uint32_t> free_slots_;
  char* headers_ = nullptr;
  unsigned inflight_ = 0;
  uint64_t inflight_bytes_ = 0;
  uint64_t inflight_store_bytes_ = 0;
  unsigned inflight_stores_ = 0;
  unsigned unsubmitted_ = 0;
  unsigned wake_sqes_ = 0;
  bool skip_open_cqe_ = false;
  uint64_t buffers_generation_ = 0;
  std::vector<BufferRegion> buffers_;
  // Link-free directory descriptors (O_PATH, opened with open_no_links on first use) of block
  // files' directories: renames, unlinks, statx and opens of block files go relative to them
  // with the base name, so a directory later swapped for a link cannot redirect them. Kept for
  // the ring's life (reopened if the directory was removed).
  std::unordered_map<std::string, int> dir_fds_;
};

class UringEngine final : public detail::JobQueue {
 public:
  explicit UringEngine(EngineConfig cfg);
  ~UringEngine() override;

  const char* name() const override { return "uring"; }
  void submit(std::unique_ptr<Job> job) override;
  void shutdown() override;
  // Registers [addr, addr+len) as fixed buffers (1 GiB pieces) with every worker's ring: the
  // first buffer index. Idle workers register at once; a refused registration is counted.
  int64_t register_buffer(uint64_t addr, uint64_t len) override;
  void unregister_buffers() override;
  bool await_buffers(double timeout_s) override;

  std::vector<BufferRegion> buffers(uint64_t* generation) const;
  const EngineConfig& config() const { return cfg_; }

 private:
  void worker_main(unsigned idx);
  void take_jobs(Ring& ring, std::vector<std::unique_ptr<Job>>& active, unsigned idx);
  void report_buffers(unsigned idx, uint64_t generation);
  void wake_workers();

  EngineConfig cfg_;
  mutable std::mutex buf_mu_;
  std::vector<BufferRegion> buffers_;
  uint64_t buffers_generation_ = 0;

  std::deque<std::unique_ptr<Job>> loads_, stores_;  // loads have priority (under mu_)
  std::vector<int> wake_fds_;
  // Per worker (under mu_): a wake-up was written to its eventfd and the worker has not looked at
  // the queues since; submit writes only to workers without one (one write wakes for many jobs).
  std::vector<uint8_t> wake_pending_;
  std::vector<uint64_t> worker_buffer_gen_;  // buffers generation each worker's ring has
  std::vector<std::thread> workers_;
};

}  // namespace pykvtier
