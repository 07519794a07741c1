"""media.transcode pieces that need no worker: binary lookup, failure classes, presets, the settings rule."""

from __future__ import annotations

from pathlib import Path

import imageio_ffmpeg
import pytest

from pipeline.config import load_settings
from pipeline.errors import PermanentError, TransientError
from tasks import ffmpeg, media_sources
from tasks.media import TranscodeJob, output_args


def test_binary_lookup_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert ffmpeg.binary("/opt/ffmpeg/bin/ffmpeg") == "/opt/ffmpeg/bin/ffmpeg"
    monkeypatch.setenv("PATH", str(tmp_path))  # no ffmpeg on PATH: the wheel's binary
    assert ffmpeg.binary(None) == imageio_ffmpeg.get_ffmpeg_exe()
    assert Path(ffmpeg.binary(None)).is_file()


def test_input_is_locked_down() -> None:
    local = ffmpeg.input_args("file:/media/a.mp4")
    assert local[local.index("-protocol_whitelist") + 1] == "file"
    assert "hls" not in local[local.index("-format_whitelist") + 1].split(",")
    remote = ffmpeg.input_args("https://cdn.example.com/a.mp4")
    assert remote[remote.index("-protocol_whitelist") + 1] == "http,https,tcp,tls"


def test_failure_classes() -> None:
    assert isinstance(ffmpeg.failure("moov atom not found\nInvalid data found", remote=False), PermanentError)
    assert isinstance(ffmpeg.failure("Server returned 503 Service Unavailable", remote=True), TransientError)
    assert isinstance(ffmpeg.failure("Server returned 404 Not Found", remote=True), PermanentError)
    assert isinstance(ffmpeg.failure("No space left on device", remote=False), TransientError)


def test_presets_and_names() -> None:
    assert "scale=-2:720" in output_args("720p")
    assert "-vn" in output_args("audio")
    job = TranscodeJob.model_construct(source_uri="https://x.example/v/movie.mov", preset="audio", output_name=None)
    assert job.output_filename() == "movie-audio.m4a"
    named = TranscodeJob.model_construct(source_uri="a.mp4", preset="480p", output_name="small.mp4")
    assert named.output_filename() == "small.mp4"


def test_transcode_limits_are_checked() -> None:
    with pytest.raises(SystemExit, match="TRANSCODE_SOFT_TIME_LIMIT"):
        load_settings(transcode_soft_time_limit=7000, transcode_time_limit=7000)
    settings = load_settings()
    assert settings.transcode_time_limit > settings.transcode_soft_time_limit


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1/a.mp4", "http://169.254.169.254/latest", "http://[::1]/a.mp4", "http://10.1.2.3/a.mp4",
     "https://localhost/a.mp4", "http://media.localhost/a.mp4", "http://0.0.0.0/a.mp4"],
)  # fmt: skip
def test_private_urls_refused_at_enqueue(url: str) -> None:
    with pytest.raises(ValueError, match="source_uri"):
        media_sources.check_url(url)


def test_names_resolving_to_private_addresses_refused_on_the_worker() -> None:
    media_sources.check_url("https://cdn.example.com/a.mp4")  # a name: no lookup at enqueue
    with pytest.raises(PermanentError, match="private address"):
        media_sources.resolve_public("http://localhost:8080/a.mp4")
