"""The envelope a kombu Redis message was decoded from, as kombu popped it from its queue.

kombu's virtual `Message` keeps the envelope it was built from (`kombu/transport/virtual/base.py: Message._raw`), and
kombu's Redis QoS writes that very dict back when it records the delivery as unacknowledged (`QoS.append`). Its
public `serializable()` is not the same text: it re-encodes the body, drops the `compression` header and orders the
keys differently. The worker's consumer puts an envelope it must not handle back where it was, byte for byte, so
the dead-letter index still finds it (`pipeline.dlq.consumer`): `raw_envelope` gives it the envelope kombu holds.
Only workers use it, and a worker refuses to start on a kombu this was not verified on (`pipeline.delivery`).
"""

from __future__ import annotations

from typing import Any


def raw_envelope(message: Any) -> dict[str, Any]:
    """The envelope `message` (a kombu virtual transport's message) was decoded from; kombu's `serializable()`
    when it holds none."""
    raw = getattr(message, "_raw", None)
    return raw if isinstance(raw, dict) else dict(message.serializable())
