"""`pykvtier bench`: fio's job options, workload generation, byte counts, verify, JSON shape."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from pykvtier.bench import main as bench_main
from pykvtier.bench.options import (
    BenchOptionError,
    jobs_from_args,
    parse_jobfile_text,
    parse_size,
    parse_time_us,
    resolve_jobs,
)
from pykvtier.bench.report import to_json
from pykvtier.bench.runner import gds_unavailable_reason, run_jobs
from pykvtier.bench.workload import FilePattern, io_pass, job_files, layout_files, promote_workload


def jobs_from_text(text: str, glob_args=()):
    from pykvtier.bench.options import parse_cmdline_jobs

    glob, _, _ = parse_cmdline_jobs(list(glob_args))
    return resolve_jobs(parse_jobfile_text(text, "<test>", glob))


# --------------------------------------------------------------------------- option parsing

@pytest.mark.parametrize("text,want", [
    ("4096", 4096), ("4k", 4096), ("4K", 4096), ("4kb", 4096), ("4KB", 4096), ("4ki", 4096),
    ("4KiB", 4000), ("4kib", 4000),  # fio's default kb_base=1024: the IEC suffixes mean 1000
    ("2m", 2 << 20), ("1g", 1 << 30), ("1mi", 1 << 20), ("1MiB", 10**6), ("0x1000", 4096),
    ("4096b", 4096), ("3t", 3 << 40),
])
def test_size_suffixes_follow_fio(text, want):
    assert parse_size(text) == want


def test_size_suffixes_with_kb_base_1000():
    assert parse_size("4k", 1000) == 4000
    assert parse_size("4KiB", 1000) == 4096
    assert parse_size("1MiB", 1000) == 1 << 20
    (job,) = jobs_from_args(["--name=a", "--kb_base=1000", "--size=1m", "--bs=4KiB"])
    assert job.size == 10**6 and job.bs == (4096, 4096)


@pytest.mark.parametrize("bad", ["1.5k", "4q", "abc", "-4k", "50%"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(BenchOptionError, match="size="):
        parse_size(bad)


def test_time_values():
    assert parse_time_us("30") == 30_000_000
    assert parse_time_us("500ms") == 500_000
    assert parse_time_us("2m") == 120_000_000
    assert parse_time_us("1h") == 3_600_000_000
    with pytest.raises(BenchOptionError):
        parse_time_us("3 weeks")


JOBFILE = """
; a comment
# another comment
[global]
ioengine=io_uring
direct=1
rw=randread
size=1g
bs=4k
bs=2m
time_based
runtime=10

[a]
iodepth=32
nrfiles=512

[global]
rw=write

[b]
numjobs=2
iodepth=8
"""


def test_jobfile_and_command_line_agree():
    from_file = jobs_from_text(JOBFILE)
    from_cmd = jobs_from_args([
        "--ioengine=io_uring", "--direct=1", "--rw=randread", "--size=1g", "--bs=4k", "--bs=2m",
        "--time_based", "--runtime=10",
        "--name=a", "--iodepth=32", "--nrfiles=512",
        "--name=b", "--rw=write", "--numjobs=2", "--iodepth=8",
    ])
    assert [j.name for j in from_file] == [j.name for j in from_cmd] == ["a", "b"]
    for f, c in zip(from_file, from_cmd):
        assert f.values == c.values
    a, b = from_file
    assert a.rw == "randread" and b.rw == "write"  # a later [global] changes later jobs only
    assert a.bs == (2 << 20, 2 << 20)  # duplicate key: the last one wins
    assert a.time_based is True and a.runtime == 10_000_000  # option without a value = 1
    assert a.ioengine == "pykvtier-uring"  # fio's io_uring is pykvtier's uring engine
    assert b.numjobs == 2 and a.size == 1 << 30


def test_command_line_globals_are_defaults_for_job_files(tmp_path):
    jf = tmp_path / "j.fio"
    jf.write_text("[x]\nrw=read\nsize=1m\nbs=64k\n[y]\nrw=read\nsize=1m\niodepth=4\n")
    x, y = jobs_from_args(["--iodepth=16", "--directory=/some/where", str(jf)])
    assert x.iodepth == 16 and y.iodepth == 4  # the file's own value wins
    assert x.directory == y.directory == "/some/where"


def test_include_and_env(tmp_path, monkeypatch):
    (tmp_path / "common.fio").write_text("direct=1\nbs=${BENCH_BS}\n")
    jf = tmp_path / "main.fio"
    jf.write_text("[global]\ninclude common.fio\nsize=8m\n[j]\nrw=read\n")
    monkeypatch.setenv("BENCH_BS", "128k")
    (j,) = jobs_from_args([str(jf)])
    assert j.direct is True and j.bs == (128 << 10, 128 << 10)


@pytest.mark.parametrize("args,match", [
    (["--name=a", "--size=1m", "--frobnicate=3"], "unknown option 'frobnicate'"),
    (["--name=a", "--size=1m", "--rw=sideways"], "rw=sideways"),
    (["--name=a", "--size=1m", "--rw=trim"], "trim"),
    (["--name=a", "--size=1m", "--ioengine=libaio"], "ioengine=libaio"),
    (["--name=a", "--size=1m", "--iodepth=0"], "iodepth=0"),
    (["--name=a", "--size=1m", "--bssplit=4k/50"], "bssplit"),
    (["--name=a", "--rw=read"], "size= is required"),
    (["--name=a", "--size=1m", "--time_based"], "time_based needs runtime"),
    (["--name=a", "--rw=promote", "--model=llama-3-8b", "--bs=4k", "--nrfiles=4"], "disagrees"),
    (["--name=a", "--rw=promote", "--model=gpt-9", "--nrfiles=4"], "unknown model preset"),
])
def test_option_errors_name_the_option(args, match):
    with pytest.raises(BenchOptionError, match=match):
        jobs_from_args(args)


def test_unknown_option_in_jobfile_names_file_and_line():
    with pytest.raises(BenchOptionError, match=r"unknown option 'nope' \(<test>:3\)"):
        jobs_from_text("[a]\nsize=1m\nnope=1\n")


def test_cli_exit_status_2_names_the_option(capsys):
    assert bench_main(["--name=a", "--size=1m", "--blocksizee=4k"]) == 2
    assert "unknown option 'blocksizee'" in capsys.readouterr().err


def test_model_gives_the_block_size():
    (j,) = jobs_from_args(["--name=p", "--rw=promote", "--model=qwen2.5-7b", "--tokens_per_block=32",
                           "--nrfiles=8"])
    assert j.bs == (57344 * 32, 57344 * 32)


def test_fio_reads_sizes_the_same_way(tmp_path):
    """The suffix table above, checked against fio itself where it is installed."""
    if not shutil.which("fio"):
        pytest.skip("fio not installed")
    for text in ("4k", "4KiB", "1ki"):
        out = subprocess.run(
            ["fio", "--name=t", f"--filename={tmp_path / 'f'}", "--rw=write", "--bs=8", f"--size={text}",
             "--output-format=json"], capture_output=True, text=True, check=True).stdout
        data = json.loads(out[out.index("{"):])
        assert data["jobs"][0]["write"]["io_bytes"] == parse_size(text), text


# --------------------------------------------------------------------------- workload generation

def _spec(*args):
    (j,) = jobs_from_args(["--name=j", *args])
    return j


def test_files_follow_filename_format(tmp_path):
    s = _spec(f"--directory={tmp_path}", "--size=1m", "--nrfiles=4", "--bs=64k", "--numjobs=2")
    fs = job_files(s, 1)
    assert [os.path.basename(p) for p in fs.paths] == ["j.1.0", "j.1.1", "j.1.2", "j.1.3"]
    assert fs.file_size == 256 << 10 and fs.blocks_per_file == 4


def test_sequential_roundrobin_order(tmp_path):
    s = _spec(f"--directory={tmp_path}", "--size=48k", "--nrfiles=3", "--bs=4k", "--rw=read")
    p = io_pass(s, job_files(s, 0))
    assert p.file_idx.tolist() == [0, 1, 2] * 4
    assert p.offsets.tolist() == [0] * 3 + [4096] * 3 + [8192] * 3 + [12288] * 3
    s2 = _spec(f"--directory={tmp_path}", "--size=48k", "--nrfiles=3", "--bs=4k", "--rw=read",
               "--file_service_type=sequential")
    p2 = io_pass(s2, job_files(s2, 0))
    assert p2.file_idx.tolist() == [0] * 4 + [1] * 4 + [2] * 4


@pytest.mark.parametrize("service", ["roundrobin", "sequential", "random"])
def test_random_pass_covers_every_block_once(tmp_path, service):
    s = _spec(f"--directory={tmp_path}", "--size=4m", "--nrfiles=4", "--bs=4k", "--rw=randread",
              f"--file_service_type={service}")
    fs = job_files(s, 0)
    p = io_pass(s, fs)
    ids = p.file_idx.astype(np.int64) * fs.blocks_per_file + p.offsets // fs.bs
    assert len(ids) == 1024 and len(np.unique(ids)) == 1024  # a random map: each block once
    assert not np.array_equal(p.offsets, np.sort(p.offsets))
    assert np.array_equal(io_pass(s, fs).offsets, p.offsets)  # randrepeat: the same sequence
    assert not np.array_equal(io_pass(s, fs, pass_no=1).offsets, p.offsets)


def test_randrw_mix(tmp_path):
    s = _spec(f"--directory={tmp_path}", "--size=64m", "--bs=4k", "--rw=randrw", "--rwmixread=70")
    p = io_pass(s, job_files(s, 0))
    share = 1 - p.is_write.mean()
    assert 0.67 < share < 0.73


def test_promote_requests_cover_the_population():
    s = _spec("--rw=promote", "--model=tiny", "--tokens_per_block=16", "--nrfiles=100", "--batch=8")
    w = promote_workload(s)
    assert len(w.population) == 100
    assert [len(r) for r in w.requests] == [8] * 12 + [4]
    assert sorted(k for r in w.requests for k in r) == sorted(w.population)


def test_promote_requests_from_the_mooncake_trace():
    s = _spec("--rw=promote", "--model=tiny", "--tokens_per_block=256", "--trace=mooncake",
              "--trace_requests=5")
    w = promote_workload(s)
    from pykvtier.replay import block_key
    from pykvtier.trace import load_trace

    reqs = load_trace(None, 5)
    assert len(w.requests) == 5
    assert w.requests[0] == [block_key(h, i, 256 * 256) for h in reqs[0].hash_ids for i in range(2)]
    assert len(w.population) == len({k for r in w.requests for k in r})
    split = promote_workload(s, max_blocks_per_job=3)
    assert split.split_requests > 0 and max(len(r) for r in split.requests) <= 3


# --------------------------------------------------------------------------- runs: bytes, verify, JSON

def _run(args):
    specs = jobs_from_args(args)
    return specs, run_jobs(specs)


def _io_args(root, *extra, direct=False):
    return [f"--directory={root}", f"--direct={int(direct)}", *extra]


@pytest.mark.parametrize("rw", ["read", "randread", "write", "randwrite"])
def test_bytes_moved_equal_bs_times_ios(root, rw):
    specs, (g,) = _run(_io_args(root, "--name=j", f"--rw={rw}", "--bs=16k", "--size=1m", "--nrfiles=4",
                                "--iodepth=4"))
    (r,) = g.clones
    d = r.write if "write" in rw else r.read
    assert r.error == 0, r.error_msg
    assert d.ios == 64 and d.io_bytes == 16384 * 64 == 1 << 20
    assert len(d.lat()) == 64 and (d.lat() > 0).all()


def test_number_ios_loops_and_randrw_bytes(root):
    _, (g,) = _run(_io_args(root, "--name=n", "--rw=read", "--bs=8k", "--size=256k", "--number_ios=10"))
    assert g.clones[0].read.ios == 10 and g.clones[0].read.io_bytes == 80 << 10
    _, (g,) = _run(_io_args(root, "--name=l", "--rw=read", "--bs=8k", "--size=256k", "--loops=3"))
    assert g.clones[0].read.ios == 96
    _, (g,) = _run(_io_args(root, "--name=m", "--rw=randrw", "--bs=8k", "--size=512k", "--iodepth=4"))
    r = g.clones[0]
    assert r.read.ios + r.write.ios == 64
    assert r.read.io_bytes + r.write.io_bytes == 512 << 10 and r.read.ios and r.write.ios


def test_direct_io_and_numjobs(direct_root):
    _, (g,) = _run(_io_args(direct_root, "--name=d", "--rw=randread", "--bs=64k", "--size=512k",
                            "--nrfiles=2", "--iodepth=8", "--numjobs=2", direct=True))
    assert [c.jobnum for c in g.clones] == [0, 1]
    assert all(c.error == 0 and c.read.io_bytes == 512 << 10 for c in g.clones)
    assert os.path.exists(os.path.join(direct_root, "d.1.1"))


def test_posix_engine_counts_the_same(root):
    _, (g,) = _run(_io_args(root, "--name=p", "--ioengine=psync", "--rw=randread", "--bs=16k",
                            "--size=512k", "--iodepth=4"))
    r = g.clones[0]
    assert r.error == 0 and r.read.ios == 32 and r.extra["engine"] == "posix"


def test_verify_passes_on_laid_out_files_and_catches_a_corrupted_block(root, capsys):
    args = _io_args(root, "--name=v", "--rw=randread", "--bs=16k", "--size=256k", "--nrfiles=4",
                    "--iodepth=4", "--verify=crc32c")
    _, (g,) = _run(args)
    assert g.clones[0].error == 0 and g.clones[0].read.ios == 16
    victim = os.path.join(root, "v.0.2")
    with open(victim, "r+b") as f:
        f.seek(20000)
        b = f.read(1)
        f.seek(20000)
        f.write(bytes([b[0] ^ 0xFF]))
    _, (g,) = _run(args)
    r = g.clones[0]
    assert r.error != 0
    assert "v.0.2" in r.error_msg and "offset 20000" in r.error_msg
    assert bench_main([*args, "--output-format=json", "--eta=never"]) == 1
    assert "verify: bad data" in capsys.readouterr().err


def test_verify_write_reads_back(root):
    _, (g,) = _run(_io_args(root, "--name=vw", "--rw=randwrite", "--bs=16k", "--size=256k",
                            "--iodepth=4", "--verify=md5"))
    r = g.clones[0]
    assert r.error == 0 and "read back and compared 16 written blocks" in r.extra["verify"]
    pat = FilePattern()
    with open(os.path.join(root, "vw.0.0"), "rb") as f:
        data = np.frombuffer(f.read(), np.uint8)
    assert pat.first_mismatch(data, os.path.join(root, "vw.0.0"), 0) == -1


def test_layout_reuses_files(root):
    s = _spec(f"--directory={root}", "--size=64k", "--bs=4k")
    fs = job_files(s, 0)
    pat = FilePattern()
    assert layout_files(fs, pat, True, "j", None) == 64 << 10
    assert layout_files(fs, pat, True, "j", None) == 0
    fs2 = job_files(_spec(f"--directory={root}", "--size=64k", "--bs=4k", "--allow_file_create=0",
                          "--filename_format=other"), 0)
    with pytest.raises(BenchOptionError, match="allow_file_create=0"):
        layout_files(fs2, pat, False, "j", None)


FIO_JOB_KEYS = {"jobname", "groupid", "error", "elapsed", "job options", "read", "write", "trim",
                "sync", "job_runtime", "usr_cpu", "sys_cpu", "ctx", "majf", "minf", "latency_ns",
                "latency_us", "latency_ms"}
FIO_DIR_KEYS = {"io_bytes", "io_kbytes", "bw_bytes", "bw", "iops", "runtime", "total_ios", "short_ios",
                "drop_ios", "slat_ns", "clat_ns", "lat_ns", "bw_min", "bw_max", "bw_samples",
                "iops_min", "iops_max", "iops_samples"}


def test_json_output_has_fios_shape(root, tmp_path):
    out = tmp_path / "o.json"
    rc = bench_main(_io_args(root, "--name=j1", "--rw=randread", "--bs=16k", "--size=512k", "--iodepth=2",
                             "--name=j2", "--rw=write", "--bs=32k", "--size=256k", "--stonewall",
                             "--output-format=json", f"--output={out}", "--eta=never"))
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["fio version"].startswith("pykvtier-bench-")
    assert {"timestamp", "time", "jobs"} <= set(data)
    j1, j2 = data["jobs"]
    assert FIO_JOB_KEYS <= set(j1) and FIO_DIR_KEYS <= set(j1["read"])
    assert j1["jobname"] == "j1" and j2["groupid"] == 1  # stonewall: a new group
    rd = j1["read"]
    assert rd["io_bytes"] == 512 << 10 and rd["total_ios"] == 32 and rd["io_kbytes"] == 512
    assert rd["bw"] == rd["bw_bytes"] // 1024
    assert rd["iops"] / rd["bw_bytes"] == pytest.approx(rd["total_ios"] / rd["io_bytes"], rel=1e-6)
    c = rd["clat_ns"]
    assert c["N"] == 32 and c["min"] <= c["percentile"]["50.000000"] <= c["percentile"]["99.000000"] <= c["max"]
    assert set(c["percentile"]) >= {"1.000000", "99.900000", "99.990000"}
    assert j1["job options"] == {"rw": "randread", "bs": "16k", "size": "512k", "iodepth": "2",
                                 "directory": str(root), "direct": "0"}
    assert j2["write"]["io_bytes"] == 256 << 10 and j2["read"]["io_bytes"] == 0
    assert j1["pykvtier"]["engine"] in ("uring", "posix") and "cpu_s_per_gib" in j1["pykvtier"]


def test_percentile_list_and_group_reporting(root):
    specs, groups = _run(_io_args(root, "--name=g", "--rw=read", "--bs=16k", "--size=128k", "--numjobs=3",
                                  "--group_reporting", "--percentile_list=50:99.5"))
    (job,) = to_json(groups)["jobs"]
    assert job["read"]["io_bytes"] == 3 * (128 << 10) and job["read"]["total_ios"] == 24
    assert list(job["read"]["clat_ns"]["percentile"]) == ["50.000000", "99.500000"]


def test_text_report_is_fio_shaped(root, capsys):
    assert bench_main(_io_args(root, "--name=t", "--rw=read", "--bs=16k", "--size=128k", "--eta=never")) == 0
    out = capsys.readouterr().out
    assert "t: (groupid=0, jobs=1): err= 0:" in out
    assert "  read: IOPS=" in out and "BW=" in out and "clat percentiles" in out
    assert "  cpu          : usr=" in out and "Run status group 0 (all jobs):" in out
    assert "READ: bw=" in out and "io=128KiB" in out


# --------------------------------------------------------------------------- KV workloads and engines

def test_promote_moves_whole_requests(root):
    _, (g,) = _run([f"--directory={root}", "--name=p", "--rw=promote", "--model=tiny",
                    "--tokens_per_block=16", "--nrfiles=40", "--batch=8", "--iodepth=8", "--verify=meta"])
    r = g.clones[0]
    assert r.error == 0, r.error_msg
    assert r.unit == "request" and r.read.ios == 5  # 40 blocks, 8 per request
    assert r.read.io_bytes == 40 * 4096 and r.extra["blocks_loaded"] == 40
    assert r.extra["verified"] == 40 and r.extra["promoter_jobs"] == 5
    _, (g,) = _run([f"--directory={root}", "--name=p", "--rw=promote", "--model=tiny",
                    "--tokens_per_block=16", "--nrfiles=40", "--batch=8", "--iodepth=8"])
    assert g.clones[0].extra["stored_at_setup"] == 0  # the population is reused


@pytest.mark.parametrize("mode", ["indexed", "probed"])
def test_lookup_answers_and_counts(root, mode):
    _, (g,) = _run([f"--directory={root}", "--name=l", "--rw=lookup", f"--lookup={mode}", "--model=tiny",
                    "--tokens_per_block=16", "--nrfiles=50", "--lookup_hit=40", "--iodepth=16"])
    r = g.clones[0]
    assert r.error == 0, r.error_msg
    assert r.read.ios == 50 and r.read.io_bytes == 0 and r.unit == "key"
    a = r.extra["answers"]
    assert a["HIT"] + a["MISS"] == 50 and 0 < a["HIT"] < 50
    assert len(r.read.lat()) == 50


def test_gds_reports_why_it_cannot_run(root):
    reason = gds_unavailable_reason()
    if reason is None:
        pytest.skip("a GDS path is available here")
    _, (g,) = _run([f"--directory={root}", "--name=g", "--ioengine=pykvtier-gds", "--rw=read", "--size=64k"])
    r = g.clones[0]
    assert r.error and "pykvtier-gds unavailable" in r.error_msg
    assert not os.path.exists(os.path.join(root, "g.0.0"))  # refused before laying out files


def test_fio_jobfile_equivalent(tmp_path):
    from pykvtier.bench.fio import fio_jobfile, metrics

    specs = jobs_from_text("[global]\nioengine=io_uring\ndirect=1\n[r]\nrw=randread\nbs=2m\nsize=1g\n"
                           "nrfiles=512\niodepth=32\n")
    text = fio_jobfile(specs, prefault=True, directory="/d")
    assert "rw=randrw\nrwmixread=100" in text and "directory=/d" in text and "ioengine=io_uring" in text
    assert "allow_file_create=0" in text and "lat_percentiles=1" in text
    again = jobs_from_text(text)
    assert again[0].bs == specs[0].bs and again[0].iodepth == 32 and again[0].rwmixread == 100
    fake = {"jobs": [{"jobname": "r", "error": 0, "usr_cpu": 10.0, "sys_cpu": 30.0, "job_runtime": 1000,
                      "read": {"io_bytes": 1 << 30, "total_ios": 512, "runtime": 1000,
                               "clat_ns": {}, "lat_ns": {"percentile": {"50.000000": 2e6, "99.000000": 9e6}}},
                      "write": {"io_bytes": 0, "total_ios": 0, "runtime": 0}}]}
    m = metrics(fake, "fio")["r"]
    assert m["gbps"] == pytest.approx((1 << 30) / 1e9) and m["iops"] == 512
    assert m["cpu_s_per_gib"] == pytest.approx(0.4) and m["p99_ms"] == pytest.approx(9.0)


@pytest.mark.parametrize("mode,loops,max_cpus", [("indexed", 50, 1.1), ("probed", 10, 3.0)])
def test_lookup_report_is_fio_shaped_and_cpu_is_over_its_runtime(root, mode, loops, max_cpus):
    """rw=lookup: the text has no Python dicts, its answers and CPU figures are the JSON's, and
    the CPU is measured over the runtime it is a percentage of. Indexed: one thread doing
    lookups cannot use more CPU than its runtime. Probed: the thread waits (GIL released) while
    io_uring workers run a step's statx batch; setting up each pass's tier is neither runtime
    nor CPU (counted in, it read as over 1000 % on this run)."""
    import re

    from pykvtier.bench.report import format_text

    specs, (g,) = _run([f"--directory={root}", "--name=l", "--rw=lookup", f"--lookup={mode}",
                        "--model=tiny", "--tokens_per_block=16", "--nrfiles=200", "--lookup_hit=40",
                        "--iodepth=16", f"--loops={loops}"])
    n = 200 * loops
    (r,) = g.clones
    assert r.error == 0, r.error_msg
    assert r.read.ios == n
    rt = r.read.runtime_s
    cpu = r.usr_s + r.sys_s
    assert 0 < cpu <= rt * max_cpus + 0.002, (cpu, rt)
    assert "timed lookups" in r.cpu_note
    (job,) = to_json([g])["jobs"]
    assert job["usr_cpu"] == pytest.approx(100.0 * r.usr_s / rt, rel=1e-3, abs=0.01)
    assert job["pykvtier"]["cpu_ns_per_key"] == pytest.approx(cpu * 1e9 / n)
    a = job["pykvtier"]["answers"]
    assert a["HIT"] + a["MISS"] == n and 0 < a["HIT"] < n

    text = format_text([g], specs)
    assert "{" not in text and "}" not in text  # no raw dicts
    (kv,) = [line for line in text.splitlines() if line.startswith("  pykvtier     : ")]
    assert f"answers: HIT={a['HIT']}, MISS={a['MISS']}" in kv
    assert "keys_per_s" not in kv  # the lookup line already gives keys/s
    (cpu_line,) = [line for line in text.splitlines() if line.startswith("  cpu          : ")]
    m = re.match(r"  cpu          : usr=([\d.]+)%, sys=([\d.]+)%, ctx=\d+, majf=\d+, minf=\d+, "
                 r"cpu/key=([\d.]+)(ns|us|ms)$", cpu_line)
    assert m, cpu_line
    assert float(m.group(1)) == pytest.approx(job["usr_cpu"], abs=0.006)
    assert float(m.group(2)) == pytest.approx(job["sys_cpu"], abs=0.006)
    per_key_ns = float(m.group(3)) * {"ns": 1, "us": 1e3, "ms": 1e6}[m.group(4)]
    assert per_key_ns == pytest.approx(job["pykvtier"]["cpu_ns_per_key"], rel=0.01, abs=1)
    assert "  lookup: keys/s=" in text and f"keys={n} in " in text


# --------------------------------------------------------------------------- words and labels

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _script(name):
    """bench/NAME.py as a module (the scripts are not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, BENCH_DIR)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(BENCH_DIR)
    return mod


def test_cmdhelp_of_an_unknown_option_exits_2(capsys):
    assert bench_main(["--cmdhelp=bogus"]) == 2
    assert capsys.readouterr() == ("", "pykvtier bench: error: --cmdhelp=bogus: no option 'bogus'; "
                                       "`pykvtier bench --cmdhelp` lists them\n")
    assert bench_main(["--cmdhelp=iodepth"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("iodepth ")


def test_layout_message_says_file_or_files_as_fio_does(tmp_path):
    import io

    log = io.StringIO()
    pat = FilePattern()
    layout_files(job_files(_spec(f"--directory={tmp_path}", "--size=64k", "--bs=4k"), 0), pat, True, "one", log)
    layout_files(job_files(_spec(f"--directory={tmp_path}", "--size=128k", "--bs=4k", "--nrfiles=2",
                                 "--filename_format=two.$filenum"), 0), pat, True, "two", log)
    assert log.getvalue() == ("one: Laying out IO file (1 file / 64KiB)\n"
                              "two: Laying out IO files (2 files / total 128KiB)\n")


def test_plural():
    from pykvtier.bench.sysutil import plural

    assert [plural(n, "round") for n in (0, 1, 2)] == ["0 rounds", "1 round", "2 rounds"]
    assert plural(1, "job file") == "1 job file" and plural(3, "job file") == "3 job files"


def test_compare_fio_labels_are_job_names():
    cf = _script("compare_fio")
    cases = [{"name": "kv-randread-2m-qd32", "jobs": ["randread-2m-qd32"]},
             {"name": "kv-randread-2m-qd32-again", "jobs": ["randread-2m-qd32", "other"]},
             {"name": "kv-write", "jobs": ["write-2m-qd8"]}]
    labels = cf.job_labels(cases)
    assert labels == {("kv-randread-2m-qd32", "randread-2m-qd32"): "kv-randread-2m-qd32/randread-2m-qd32",
                      ("kv-randread-2m-qd32-again", "randread-2m-qd32"):
                          "kv-randread-2m-qd32-again/randread-2m-qd32",
                      ("kv-randread-2m-qd32-again", "other"): "other",
                      ("kv-write", "write-2m-qd8"): "write-2m-qd8"}
    assert cf.label_width(labels) == len("kv-randread-2m-qd32-again/randread-2m-qd32 pykvtier")
    assert cf.label_width({("a", "b"): "b"}) == 26
    mount = ("/", "ext4", "/dev/vda")
    assert cf.headline(1, 1, "/d", mount) == "compare_fio: 1 job file, 1 round, files in /d (ext4 on /dev/vda)"
    assert cf.headline(3, 5, "/d", mount) == "compare_fio: 3 job files, 5 rounds, files in /d (ext4 on /dev/vda)"


_JOB = "[global]\ndirect=1\nbs=64k\nsize=256k\nnrfiles=4\nrw=randread\n[{name}]\niodepth={qd}\n"


def _on_tmpfs(path) -> bool:
    from pykvtier.bench.sysutil import mount_of

    return mount_of(str(path))[1] in ("tmpfs", "ramfs")


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_compare_fio_names_each_job_the_same_way_everywhere(tmp_path):
    """Two job files whose names share their first 21 characters, one round: every row names
    its job in full (per round, medians, ratios), and the counts are singular."""
    if _on_tmpfs(tmp_path):
        pytest.skip("compare_fio refuses a tmpfs directory (no O_DIRECT)")
    files = []
    for stem, name, qd in (("kv-randread-tiny-job-a", "randread-64k-first", 2),
                           ("kv-randread-tiny-job-b", "randread-64k-second", 1)):
        files.append(tmp_path / f"{stem}.fio")
        files[-1].write_text(_JOB.format(name=name, qd=qd))
    d = tmp_path / "d"
    import sys

    proc = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "compare_fio.py"), "--dir", str(d),
                           "--rounds", "1", "--no-drop-caches", *map(str, files)],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"compare_fio: 2 job files, 1 round, files in {d} " + out[0].split(f"{d} ", 1)[1]
    assert "medians over 1 round (GB = 1e9 B; latency: fio lat = pykvtier clat, per I/O)" in out
    width = len("randread-64k-second pykvtier")  # the label column: the longest label and tool
    jobs = ("randread-64k-first", "randread-64k-second")
    rows = [line[:2 + width + 1] for line in out if line.startswith("  randread-") and "bandwidth" not in line]
    per_round = [f"  {job} {tool}".ljust(2 + width) + " " for job in jobs for tool in ("fio", "pykvtier")]
    assert rows == per_round + per_round  # per round, then the medians
    ratios = [line[:2 + 24 + 11] for line in out if line.startswith("  randread-") and " bandwidth " in line]
    assert ratios == [f"  {j:<24} bandwidth " for j in jobs]
    assert "kv-randread" not in "\n".join(out[6:])
    assert proc.stderr.splitlines() == ["randread-64k-first: Laying out IO files (4 files / total 256KiB)",
                                        "randread-64k-second: Laying out IO files (4 files / total 256KiB)"]


def test_sweep_install_hint_and_layout_label():
    sw = _script("sweep")
    assert "pip install -e '.[bench]'" in sw.MATPLOTLIB_HINT and "pykvtier[bench]" not in sw.MATPLOTLIB_HINT
    assert "pykvtier[bench]" not in sw.__doc__
    assert sw.job_name(2 << 20, [8, 32]) == "sweep-2MiB-qd8,32"
    (spec,) = jobs_from_args(sw.job_args("/d", 2 << 20, 8, 4 << 20, "pykvtier-uring", sw.job_name(2 << 20, [8, 32])))
    assert (spec.name, spec.values["iodepth"]) == ("sweep-2MiB-qd8,32", 8)
    (spec,) = jobs_from_args(sw.job_args("/d", 2 << 20, 32, 4 << 20, "pykvtier-uring"))
    assert spec.name == "sweep-2MiB-qd32"


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_sweep_labels_its_layout_with_the_iodepths_it_runs(tmp_path):
    if _on_tmpfs(tmp_path):
        pytest.skip("sweep refuses a tmpfs directory (no O_DIRECT)")
    import sys

    d = tmp_path / "d"
    proc = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "sweep.py"), "--dir", str(d), "--bs", "64k",
                           "--iodepth", "2,4", "--engines", "pykvtier-posix", "--rounds", "1", "--size", "256k",
                           "--no-drop-caches", "--png", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["sweep-64KiB-qd2,4: Laying out IO files (4 files / total 256KiB)"]
    assert proc.stdout.splitlines()[0].startswith(
        "sweep: bs 64KiB x iodepth 2,4 x fio, pykvtier-posix; 256KiB per run; 1 round; files in ")


def _have_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


@pytest.mark.sglang
@pytest.mark.skipif(not _have_sglang(), reason="SGLang is not installed (requirements-sglang.txt)")
def test_vs_sglang_file_runs_every_tier_and_checks_every_page(tmp_path):
    """bench/vs_sglang_file.py at a tiny size (8 KiB pages, 6 of them, batches of 4: one short
    batch): every tier and layout stores and loads, every loaded page is checked, each tier's
    directory is gone after it. Timings and verdicts are not checked."""
    if _on_tmpfs(tmp_path):
        pytest.skip("vs_sglang_file refuses a tmpfs directory (no O_DIRECT)")
    import sys

    d, out_json = tmp_path / "d", tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "vs_sglang_file.py"), "--dir", str(d),
                           "--page-size", "16", "--layers", "2", "--kv-heads", "2", "--head-dim", "32",
                           "--set-bytes", "48K", "--batch-pages", "4", "--min-batches", "3",
                           "--no-drop-caches", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    rows = {(r["phase"], r["layout"], r["tier"]): r for r in data["results"]}
    tiers = ("pykvtier-v1", "pykvtier-legacy", "hicache-file")
    assert set(rows) == {(ph, lay, t) for ph in ("store", "load") for lay in ("page_first", "layer_first")
                         for t in tiers}
    assert (data["page_bytes"], data["pages"], data["batch_pages"], data["load_passes"]) == (8192, 6, 4, 2)
    for (phase, layout, tier), r in rows.items():
        assert r["batches"] == (2 if phase == "store" else 4)
        if phase == "load":
            assert r["verified_pages"] == 12
    assert rows["load", "page_first", "pykvtier-v1"]["path"] == "zero copy (v1)"
    assert rows["load", "layer_first", "pykvtier-v1"]["path"] == "staging arena (v1)"
    assert rows["load", "page_first", "pykvtier-legacy"]["path"] == "staging arena (legacy tensors)"
    assert os.listdir(d) == []
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if line.startswith("  page_first pykvtier-v1 (backend calls): GB/s ")) == 1
    assert sum(1 for line in lines if " <= 0.5x " in line) == 8  # 2 layouts x 2 tiers x 2 views
    assert sum(1 for line in lines if "every page byte-exact" in line) == 6


def test_vs_lmcache_disk_runs_every_tier_and_checks_every_chunk(tmp_path):
    """bench/vs_lmcache_disk.py at a tiny size (8 KiB chunks, 32 of them, batches of 3: one short
    batch): pykvtier's plug-in and both LocalDiskBackend modes store and retrieve inside LMCache's
    engine, every chunk checked (the script exits non-zero on a wrong byte), each tier's directory
    gone after it. Timings and verdicts are not checked."""
    pytest.importorskip("lmcache", reason="LMCache is not installed (requirements-lmcache.txt)")
    if _on_tmpfs(tmp_path):
        pytest.skip("vs_lmcache_disk refuses a tmpfs directory (no O_DIRECT)")
    import sys

    d, out_json = tmp_path / "d", tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-P", os.path.join(BENCH_DIR, "vs_lmcache_disk.py"),
                           "--dir", str(d), "--total", "256K", "--batch", "3", "--min-batches", "2",
                           "--chunk-tokens", "16", "--layers", "2", "--kv-heads", "2",
                           "--head-dim", "32", "--no-drop-caches", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    rows = {(r["phase"], r["tier"]): r for r in data["results"]}
    assert set(rows) == {(ph, t) for ph in ("store", "retrieve")
                         for t in ("pykvtier", "disk-buffered", "disk-odirect")}
    assert (data["chunk_bytes"], data["chunks"], data["batch_chunks"]) == (8192, 32, 3)
    for (phase, tier), r in rows.items():
        assert r["bytes"] == (32 if phase == "store" else 32 * data["retrieve_passes"]) * 8192, (phase, tier)
    assert rows[("store", "pykvtier")]["io"] in ("engine uring, O_DIRECT True, verify payload",
                                                  "engine posix, O_DIRECT True, verify payload")
    assert not d.exists() or not any(d.iterdir())
    # --verify reaches the plug-in's tiers (pykvtier alone, retrieves still checked byte for byte)
    proc = subprocess.run([sys.executable, "-P", os.path.join(BENCH_DIR, "vs_lmcache_disk.py"),
                           "--dir", str(d), "--total", "64K", "--batch", "4", "--min-batches", "1",
                           "--chunk-tokens", "16", "--layers", "2", "--kv-heads", "2",
                           "--head-dim", "32", "--no-drop-caches", "--tiers", "pykvtier",
                           "--verify", "header", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {(r["phase"], r["tier"]): r for r in json.loads(out_json.read_text())["results"]}
    assert set(rows) == {("store", "pykvtier"), ("retrieve", "pykvtier")}
    assert rows[("retrieve", "pykvtier")]["io"].endswith(", verify header")
    assert rows[("retrieve", "pykvtier")]["verified_chunks"] == 8


def test_shared_churn_counts_every_key_and_checks_every_byte(tmp_path):
    """bench/shared_churn.py at a tiny size (2 processes sharing a root of 12 blocks of 64 KiB,
    1.5 s): every request key is loaded or stored, every count adds up per worker, the bytes
    verified are the loads that succeeded times the block size, no byte was wrong, the root was
    sampled and holds no temporary once the workers are gone. The rates and the capacity verdict
    are what the script measures: not checked."""
    import sys

    import pykvtier

    bs, out_json = 64 << 10, tmp_path / "churn.json"
    cmd = [sys.executable, os.path.join(BENCH_DIR, "shared_churn.py"), "--procs", "2",
           "--capacity-blocks", "12", "--block-size", "64KiB", "--request-blocks", "4",
           "--seconds", "1.5", "--dir", str(tmp_path / "d"), "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("command: ") and lines[0].endswith(" ".join(cmd[1:]))
    assert any(line.startswith("  store failure % (of stores after a MISS) ") for line in lines)
    data = json.loads(out_json.read_text())
    cfg, summary = data["config"], data["summary"]
    assert (cfg["block_size"], cfg["file_bytes"], cfg["procs"]) == (bs, bs + 4096, 2)
    assert cfg["capacity_bytes"] == 12 * (bs + 4096)
    here = os.path.dirname(pykvtier.__file__)
    assert data["pykvtier"] == [here]  # what the workers imported
    assert len(data["workers"]) == 2
    for w in data["workers"]:
        c = w["counts"]
        assert w["modules"]["pykvtier.tier"] == os.path.join(here, "tier.py")
        assert c["requests"] > 0 and c["load_keys"] + c["store_keys"] > 0
        assert c["request_keys"] == c["keys_hit"] + c["store_keys_after_miss"]
        assert c["load_keys"] == c["keys_hit"] == c.get("load_ok", 0) + c.get("load_failed", 0)
        assert c.get("bytes_verified", 0) == c.get("load_ok", 0) * bs
        assert c.get("wrong_blocks", 0) == c.get("wrong_bytes", 0) == 0
        assert sum(w["load_failures"].values()) == c.get("load_failed", 0)
        assert c["store_keys"] == c["store_keys_after_miss"] + c["store_keys_after_load_failure"]
        assert c["store_keys"] == c.get("store_ok", 0) + c.get("store_failed", 0)
        assert sum(w["store_failures"].values()) == c.get("store_failed", 0)
        assert w["stats"]["blocks_loaded"] == c.get("load_ok", 0)
    assert summary["wrong_bytes"] == 0
    assert summary["samples"] == len(data["samples"]) >= 1
    assert summary["root_final_blocks"] >= 1 and summary["root_final_tmps"] == 0
    assert summary["bytes_verified"] == sum(w["counts"].get("load_ok", 0) for w in data["workers"]) * bs
    assert not os.listdir(tmp_path / "d")  # the root is removed (no --keep)
