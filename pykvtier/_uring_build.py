"""cffi builder (out-of-line API mode) for ``pykvtier._uring``: liburing for the phase-1 probe.

The module exposes exactly what :mod:`pykvtier.probe` needs: set up a ring, prepare and submit
a batch of ``statx`` SQEs in one call, reap every completed CQE in one call, wait. API mode:
every call goes through a compiled C wrapper, ``static inline`` liburing functions included,
and cffi releases the GIL around each call (``Py_BEGIN_ALLOW_THREADS`` in the emitted source).

Build-time script; it must not import anything from ``pykvtier`` (it runs before the package
exists). CMake runs it as::

    python pykvtier/_uring_build.py OUTPUT.c

which only writes the C source of the extension (``ffibuilder.emit_c_code``); CMake compiles
that file as the module ``pykvtier._uring`` and links it to liburing. Without CMake (tests,
development) build it in place with ``make_ffi(libraries=["uring"]).compile(tmpdir=...)``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import cffi

MODULE_NAME = "pykvtier._uring"

# C declarations visible from Python. Structures are partial (``...;``): the C compiler
# supplies their real size and layout.
CDEF = """
struct io_uring { ...; };
struct statx { uint32_t stx_mask; uint32_t stx_nlink; uint16_t stx_mode; uint64_t stx_size; ...; };
struct pykvtier_statx_req { struct statx stx; uint64_t tag; int32_t res; uint32_t done; ...; };
struct pykvtier_reap_out { uint64_t *tag; int32_t *res; uint64_t *size; uint32_t *mode;
                           uint32_t *nlink; ...; };

#define AT_FDCWD ...
#define AT_SYMLINK_NOFOLLOW ...
#define AT_STATX_SYNC_AS_STAT ...
#define STATX_TYPE ...
#define STATX_MODE ...
#define STATX_NLINK ...
#define STATX_SIZE ...
#define IORING_SETUP_SUBMIT_ALL ...
#define IORING_FEAT_NODROP ...

int io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);
void io_uring_queue_exit(struct io_uring *ring);

unsigned pykvtier_ring_features(const struct io_uring *ring);
unsigned pykvtier_sq_entries(const struct io_uring *ring);
unsigned pykvtier_cq_entries(const struct io_uring *ring);
const unsigned *pykvtier_cq_khead(const struct io_uring *ring);
const unsigned *pykvtier_cq_ktail(const struct io_uring *ring);
int pykvtier_statx_submit(struct io_uring *ring, const char *paths, size_t stride,
                          const uint64_t *offsets, struct pykvtier_statx_req *reqs,
                          unsigned count, uint64_t tag_base, int dfd, int flags, unsigned mask,
                          unsigned *prepared, unsigned *submits);
unsigned pykvtier_statx_reap(struct io_uring *ring, unsigned mask,
                             const struct pykvtier_reap_out *out, unsigned at, unsigned max);
int pykvtier_wait(struct io_uring *ring, unsigned wait_nr, int64_t timeout_ns);
"""

# C source compiled into the module. The helpers move the per-probe loops out of Python: one
# call prepares and submits a whole batch of statx SQEs, one call reaps every completed one.
C_SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <liburing.h>

/* Features the kernel reported at io_uring_queue_init (IORING_FEAT_*). */
static unsigned pykvtier_ring_features(const struct io_uring *ring)
{
    return ring->features;
}

/* Number of entries of the submission queue ring. */
static unsigned pykvtier_sq_entries(const struct io_uring *ring)
{
    return ring->sq.ring_entries;
}

/* Number of entries of the completion queue ring. */
static unsigned pykvtier_cq_entries(const struct io_uring *ring)
{
    return ring->cq.ring_entries;
}

/*
 * The CQ ring's head and tail, shared with the kernel: head != tail when CQEs wait to be
 * reaped. A plain read is a hint (no barrier); pykvtier_statx_reap reads them properly.
 */
static const unsigned *pykvtier_cq_khead(const struct io_uring *ring)
{
    return ring->cq.khead;
}

static const unsigned *pykvtier_cq_ktail(const struct io_uring *ring)
{
    return ring->cq.ktail;
}

/*
 * One statx probe of a batch. The kernel writes `stx`; pykvtier_statx_reap sets `res` and
 * `done`. The SQE's user_data is the request's address, so a CQE leads back to it.
 */
struct pykvtier_statx_req {
    struct statx stx;
    uint64_t tag;   /* the caller's number for this probe, given back by the reap */
    int32_t res;    /* valid once done: 0, or -errno (-ENODATA: a field of `mask` is missing) */
    uint32_t done;  /* 0 while in flight, 1 once its CQE was reaped */
};

/*
 * Prepares one statx(dfd, path, flags, mask) SQE per request and submits them, as few
 * io_uring_submit calls as the SQ ring allows (one when `count` fits in it). Request i
 * (i < count) reads the NUL-terminated path at paths + offsets[i] (paths + i * stride when
 * `offsets` is NULL), writes reqs[i] and is tagged tag_base + i; requests before *prepared
 * are already queued (0 on the first call). The paths and reqs must live until every
 * request's CQE was reaped.
 * Returns 0 once all `count` went out, or the negative errno of a failed io_uring_submit
 * (-EBUSY/-EAGAIN: reap completions, then call again with the same arguments). *prepared
 * counts the requests queued so far; *submits is incremented per io_uring_submit call that
 * carried SQEs. Never waits for completions.
 */
static int pykvtier_statx_submit(struct io_uring *ring, const char *paths, size_t stride,
                                 const uint64_t *offsets, struct pykvtier_statx_req *reqs,
                                 unsigned count, uint64_t tag_base, int dfd, int flags,
                                 unsigned mask, unsigned *prepared, unsigned *submits)
{
    for (;;) {
        while (*prepared < count) {
            unsigned i = *prepared;
            struct io_uring_sqe *sqe = io_uring_get_sqe(ring);

            if (sqe == NULL)
                break;
            reqs[i].tag = tag_base + i;
            reqs[i].res = 0;
            reqs[i].done = 0;
            io_uring_prep_statx(sqe, dfd, paths + (offsets ? offsets[i] : (size_t)i * stride),
                                flags, mask, &reqs[i].stx);
            io_uring_sqe_set_data64(sqe, (uint64_t)(uintptr_t)&reqs[i]);
            (*prepared)++;
        }
        while (io_uring_sq_ready(ring)) {
            int rc = io_uring_submit(ring);

            if (rc > 0)
                (*submits)++;
            else if (rc != -EINTR)
                return rc < 0 ? rc : -EIO;
        }
        if (*prepared == count)
            return 0;
    }
}

/* Five parallel output arrays of pykvtier_statx_reap, one element per reaped probe. */
struct pykvtier_reap_out {
    uint64_t *tag;
    int32_t *res;
    uint64_t *size;
    uint32_t *mode;
    uint32_t *nlink;
};

/*
 * Non-blocking: reaps up to `max` available CQEs of statx requests queued by
 * pykvtier_statx_submit. For each: marks the request done, sets its `res` (-ENODATA when the
 * file system filled in fewer fields than `mask`), and stores (tag, res, size, mode, nlink)
 * at index at, at + 1, ... of the output arrays (size, mode, nlink are 0 unless res == 0).
 * Returns how many were stored. io_uring_peek_batch_cqe also flushes CQEs the kernel kept on
 * its overflow list (IORING_FEAT_NODROP). CQEs of the timeout SQEs liburing itself submits
 * for a timed wait on kernels without IORING_FEAT_EXT_ARG are dropped.
 */
static unsigned pykvtier_statx_reap(struct io_uring *ring, unsigned mask,
                                    const struct pykvtier_reap_out *out, unsigned at,
                                    unsigned max)
{
    struct io_uring_cqe *cqes[64];
    unsigned total = 0;

    while (total < max) {
        unsigned want = max - total;
        unsigned got, i;

        if (want > 64)
            want = 64;
        got = io_uring_peek_batch_cqe(ring, cqes, want);
        if (got == 0)
            break;
        for (i = 0; i < got; i++) {
            struct pykvtier_statx_req *req;
            int32_t r = cqes[i]->res;
            unsigned k = at + total;

            if (cqes[i]->user_data == LIBURING_UDATA_TIMEOUT)
                continue;
            req = (struct pykvtier_statx_req *)(uintptr_t)cqes[i]->user_data;
            if (r == 0 && (req->stx.stx_mask & mask) != mask)
                r = -ENODATA;
            req->res = r;
            req->done = 1;
            out->tag[k] = req->tag;
            out->res[k] = r;
            out->size[k] = r == 0 ? req->stx.stx_size : 0;
            out->mode[k] = r == 0 ? req->stx.stx_mode : 0;
            out->nlink[k] = r == 0 ? req->stx.stx_nlink : 0;
            total++;
        }
        io_uring_cq_advance(ring, got);
    }
    return total;
}

/*
 * Block until at least `wait_nr` CQEs are available (clamped to the CQ ring size) or
 * `timeout_ns` nanoseconds passed (a negative timeout waits without limit). Consumes no CQE.
 * Returns 0, -ETIME on timeout, -EINTR if a signal arrived, or another negative errno.
 */
static int pykvtier_wait(struct io_uring *ring, unsigned wait_nr, int64_t timeout_ns)
{
    struct io_uring_cqe *cqe = NULL;
    struct __kernel_timespec ts;

    if (wait_nr == 0)
        return 0;
    if (wait_nr > ring->cq.ring_entries)
        wait_nr = ring->cq.ring_entries;
    if (timeout_ns < 0)
        return io_uring_wait_cqes(ring, &cqe, wait_nr, NULL, NULL);
    ts.tv_sec = timeout_ns / 1000000000;
    ts.tv_nsec = timeout_ns % 1000000000;
    return io_uring_wait_cqes(ring, &cqe, wait_nr, &ts, NULL);
}
"""


def make_ffi(libraries: Sequence[str] | None = None) -> cffi.FFI:
    """Return a configured cffi builder for ``pykvtier._uring``.

    ``libraries`` are passed to the linker when the builder compiles the module itself
    (``ffi.compile``), e.g. ``["uring"]``; CMake links liburing on its own, so the default
    (``None``) links nothing.
    """
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(MODULE_NAME, C_SOURCE, libraries=list(libraries or ()))
    return ffi


ffibuilder = make_ffi()


def main(argv: Sequence[str]) -> int:
    """Write the C source of ``pykvtier._uring`` to ``argv[1]``; return an exit status."""
    if len(argv) != 2:
        sys.stderr.write(f"usage: {argv[0]} OUTPUT.c\n")
        return 2
    ffibuilder.emit_c_code(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
