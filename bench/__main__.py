"""`make bench` / `python -m bench [PART ...] [options]`: stock Celery against the pipeline on a throwaway Redis.

Parts: enqueue, bulk, drain, latency, every (start latency of a worker on every queue; all five by default:
`bench.compare`), and the standalone pdf_memory, webhook_fanout, replicated_enqueue, fairness, flows,
priority_overtake, backlog, io_concurrency, celery_api, redis_cost and cluster benchmarks (run only when named). Not a
test: nothing is asserted.

    python -m bench                                  # the comparison table, medians of 3
    python -m bench drain latency --json             # two parts, one JSON document on stdout
    python -m bench drain --pipeline-worker 'celery -A bench.pipeline_app worker -Q bench-pipeline -P threads -c 8'
    python -m bench drain --pipeline-worker 'celery -A bench.pipeline_app worker -Q bench-pipeline -P solo' \\
                          --pipeline-worker 'celery -A bench.pipeline_app worker -Q bench-pipeline -P solo'
    python -m bench io_concurrency --latency 2 --jobs 1000 --io-worker 'pipeline worker --processes 2 -Q webhooks'
    python -m bench redis_cost --jobs 1000                # Redis CPU and bytes kept per job: pipeline, Celery, BullMQ
    python -m bench cluster --jobs 1500                   # the same drain on a 1-master and a 3-master Redis Cluster
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from bench import cluster, io_concurrency, redis_cost
from bench.compare import DEFAULT_WORKERS, PARTS, Options, measure, table
from bench.procs import redis_server

STANDALONE = (
    "pdf_memory",
    "webhook_fanout",
    "replicated_enqueue",
    "fairness",
    "flows",
    "priority_overtake",
    "backlog",
    "io_concurrency",
    "celery_api",
    "redis_cost",
    "cluster",
)
#: --jobs when not given: per measurement of the comparison, and for io_concurrency.
JOBS = 5000
IO_JOBS = 3000


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "parts",
        nargs="*",
        metavar="PART",
        help=f"any of {', '.join((*PARTS, *STANDALONE))}; default: {' '.join(PARTS)}",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--jobs",
        type=int,
        help=f"jobs per enqueue, bulk and drain measurement (default {JOBS}); io_concurrency: "
        f"webhook jobs per system (default {IO_JOBS}); redis_cost: per system and rep (default {redis_cost.JOBS}); "
        f"cluster: per cluster and rep (default {cluster.JOBS})",
    )
    parser.add_argument("--rate", type=float, default=200.0, help="latency: jobs per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="latency: how long to send")
    parser.add_argument(
        "--pipeline-worker",
        action="append",
        metavar="COMMAND",
        help=f"worker command line for the pipeline (repeat to run several processes); default: "
        f"{DEFAULT_WORKERS['pipeline'][0]!r}. It must load bench.pipeline_app (the no-op task) and consume "
        "the queue bench-pipeline.",
    )
    parser.add_argument("--stock-worker", action="append", metavar="COMMAND", help="the same for stock Celery")
    io = parser.add_argument_group("io_concurrency")
    io.add_argument("--latency", type=float, default=0.1, help="seconds the endpoint waits before answering 200")
    io.add_argument(
        "--io-worker",
        action="append",
        metavar="COMMAND",
        help="the pipeline's I/O worker command line (repeat to run several); default "
        f"{io_concurrency.DEFAULT_IO_WORKER[0]!r}. It must run webhooks.deliver from the repo's app on the webhooks "
        "queue.",
    )
    io.add_argument(
        "--io-timeout", type=float, default=900.0, help="seconds per system and rep before its figures are partial"
    )
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts if p not in (*PARTS, *STANDALONE)]
    if unknown:
        parser.error(f"unknown part {', '.join(unknown)}; any of {', '.join((*PARTS, *STANDALONE))}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    parts = tuple(p for p in args.parts if p in PARTS) or (() if args.parts else PARTS)
    standalone = [p for p in args.parts if p in STANDALONE]
    workers = dict(DEFAULT_WORKERS)
    if args.pipeline_worker:
        workers["pipeline"] = args.pipeline_worker
    if args.stock_worker:
        workers["stock"] = args.stock_worker
    jobs = args.jobs or JOBS
    options = Options(args.reps, jobs, jobs, jobs, args.rate, args.seconds, parts, workers)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    with redis_server() as url:
        if parts:
            result = measure(url, options, say)
            print(json.dumps(result, indent=2) if args.json else "\n" + table(result), flush=True)
        os.environ.update(REDIS_URL=url, ENV_FILE="", SECRETS_DIR="/nonexistent", LOG_LEVEL="WARNING")
        for name in standalone:
            say(f"== {name}")
            if name == "io_concurrency":
                io_options = io_concurrency.Options(
                    args.jobs or IO_JOBS,
                    args.latency,
                    args.reps,
                    args.io_timeout,
                    args.io_worker or io_concurrency.DEFAULT_IO_WORKER,
                )
                io_concurrency.main(io_options, as_json=args.json)
            elif name == "redis_cost":
                redis_cost.main(args.jobs or redis_cost.JOBS, args.reps, as_json=args.json)
            elif name == "cluster":
                cluster.main(args.jobs or cluster.JOBS, args.reps, as_json=args.json)
            else:
                importlib.import_module(f"bench.{name}").main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
