"""Run every benchmark against a throwaway Redis; print figures and ratios. Not a test: nothing is asserted."""

from __future__ import annotations

import importlib
import os
import sys

from bench.procs import redis_server

#: Benchmarks in run order; a module that is absent is skipped with a note.
BENCHMARKS = ("bench.overhead", "bench.pdf_memory", "bench.webhook_fanout")


def main() -> int:
    selected = [b for b in BENCHMARKS if not sys.argv[1:] or b.rsplit(".", 1)[-1] in sys.argv[1:]]
    with redis_server() as url:
        os.environ.update(REDIS_URL=url, ENV_FILE="", LOG_LEVEL="WARNING")
        for name in selected:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError:
                print(f"== {name}: not present, skipped")
                continue
            print(f"== {name}", flush=True)
            module.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
