"""The locked Celery's sdist, downloaded once into a cache directory, its sha256 checked against the lock.

Only `t/` is extracted (the sdist's `celery/` package must not shadow the installed one on `sys.path`).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements-dev.lock"


def locked(name: str = "celery") -> tuple[str, set[str]]:
    """The version `requirements-dev.lock` pins for `name`, and the sha256 hashes it accepts (wheel and sdist)."""
    text = LOCK.read_text()
    found = re.search(rf"^{re.escape(name)}==(\S+)((?:\s*\\\s*--hash=sha256:[0-9a-f]+)+)", text, re.MULTILINE)
    if found is None:
        raise SystemExit(f"{LOCK.name}: no hashed pin for {name}")
    return found.group(1), set(re.findall(r"sha256:([0-9a-f]+)", found.group(2)))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(cache: Path) -> Path:
    """The directory holding the locked Celery's `t/` (downloaded and extracted on first use)."""
    version, hashes = locked()
    target = cache / f"celery-{version}"
    if (target / "t" / "integration" / "conftest.py").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"celery-{version}.tar.gz"
    if not archive.exists():
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*argv, "--dest", str(cache), f"celery=={version}"], check=True)
    digest = sha256(archive)
    if digest not in hashes:
        archive.unlink()
        raise SystemExit(f"{archive.name}: sha256 {digest} is not one {LOCK.name} accepts for celery=={version}")
    prefix = f"celery-{version}/t/"
    with tarfile.open(archive) as tar:
        members = [member for member in tar.getmembers() if member.name.startswith(prefix)]
        tar.extractall(cache, members=members, filter="data")
    return target
