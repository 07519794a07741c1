"""Running ffmpeg safely: finding the binary, probing a file, transcoding with progress, killing it cleanly.

ffmpeg runs in its own session (process group) with `-nostdin`, a protocol whitelist and a demuxer
whitelist (no playlists or concat files that could reach other files or hosts). Whatever ends the run
early (soft time limit, a revoke's SIGTERM turned into SystemExit by the pool, any error) goes
through one `finally` that kills ffmpeg's whole process group and reaps it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipeline.errors import PermanentError, TransientError

#: Demuxers a source may use: containers and raw audio formats; no hls, concat, image2 sequences, etc.
INPUT_FORMATS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,mpeg,ogg,wav,mp3,aac,flac,asf"
_DURATION = re.compile(r"Duration: (\d+):(\d\d):(\d\d(?:\.\d+)?)")
_VIDEO = re.compile(r"Stream #\S+.*?: Video: (\w+).*?, (\d{2,5})x(\d{2,5})")
_AUDIO = re.compile(r"Stream #\S+.*?: Audio: (\w+)")
_TRANSIENT = re.compile(
    r"Server returned 5\d\d|Connection (refused|reset|timed out)|timed out|Network is unreachable|"
    r"No space left on device|Temporary failure in name resolution",
    re.IGNORECASE,
)


def binary(configured: str | None) -> str:
    """FFMPEG_BINARY if set, else `ffmpeg` on PATH, else the imageio-ffmpeg wheel's binary."""
    if configured:
        return configured
    found = shutil.which("ffmpeg")
    if found:
        return found
    import imageio_ffmpeg

    return str(imageio_ffmpeg.get_ffmpeg_exe())


def input_args(source: str) -> list[str]:
    """`-i` and the safety options for a local path (as `file:`) or an http(s) URL."""
    remote = source.startswith(("http://", "https://"))
    protocols = "http,https,tcp,tls" if remote else "file"
    return ["-protocol_whitelist", protocols, "-format_whitelist", INPUT_FORMATS, "-i", source]


@dataclass(frozen=True)
class MediaInfo:
    duration_s: float
    width: int | None
    height: int | None
    video_codec: str | None
    audio_codec: str | None


def failure(stderr: str, remote: bool) -> Exception:
    """The pipeline error for a failed ffmpeg run, from the end of its stderr."""
    tail = "\n".join(stderr.strip().splitlines()[-5:])
    if (remote and _TRANSIENT.search(stderr)) or "No space left on device" in stderr:
        return TransientError(f"ffmpeg failed (may pass): {tail}")
    return PermanentError(f"ffmpeg failed: {tail}")


def probe(ffmpeg: str, source: str, timeout: float = 60) -> MediaInfo:
    """Duration, size and codecs of `source`, read from `ffmpeg -i` (works without ffprobe)."""
    argv = [ffmpeg, "-hide_banner", "-nostdin", *input_args(source)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, start_new_session=True, check=False)
    text = proc.stderr
    duration, video, audio = _DURATION.search(text), _VIDEO.search(text), _AUDIO.search(text)
    if duration is None or (video is None and audio is None):
        raise failure(text, source.startswith(("http://", "https://")))
    hours, minutes, seconds = duration.groups()
    return MediaInfo(
        duration_s=int(hours) * 3600 + int(minutes) * 60 + float(seconds),
        width=int(video.group(2)) if video else None,
        height=int(video.group(3)) if video else None,
        video_codec=video.group(1) if video else None,
        audio_codec=audio.group(1) if audio else None,
    )


ProgressFn = Callable[[float, float | None, int], None]


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Make SIGTERM raise SystemExit while ffmpeg runs, unless a handler (billiard's does) is set already."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def transcode(argv: list[str], duration_s: float, on_progress: ProgressFn, remote: bool, interval: float = 1.0) -> None:
    """Run ffmpeg (`argv` without the progress options); report (percent, eta_s, pid) at most every `interval` s."""
    full = [argv[0], "-hide_banner", "-nostdin", "-nostats", "-progress", "pipe:1", *argv[1:]]
    stderr_tail: deque[str] = deque(maxlen=40)
    with _sigterm_raises():
        proc = subprocess.Popen(
            full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, bufsize=1
        )
        reader = threading.Thread(target=lambda: stderr_tail.extend(proc.stderr or ()), daemon=True)
        reader.start()
        try:
            _follow(proc, duration_s, on_progress, interval)
            code = proc.wait()
            reader.join(5)
        finally:
            kill_group(proc)
    if code != 0:
        raise failure("\n".join(stderr_tail), remote)
    on_progress(100.0, 0.0, proc.pid)


def _follow(proc: subprocess.Popen[str], duration_s: float, on_progress: ProgressFn, interval: float) -> None:
    last = 0.0
    out_s, speed = 0.0, 0.0
    for line in proc.stdout or ():
        key, _, value = line.strip().partition("=")
        if key == "out_time_us" and value.isdigit():
            out_s = int(value) / 1e6
        elif key == "speed" and value.endswith("x"):
            with contextlib.suppress(ValueError):
                speed = float(value[:-1])
        elif key == "progress" and time.monotonic() - last >= interval and duration_s > 0:
            last = time.monotonic()
            percent = min(99.9, 100.0 * out_s / duration_s)
            eta = max(0.0, (duration_s - out_s) / speed) if speed > 0 else None
            on_progress(percent, eta, proc.pid)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill ffmpeg's process group (it is its own session leader) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
