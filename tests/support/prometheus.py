"""A real Prometheus server (Debian's `prometheus`, `make system-deps`) for tests, stopped by PID.

It runs in a directory of its own on a free loopback port with a generated configuration: the given
targets scraped every second, the given rule files evaluated every second.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.support.procs import free_port, stop_process, wait_for


def instant_rules(source: Path, target: Path) -> Path:
    """`source`'s rules with every `for:` set to 0s (expressions untouched): an alert fires as soon as its
    expression holds, so a test sees it in seconds rather than after the production hold time."""
    doc = yaml.safe_load(source.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "0s"
    target.write_text(yaml.safe_dump(doc, sort_keys=False))
    return target


class PrometheusServer:
    def __init__(self, directory: Path, targets: dict[str, int], rule_files: list[Path]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (make system-deps installs Debian's package)")
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.targets = targets
        self.rule_files = rule_files
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrometheusServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for job, port in self.targets.items()
            ],
        }
        config_file = self.directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        argv = [
            self.binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with (self.directory / "prometheus.log").open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._ready, 30, 0.2, what=f"prometheus on port {self.port}")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited at start:\n{self.log()[-3000:]}")
        ready = f"http://127.0.0.1:{self.port}/-/ready"
        with contextlib.suppress(OSError), urllib.request.urlopen(ready, timeout=2) as resp:  # loopback
            return bool(resp.status == 200)
        return False

    def log(self) -> str:
        path = self.directory / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a successful answer."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:  # loopback
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series."""
        return [(r["metric"], float(r["value"][1])) for r in self.api("query", query=promql)["result"]]

    def scalar(self, promql: str) -> float | None:
        """The value of a query that yields at most one series (None when it yields none)."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return result[0][1] if result else None

    def alerts(self, state: str = "firing") -> list[dict[str, str]]:
        """The labels of every alert in `state` (alertname included)."""
        return [a["labels"] for a in self.api("alerts")["alerts"] if a["state"] == state]

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
