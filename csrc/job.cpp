// Job helpers shared by the host engines: see job.hpp.
#include "job.hpp"

#include <unordered_map>

#include "block_header.hpp"
#include "checksum.hpp"
#include "safe_path.hpp"

namespace pykvtier {

void fill_header(char* hdr, const Request& r) {
  fill_block_header(hdr, r.digest, r.length, payload_xxh3(reinterpret_cast<const void*>(r.addr), r.length));
}

int64_t verify_block(const char* hdr, const Request& r) {
  uint64_t want = 0;
  if (int64_t e = check_block_header(hdr, r.digest, r.length, &want)) return e;
  if (want != payload_xxh3(reinterpret_cast<const void*>(r.addr), r.length)) return kErrChecksum;
  return 0;
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

void apply_dir_errors(Job& job, const std::vector<std::string>& dirs, const std::vector<int>& err,
                      EngineStats& stats) {
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

FinishedJob make_finished(Job& job) {
  FinishedJob f;
  f.id = job.id;
  f.op = job.op;
  f.results.reserve(job.reqs.size());
  for (auto& r : job.reqs) f.results.push_back(r.result);
  f.submits = job.submits;
  f.queued_s = job.start_time > 0 ? job.start_time - job.submit_time : 0;
  f.transfer_s = job.start_time > 0 ? job.end_time - job.start_time : 0;
  return f;
}

}  // namespace pykvtier
