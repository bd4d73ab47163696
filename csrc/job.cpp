// Job helpers shared by the host engines: see job.hpp.
#include "job.hpp"

#include "block_header.hpp"
#include "checksum.hpp"

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
