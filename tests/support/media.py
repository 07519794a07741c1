"""Test clips for transcode tests, generated with ffmpeg's lavfi sources into MEDIA_ROOT."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_clip(name: str, seconds: float, size: str = "320x240") -> Path:
    """MEDIA_ROOT/<name>: a test pattern with a tone, H.264 + AAC, index at the front (streamable over HTTP).

    The API, the workers and the test process share DATA_DIR, so every one of them sees the file.
    """
    from pipeline.config import get_settings  # after the session's settings exist

    path = get_settings().media_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        subprocess.run(
            ["ffmpeg", "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
             "-f", "lavfi", "-i", f"testsrc=size={size}:rate=25:duration={seconds}",
             "-f", "lavfi", "-i", f"sine=frequency=440:sample_rate=48000:duration={seconds}",
             "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest",
             "-movflags", "+faststart", str(path)],
            check=True,
        )  # fmt: skip
    return path
