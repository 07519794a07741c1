"""Configuration: environment, `.env` and a secrets directory → one validated `Settings` → Celery's conf.

Config flows one way: env → `Settings` (`settings.py`) → `celery_conf()` (`celery.py`, beat entries from
`beat.py`) → `app.conf`; `serialization.py` holds the worker's JSON decoding. No other module reads
`os.environ`. Nothing is read at import: a process calls `get_settings()` when it starts, and an invalid value
stops it with one message naming the variable.
"""

from pipeline.config.settings import (
    API_TOKEN_MIN_LENGTH,
    LOCAL_REDIS_PORT,
    Settings,
    example,
    get_settings,
    load_settings,
)

__all__ = ["API_TOKEN_MIN_LENGTH", "LOCAL_REDIS_PORT", "Settings", "example", "get_settings", "load_settings"]
