"""`media.transcode`: transcode a video (or extract its audio) with ffmpeg into H.264/AAC MP4 or AAC.

Sources are files under MEDIA_ROOT (checked at enqueue and again on the worker: no `..`, no symlink
leading out) or http(s) URLs. Output goes to `media/<task id>/<name>` in the storage backend, written
under a temporary name and moved into place only when ffmpeg finished; on a soft time limit or a
revoke ffmpeg's process group is killed and the partial file deleted. Long-running profile: the
task's time limits are TRANSCODE_SOFT_TIME_LIMIT / TRANSCODE_TIME_LIMIT (see docs/tasks.md).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.config import get_settings
from pipeline.errors import PermanentError
from pipeline.storage import get_storage
from pipeline.task import JobContext, typed_task
from tasks import ffmpeg
from tasks.media_sources import check_url, is_remote, local_source, resolve_public

Preset = Literal["1080p", "720p", "480p", "audio"]
VIDEO_HEIGHT = {"1080p": 1080, "720p": 720, "480p": 480}
VIDEO_ARGS = ["-c:v", "libx264", "-preset", "veryfast", "-crf", "23", "-pix_fmt", "yuv420p", "-profile:v", "high"]
AUDIO_ARGS = ["-c:a", "aac", "-b:a", "128k", "-ac", "2"]


class TranscodeJob(BaseModel):
    # The example's source is a file you put in MEDIA_ROOT (default DATA_DIR/media).
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"source_uri": "sample.mp4", "preset": "480p"}]}
    )

    #: A path under MEDIA_ROOT (relative to it, absolute, or file://), or an http/https URL.
    source_uri: str = Field(min_length=1, max_length=4096)
    preset: Preset
    #: Base name of the output (the extension follows the preset). Default: `<source stem>-<preset>`.
    output_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")

    @field_validator("source_uri")
    @classmethod
    def _safe_source(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if is_remote(value):
            check_url(value)
            return value
        if scheme not in ("", "file"):
            raise ValueError("source_uri must be a path under MEDIA_ROOT or an http(s) URL")
        local_source(value)
        return value

    @property
    def remote(self) -> bool:
        return is_remote(self.source_uri)

    def ffmpeg_input(self) -> str:
        return self.source_uri if self.remote else f"file:{local_source(self.source_uri)}"

    def output_filename(self) -> str:
        ext = ".m4a" if self.preset == "audio" else ".mp4"
        stem = self.output_name or f"{PurePosixPath(urlsplit(self.source_uri).path).stem or 'output'}-{self.preset}"
        return stem if stem.endswith(ext) else stem + ext


class TranscodeResult(BaseModel):
    uri: str
    duration_s: float
    width: int | None
    height: int | None
    bytes: int
    video_codec: str | None
    audio_codec: str | None


def output_args(preset: Preset) -> list[str]:
    if preset == "audio":
        return ["-map", "0:a:0", "-vn", *AUDIO_ARGS, "-movflags", "+faststart", "-f", "mp4"]
    scale = f"scale=-2:{VIDEO_HEIGHT[preset]}"
    maps = ["-map", "0:v:0", "-map", "0:a:0?"]
    return [*maps, "-vf", scale, *VIDEO_ARGS, *AUDIO_ARGS, "-movflags", "+faststart", "-f", "mp4"]


def transcode_job(job: TranscodeJob, ctx: JobContext) -> TranscodeResult:
    """Probe the source, transcode it into storage with progress, and describe the result."""
    exe = ffmpeg.binary(get_settings().ffmpeg_binary)
    if job.remote:
        resolve_public(job.source_uri)
    source = job.ffmpeg_input()
    info = ffmpeg.probe(exe, source)
    if job.preset == "audio" and info.audio_codec is None:
        raise PermanentError("the source has no audio stream: nothing to extract for preset 'audio'")
    if job.preset != "audio" and info.video_codec is None:
        raise PermanentError(f"the source has no video stream: use preset 'audio', not {job.preset!r}")
    storage = get_storage()
    key = f"media/{ctx.task_id}/{job.output_filename()}"

    def report(percent: float, eta_s: float | None, pid: int) -> None:
        ctx.progress(percent, None if eta_s is None else round(eta_s, 1), ffmpeg_pid=pid)

    with storage.writing(key) as partial:
        argv = [exe, *ffmpeg.input_args(source), *output_args(job.preset), "-y", str(partial)]
        ffmpeg.transcode(argv, info.duration_s, report, job.remote)
        out = ffmpeg.probe(exe, f"file:{partial}")
        size = partial.stat().st_size
    return TranscodeResult(
        uri=storage.uri(key),
        duration_s=round(out.duration_s, 3),
        width=out.width,
        height=out.height,
        bytes=size,
        video_codec=out.video_codec,
        audio_codec=out.audio_codec,
    )


# Its time limits are TRANSCODE_SOFT_TIME_LIMIT / TRANSCODE_TIME_LIMIT (task annotations, `pipeline.config.celery`).
# track_started: "started" from the moment a worker takes it, before its first progress report.
@typed_task(
    "media.transcode",
    kind="transcode",
    payload=TranscodeJob,
    result=TranscodeResult,
    acks_late=True,
    track_started=True,
)
def transcode(job: TranscodeJob, ctx: JobContext) -> TranscodeResult:
    """Transcode one source to a preset."""
    return transcode_job(job, ctx)


enqueue = transcode.enqueue
