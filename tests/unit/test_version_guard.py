"""Processes on a library version the seam was not verified on: beat, the CLI and the API refuse to start (exit status
2, one line naming the library, its version and the verified one), unless ALLOW_UNVERIFIED_VERSIONS=true.

The version is faked the way an upgrade would show it: a `kombu-5.8.0.dist-info` directory ahead of the installed
packages on PYTHONPATH, so that `importlib.metadata.version("kombu")` answers 5.8.0 while the installed kombu is the
one imported. No Redis is needed: the refusal comes before any connection. The API's app factory is checked in this
process, with the installed version read as 5.8.0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.compat import versions

ROOT = Path(__file__).resolve().parents[2]
FAKE = "5.8.0"


@pytest.fixture
def newer_kombu(tmp_path: Path) -> Path:
    """A directory whose only content is kombu's metadata at version FAKE."""
    info = tmp_path / f"kombu-{FAKE}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kombu\nVersion: {FAKE}\n")
    return tmp_path


def _env(path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "REDIS_", "PIPELINE_", "ALLOW_"))}
    return {
        **env,
        "ENV_FILE": "",
        "SECRETS_DIR": "/nonexistent",
        "REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens: nothing here may need Redis
        "PYTHONPATH": str(path),
        **extra,
    }


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


BEAT = [sys.executable, "-m", "celery", "-A", "pipeline", "beat", "-l", "INFO"]
CLI = [sys.executable, "-m", "pipeline", "kinds"]


def test_the_fake_version_is_what_the_metadata_says(newer_kombu: Path) -> None:
    code = "import kombu, importlib.metadata as m; print(m.version('kombu'), kombu.__version__)"
    done = _run([sys.executable, "-c", code], _env(newer_kombu))
    reported, imported = done.stdout.split()
    assert (reported, imported) == (FAKE, versions.installed("kombu")), done.stderr


@pytest.mark.parametrize("argv", [BEAT, CLI], ids=["beat", "cli"])
def test_a_process_refuses_an_unverified_kombu_naming_it(argv: list[str], newer_kombu: Path) -> None:
    done = _run(argv, _env(newer_kombu))
    assert done.returncode == versions.EX_REFUSED, done.stderr
    assert f"kombu {FAKE}" in done.stderr and versions.verified()["kombu"] in done.stderr
    assert "ALLOW_UNVERIFIED_VERSIONS=true" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_cli_runs_on_an_unverified_kombu_once_the_risk_is_accepted(newer_kombu: Path) -> None:
    done = _run(CLI, _env(newer_kombu, ALLOW_UNVERIFIED_VERSIONS="true"))
    assert done.returncode == 0, done.stderr
    assert "email" in done.stdout
    assert f"runs on unverified versions (ALLOW_UNVERIFIED_VERSIONS=true): kombu {FAKE}" in done.stderr


def test_beat_starts_on_an_unverified_kombu_once_the_risk_is_accepted(newer_kombu: Path, tmp_path: Path) -> None:
    """Beat goes past the guard and waits for Redis (none here: it retries), as it would on the verified versions."""
    log = tmp_path / "beat.log"
    with log.open("wb") as out:
        beat = subprocess.Popen(
            BEAT,
            cwd=ROOT,
            env=_env(newer_kombu, ALLOW_UNVERIFIED_VERSIONS="true"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        waiting = ("Retrying Redis connection", "Redis unreachable at start")  # redbeat's retry, then ours
        while not any(w in log.read_text() for w in waiting) and time.monotonic() < deadline:
            assert beat.poll() is None, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        assert any(w in text for w in waiting), text
        assert text.count(f"runs on unverified versions (ALLOW_UNVERIFIED_VERSIONS=true): kombu {FAKE}") == 1
    finally:
        os.killpg(beat.pid, signal.SIGKILL)
        beat.wait(10)


def test_the_api_refuses_to_start_on_an_unverified_kombu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.api.factory import create_app
    from pipeline.config import Settings

    settings = Settings(_env_file=None, api_token="t" * 32)  # type: ignore[call-arg]
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: FAKE if name == "kombu" else real(name))
    with pytest.raises(SystemExit) as refused:
        create_app(settings)
    assert refused.value.code == versions.EX_REFUSED
    assert f"refusing to start the API: kombu {FAKE}" in capsys.readouterr().err
