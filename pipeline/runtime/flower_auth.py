"""Flower refuses to run open: `celery -A pipeline flower` takes its basic auth from our settings.

Flower (flower/command.py) builds its options with tornado.options: FLOWER_* environment variables,
then `flowerconfig.py`, then its command line, then `parse_command_line()` runs tornado's parse
callbacks, before the web application exists. We register two such callbacks when the app is loaded
inside a `celery` command process that has Flower's options defined (`celery` imports every
sub-command, Flower's included, before it loads the app); other processes never parse tornado
options, so the callbacks are inert there.

The callback fills `basic_auth` from FLOWER_BASIC_AUTH (`user:password[,user2:password2]`, from the
environment, `.env` or the secrets directory) unless Flower was given `--basic_auth` or `--auth`
itself, and stops Flower with exit status 2 when no authentication is configured (or FLOWER_BASIC_AUTH
is malformed) — unless FLOWER_UNAUTHENTICATED=true, a development flag that `pipeline run` sets. The
message goes to stderr and the exit is `SystemExit(2)`: a `SystemExit` carrying the message itself would
exit with status 1, and nothing between tornado's callback and the interpreter (Flower's command,
click, celery's `main`) catches it.

On a Redis Cluster URL the second callback (`on_cluster`) gives Flower its broker view on the cluster
(`pipeline.compat.flowerbroker`, queue lengths; on a flower this was not verified on the view answers 404) and logs
one WARNING saying what Flower cannot show there yet: its worker and task views come from Celery's events and control
replies, which the cluster transport does not carry between processes yet (docs/cluster.md).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pipeline.compat import flowerbroker
from pipeline.config import get_settings
from pipeline.config.cluster import is_cluster

log = logging.getLogger(__name__)
REFUSAL = (
    "pipeline: Flower refuses to start without authentication: set FLOWER_BASIC_AUTH=user:password "
    "(or pass --basic_auth/--auth). For a local development stack only, set FLOWER_UNAUTHENTICATED=true."
)
ON_CLUSTER = (
    "Flower on a Redis Cluster: its broker view (queue lengths) is not supported on this Flower version; its worker"
    " and task views work; use `pipeline queues`, the API (/queues) or the exporter for depths (docs/cluster.md)"
)
EXIT_REFUSED = 2
_installed: list[Any] = []


def _refuse(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_REFUSED)


def check_auth(options: Any) -> None:
    """Apply FLOWER_BASIC_AUTH to Flower's options, or refuse to run without authentication."""
    settings = get_settings()
    # An empty FLOWER_BASIC_AUTH reaches Flower as [""]: that is no credential at all.
    options.basic_auth = [c.strip() for c in options.basic_auth or () if c.strip()]
    if not (options.basic_auth or options.auth) and settings.flower_basic_auth is not None:
        credentials = settings.flower_basic_auth.get_secret_value()
        options.basic_auth = [c.strip() for c in credentials.split(",") if c.strip()]
    if any(":" not in credential for credential in options.basic_auth or ()):
        _refuse("pipeline: FLOWER_BASIC_AUTH must be user:password[,user2:password2]")
    if options.basic_auth or options.auth:
        return
    if settings.flower_unauthenticated:
        log.warning("Flower runs WITHOUT authentication (FLOWER_UNAUTHENTICATED=true): development only")
        return
    _refuse(REFUSAL)


def on_cluster() -> None:
    """On a Redis Cluster URL: Flower's broker view on the cluster (`pipeline.compat.flowerbroker`), or one WARNING
    when this Flower version has none. Its worker and task views need nothing more: Celery's events and control
    replies reach it over the cluster transport (`pipeline.delivery.cluster_fanout`)."""
    if is_cluster(get_settings().broker_url) and not flowerbroker.install():
        log.warning(ON_CLUSTER)


def install() -> None:
    """Register the check with Flower's option parsing, when this process runs a `celery` command with Flower."""
    if _installed or "flower.options" not in sys.modules:
        return
    from tornado.options import options

    if "basic_auth" not in options:
        return
    options.add_parse_callback(lambda: check_auth(options))
    options.add_parse_callback(on_cluster)
    _installed.append(options)
