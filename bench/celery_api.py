"""`python -m bench celery_api`: Celery's own API against the pipeline's worker and stock Celery's, in one run.

A Celery user's calls, from a client process of its own (`bench.celery_client`): p50 of start to finish of
`add.delay(1, 2).get()` and of a chain of five `add` steps, `.get()` on the chain. Stock Celery runs with its default
settings (`bench.stock_app`, its own worker process); the pipeline runs the same plain `@app.task` on its app
(`bench.pipeline_app`), on prefork and on the asyncio pool (`-P custom`, what `pipeline worker` runs). Same Redis,
systems interleaved per rep; ratios are pipeline ÷ stock prefork (issue #42 target: within 1.5x).
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time

import redis

from bench.procs import Workers, bench_env, run_producer
from pipeline.runtime.asyncpool import POOL

CALLS = 200
REPS = 3
#: (system, the client's app, worker command lines, extra environment).
SYSTEMS: tuple[tuple[str, str, list[str], dict[str, str]], ...] = (
    ("stock prefork", "stock", ["celery -A bench.stock_app worker -P prefork -c 2 --loglevel WARNING"], {}),
    (
        "pipeline prefork",
        "pipeline",
        ["celery -A bench.pipeline_app worker -Q bench-pipeline -P prefork -c 2 --loglevel WARNING"],
        {},
    ),
    (
        "pipeline asyncio pool",
        "pipeline",
        ["celery -A bench.pipeline_app worker -Q bench-pipeline -P custom -c 10 --loglevel WARNING"],
        {"CELERY_CUSTOM_WORKER_POOL": POOL},
    ),
)
TARGET = 1.5


def _measure(url: str, app: str, lines: list[str], extra: dict[str, str]) -> dict[str, float]:
    env = {**bench_env(url), **extra}
    commands = [shlex.split(line) for line in lines]
    for argv in commands:
        argv[0] = os.path.join(os.path.dirname(sys.executable), "celery")
    redis.Redis.from_url(url).flushdb()
    workers = Workers(commands, env).start()
    try:
        time.sleep(3)  # booted: the client's first calls are warm-up anyway
        workers.check()
        return run_producer_module(env, app)
    finally:
        workers.stop()


def run_producer_module(env: dict[str, str], app: str) -> dict[str, float]:
    out = run_producer(env, app, CALLS, module="bench.celery_client")
    return {k: float(v) for k, v in out.items()}


def main() -> None:
    url = os.environ["REDIS_URL"]
    reps: dict[str, dict[str, list[float]]] = {name: {} for name, *_ in SYSTEMS}
    for rep in range(REPS):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for name, app, lines, extra in order:
            print(f"  rep {rep + 1}/{REPS} {name}", flush=True)
            for figure, value in _measure(url, app, lines, extra).items():
                reps[name].setdefault(figure, []).append(value)
    medians = {name: {k: statistics.median(v) for k, v in figures.items()} for name, figures in reps.items()}
    stock = medians["stock prefork"]
    print(f"{'':24}{'delay().get() p50':>20}{'ratio':>8}{'chain of 5 p50':>18}{'ratio':>8}")
    for name, figures in medians.items():
        print(
            f"{name:24}{figures['add']:>17.1f} ms{figures['add'] / stock['add']:>7.2f}x"
            f"{figures['chain5']:>15.1f} ms{figures['chain5'] / stock['chain5']:>7.2f}x"
        )
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; medians of {REPS} reps of {CALLS} calls each, "
        f"systems interleaved; ratios are ÷ stock prefork (issue #42 target: <= {TARGET}x)"
    )
