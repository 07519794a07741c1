"""media.transcode with real ffmpeg: outputs checked with ffprobe, failures dead-lettered, revoke and soft
time limit leave no ffmpeg process and no partial file."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery.result import AsyncResult

from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.dlq import admin as dlq_admin
from pipeline.errors import PayloadInvalid
from tasks.media import transcode
from tests.support.media import make_clip
from tests.support.procs import RedisServer, Worker, free_port, wait_for

pytestmark = pytest.mark.integration
CLIP_S = 2.5


def media_root() -> Path:
    root = get_settings().media_path
    root.mkdir(parents=True, exist_ok=True)
    return root


def ffprobe(path: Path) -> dict[str, Any]:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "format=duration:stream=codec_type,codec_name,width,height",
         "-of", "json", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return dict(json.loads(out))


def partials() -> list[Path]:
    directory = get_settings().storage_path / ".partial"
    return list(directory.iterdir()) if directory.is_dir() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone, or reaped between the open and the read
        return False
    return state != "Z"


@pytest.mark.parametrize(("preset", "height"), [("480p", 480), ("720p", 720), ("audio", None)])
def test_transcode_output_probed(
    transcode_worker: Worker, redis_server: RedisServer, preset: str, height: int | None
) -> None:
    make_clip("clip.mp4", CLIP_S)
    task_id = str(uuid.uuid4())
    pubsub = redis_server.client().pubsub()
    pubsub.subscribe(f"celery-task-meta-{task_id}")  # the result backend publishes every state change here
    payload = transcode.validate({"source_uri": "clip.mp4", "preset": preset})
    transcode.task.apply_async((payload.model_dump(),), task_id=task_id)
    result = transcode.result(task_id, timeout=120)
    progress = [m["result"]["percent"] for m in _states(pubsub) if m["status"] == "PROGRESS"]
    assert progress[-1] == 100.0
    assert progress == sorted(progress)
    path = Path(urlsplit(result.uri).path)
    probed = ffprobe(path)
    streams = {s["codec_type"]: s for s in probed["streams"]}
    assert abs(float(probed["format"]["duration"]) - CLIP_S) <= 0.1
    assert abs(result.duration_s - CLIP_S) <= 0.1
    assert streams["audio"]["codec_name"] == "aac"
    assert result.audio_codec == "aac"
    if height is None:
        assert "video" not in streams
        assert path.suffix == ".m4a"
        assert (result.width, result.height, result.video_codec) == (None, None, None)
    else:
        assert streams["video"]["codec_name"] == "h264"
        assert streams["video"]["height"] == height == result.height
        assert streams["video"]["width"] == result.width == round(320 / 240 * height / 2) * 2
        assert path.name == f"clip-{preset}.mp4"
    assert result.bytes == path.stat().st_size


def _states(pubsub: Any) -> list[dict[str, Any]]:
    states = []
    while (message := pubsub.get_message(timeout=1.0)) is not None:
        if message["type"] == "message":
            states.append(json.loads(message["data"]))
    return states


@pytest.mark.usefixtures("clean_dlq")
def test_corrupt_source_is_permanent_and_dead_lettered(transcode_worker: Worker) -> None:
    (media_root() / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(4096))
    task_id = transcode.enqueue({"source_uri": "corrupt.mp4", "preset": "480p"})
    entry: Any = wait_for(lambda: _dead_letter(task_id), 60, 0.2, what="the DLQ entry")
    assert entry.exception_type == "pipeline.errors.PermanentError"
    assert "ffmpeg failed" in entry.exception_message
    assert entry.attempts == 1


@pytest.mark.usefixtures("clean_dlq")
def test_video_preset_on_audio_only_source_is_permanent(transcode_worker: Worker) -> None:
    path = media_root() / "tone.m4a"
    if not path.exists():
        subprocess.run(
            ["ffmpeg", "-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-f", "lavfi",
             "-i", "sine=duration=1", "-c:a", "aac", str(path)],
            check=True,
        )  # fmt: skip
    task_id = transcode.enqueue({"source_uri": "tone.m4a", "preset": "720p"})
    entry: Any = wait_for(lambda: _dead_letter(task_id), 60, 0.2, what="the DLQ entry")
    assert "no video stream" in entry.exception_message
    audio = transcode.result(transcode.enqueue({"source_uri": "tone.m4a", "preset": "audio"}), timeout=60)
    assert audio.audio_codec == "aac"
    assert audio.video_codec is None


def _dead_letter(task_id: str) -> object:
    try:
        return dlq_admin.get(task_id)
    except dlq_admin.DeadLetterNotFound:
        return None


def test_sources_outside_media_root_refused_at_enqueue(tmp_path: Path) -> None:
    make_clip("clip.mp4", CLIP_S)
    outside = tmp_path / "outside.mp4"
    outside.write_bytes(b"x")
    link = media_root() / f"escape-{uuid.uuid4().hex[:6]}.mp4"
    link.symlink_to(outside)
    bad = ["../clip.mp4", "sub/../../clip.mp4", str(outside), f"file://{outside}", link.name, "missing.mp4",
           "ftp://example.com/a.mp4", "concat:clip.mp4|clip.mp4", "http:///nohost.mp4"]  # fmt: skip
    for source in bad:
        with pytest.raises(PayloadInvalid, match="source_uri"):
            transcode.enqueue({"source_uri": source, "preset": "480p"})
    for source in ("clip.mp4", str(media_root() / "clip.mp4"), "https://media.example.com/a.mp4"):
        transcode.validate({"source_uri": source, "preset": "480p"})  # accepted


def _running_ffmpeg(task_id: str) -> int | None:
    # The pid is the task's own detail of its PROGRESS meta (the job status keeps percent and eta_s only).
    result: AsyncResult[Any] = AsyncResult(task_id, app=get_app())
    progress = result.info if result.state == "PROGRESS" and isinstance(result.info, dict) else {}
    pid = progress.get("ffmpeg_pid")
    return int(pid) if pid and progress.get("percent", 0) < 100 else None


def test_revoke_mid_transcode_kills_ffmpeg_and_leaves_no_partial_file(transcode_worker: Worker) -> None:
    make_clip("long.mp4", 90)
    task_id = transcode.enqueue({"source_uri": "long.mp4", "preset": "1080p"})
    pid: Any = wait_for(lambda: _running_ffmpeg(task_id), 60, 0.1, what="ffmpeg to report progress")
    assert alive(pid)
    wait_for(lambda: any(p.name.endswith("long-1080p.mp4") for p in partials()), 30, 0.1, what="a partial output")
    get_app().control.revoke(task_id, terminate=True)
    wait_for(lambda: not alive(pid), 30, 0.1, what=f"ffmpeg {pid} to be gone")
    wait_for(lambda: not any(p.name.endswith("long-1080p.mp4") for p in partials()), 10, 0.1, what="partial removed")
    assert not (get_settings().storage_path / "media" / task_id).exists()


@pytest.mark.usefixtures("clean_dlq")
def test_soft_time_limit_kills_ffmpeg_and_dead_letters(transcode_worker: Worker) -> None:
    make_clip("long.mp4", 90)
    task_id = str(uuid.uuid4())
    payload = transcode.validate({"source_uri": "long.mp4", "preset": "1080p", "output_name": "soft"})
    # Time limits travel in the message (the producer's TRANSCODE_* settings); here: 4 s instead of hours.
    transcode.task.apply_async((payload.model_dump(),), task_id=task_id, soft_time_limit=4, time_limit=30)
    pid: Any = wait_for(lambda: _running_ffmpeg(task_id), 60, 0.1, what="ffmpeg to report progress")
    entry: Any = wait_for(lambda: _dead_letter(task_id), 60, 0.2, what="the DLQ entry")
    assert entry.exception_type.endswith("SoftTimeLimitExceeded")
    assert not alive(pid)
    assert not any(p.name.endswith("soft.mp4") for p in partials())
    assert not (get_settings().storage_path / "media" / task_id).exists()


@pytest.fixture
def http_media() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 serving MEDIA_ROOT."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(media_root()))
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_source(make_worker: Any, http_media: str) -> None:
    make_clip("clip.mp4", CLIP_S)
    url = f"{http_media}/clip.mp4"
    with pytest.raises(PayloadInvalid, match="private"):
        transcode.enqueue({"source_uri": url, "preset": "480p"})  # refused by default: SSRF guard
    env = {"MEDIA_ALLOW_PRIVATE_URLS": "true"}
    make_worker("media-private-urls", env=env, queues="transcode-private-urls", concurrency=1)
    task_id = str(uuid.uuid4())
    payload = {"source_uri": url, "preset": "480p"}
    transcode.task.apply_async((payload,), task_id=task_id, queue="transcode-private-urls")
    result = transcode.result(task_id, timeout=120)
    probed = ffprobe(Path(urlsplit(result.uri).path))
    assert abs(float(probed["format"]["duration"]) - CLIP_S) <= 0.1
    assert result.height == 480
    assert result.uri.endswith("/clip-480p.mp4")
