"""The `pipeline` command: `main` (enqueue, status, queues, kinds, exporter, run), `dlq` (the dead-letter
queue), `output` (human and `--json` output, payload input), `stack` (`pipeline run`: the local stack)."""
