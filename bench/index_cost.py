"""CPU cost per key of the block index (``_native.BlockIndex``) as it grows: a load's admission
and finish (``admit_loads`` + ``finish_loads``) of 32 random present keys, at 1k to 500k indexed
blocks. Best of 5 timeit repeats; printed, never asserted.

    python bench/index_cost.py
    python bench/index_cost.py --blocks 1000 2000000
"""

from __future__ import annotations

import argparse
import os
import random
import timeit

from pykvtier import _native


def cost(n_blocks: int, job: int = 32, seed: int = 0) -> float:
    """us per key of admit_loads + finish_loads of `job` random present keys among n_blocks."""
    rng = random.Random(seed)
    ix = _native.BlockIndex(False)
    digests = [os.urandom(16) for _ in range(n_blocks)]
    for i in range(0, n_blocks, 4096):
        part = b"".join(digests[i:i + 4096])
        n = len(part) // 16
        assert ix.admit_stores(part, n) == (n, None)
        assert ix.finish_stores(part, [1] * n) == n
    jobs = [b"".join(rng.sample(digests, job)) for _ in range(2000)]
    it = iter(jobs * 60)

    def one() -> None:
        j = next(it)
        assert ix.admit_loads(j) is None
        ix.finish_loads(j)

    return min(timeit.repeat(one, number=2000, repeat=5)) / 2000 / job * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[1000, 20000, 120000, 500000])
    args = p.parse_args()
    print("indexed blocks   admit + finish of a load, us/key")
    for n in args.blocks:
        print(f"{n:14d}   {cost(n):.3f}")


if __name__ == "__main__":
    main()
