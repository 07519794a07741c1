"""Redis Cluster URLs (`pipeline.config.cluster`): the seeds, TLS and credentials they name, and a clear refusal of
one a cluster client cannot use, naming the variable."""

from __future__ import annotations

import pytest
from kombu import Connection

from pipeline.config import load_settings
from pipeline.config.celery import celery_conf
from pipeline.config.cluster import ClusterUrl, is_cluster, parse, seed_url
from pipeline.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("redis+cluster://10.0.0.1:7000/0", ClusterUrl((("10.0.0.1", 7000),), tls=False)),
        (
            "redis+cluster://a:7000,b:7001,c/0",
            ClusterUrl((("a", 7000), ("b", 7001), ("c", 6379)), tls=False),
        ),
        (
            "rediss+cluster://:s3cr%40t@redis.internal:6380",
            ClusterUrl((("redis.internal", 6380),), True, None, "s3cr@t"),
        ),
        (
            "redis+cluster://app:pw@[::1]:7000,[fe80::1]/0",
            ClusterUrl((("::1", 7000), ("fe80::1", 6379)), False, "app", "pw"),
        ),
    ],
)
def test_a_cluster_url_names_its_seeds_tls_and_credentials(url: str, parsed: ClusterUrl) -> None:
    assert is_cluster(url)
    assert parse(url) == parsed


@pytest.mark.parametrize(
    ("url", "fault"),
    [
        ("redis+cluster://h1:7000/1", "only database 0"),
        ("redis+cluster:///0", "at least one seed"),
        ("redis+cluster://,/0", "at least one seed"),
        ("redis+cluster://h1:70000/0", "no valid port"),
        ("redis+cluster://h1:port/0", "no valid port"),
        ("redis+cluster://h1:7000/0?ssl_cert_reqs=none", "no query"),
    ],
)
def test_a_bad_cluster_url_stops_the_settings_naming_the_variable_and_the_fault(url: str, fault: str) -> None:
    with pytest.raises(ConfigError, match=f"REDIS_URL: .*{fault}"):
        load_settings(redis_url=url)
    with pytest.raises(ConfigError, match=f"RESULT_BACKEND_URL: .*{fault}"):
        load_settings(result_backend_url=url)


def test_results_on_a_cluster_are_on_the_brokers_cluster_only() -> None:
    cluster = "redis+cluster://h1:7000,h2:7001/0"
    assert load_settings(redis_url=cluster, result_backend_url=cluster).result_url == cluster
    assert load_settings(redis_url=cluster, result_backend_url="redis://r:6379/1").result_url == "redis://r:6379/1"
    with pytest.raises(ConfigError, match="RESULT_BACKEND_URL: a Redis Cluster holds results only as REDIS_URL's"):
        load_settings(redis_url="redis://h:6379/0", result_backend_url=cluster)
    with pytest.raises(ConfigError, match="RESULT_BACKEND_URL: a Redis Cluster holds results only as REDIS_URL's"):
        load_settings(redis_url=cluster, result_backend_url="redis+cluster://other:7000/0")


def test_other_urls_are_not_clusters_and_an_unknown_scheme_names_the_cluster_ones() -> None:
    for url in ("redis://h:6379/0", "rediss://h/0", "sentinel://h:26379;sentinel://g:26379", "cluster://h"):
        assert not is_cluster(url)
    assert load_settings(redis_url="redis+cluster://h1:7000,h2:7001/0").broker_url.startswith("redis+cluster://")
    with pytest.raises(ConfigError, match=r"redis\+cluster://"):
        load_settings(redis_url="cluster://h1:7000/0")


@pytest.mark.parametrize(
    ("url", "seed", "broker"),
    [
        ("redis+cluster://a:7000,b:7001/0", "redis://a:7000/0", "rediscluster://a:7000/0"),
        (
            "rediss+cluster://:s3cr%40t@redis.internal:6380",
            "rediss://:s3cr%40t@redis.internal:6380/0",
            "rediscluster://redis.internal:6380/0",
        ),
        ("redis+cluster://app:pw@[::1]:7000,[fe80::1]/0", "redis://app:pw@[::1]:7000/0", "rediscluster://[::1]:7000/0"),
    ],
)
def test_celery_is_given_the_cluster_transport_on_a_url_kombu_parses(url: str, seed: str, broker: str) -> None:
    assert seed_url(url) == seed
    settings = load_settings(redis_url=url)
    conf = celery_conf(settings)
    assert conf["broker_url"] == broker and conf["broker_transport"] == "pipeline.delivery.clustered:ClusterTransport"
    assert conf["result_backend"] == "rediscluster"  # the cluster result backend (`pipeline.compat.clusterresults`)
    connection = Connection(conf["broker_url"], transport=conf["broker_transport"])  # kombu parses it: no "cast" error
    assert connection.port == int(broker.rsplit(":", 1)[1].split("/")[0])
