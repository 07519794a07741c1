"""Peak memory of `pdf.render`'s report renderer: small vs ~50 MB report, each in a fresh subprocess.

The streaming canvas writes every page as it is finished, so peak RSS should stay flat as the page
count grows. For contrast the same large report is also rendered with reportlab's stock canvas, which
holds the whole document in memory until `save()`.

    python -m bench.pdf_memory            # prints a table and one JSON line
"""

from __future__ import annotations

import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

COLUMNS = ["id", "reference", "checksum", "amount"]
#: ~50 MB of PDF at this many rows (about 56 rows per page).
LARGE_ROWS = 650_000
SMALL_ROWS = 2_000


def rows(count: int) -> Iterator[list[str | int | float]]:
    """Rows like a ledger export: ids and hashes, which compress about as badly as real data."""
    for i in range(count):
        digest = hashlib.sha256(str(i).encode()).hexdigest()
        yield [i, digest[:24], digest[24:48], round(i * 0.37, 2)]


def child(mode: str, count: int) -> None:
    """Render one report and print pages, bytes, seconds and this process's peak RSS as JSON."""
    from pipeline.storage import LocalStorage
    from tasks.pdf import render_report

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if mode == "streaming":
            result = render_report(LocalStorage(Path(scratch)), "bench.pdf", "Benchmark report", COLUMNS, rows(count))
            pages, size = result.pages, result.bytes
        else:
            from reportlab.pdfgen.canvas import Canvas

            from tasks.pdf_templates import draw_report

            path = Path(scratch) / "bench.pdf"
            canvas = Canvas(str(path))
            draw_report(canvas, "Benchmark report", COLUMNS, rows(count))
            pages = canvas.getPageNumber() - 1
            canvas.save()
            size = path.stat().st_size
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    seconds = time.perf_counter() - started
    summary = {"mode": mode, "rows": count, "pages": pages, "mb": size / 1e6, "peak_rss_mb": peak_mb, "s": seconds}
    print(json.dumps(summary))


def measure(mode: str, count: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.pdf_memory", "--child", mode, str(count)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    runs = [measure("streaming", SMALL_ROWS), measure("streaming", LARGE_ROWS), measure("stock", LARGE_ROWS)]
    print(f"{'renderer':10} {'pages':>7} {'PDF MB':>8} {'peak RSS MB':>12} {'seconds':>8}")
    for r in runs:
        print(f"{r['mode']:10} {r['pages']:>7} {r['mb']:>8.1f} {r['peak_rss_mb']:>12.1f} {r['s']:>8.1f}")
    small, large, stock = runs
    growth = large["peak_rss_mb"] - small["peak_rss_mb"]
    print(
        json.dumps(
            {
                "bench": "pdf_memory",
                "small_pages": small["pages"],
                "large_pages": large["pages"],
                "large_mb": round(large["mb"], 1),
                "peak_rss_small_mb": round(small["peak_rss_mb"], 1),
                "peak_rss_large_mb": round(large["peak_rss_mb"], 1),
                "peak_rss_growth_mb": round(growth, 1),
                "stock_reportlab_peak_rss_mb": round(stock["peak_rss_mb"], 1),
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
