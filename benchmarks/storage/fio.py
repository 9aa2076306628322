"""fio: the five storage profiles of the storage evaluation, run with the real fio.

Every profile runs against one data file under ``--target`` (laid out once, reused by every profile, as
the storage evaluation does). Concurrency is ``numjobs`` threads of synchronous I/O (``ioengine=psync``), each
thread on its own slice of the file; "client cache bypassed" is ``direct=1`` (O_DIRECT). Each phase is
time based: it loops over its region for ``--runtime`` seconds.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import format_table, write_json
from benchmarks.storage import KiB, MiB, format_size, parse_size, split_choices

log = logging.getLogger(__name__)

DATAFILE_NAME = "storage-bench.fio.dat"
DEFAULT_SIZE = "1G"
DEFAULT_RUNTIME_S = 30.0
DEFAULT_SMALL_WSS = "64M"
QUICK_SIZE = "256M"
QUICK_RUNTIME_S = 4.0
QUICK_SMALL_WSS = "32M"
FIO_IOENGINE = "psync"
LAYOUT_CHUNK = 8 * MiB
FIO_TIMEOUT_MARGIN_S = 120.0
NS_PER_MS = 1e6
MS_PER_S = 1000.0
P50, P99 = "50.000000", "99.000000"

# Keys of every JSON row (the tests check them).
FIO_JSON_KEYS = (
    "benchmark", "profile", "phase", "rw", "block_size", "concurrency", "direct", "region_bytes",
    "target", "runtime_s", "io_bytes", "bw_mibps", "iops", "lat_avg_ms", "lat_p50_ms", "lat_p99_ms",
    "fio_version",
)


@dataclass(frozen=True)
class Profile:
    """One fio profile: an access pattern run as a write phase and/or a read phase."""

    name: str
    description: str
    block_size: int
    random: bool
    phases: tuple[str, ...]
    concurrency: int
    direct: bool
    small_wss: bool = False

    def rw(self, phase: str) -> str:
        """fio's ``rw=`` value for ``phase`` ("write" or "read")."""
        return f"rand{phase}" if self.random else phase


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("streaming", "1 MiB sequential writes then reads, 32 concurrent", MiB, False,
                ("write", "read"), 32, direct=False),
        Profile("max-latency", "4 KiB random writes then reads, one at a time", 4 * KiB, True,
                ("write", "read"), 1, direct=False),
        Profile("min-latency", "4 KiB sequential writes then reads, one at a time, cache bypassed",
                4 * KiB, False, ("write", "read"), 1, direct=True),
        Profile("random-throughput", "4 KiB random writes then reads, 32 concurrent", 4 * KiB, True,
                ("write", "read"), 32, direct=False),
        Profile("small-wss", "1 MiB sequential reads over a small working set, 32 concurrent, cache bypassed",
                MiB, False, ("read",), 32, direct=True, small_wss=True),
    )
}


@dataclass(frozen=True)
class FioSettings:
    """What every phase shares."""

    datafile: Path
    size: int
    small_wss: int
    runtime_s: float
    direct_mode: str  # "spec": as each profile says; "all": bypass the cache everywhere
    direct_supported: bool


def fio_binary() -> str:
    """Path of the fio executable.

    Raises:
        FileNotFoundError: fio is not installed.
    """
    path = shutil.which("fio")
    if path is None:
        raise FileNotFoundError("fio is not installed (apt-get install fio); it is needed by `storage fio`")
    return path


def direct_io_supported(directory: Path) -> tuple[bool, str]:
    """Whether files in ``directory`` can be opened with O_DIRECT, and why not when they cannot."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    probe = directory / f".{DATAFILE_NAME}.odirect-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        os.close(fd)
        return True, ""
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return False, f"O_DIRECT is refused on {directory} ({err.strerror}; tmpfs does this)"
    finally:
        probe.unlink(missing_ok=True)


def lay_out(datafile: Path, size: int) -> None:
    """Make ``datafile`` at least ``size`` bytes of non-zero data (kept when already large enough)."""
    if datafile.exists() and datafile.stat().st_size >= size:
        return
    log.info("laying out %s (%s)", datafile, format_size(size))
    chunk = os.urandom(LAYOUT_CHUNK)
    with open(datafile, "wb") as f:
        for offset in range(0, size, LAYOUT_CHUNK):
            f.write(chunk[: min(LAYOUT_CHUNK, size - offset)])
        f.flush()
        os.fsync(f.fileno())


def fio_argv(profile: Profile, phase: str, settings: FioSettings) -> tuple[list[str], dict[str, Any]]:
    """fio's command line for one phase, and the facts about it that go into the row."""
    region = settings.small_wss if profile.small_wss else settings.size
    region = min(region, settings.size)
    block = profile.block_size
    slice_bytes = region // profile.concurrency // block * block
    offset_increment = slice_bytes
    if slice_bytes < block:  # too small to give each thread its own slice: all share the whole region
        slice_bytes, offset_increment = max(region // block * block, block), 0
    direct = (profile.direct or settings.direct_mode == "all") and settings.direct_supported
    argv = [
        fio_binary(),
        f"--name={profile.name}-{phase}",
        f"--filename={settings.datafile}",
        f"--rw={profile.rw(phase)}",
        f"--bs={block}",
        f"--size={slice_bytes}",
        f"--offset_increment={offset_increment}",
        f"--numjobs={profile.concurrency}",
        "--thread",
        "--group_reporting",
        "--time_based",
        f"--runtime={int(settings.runtime_s * MS_PER_S)}ms",
        f"--direct={int(direct)}",
        f"--ioengine={FIO_IOENGINE}",
        "--output-format=json",
    ]
    facts = {
        "profile": profile.name,
        "phase": phase,
        "rw": profile.rw(phase),
        "block_size": block,
        "concurrency": profile.concurrency,
        "direct": direct,
        "region_bytes": slice_bytes if offset_increment == 0 else slice_bytes * profile.concurrency,
    }
    return argv, facts


def parse_fio_output(stdout: str, phase: str) -> dict[str, Any]:
    """Bandwidth (MiB/s), IOPS and completion latency (ms) of ``phase`` from fio's JSON output.

    fio reports ``bw`` in KiB/s and ``clat_ns`` in nanoseconds. Text before the JSON (fio's own
    warnings) is skipped.

    Raises:
        ValueError: the output holds no JSON document or no job.
        RuntimeError: fio reports an error for the job.
    """
    start = stdout.find("{")
    if start < 0:
        raise ValueError(f"fio printed no JSON: {stdout[-500:]!r}")
    doc = json.loads(stdout[start:])
    if not doc.get("jobs"):
        raise ValueError("fio JSON has no jobs")
    job = doc["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job {job.get('jobname')} failed with error {job['error']}")
    side = job[phase]
    clat = side["clat_ns"]
    percentiles = clat.get("percentile", {})
    return {
        "fio_version": doc.get("fio version"),
        "runtime_s": side["runtime"] / MS_PER_S,
        "io_bytes": side["io_bytes"],
        "bw_mibps": side["bw"] / KiB,
        "iops": side["iops"],
        "lat_avg_ms": clat["mean"] / NS_PER_MS,
        "lat_p50_ms": percentiles.get(P50, 0.0) / NS_PER_MS,
        "lat_p99_ms": percentiles.get(P99, 0.0) / NS_PER_MS,
    }


def run_phase(profile: Profile, phase: str, settings: FioSettings) -> dict[str, Any]:
    """Run one phase of ``profile`` with fio and return its row.

    Raises:
        RuntimeError: fio exits non-zero (its stderr is in the message).
    """
    argv, facts = fio_argv(profile, phase, settings)
    log.info("fio %s %s: %s", profile.name, phase, " ".join(argv[1:]))
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=settings.runtime_s + FIO_TIMEOUT_MARGIN_S
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"fio {profile.name} {phase} exited {result.returncode}: {result.stderr.strip()[-2000:]}"
        )
    return {"benchmark": "storage.fio", **facts, "target": str(settings.datafile.parent),
            **parse_fio_output(result.stdout, phase)}


def run_profiles(profiles: Sequence[Profile], settings: FioSettings) -> list[dict[str, Any]]:
    """Every phase of every profile, in order, on the laid-out data file."""
    lay_out(settings.datafile, settings.size)
    return [run_phase(p, phase, settings) for p in profiles for phase in p.phases]


_TABLES = {
    "Bandwidth [MiB/s]": [("Writes:", "write", "bw_mibps"), ("Reads:", "read", "bw_mibps")],
    "Latency [ms]": [
        (f"{side.title()}s {label}", side, key)
        for side in ("write", "read")
        for label, key in (("Avg.:", "lat_avg_ms"), ("Median:", "lat_p50_ms"), ("99%:", "lat_p99_ms"))
    ],
    "IOPS": [("Writes:", "write", "iops"), ("Reads:", "read", "iops")],
}


def format_tables(rows: Sequence[dict[str, Any]]) -> str:
    """The storage evaluation's three tables (bandwidth, latency, IOPS): one column per profile."""
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    by_key = {(r["profile"], r["phase"]): r for r in rows}
    out = []
    for title, lines in _TABLES.items():
        table_rows = [
            {"metric": label, **{p: by_key[(p, side)][key] for p in profiles if (p, side) in by_key}}
            for label, side, key in lines
        ]
        out.append(format_table(table_rows, {"metric": title, **{p: p for p in profiles}}))
    return "\n\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fio`` subcommand's flags."""
    parser.add_argument("--target", type=Path, required=True, help="directory on the storage to test")
    parser.add_argument("--size", type=parse_size, default=None, help=f"data file size (default {DEFAULT_SIZE}; 4K/64M/1G)")
    parser.add_argument("--runtime", type=float, default=None,
                        help=f"seconds per phase (default {DEFAULT_RUNTIME_S:g})")
    parser.add_argument("--profiles", default=",".join(PROFILES),
                        help=f"comma-separated subset of: {', '.join(PROFILES)}")
    parser.add_argument("--small-wss", type=parse_size, default=None,
                        help=f"working set of the small-wss profile (default {DEFAULT_SMALL_WSS})")
    parser.add_argument("--direct", choices=("spec", "all"), default="spec",
                        help="'spec': O_DIRECT only where the profile bypasses the cache (min-latency, "
                             "small-wss); 'all': O_DIRECT for every profile")
    parser.add_argument("--quick", action="store_true",
                        help=f"quick run: --size {QUICK_SIZE} --runtime {QUICK_RUNTIME_S:g} "
                             f"--small-wss {QUICK_SMALL_WSS} unless given (about a minute)")
    parser.add_argument("--keep-file", action="store_true", help="keep the data file afterwards")
    parser.add_argument("--json", type=Path, help="write the rows as JSON to this path")


def main(args: argparse.Namespace) -> int:
    """Run the selected profiles and print the tables; 0 on success."""
    names = split_choices(args.profiles, list(PROFILES), "--profiles")
    size = args.size or parse_size(QUICK_SIZE if args.quick else DEFAULT_SIZE)
    runtime_s = args.runtime or (QUICK_RUNTIME_S if args.quick else DEFAULT_RUNTIME_S)
    small_wss = args.small_wss or parse_size(QUICK_SMALL_WSS if args.quick else DEFAULT_SMALL_WSS)
    if runtime_s <= 0:
        raise SystemExit("--runtime must be positive")
    min_size = max(PROFILES[n].block_size for n in names)
    if min(size, small_wss) < min_size:
        raise SystemExit(f"--size and --small-wss must be at least {format_size(min_size)} (a block)")
    fio_binary()
    args.target.mkdir(parents=True, exist_ok=True)
    direct_ok, why_not = direct_io_supported(args.target)
    settings = FioSettings(args.target / DATAFILE_NAME, size, small_wss, runtime_s, args.direct, direct_ok)
    notes = []
    if not direct_ok:
        notes.append(f"note: {why_not}: the cache-bypassing profiles ran buffered (direct=0)")
        log.warning(notes[-1])
    if args.direct == "spec":
        notes.append("note: streaming, max-latency and random-throughput are buffered, as the profiles "
                     "define them: with a data file smaller than RAM their reads may come from the page cache")
    try:
        rows = run_profiles([PROFILES[n] for n in names], settings)
    finally:
        if not args.keep_file:
            settings.datafile.unlink(missing_ok=True)
    print(f"fio on {args.target} ({rows[0]['fio_version']}): data file {format_size(size)}, "
          f"{runtime_s:g} s per phase, small WSS {format_size(small_wss)}, "
          f"threads of {FIO_IOENGINE} I/O\n")
    print(format_tables(rows))
    for note in notes:
        print(note)
    if args.json:
        write_json(args.json, rows)
    return 0
