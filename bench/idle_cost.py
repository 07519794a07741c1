"""What an idle worker costs its Redis, and what it sends it: CPU per second and the commands by kind.

    python -m bench.idle_cost [--warm 15] [--seconds 10] [--json] -- pipeline worker
    python -m bench.idle_cost -- celery -A pipeline worker --loglevel WARNING

A throwaway redis-server (`bench.procs.redis_server`: no persistence, a port of its own), then:

1. **baseline**: Redis's `INFO cpu` (user + sys) over `--seconds` with no client but this one;
2. the worker command started (`bench.procs.bench_env`: this Redis, nothing of the caller's settings), left
   `--warm` seconds to settle (boot, first fetches, an idle worker's waits grown to their longest);
3. **idle**: `INFO cpu` over `--seconds` again; the worker's cost is idle less baseline (µs of CPU per second);
4. then `INFO commandstats` before and after `--seconds` of `MONITOR` (calls and execution µs per second of each
   command; MONITOR's own cost is in this window, so its CPU is not read), and the monitored commands counted by
   kind: a script's own calls (`lua`) apart from the clients', a command's first words kept, a list key's dropped.

The worker is stopped by its process group's id. The machine's other load moves the figures: compare runs made
one after the other, alternated.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import redis

from bench.procs import ROOT, bench_env, redis_server

#: Commands whose arguments say nothing useful by kind (a list key per queue and priority step).
BARE = frozenset({"EXISTS", "RPOP", "BLMOVE", "LLEN"})


def cpu_us_per_s(client: redis.Redis, seconds: float) -> float:
    """Redis's own CPU (user + sys) over `seconds`, µs per second."""

    def used() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    began, before = time.monotonic(), used()
    time.sleep(seconds)
    return (used() - before) / (time.monotonic() - began) * 1e6


def kind(command: str, from_script: bool) -> str:
    """A monitored command by kind: its name and first arguments (a script by its SHA's first 12 characters)."""
    words = command.split(" ")
    name = words[0].upper()
    if name in BARE:
        shown = ""
    elif name == "EVALSHA":
        shown = " ".join([words[1][:12], *(w[:40] for w in words[2:5])])
    else:
        shown = " ".join(w[:40] for w in words[1:4])
    return f"{'lua' if from_script else 'client':6} {name} {shown}".rstrip()


def monitored(url: str, seconds: float) -> list[dict[str, Any]]:
    """Every command Redis ran for `seconds` (MONITOR)."""
    seen: list[dict[str, Any]] = []
    until = time.monotonic() + seconds
    with redis.Redis.from_url(url).monitor() as monitor:
        for event in monitor.listen():
            seen.append(event)
            if time.monotonic() > until:
                break
    return seen


def measure(argv: list[str], warm: float, seconds: float) -> dict[str, Any]:
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        baseline = cpu_us_per_s(client, seconds)
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=bench_env(url),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(warm)
            if proc.poll() is not None:
                raise RuntimeError(f"{argv}: exited with {proc.returncode}")
            idle = cpu_us_per_s(client, seconds)
            before = client.info("commandstats")
            seen = monitored(url, seconds)
            after = client.info("commandstats")
            connections = len(client.client_list())
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stats = {
        name.removeprefix("cmdstat_"): {
            "calls_per_s": (row["calls"] - before.get(name, {}).get("calls", 0)) / seconds,
            "usec_per_s": (row["usec"] - before.get(name, {}).get("usec", 0)) / seconds,
        }
        for name, row in sorted(after.items())
        if row["calls"] != before.get(name, {}).get("calls", 0)
    }
    kinds = collections.Counter(kind(e["command"], e.get("client_type") == "lua") for e in seen)
    return {
        "argv": argv,
        "baseline_us_per_s": baseline,
        "idle_us_per_s": idle,
        "worker_us_per_s": idle - baseline,
        "connections": connections,
        "commandstats_per_s": stats,
        "monitored": dict(kinds.most_common()),
        "seconds": seconds,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{' '.join(result['argv'])}: Redis alone {result['baseline_us_per_s']:,.0f} µs/s, with the idle worker "
        f"{result['idle_us_per_s']:,.0f}: the worker's {result['worker_us_per_s']:,.0f} µs of Redis CPU per second; "
        f"{result['connections']} connections",
        "commandstats (calls/s, execution µs/s):",
    ]
    lines += [
        f"  {name:24} {row['calls_per_s']:8.2f} {row['usec_per_s']:9.1f}"
        for name, row in result["commandstats_per_s"].items()
    ]
    lines.append(f"MONITOR, {result['seconds']:.0f} s, by kind:")
    lines += [f"  {count:6} {what}" for what, count in result["monitored"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=float, default=15.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    argv = [a for a in options.command if a != "--"] or ["pipeline", "worker"]
    if argv[0] in ("pipeline", "celery"):  # this interpreter's, whatever is on PATH
        argv = [sys.executable, "-m", *argv]
    result = measure(argv, options.warm, options.seconds)
    print(json.dumps(result, indent=2) if options.json else table(result))


if __name__ == "__main__":
    sys.exit(main())
