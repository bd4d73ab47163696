"""cffi builder (out-of-line API mode) for ``pykvtier._uring``: liburing for the phase-1 probe.

The module exposes exactly what :mod:`pykvtier.probe` needs to prepare ``statx`` SQEs from
Python, submit them in batches and reap their CQEs. API mode: every call goes through a
compiled C wrapper, ``static inline`` liburing functions included, and cffi releases the GIL
around each call.

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

# C declarations visible from Python. Structures that Python only allocates or passes around
# are partial (``...;``): the C compiler supplies their real size and layout.
CDEF = """
struct io_uring { ...; };
struct io_uring_sqe { uint64_t user_data; ...; };
struct io_uring_cqe { uint64_t user_data; int32_t res; uint32_t flags; ...; };
struct statx { uint32_t stx_mask; uint64_t stx_size; ...; };

#define AT_FDCWD ...
#define AT_SYMLINK_NOFOLLOW ...
#define AT_STATX_SYNC_AS_STAT ...
#define STATX_SIZE ...
#define STATX_BASIC_STATS ...
#define IORING_SETUP_SUBMIT_ALL ...
#define IORING_FEAT_NODROP ...

int io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags);
void io_uring_queue_exit(struct io_uring *ring);
struct io_uring_sqe *io_uring_get_sqe(struct io_uring *ring);
void io_uring_prep_statx(struct io_uring_sqe *sqe, int dfd, const char *path, int flags,
                         unsigned mask, struct statx *statxbuf);
void io_uring_sqe_set_data64(struct io_uring_sqe *sqe, uint64_t data);
int io_uring_submit(struct io_uring *ring);
unsigned io_uring_sq_ready(const struct io_uring *ring);
unsigned io_uring_sq_space_left(const struct io_uring *ring);
unsigned io_uring_peek_batch_cqe(struct io_uring *ring, struct io_uring_cqe **cqes,
                                 unsigned count);
void io_uring_cq_advance(struct io_uring *ring, unsigned nr);

unsigned pykvtier_ring_features(const struct io_uring *ring);
unsigned pykvtier_cq_entries(const struct io_uring *ring);
unsigned pykvtier_reap(struct io_uring *ring, uint64_t *user_data, int32_t *res, unsigned max);
int pykvtier_wait(struct io_uring *ring, unsigned wait_nr, int64_t timeout_ns);
"""

# C source compiled into the module. The helpers batch what would otherwise be one
# GIL-releasing call per CQE; SQE preparation stays in Python.
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

/* Number of entries of the completion queue ring. */
static unsigned pykvtier_cq_entries(const struct io_uring *ring)
{
    return ring->cq.ring_entries;
}

/*
 * Non-blocking: copy up to `max` available CQEs into user_data[] and res[], mark them seen and
 * return how many were copied. io_uring_peek_batch_cqe also flushes CQEs the kernel kept on
 * its overflow list (IORING_FEAT_NODROP) without waiting. CQEs of the timeout SQEs liburing
 * itself submits for a timed wait on kernels without IORING_FEAT_EXT_ARG are dropped.
 */
static unsigned pykvtier_reap(struct io_uring *ring, uint64_t *user_data, int32_t *res,
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
            if (cqes[i]->user_data == LIBURING_UDATA_TIMEOUT)
                continue;
            user_data[total] = cqes[i]->user_data;
            res[total] = cqes[i]->res;
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
