"""`pykvtier replay --nodes`: one replay process per root, requests dealt out, cross-node hits by
the join of the nodes' stored keys and loaded blocks. Here the same local directory is given
twice (two processes, one root); tests/test_sharedfs.py runs it over two JuiceFS mounts.

The node processes run concurrently, so which blocks a node finds stored by the other depends on
timing: the tests assert the relations that hold whatever the timing, never a figure of it."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from pykvtier import cli, models, replay
from pykvtier.replay import (NODES_DEAL, NodeResult, ReplayConfig, ReplayConfigError, ReplaySummary,
                             block_key, run_nodes)
from pykvtier.trace import Request, load_trace

pytest.importorskip("pykvtier._native", reason="the native engine is not built")

TINY_TPB = 128  # tiny model: 32 KiB blocks, 4 per trace block
TINY_BS = models.block_size_bytes("tiny", TINY_TPB)
SPB = 512 // TINY_TPB

#: totals that are the sum of the nodes' figures (the others: ratios, percentiles, GB/s, the
#: union of stored keys, the longest wall)
SUMMED = ("requests", "blocks_requested", "blocks_looked_up", "blocks_hit", "blocks_loaded",
          "blocks_loaded_cross_node", "blocks_loaded_both", "blocks_loaded_own",
          "blocks_loaded_unattributed", "cross_stored_after_load", "load_lost_keys",
          "bytes_loaded", "bytes_verified", "blocks_stored", "bytes_stored", "evictions",
          "verification_failures", "errors")


def _config(**kw):
    base = dict(model="tiny", tokens_per_block=TINY_TPB, max_requests=None, capacity_bytes=None,
                root=None, engine="auto", progress=False)
    base.update(kw)
    return ReplayConfig(**base)


def check_nodes_relations(r, requests, roots):
    """What holds for every run of ``run_nodes(..., requests)`` over ``roots``, whatever the
    timing of the node processes (also used by tests/test_sharedfs.py)."""
    assert r.ok, (r.problems, [n.summary.error_samples for n in r.nodes], r.single.error_samples)
    assert r.deal == NODES_DEAL == "round robin by request order"
    n_nodes = len(roots)
    assert [n.node for n in r.nodes] == list(range(n_nodes))
    name = os.path.basename(r.base)
    assert name.startswith("pykvtier-replay-nodes-") and os.path.dirname(r.base) == roots[0]
    assert [n.root for n in r.nodes] == [os.path.join(root, name, "nodes") for root in roots]
    assert r.single.root == os.path.join(r.base, "single")
    assert r.base_removed and not os.path.exists(r.base)
    bs = r.single.block_size_bytes
    for n in r.nodes:
        s = n.summary
        share = requests[n.node::n_nodes]  # round robin by request order
        assert s.requests == len(share)
        assert s.blocks_requested == SPB * sum(len(q.hash_ids) for q in share)
        assert s.ok and s.verification_failures == 0 and s.errors == 0
        # every loaded byte verified, and the loaded blocks are those the node recorded
        assert n.bytes_verified == s.blocks_loaded * bs == s.bytes_loaded
        assert len(n.loaded) == len(n.loaded_t) == len(n.loaded_from) == s.blocks_loaded
        assert s.blocks_loaded + n.load_lost_keys == s.blocks_hit  # (every hit is loaded)
        assert len(n.stored) <= s.blocks_stored
        # the join: a cross-node hit is a block only the other nodes stored, before the load
        others = [o for o in r.nodes if o is not n]
        for key, t, src in zip(n.loaded, n.loaded_t, n.loaded_from):
            by_others = [o for o in others if key in o.stored]
            if src == "cross-node":
                assert key not in n.stored and by_others
                assert any(o.stored[key] < t for o in by_others)
            elif src == "own":
                assert key in n.stored and not by_others
            else:
                assert src == "both" and key in n.stored and by_others
        counts = [n.count(x) for x in ("cross-node", "both", "own", "none")]
        assert sum(counts) == s.blocks_loaded and counts[3] == 0
    d = r.to_dict()
    total, nodes = d["total"], d["nodes"]
    for name in SUMMED:
        assert total[name] == sum(nd[name] for nd in nodes), name
    assert total["bytes_verified"] == total["blocks_loaded"] * bs
    assert total["blocks_loaded_unattributed"] == total["cross_stored_after_load"] == 0
    assert total["distinct_keys_stored"] == len(set().union(*(n.stored for n in r.nodes)))
    loaded, looked_up = total["blocks_loaded"], total["blocks_looked_up"]
    cross = total["blocks_loaded_cross_node"]
    assert total["cross_node_hit_ratio"] == (cross / loaded if loaded else 0.0)
    assert total["cross_node_of_looked_up"] == (cross / looked_up if looked_up else 0.0)
    assert total["block_hit_ratio"] == total["blocks_hit"] / total["blocks_requested"]
    assert total["wall_s"] == max(nd["wall_s"] for nd in nodes)
    # the single node replayed the same requests, all of them, verified
    single = d["single_node"]
    assert single["requests"] == len(requests) == total["requests"]
    assert single["blocks_requested"] == total["blocks_requested"]
    assert single["bytes_verified"] == single["blocks_loaded"] * bs
    assert r.single.ok and r.single.blocks_hit == sum(_single_hits(requests))
    assert json.loads(json.dumps(d)) == d


def _single_hits(requests):
    """Per request, the hits one unlimited tier gives (the single node, capacity none)."""
    present: set[tuple[int, int]] = set()
    out = []
    for q in requests:
        keys = [(h, s) for h in q.hash_ids for s in range(SPB)]
        hits = 0
        for k in keys:
            if k not in present:
                break
            hits += 1
        out.append(hits)
        present.update(keys)
    return out


def test_same_directory_twice_two_processes_exact_relations(root):
    requests = load_trace(None, max_requests=120)
    r = run_nodes(_config(), [root, root], requests)
    check_nodes_relations(r, requests, [root, root])
    assert [n.root for n in r.nodes] == [r.nodes[0].root] * 2  # one root, two processes
    assert sum(n.summary.blocks_hit for n in r.nodes) > 0


def test_three_nodes_and_the_cli_json(root, capsys):
    rc = cli.main(["replay", "--nodes", f"{root},{root},{root}", "--model", "tiny",
                   "--tokens-per-block", str(TINY_TPB), "--max-requests", "30", "--capacity", "none",
                   "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    d = json.loads(out)  # exactly one JSON object
    assert d["ok"] is True and d["problems"] == [] and len(d["nodes"]) == 3
    assert [nd["requests"] for nd in d["nodes"]] == [10, 10, 10]
    for name in SUMMED:
        assert d["total"][name] == sum(nd[name] for nd in d["nodes"]), name
    assert d["single_node"]["requests"] == 30
    assert d["total"]["bytes_verified"] == d["total"]["blocks_loaded"] * TINY_BS


def test_cli_text(root, capsys):
    rc = cli.main(["replay", "--nodes", f"{root},{root}", "--model", "tiny", "--tokens-per-block",
                   str(TINY_TPB), "--max-requests", "12", "--capacity", "64MiB"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("pykvtier replay --nodes: 12 requests of <bundled "
                               "mooncake_conversation_trace.jsonl.gz>, dealt round robin by "
                               "request order to 2 nodes")
    for label in ("node 0", "node 1", "total", "single node"):  # a row in each table
        assert sum(1 for ln in lines if re.match(rf"  {label} +\d", ln)) == 2, (label, out)
    assert lines[-1] == "  OK"


class _CorruptingTier:
    """A node's shared tier that flips one byte of every loaded block before the replay sees it."""

    def __init__(self, inner, block_size):
        self._inner, self._bs = inner, block_size
        self._arena, self._loads = None, {}

    def set_arena(self, buf):
        self._arena = np.asarray(buf).view(np.uint8)
        self._inner.set_arena(buf)

    def submit_load(self, job):
        self._loads[job.job_id] = list(job.slot_ids)
        self._inner.submit_load(job)

    def _corrupt(self, results):
        for r in results:
            for slot in self._loads.pop(r.job_id, []):
                self._arena[slot * self._bs + 4097] ^= 0x01
        return results

    def get_finished_jobs(self):
        return self._corrupt(self._inner.get_finished_jobs())

    def wait(self, timeout_s=None):
        return self._corrupt(self._inner.wait(timeout_s=timeout_s))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def corrupting_shared_tier(root, bs, capacity, engine):
    """(module level: the node processes import it by name)"""
    from pykvtier import DiskTier

    return _CorruptingTier(DiskTier(root, bs, capacity_bytes=capacity, engine=engine, shared=True), bs)


# Three requests per node (dealt: node 0 the even ones, node 1 the odd ones), each node's third
# reusing its first. With an arena of 12 slots (REUSE_ARENA) a node's second request (8 blocks)
# waits for the slots of its first request's store (8 blocks), so its third one finds those
# blocks stored, whatever the timing (a shared tier's store may wait for the evictor's grant,
# and a lookup meanwhile is a MISS): loads on both nodes.
REUSE = [Request(i, 512 * len(ids), 1, tuple(ids)) for i, ids in
         enumerate([[1, 2], [3, 4], [9, 10], [11, 12], [1, 2, 5], [3, 4, 6]])]
REUSE_ARENA = 12 * TINY_BS


def test_wrong_bytes_on_a_node_fail_the_run(root):
    r = run_nodes(_config(arena_bytes=REUSE_ARENA), [root, root], REUSE,
                  tier_factory=corrupting_shared_tier)
    assert not r.ok
    for n in r.nodes:
        assert n.summary.blocks_loaded >= 2 * SPB  # (at least its own first request's blocks)
        assert n.summary.verification_failures == n.summary.blocks_loaded  # every one caught
        assert n.bytes_verified == n.summary.blocks_loaded * TINY_BS
    assert r.single.ok  # (a plain tier)
    assert "FAILED" in replay.format_nodes(r).splitlines()[-1]


def test_wrong_bytes_fail_the_command_loudly(root, monkeypatch, capsys):
    monkeypatch.setattr(replay, "_shared_tier", corrupting_shared_tier)  # what the nodes run
    trace = os.path.join(root, "reuse.jsonl")
    with open(trace, "w") as f:
        for q in REUSE:
            f.write(json.dumps({"timestamp": q.timestamp_ms, "input_length": q.input_length,
                                "output_length": 1, "hash_ids": list(q.hash_ids)}) + "\n")
    rc = cli.main(["replay", trace, "--nodes", f"{root},{root}", "--model", "tiny",
                   "--tokens-per-block", str(TINY_TPB), "--capacity", "none",
                   "--arena", str(REUSE_ARENA)])
    out = capsys.readouterr().out
    assert rc == 1
    lines = out.splitlines()
    assert lines[-1] == "  FAILED"
    assert any(ln.startswith("  node 0 ! load job ") and ln.endswith("has the wrong bytes") for ln in lines)


def test_the_join_counts_by_who_stored_each_loaded_key():
    """_attribute alone, on made-up records: own, cross-node, both, none; and a cross-node hit
    whose other-node store came only after the load."""
    k = [block_key(i, 0, TINY_BS) for i in range(5)]
    dummy = ReplaySummary.__new__(ReplaySummary)

    def node(i, stored, loaded):
        return NodeResult(node=i, root="/r", summary=dummy, stored=stored,
                          loaded=[key for key, _ in loaded], loaded_t=[t for _, t in loaded],
                          bytes_verified=0, load_lost_keys=0, load_latencies=[], load_intervals=[])

    a = node(0, {k[0]: 1.0, k[2]: 1.0}, [(k[0], 5.0), (k[1], 5.0), (k[2], 5.0), (k[3], 5.0), (k[4], 5.0)])
    b = node(1, {k[1]: 2.0, k[2]: 3.0, k[4]: 9.0}, [(k[0], 4.0), (k[0], 6.0)])
    replay._attribute([a, b])
    assert a.loaded_from == ["own", "cross-node", "both", "none", "cross-node"]
    assert a.cross_stored_after_load == 1  # k[4]: b stored it at 9.0, a loaded it at 5.0
    assert b.loaded_from == ["cross-node", "cross-node"] and b.cross_stored_after_load == 0
    assert (a.count("cross-node"), a.count("own"), a.count("both"), a.count("none")) == (2, 1, 1, 1)


def test_a_load_of_a_block_evicted_after_its_lookup_is_lost_not_an_error():
    """A node's load that finds its block evicted from the shared root since the lookup (its
    file gone, or the evictor's announcement applied in between) counts in load_lost_keys; any
    other failed key of a load is an error, as in a plain replay."""
    from pykvtier.replay import _NodeDriver, _Pending, _Progress, _SignalGuard

    k = [block_key(i, 0, TINY_BS) for i in range(4)]
    d = _NodeDriver(None, np.zeros(4 * TINY_BS, dtype=np.uint8), TINY_BS, TINY_TPB, _SignalGuard(),
                    _Progress(0, False))

    class Result:
        job_id = 7
        failed_keys = {k[0]: "not in the tier", k[1]: "ENOENT: No such file or directory",
                       k[2]: "an earlier load of this block failed"}

    d._count_failures(Result(), _Pending(True, k, [0, 1, 2, 3], 0.0), {k[3]})
    c = d.counters
    assert (d.load_lost_keys, c.load_failed_keys, c.errors) == (2, 1, 1)
    assert c.failure_reasons == {"load: an earlier load of this block failed": 1}


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "ONLY"], "--nodes needs at least two roots (comma-separated), got 1"),
    (["--nodes", "{r},"], "--nodes: an empty root (it would mean the current directory)"),
    (["--nodes", "{r},{r}/missing"], "--nodes: {r}/missing is not a directory (each root is a "
     "node's mount of one shared directory)"),
    (["--nodes", "{r},{r}", "--root", "{r}"], "--nodes takes the roots: no --root with it"),
])
def test_bad_node_roots_are_usage_errors(root, capsys, argv, message):
    argv = [a.format(r=root) for a in argv]
    if argv[1] == "ONLY":
        argv[1] = root
    assert cli.main(["replay", *argv, "--model", "tiny"]) == 2
    assert capsys.readouterr().err == f"pykvtier replay: {message.format(r=root)}\n"
    assert os.listdir(root) == []  # nothing made


def test_roots_that_are_not_one_directory_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with pytest.raises(ReplayConfigError) as ei:
        run_nodes(_config(), [str(a), str(b)], REUSE)
    msg = str(ei.value)
    assert msg.startswith(f"--nodes: {b} does not show what was written through {a} ({b}/"
                          "pykvtier-replay-nodes-")
    assert msg.endswith("/check: No such file or directory): the roots must be mounts of one "
                        "shared directory (or one path given twice)")
    assert os.listdir(a) == os.listdir(b) == []  # the fresh directory is removed


def refusing_node1_tier(root, bs, capacity, engine):
    """Node 0's shared tier; node 1's open is refused (a ValueError, as DiskTier's)."""
    import multiprocessing

    if multiprocessing.current_process().name == "pykvtier-replay-node1":
        raise ValueError("refused for the test")
    from pykvtier import DiskTier

    return DiskTier(root, bs, capacity_bytes=capacity, engine=engine, shared=True)


def test_a_node_that_cannot_open_its_tier_stops_the_others(root):
    """Node 1's tier cannot open: node 0, waiting for it at the start with its tier open, is let
    go (its tier shut down); the run is a usage error naming node 1; nothing is left."""
    with pytest.raises(ReplayConfigError) as ei:
        run_nodes(_config(), [root, root], REUSE, tier_factory=refusing_node1_tier)
    name = os.path.basename(os.path.dirname(str(ei.value).split()[2].strip("():")))
    assert str(ei.value) == (f"node 1 ({root}/{name}/nodes): cannot open the tier at "
                             f"{root}/{name}/nodes: refused for the test")
    assert os.listdir(root) == []
