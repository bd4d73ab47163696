// Python entry tuples -> a job's requests, shared by the bindings of every engine
// (pykvtier._native's io_uring engine, pykvtier._gds). Both engines' Job/Request types have the
// same fields and Op names; only this header and the bindings files touch Python objects.
//
//   read / write:  (path, file_offset, length, addr[, rename_target (write only)])
//   read_block:    (path, payload_length, addr, key_digest: 16 bytes)
//   write_block:   (tmp_path, final_path, payload_length, addr, key_digest: 16 bytes
//                   [, recycle_path: an evicted block file to reuse, or "" (io_uring engine)])
//   unlink:        path, or (path,)
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <string>

#include "block_format.hpp"

namespace pykvtier {

inline constexpr uint64_t kMaxRequestBytes = 1ull << 30;  // CQE results are int32

[[noreturn]] inline void entry_error(size_t i, const std::string& path, const std::string& what) {
  std::string shown;  // a NUL byte would end the message: shown as \0; a long path shortened
  for (char ch : path.substr(0, 200)) shown += ch == '\0' ? std::string("\\0") : std::string(1, ch);
  if (path.size() > 200) shown += "...";
  throw pybind11::value_error("entry " + std::to_string(i) + " (" + shown + "): " + what);
}

// Entry i's `what` (its path, rename target or recycle path) is one the kernel takes: not empty
// (unless optional), no NUL byte, shorter than PATH_MAX. (io_uring fails such a path while
// preparing the open, which cancels the rest of its chain without completions: it must never
// reach the ring.) Errors name the entry by its path.
inline void check_path(size_t i, const std::string& entry_path, const char* what,
                       const std::string& path, bool optional) {
  if (path.empty()) {
    if (optional) return;
    entry_error(i, entry_path, std::string(what) + " is empty");
  }
  if (path.find('\0') != std::string::npos)
    entry_error(i, entry_path, std::string(what) + " contains a NUL byte");
  if (path.size() >= 4096)
    entry_error(i, entry_path, std::string(what) + " is " + std::to_string(path.size()) +
                                   " bytes, not shorter than PATH_MAX (4096)");
}

template <class Op>
Op op_from_name(const std::string& s) {
  if (s == "read") return Op::Read;
  if (s == "write") return Op::Write;
  if (s == "read_block") return Op::ReadBlock;
  if (s == "write_block") return Op::WriteBlock;
  if (s == "unlink") return Op::Unlink;
  throw pybind11::value_error("unknown op '" + s +
                              "': expected read, write, read_block, write_block or unlink");
}

// Sets job.op and fills job.reqs from entries, checking each entry's shape, length (1 byte ..
// 1 GiB) and address (not NULL). addr_kind names the memory in errors ("host", "device").
// Raises ValueError naming the entry; nothing is queued then.
template <class Job>
void parse_entries(Job& job, const std::string& op_s, const pybind11::sequence& entries,
                   const char* addr_kind) {
  namespace py = pybind11;
  using Op = decltype(job.op);
  job.op = op_from_name<Op>(op_s);
  const size_t n = py::len(entries);
  job.reqs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto& r = job.reqs[i];
    py::handle e = entries[i];
    if (job.op == Op::Unlink) {
      r.path = py::isinstance<py::str>(e) ? e.cast<std::string>()
                                          : py::reinterpret_borrow<py::sequence>(e)[0].cast<std::string>();
      check_path(i, r.path, "path", r.path, false);
      continue;
    }
    py::tuple t = py::reinterpret_borrow<py::object>(e).cast<py::tuple>();
    auto need = [&](size_t k) {
      if (t.size() != k)
        throw py::value_error("entry " + std::to_string(i) + ": expected a tuple of " + std::to_string(k) +
                              " items for op '" + op_s + "', got " + std::to_string(t.size()));
    };
    auto digest = [&](py::handle h) {
      std::string d = h.cast<py::bytes>();
      if (d.size() != kDigestBytes)
        entry_error(i, r.path, "key digest must be " + std::to_string(kDigestBytes) + " bytes");
      std::memcpy(r.digest, d.data(), kDigestBytes);
    };
    switch (job.op) {
      case Op::Read:
      case Op::Write:
        if (t.size() == 5 && job.op == Op::Write)
          r.target = t[4].cast<std::string>();
        else
          need(4);
        r.path = t[0].cast<std::string>();
        r.offset = t[1].cast<uint64_t>();
        r.length = t[2].cast<uint64_t>();
        r.addr = t[3].cast<uint64_t>();
        break;
      case Op::ReadBlock:
        need(4);
        r.path = t[0].cast<std::string>();
        r.length = t[1].cast<uint64_t>();
        r.addr = t[2].cast<uint64_t>();
        digest(t[3]);
        break;
      case Op::WriteBlock:
        if (t.size() == 6) {
          std::string recycle = t[5].cast<std::string>();
          if constexpr (requires { r.recycle; }) {
            r.recycle = std::move(recycle);
          } else if (!recycle.empty()) {
            entry_error(i, t[0].cast<std::string>(), "this engine does not recycle block files");
          }
        } else {
          need(5);
        }
        r.path = t[0].cast<std::string>();
        r.target = t[1].cast<std::string>();
        r.length = t[2].cast<uint64_t>();
        r.addr = t[3].cast<uint64_t>();
        digest(t[4]);
        break;
      case Op::Unlink:
        break;
    }
    check_path(i, r.path, "path", r.path, false);
    check_path(i, r.path, "rename target", r.target, true);
    if constexpr (requires { r.recycle; }) check_path(i, r.path, "recycle path", r.recycle, true);
    if (r.length == 0) entry_error(i, r.path, "length is 0");
    if (r.length > kMaxRequestBytes)
      entry_error(i, r.path, "length " + std::to_string(r.length) + " exceeds the 1 GiB per-request limit");
    if (r.addr == 0) entry_error(i, r.path, std::string(addr_kind) + " address is NULL");
  }
}

// poll / wait / drain / pending_jobs of an engine class (its FinishedJobs base): the same for
// every engine. Returns cls for further .def()s.
template <class Cls>
Cls& def_finished_jobs(Cls& cls) {
  namespace py = pybind11;
  using Engine = typename Cls::type;
  cls.def(
         "poll",
         [](Engine& e) {
           auto fin = e.poll();
           py::list out;
           for (auto& f : fin)  // (op_name: the engine's own, found by argument lookup)
             out.append(py::make_tuple(f.id, op_name(f.op), py::cast(f.results), f.submits,
                                       f.queued_s, f.transfer_s));
           return out;
         },
         "Finished jobs since the last call, each exactly once: list of\n"
         "(job_id, op, results, submits, queued_seconds, transfer_seconds). Never blocks.")
      .def(
          "wait",
          [](Engine& e, std::optional<double> timeout_s) {
            py::gil_scoped_release nogil;
            return e.wait(timeout_s ? *timeout_s : -1.0);
          },
          py::arg("timeout_s") = py::none(),
          "Blocks (GIL released) until a finished job can be polled, nothing is pending, or\n"
          "timeout_s seconds passed. Returns True if poll() has something.")
      .def(
          "drain",
          [](Engine& e) {
            py::gil_scoped_release nogil;
            e.drain();
          },
          "Blocks (GIL released) until every submitted job finished; results stay for poll().")
      .def(
          "pending_jobs", [](Engine& e) { return e.pending_jobs(); },
          "Jobs submitted and not yet finished.");
  return cls;
}

}  // namespace pykvtier
