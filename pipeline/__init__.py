"""pipeline: typed Celery tasks on Redis with retries, a dead-letter queue, schedules and operations.

`celery -A pipeline worker` finds the application here.
"""

from pipeline.app import app

__all__ = ["app"]
