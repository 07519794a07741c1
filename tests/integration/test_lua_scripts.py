"""The server-side scripts in `pipeline/lua` run against a real Redis: what each writes and answers, that every
file documents its KEYS and ARGV at its top, and that a server which lost its scripts (SCRIPT FLUSH, a
restart) is sent them again by the registry without the caller noticing.

The scripts run on a redis-server of this module's own, so flushing its scripts and its keys disturbs no
worker of the session.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu.utils.encoding import bytes_to_str

from pipeline.broker import is_oom
from pipeline.constants import CANCEL_KEY, GROUP_KEY_PREFIX, HEADER_GROUP
from pipeline.lua import INCLUDE, names, parts, script, sha, source
from pipeline.queues.wake import WAKE_MAX
from tests.support.monitor import Monitor
from tests.support.procs import RedisServer

LUA = Path(__file__).resolve().parents[2] / "pipeline" / "lua"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lua_redis(work_dir: Path) -> Iterator[RedisServer]:
    """A redis-server for this module alone."""
    server = RedisServer(work_dir / f"lua-redis-{uuid.uuid4().hex[:6]}").start()
    yield server
    server.stop()


@pytest.fixture
def client(lua_redis: RedisServer) -> Iterator[redis.Redis]:
    """A client on an empty database, with no script loaded."""
    client = lua_redis.client()
    client.flushdb()
    client.script_flush()
    yield client
    client.close()


def enqueue(
    client: redis.Redis,
    ids: list[str],
    *,
    claim_key: str = "q",
    claim_ttl: int | str = "",
    channel: str = "",
    keep: int = 100,
    now: float = 1000.0,
    group: str = "",
    messages: list[str] | None = None,
) -> object:
    """Run `enqueue.lua` as `pipeline.producer.script.store_jobs` does: records `rec:<id>`, index `idx`,
    queue `q`, message `m:<id>` and event `e:<id>` per job."""
    messages = messages or [f"m:{i}" for i in ids]
    events = [f"e:{i}" for i in ids] if channel else []
    head = ["rec:", "record", 600, repr(now), keep, len(ids), channel, claim_ttl, group]
    args = [*head, *ids, *messages, *events]
    return script("enqueue")(keys=["idx", "q", claim_key, "wake:q", *_group_keys("q", group)], args=args, client=client)


def _group_keys(key: str, group: str) -> list[str]:
    """The KEYS `enqueue.lua` takes for a group's jobs of list `key` (none without a group)."""
    if not group:
        return []
    prefix = GROUP_KEY_PREFIX
    return [f"{prefix}jobs:{key}:{group}", f"{prefix}ring:{key}", f"{prefix}state:{key}", f"{prefix}count"]


def test_enqueue_writes_records_index_messages_and_events(client: redis.Redis) -> None:
    events = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]  # unannotated in redis-py
    events.subscribe("events")
    events.get_message(timeout=1)  # the subscription's confirmation
    assert enqueue(client, ["a", "b", "c"], channel="events") == 3
    assert [client.get(f"rec:{i}") for i in "abc"] == [b"record"] * 3
    assert all(0 < client.ttl(f"rec:{i}") <= 600 for i in "abc")
    assert client.zrange("idx", 0, -1, withscores=True) == [(b"a", 1000.0), (b"b", 1000.0), (b"c", 1000.0)]
    assert client.lrange("q", 0, -1) == [b"m:c", b"m:b", b"m:a"]  # LPUSHed in order: the first is popped first
    received = [events.get_message(timeout=1) for _ in range(3)]
    assert [m["data"] for m in received if m] == [b"e:a", b"e:b", b"e:c"]
    events.close()


def test_enqueue_keeps_the_most_recent_entries_of_the_index(client: redis.Redis) -> None:
    client.zadd("idx", {"old1": 1.0, "old2": 2.0, "old3": 3.0})
    assert enqueue(client, ["new"], keep=2, now=10.0) == 1
    assert client.zrange("idx", 0, -1) == [b"old3", b"new"]


def test_enqueue_claims_the_idempotency_key_or_answers_its_holder_and_writes_nothing(client: redis.Redis) -> None:
    assert enqueue(client, ["first"], claim_key="claim", claim_ttl=60) == 1
    assert client.get("claim") == b"first" and 0 < client.ttl("claim") <= 60
    assert enqueue(client, ["second"], claim_key="claim", claim_ttl=60) == b"first"
    assert client.get("rec:second") is None
    assert client.zrange("idx", 0, -1) == [b"first"]
    assert client.lrange("q", 0, -1) == [b"m:first"]


def cas(client: redis.Redis, old: str, new: str, ttl: int = 0) -> object:
    return script("once_cas")(keys=["once"], args=[old, new, ttl], client=client)


def test_once_cas_moves_the_key_only_from_the_expected_value(client: redis.Redis) -> None:
    assert cas(client, "claimed", "sending", 60) == 0  # no key: nothing to compare with
    assert client.get("once") is None
    client.set("once", "claimed")
    assert cas(client, "someone else's", "sending", 60) == 0
    assert client.get("once") == b"claimed"
    assert cas(client, "claimed", "sending", 60) == 1
    assert client.get("once") == b"sending" and 0 < client.ttl("once") <= 60
    assert cas(client, "sending", "") == 1  # '' deletes
    assert client.exists("once") == 0


def take(client: redis.Redis, interval_ms: float, tau_ms: float, carried: float | None = None) -> tuple[float, float]:
    """(wait, slot) in ms, the slot on Redis's clock."""
    args = [interval_ms, tau_ms, "" if carried is None else carried]
    wait, slot = script("rate_acquire")(keys=["rate"], args=args, client=client)
    return float(wait), float(slot)


def redis_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


#: A long interval for the rate tests: consecutive calls land well inside it however slow the machine is.
MINUTE = 60_000


def take_timed(client: redis.Redis, interval_ms: float, tau_ms: float) -> tuple[float, float, float, float]:
    """`take`'s (wait, slot), with Redis's clock (ms) read just before and just after the call."""
    before = redis_ms(client)
    wait, slot = take(client, interval_ms, tau_ms)
    return wait, slot, before, redis_ms(client)


def waited_for(wait: float, slot: float, before: float, after: float) -> bool:
    """The wait is the slot less the script's clock, which read between `before` and `after` (the slot is sent with
    a tenth of a ms)."""
    return slot - after - 0.1 <= wait <= slot - before + 0.1


def test_rate_acquire_answers_the_wait_for_each_reserved_slot(client: redis.Redis) -> None:
    taken = [take_timed(client, MINUTE, 0) for _ in range(3)]  # 1/min, no burst
    slots = [slot for _wait, slot, _before, _after in taken]
    assert taken[0][0] == 0
    assert [later - earlier for earlier, later in itertools.pairwise(slots)] == [pytest.approx(MINUTE, abs=0.1)] * 2
    assert all(waited_for(*call) for call in taken)  # each call takes the next slot, and waits for it
    pttl = client.pttl("rate")
    assert MINUTE < pttl <= 3 * MINUTE + 1001  # the key outlives the last slot by a second, then goes


def test_rate_acquire_gives_slots_on_redis_clock(client: redis.Redis) -> None:
    before = redis_ms(client)
    (_, first), (wait, second) = take(client, MINUTE, 0), take(client, MINUTE, 0)
    after = redis_ms(client)
    assert before <= first <= after and second == pytest.approx(first + MINUTE, abs=1)
    assert second - after <= wait <= second - before


def test_a_carried_slot_is_judged_on_redis_clock_and_honoured_without_taking_another(client: redis.Redis) -> None:
    now = redis_ms(client)
    assert take(client, MINUTE, 0, carried=now + 200) == (0.0, now + 200)  # within half an interval: start on it
    assert client.exists("rate") == 0  # no slot taken
    before = redis_ms(client)
    wait, slot = take(client, 1000, 0, carried=before + 5000)  # held by a worker whose clock runs ahead
    after = redis_ms(client)
    assert slot == before + 5000 and waited_for(wait, slot, before, after) and client.exists("rate") == 0
    wait, slot = take(client, 1000, 0, carried=now - 5000)  # late (a busy worker, or a clock behind): asks again
    assert wait == 0 and slot >= now and client.exists("rate") == 1


def test_rate_acquire_lets_a_burst_start_at_once(client: redis.Redis) -> None:
    taken = [take_timed(client, MINUTE, 2 * MINUTE) for _ in range(4)]  # 1/min, burst 3
    assert [wait for wait, _slot, _before, _after in taken[:3]] == [0, 0, 0]
    assert taken[3][0] > 0 and waited_for(*taken[3])
    assert taken[3][1] - taken[0][1] == pytest.approx(MINUTE, abs=0.1)  # the burst spent, the next slot is one away


def test_delayed_release_moves_due_jobs_only(client: redis.Redis) -> None:
    due = {"early": 100.0, "due": 200.0, "orphan": 150.0, "later": 300.0}
    client.zadd("delayed", due)
    client.hset("messages", mapping={"early": "body-early", "due": "body-due", "later": "body-later"})
    client.hset("dests", mapping={"early": "queue-a", "due": "queue-b", "orphan": "queue-a", "later": "queue-a"})
    keys = ["delayed", "messages", "dests"]
    released = script("delayed_release")(keys=keys, args=[250.0, 500, "wake:"], client=client)
    assert released == 2  # the orphan (no message) is dropped, not pushed
    assert client.lrange("queue-a", 0, -1) == [b"body-early"]
    assert client.lrange("queue-b", 0, -1) == [b"body-due"]
    assert client.zrange("delayed", 0, -1) == [b"later"]
    assert client.hkeys("messages") == [b"later"] and client.hkeys("dests") == [b"later"]


def test_delayed_release_takes_at_most_the_limit_earliest_first(client: redis.Redis) -> None:
    client.zadd("delayed", {"j1": 1.0, "j2": 2.0, "j3": 3.0})
    client.hset("messages", mapping={"j1": "b1", "j2": "b2", "j3": "b3"})
    client.hset("dests", mapping={"j1": "queue", "j2": "queue", "j3": "queue"})
    keys = ["delayed", "messages", "dests"]
    assert script("delayed_release")(keys=keys, args=[time.time(), 2, "wake:"], client=client) == 2
    assert client.lrange("queue", 0, -1) == [b"b2", b"b1"]
    assert client.zrange("delayed", 0, -1) == [b"j3"]


def test_enqueue_and_delayed_release_push_one_wake_marker_per_job_kept_to_wake_max(client: redis.Redis) -> None:
    """An idle worker waits on its queues' markers (`pipeline.queues.wake`): each job pushed brings one, on the
    queue's marker whatever its priority step, and a marker nobody consumes stays bounded."""
    assert enqueue(client, ["a", "b"]) == 2
    assert client.llen("wake:q") == 2
    assert enqueue(client, [f"j{i}" for i in range(40)]) == 40
    assert client.llen("wake:q") == WAKE_MAX
    assert enqueue(client, ["c"], claim_key="claim", claim_ttl=60) == 1
    client.ltrim("wake:q", 1, 0)
    assert enqueue(client, ["d"], claim_key="claim", claim_ttl=60) == b"c"  # refused: nothing pushed, no marker
    assert client.exists("wake:q") == 0
    ids = [f"p{i}" for i in range(40)]
    client.zadd("delayed", dict.fromkeys(ids, 1.0))
    client.hset("messages", mapping=dict.fromkeys(ids, "body"))
    client.hset("dests", mapping={i: "mail\x06\x163" if n % 2 else "mail" for n, i in enumerate(ids)})
    client.hset("dests", "p0", "other")
    keys = ["delayed", "messages", "dests"]
    assert script("delayed_release")(keys=keys, args=[time.time(), 3, "wake:"], client=client) == 3
    assert client.llen("wake:mail") == 2 and client.llen("wake:other") == 1  # the priority step's queue: `mail`
    assert script("delayed_release")(keys=keys, args=[time.time(), 500, "wake:"], client=client) == 37
    assert client.llen("wake:mail") == WAKE_MAX and client.llen("wake:other") == 1
    assert client.llen("mail") + client.llen("mail\x06\x163") == 39


def _raw(path: str) -> str:
    return (LUA / path).read_text()


def test_every_script_is_a_named_entry_point_with_its_keys_and_argv_at_its_head_and_is_named_by_its_sha() -> None:
    """Each `<name>.lua` defines one entry point, `local function <entry>(KEYS, ARGV)` (`<name>`, or `store_result`
    where the helper is `store`), under a comment giving its KEYS, ARGV and reply, and ends by calling it; no file
    (script or part) is over 300 lines."""
    assert {"enqueue", "once_cas", "rate_acquire", "delayed_release"} <= set(names())
    for name in names():
        lines = _raw(f"{name}.lua").splitlines()
        assert lines and lines[0].startswith("--"), name
        [head] = [i for i, line in enumerate(lines) if re.fullmatch(r"local function \w+\(KEYS, ARGV\)", line)]
        entry = lines[head].split()[2].partition("(")[0]
        assert entry in (name, f"{name}_result"), name
        above = itertools.takewhile(lambda line: line.startswith("--"), lines[head - 1 :: -1])
        contract = "\n".join(above)
        assert "KEYS" in contract and "ARGV" in contract and "Returns" in contract, name
        assert lines[-1] == f"return {entry}(KEYS, ARGV)", name
        assert script(name).sha == sha(name), name
    files = [*(f"{n}.lua" for n in names()), *(f"parts/{p}.lua" for p in parts())]
    assert {f: n for f in files if (n := len(_raw(f).splitlines())) > 300} == {}


def test_a_server_that_lost_the_script_is_sent_it_again(client: redis.Redis) -> None:
    assert cas(client, "x", "y") == 0
    assert client.script_exists(sha("once_cas")) == [True]
    client.script_flush()
    assert client.script_exists(sha("once_cas")) == [False]
    client.set("once", "x")
    assert cas(client, "x", "y", 60) == 1  # NOSCRIPT answered by loading it, inside the call
    assert client.get("once") == b"y"
    assert client.script_exists(sha("once_cas")) == [True]
    client.script_flush()  # an assembled script (its parts included) is sent again the same way
    meta = json.dumps({"status": "SUCCESS", "result": 1})
    assert script("store")(keys=["celery-task-meta-1", "pipeline:lease"], args=[meta, 0, "", ""], client=client) == 1
    assert client.get("celery-task-meta-1") == meta.encode()
    assert client.script_exists(sha("store")) == [True]


def test_every_shared_function_is_written_once_and_included_where_it_is_used() -> None:
    """`store`, `held`, `acknowledge`, a flow's `create`, `claim`, `record` and `finish`, `gcra`: each is defined in one
    part only, never in a script, and each script that uses it has it exactly once once assembled (`--- @include`)."""
    defined: dict[str, list[str]] = {}
    for path in [*(f"{n}.lua" for n in names()), *(f"parts/{p}.lua" for p in parts())]:
        for function in re.findall(r"^local function (\w+)\(", _raw(path), flags=re.M):
            defined.setdefault(function, []).append(path)
    assert {f: paths for f, paths in defined.items() if len(paths) > 1} == {}
    users = {
        "store": ("store", "settle", "fetch", "flow_advance"),
        "held": ("store", "settle", "fetch", "flow_advance"),
        "acknowledge": ("settle", "fetch"),
        "record": ("fetch", "flow_advance", "flow_claim"),
        "finish": ("fetch", "flow_advance", "flow_claim"),
        "create": ("flow_advance", "flow_claim"),
        "claim": ("flow_advance", "flow_claim"),
        "gcra": ("rate_acquire", "fetch"),
    }
    for function, scripts in users.items():
        assert defined[function][0].startswith("parts/"), function
        for name in scripts:
            assert source(name).decode().count(f"local function {function}(") == 1, (function, name)
    assert not any(INCLUDE.search(source(name)) for name in names()), "every include line is replaced"


def _lease(client: redis.Redis, tags: dict[str, str]) -> None:
    """Leased deliveries as the fetch records them: `unacked`, the index, the owner, the count and a history."""
    for tag, owner in tags.items():
        client.hset("unacked", tag, "[]")
        client.zadd("unacked_index", {tag: 1})
        client.hset("pipeline:lease", tag, owner)
        client.hset("pipeline:deliveries", tag, 1)
        client.rpush(f"hist:{tag}", "x")


def test_settle_stores_the_results_then_acknowledges_only_what_the_owner_holds(client: redis.Redis) -> None:
    """`settle.lua` on a real Redis: results written (a stored SUCCESS left alone), the owner's tags acknowledged
    with every record of theirs, a peer's tag fenced and untouched, and a result of a delivery the owner lost not
    written."""
    keys = ["unacked", "unacked_index", "pipeline:lease", "pipeline:deliveries"]
    _lease(client, {"mine": "me", "theirs": "peer"})
    client.set("result-done", '{"status": "SUCCESS"}')
    results = [
        ("result-new", '{"status": "SUCCESS", "result": 1}', 60, "mine"),
        ("result-done", '{"status": "FAILURE"}', 0, ""),
        ("result-theirs", '{"status": "SUCCESS", "result": 2}', 60, "theirs"),
    ]
    fenced = script("settle")(
        keys=[*keys, *(r[0] for r in results)],
        args=["me", "hist:", len(results), *(x for _k, v, e, t in results for x in (v, e, t)), "mine", "theirs"],
        client=client,
    )
    assert fenced == [b"theirs"]
    assert client.get("result-new") == b'{"status": "SUCCESS", "result": 1}' and 0 < client.ttl("result-new") <= 60
    assert client.get("result-done") == b'{"status": "SUCCESS"}'
    assert client.get("result-theirs") is None  # the lease is a peer's: this worker stores nothing for it
    assert [client.hexists(key, "mine") for key in ("unacked", "pipeline:lease", "pipeline:deliveries")] == [0, 0, 0]
    assert client.zscore("unacked_index", "mine") is None and not client.exists("hist:mine")
    assert client.hget("pipeline:lease", "theirs") == b"peer" and client.exists("hist:theirs")


def test_store_is_fenced_by_the_jobs_lease(client: redis.Redis) -> None:
    _lease(client, {"mine": "me", "theirs": "peer"})
    store = script("store")
    assert store(keys=["r1", "pipeline:lease"], args=['{"status": "STARTED"}', 0, "mine", "me"], client=client) == 1
    assert store(keys=["r2", "pipeline:lease"], args=['{"status": "SUCCESS"}', 0, "theirs", "me"], client=client) == -1
    assert store(keys=["r3", "pipeline:lease"], args=['{"status": "SUCCESS"}', 60, "", ""], client=client) == 1
    assert client.get("r1") == b'{"status": "STARTED"}' and client.get("r2") is None and client.ttl("r3") > 0


def _advance_item(client: redis.Redis, node: str, result: tuple[str, str, str, str]) -> list[object]:
    """`flow_advance.lua` recording item `node` of step `split` of flow `f1`, storing its job's result `result`
    (task key, meta, delivery tag, owner) in the same call; no step offered."""
    key, meta, tag, owner = result
    head = [node, '{"ok": true}', f"job-{node}", 1000.0, 60, "rec:", 100, "split", "1", "f1", "fan", 2]
    args = [*head, 0, 0, 100, "", meta, 0, tag, owner]
    keys = ["pipeline:flow:{f1}", "flows", key, "pipeline:lease"]
    return list(script("flow_advance")(keys=keys, args=args, client=client))


def test_advance_stores_the_jobs_result_fenced_and_records_the_node_either_way(client: redis.Redis) -> None:
    """The call that records a node stores its job's SUCCESS as store.lua would (a final state left alone), only while
    the owner holds the job's lease; the node is recorded whatever became of the result."""
    _lease(client, {"mine": "me", "theirs": "peer"})
    client.hset("pipeline:flow:{f1}", mapping={"state": "running", "left": 1, "total": 3, "done": 0, "more:split": 3})
    success = '{"status": "SUCCESS", "result": {"ok": true}}'
    reply = _advance_item(client, "split[0]", ("r0", success, "mine", "me"))
    assert reply[:6] == [1, b"running", 0, b"", b"", 1]
    assert client.get("r0") == success.encode()
    reply = _advance_item(client, "split[1]", ("r1", success, "theirs", "me"))
    assert reply[:6] == [1, b"running", 0, b"", b"", -1]  # fenced: a peer holds the job; its node is recorded still
    assert client.get("r1") is None
    client.set("r2", '{"status": "REVOKED"}')
    assert _advance_item(client, "split[2]", ("r2", success, "", ""))[:6] == [1, b"running", 1, b"", b"", 0]
    assert client.get("r2") == b'{"status": "REVOKED"}'
    assert client.hgetall("pipeline:flow:{f1}:results").keys() == {b"split[0]", b"split[1]", b"split[2]"}
    assert _advance_item(client, "split[0]", ("r0", success, "mine", "me"))[:6] == [0, b"running", 1, b"", b"", 0]


def test_advance_with_a_result_is_refused_as_a_whole_at_maxmemory(client: redis.Redis) -> None:
    """Storing the job's result does not let a flow's advance past maxmemory: its first write is the node's record,
    refused on a full Redis (nothing written, the job retries), as without a result."""
    _lease(client, {"mine": "me"})
    client.hset("pipeline:flow:{f1}", mapping={"state": "running", "left": 1, "total": 2, "done": 0, "more:split": 2})
    client.set("r0", '{"status": "STARTED"}')
    client.rpush("filler", *("x" * 10_000 + str(i) for i in range(100)))
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 256 * 1024)
    try:
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            _advance_item(client, "split[0]", ("r0", '{"status": "SUCCESS"}', "mine", "me"))
    finally:
        client.config_set("maxmemory", 0)
    assert client.get("r0") == b'{"status": "STARTED"}' and not client.exists("pipeline:flow:{f1}:results")


def test_renew_and_release_touch_only_the_owners_leases_on_redis_clock(client: redis.Redis) -> None:
    """The new expiry is Redis's TIME plus the lease: whatever the caller's clock says."""
    for tag, owner in (("mine", "me"), ("theirs", "peer")):
        client.zadd("unacked_index", {tag: 1})
        client.hset("pipeline:lease", tag, owner)
    seconds, micros = client.time()
    lost = script("renew")(keys=["unacked_index", "pipeline:lease"], args=["me", 30, "mine", "theirs"], client=client)
    assert lost == [b"theirs"]
    expiry = client.zscore("unacked_index", "mine")
    assert expiry is not None and 0 <= expiry - (seconds + micros / 1e6 + 30) < 2
    assert client.zscore("unacked_index", "theirs") == 1
    script("release")(keys=["unacked_index", "pipeline:lease"], args=["me", "mine", "theirs"], client=client)
    assert client.zscore("unacked_index", "mine") == 0 and not client.hexists("pipeline:lease", "mine")
    assert client.hget("pipeline:lease", "theirs") == b"peer" and client.zscore("unacked_index", "theirs") == 1


def test_fetch_and_renewal_write_whole_second_expiries_never_short_of_the_lease(client: redis.Redis) -> None:
    """Each lease expiry is Redis's clock plus the lease rounded up to the whole second: the holder keeps at least
    the lease it was granted (at most a second more), and the small index keeps every score as an integer."""
    client.lpush("jobs", _envelope("job-1"))
    for lease in ("30", "2.5"):
        seconds, micros = client.time()
        if lease == "30":
            keys = ["unacked", "unacked_index", "pipeline:lease", "pipeline:deliveries", "jobs", "test:paused"]
            args = [lease, "me", "node", "x:", "hist:", 20, 60, "0", 10, 0, 0, GROUP_KEY_PREFIX, 0, ""]
            script("fetch")(keys=keys, args=args, client=client)
        else:
            renew = script("renew")
            assert renew(keys=["unacked_index", "pipeline:lease"], args=["me", lease, "job-1"], client=client) == []
        after_s, after_us = client.time()
        expiry = client.zscore("unacked_index", "job-1")
        assert expiry is not None and expiry.is_integer(), expiry
        assert seconds + micros / 1e6 + float(lease) <= expiry <= after_s + after_us / 1e6 + float(lease) + 1
        assert client.object("encoding", "unacked_index") == b"listpack"


def _fetch(
    client: redis.Redis, queues: list[str], untracked: str, count: int = 10, cap: int = 0, limits: str = ""
) -> list[object]:
    """`fetch.lua`'s reply, less its (empty) third field, the answers to nodes (none carried here)."""
    keys = ["unacked", "unacked_index", "pipeline:lease", "pipeline:deliveries", *queues, "test:paused"]
    args = [30, "me", "node", "x:", "hist:", 20, 60, untracked, count, 0, cap, GROUP_KEY_PREFIX, 0, limits]
    reply = script("fetch")(keys=keys, args=args, client=client)
    assert isinstance(reply, list) and reply[2] == []
    return [*reply[:2], *reply[3:]]


def test_fetch_records_a_carried_node_as_flow_advance_does_after_its_results_and_acknowledgements(
    client: redis.Redis,
) -> None:
    """A solo worker's fan-out item: its node is recorded by the fetch that stores its result (as `flow_advance.lua`
    records an item offering no step), answered as flow_advance.lua answers; once only; a node of no flow is
    answered as such."""
    _lease(client, {"mine": "me"})
    client.hset("pipeline:flow:{f1}", mapping={"state": "running", "left": 0, "total": 2, "done": 1, "more:split": 1})
    client.hset("pipeline:flow:{f1}", "on:split", "900.5")
    client.lpush("jobs", _envelope("job-1"))
    result = ('{"status": "SUCCESS"}', 60, "mine")
    node = ["split[1]", '{"ok": true}', "job-x", "split", "1000.0", 60]
    keys = ["unacked", "unacked_index", "pipeline:lease", "pipeline:deliveries", "jobs", "result-1"]
    keys += ["pipeline:flow:{f1}", "pipeline:flow:{gone}", "test:paused"]
    args = [30, "me", "node", "x:", "hist:", 20, 60, "0", 10, 1, 0, GROUP_KEY_PREFIX, 2, "", *result]
    args += [*node, *["split[0]", "{}", "job-y", "split", "1000.0", 60], "mine"]
    reply = script("fetch")(keys=keys, args=args, client=client)
    assert reply[:3] == [[], [], [1, b"succeeded", 1, b"900.5", 0, b"", 0, b""]]
    assert reply[3:5] == [b"jobs", b"job-1"]
    assert client.hget("pipeline:flow:{f1}:results", "split[1]") == b'{"ok": true}'
    assert client.hget("pipeline:flow:{f1}:tasks", "split[1]") == b"job-x"
    assert client.hmget("pipeline:flow:{f1}", ["state", "finished", "more:split"]) == [b"succeeded", b"1000.0", b"0"]
    assert client.ttl("pipeline:flow:{f1}:results") > 0 and not client.exists("pipeline:flow:{gone}")
    assert client.get("result-1") == b'{"status": "SUCCESS"}' and not client.hexists("pipeline:lease", "mine")
    args[12] = 1
    again = script("fetch")(keys=[*keys[:7], "test:paused"], args=[*args[:-7], "x"], client=client)
    assert again[2] == [0, b"succeeded", 1, b""]  # recorded before: nothing changes


def _envelope(tag: str) -> str:
    return json.dumps(
        {"body": "", "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "q"}}}
    )


def test_fetch_leases_on_redis_clock_and_leaves_a_queue_consumed_without_acknowledgement_unrecorded(
    client: redis.Redis,
) -> None:
    client.lpush("jobs", _envelope("job-1"))
    client.lpush("reply.celery.pidbox", _envelope("reply-1"))
    seconds, _micros = client.time()
    reply = _fetch(client, ["jobs", "reply.celery.pidbox"], "01")
    assert reply[1] == []  # no consumed queue is paused
    assert reply[2:7] == [b"jobs", b"job-1", 1, _envelope("job-1").encode(), 0]
    assert reply[7:10] == [b"", b"", b""]  # no rate slot taken
    assert reply[10:15] == [b"reply.celery.pidbox", b"", 0, _envelope("reply-1").encode(), 2]
    assert client.hkeys("unacked") == [b"job-1"] and client.hkeys("pipeline:lease") == [b"job-1"]
    expiry = client.zscore("unacked_index", "job-1")
    assert expiry is not None and 29 <= expiry - seconds <= 32


def test_fetch_pops_nothing_from_a_paused_queue_and_names_it(client: redis.Redis) -> None:
    """A queue in the paused set keeps every job, on each priority sub-key too; the fetch takes the next queue's
    and names the paused queues it consumes. Removed from the set, the queue is fetched again, oldest first."""
    client.delete("test:paused")
    client.lpush("held", _envelope("held-1"))
    client.lpush("held\x06\x163", _envelope("held-3"))
    client.lpush("free", _envelope("free-1"))
    client.sadd("test:paused", "held", "elsewhere")
    reply = _fetch(client, ["held", "free", "held\x06\x163", "free\x06\x163"], "0000")
    assert reply[1] == [b"held"]
    assert reply[2:4] == [b"free", b"free-1"] and len(reply) == 10
    assert client.llen("held") == 1 and client.llen("held\x06\x163") == 1
    assert client.hkeys("unacked") == [b"free-1"]
    client.srem("test:paused", "held")
    reply = _fetch(client, ["held", "free", "held\x06\x163", "free\x06\x163"], "0000")
    assert reply[1] == [] and reply[2:4] == [b"held", b"held-1"] and reply[10:12] == [b"held\x06\x163", b"held-3"]


def test_a_paused_queues_groups_keep_their_jobs(client: redis.Redis) -> None:
    client.delete("test:paused")
    _enqueue_group(client, "tenant", ["t-0"])
    client.lpush("jobs", _grouped("plain-0", None))
    client.sadd("test:paused", "jobs")
    assert _taken(client, 2) == []
    assert client.llen("jobs") == 1 and client.hget(GROUP_KEY_PREFIX + "count", "jobs") == b"1"
    client.srem("test:paused", "jobs")
    assert sorted(_taken(client, 2)) == ["plain-0", "t-0"]


@pytest.mark.parametrize("first_write", ["fetch", "settle", "store", "renew", "release"])
def test_the_delivery_scripts_run_on_a_redis_at_maxmemory(client: redis.Redis, first_write: str) -> None:
    """At maxmemory (noeviction) Redis refuses a script whose first write may grow memory: each script that takes or
    settles jobs writes one that frees memory first, so a full Redis is drained by its workers."""
    _lease(client, {"mine": "me"})
    client.lpush("jobs", _envelope("job-1"))
    client.rpush("filler", *("x" * 10_000 + str(i) for i in range(100)))
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 256 * 1024)  # well past it: full
    try:
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory") as refused:
            client.set("probe", "x")  # a plain write is refused
        assert is_oom(refused.value)
        lease = ["unacked_index", "pipeline:lease"]
        result = ("result-1", '{"status": "SUCCESS"}', 60, "mine")
        if first_write == "fetch":
            assert _fetch(client, ["jobs"], "0")[3] == b"job-1"
        elif first_write == "settle":
            keys = ["unacked", "unacked_index", "pipeline:lease", "pipeline:deliveries", "result-1"]
            assert script("settle")(keys=keys, args=["me", "hist:", 1, *result[1:], "mine"], client=client) == []
            assert client.get("result-1") == b'{"status": "SUCCESS"}'
        elif first_write == "store":
            args = [result[1], 60, "mine", "me"]
            assert script("store")(keys=["result-1", "pipeline:lease"], args=args, client=client) == 1
        elif first_write == "renew":
            assert script("renew")(keys=lease, args=["me", 30, "mine"], client=client) == []
        else:
            assert script("release")(keys=lease, args=["me", "mine"], client=client) == 0
    finally:
        client.config_set("maxmemory", 0)


def _grouped(tag: str, group: str | None) -> str:
    """A message envelope with delivery tag `tag` (also its id) in `group`."""
    headers = {"id": tag, **({HEADER_GROUP: group} if group else {})}
    properties = {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "jobs"}}
    return json.dumps({"body": "", "headers": headers, "properties": properties})


def _enqueue_group(client: redis.Redis, group: str, tags: list[str]) -> None:
    script("enqueue")(
        keys=["idx", "jobs", "jobs", "wake:jobs", *_group_keys("jobs", group)],
        args=[
            "rec:",
            "r",
            600,
            "1.0",
            100,
            len(tags),
            "",
            "",
            group,
            *tags,
            *(_grouped(t, group) for t in tags),
        ],
        client=client,
    )


def _taken(client: redis.Redis, n: int, cap: int = 0) -> list[str]:
    """Tags of the next `n` fetches of one job each."""
    tags = []
    for _ in range(n):
        reply = _fetch(client, ["jobs"], "0", count=1, cap=cap)
        tags += [bytes_to_str(reply[i]) for i in range(3, len(reply), 8)]  # each element's tag
    return tags


def test_groups_take_turns_with_each_other_and_with_ungrouped_jobs(client: redis.Redis) -> None:
    _enqueue_group(client, "big", [f"big-{i}" for i in range(50)])
    _enqueue_group(client, "small", ["small-0", "small-1"])
    client.lpush("jobs", _grouped("plain-0", None), _grouped("plain-1", None))
    assert client.hget(GROUP_KEY_PREFIX + "count", "jobs") == b"52"  # the depth every display adds up

    order = _taken(client, 8)

    assert sorted(order[:6]) == sorted(["big-0", "small-0", "plain-0", "big-1", "small-1", "plain-1"])
    assert order[6:] == ["big-2", "big-3"]  # only the big group left: its backlog, in order
    assert order[:2] == ["plain-0", "big-0"]  # ungrouped jobs take every other turn; groups share the rest
    assert order.index("small-0") == 3  # one of big's jobs ahead of it, not its backlog
    assert client.hget(GROUP_KEY_PREFIX + "count", "jobs") == b"46"  # six of the 52 taken


def test_a_capped_group_waits_for_a_lease_to_end_while_others_run(client: redis.Redis) -> None:
    _enqueue_group(client, "a", ["a-0", "a-1", "a-2", "a-3"])
    _enqueue_group(client, "b", ["b-0"])

    first = _taken(client, 4, cap=2)
    assert sorted(first) == ["a-0", "a-1", "b-0"]  # a's third job waits: two of a's run; the fourth fetch is empty
    assert _taken(client, 1, cap=2) == []

    client.hdel("pipeline:lease", "a-0")  # a-0's lease ended (acknowledged, restored, given up: any path)
    assert _taken(client, 2, cap=2) == ["a-2"]  # a slot again, and only one
    assert client.hget(GROUP_KEY_PREFIX + "count", "jobs") == b"1"


def test_a_group_enqueued_again_while_its_jobs_run_is_held_to_its_cap(client: redis.Redis) -> None:
    """A group whose list emptied while its jobs run leaves the state hash; the next enqueue puts it back in the ring
    (enqueue.lua does not know the worker's cap). The fetch checks the cap when it takes the job."""
    _enqueue_group(client, "a", ["a-0", "a-1"])
    assert _taken(client, 3, cap=2) == ["a-0", "a-1"]  # both run; a's list is empty
    _enqueue_group(client, "a", ["a-2", "a-3"])  # a is back in the ring
    _enqueue_group(client, "b", ["b-0"])

    assert _taken(client, 3, cap=2) == ["b-0"]  # a's third job waits; b's runs, not behind a's
    assert client.hget(GROUP_KEY_PREFIX + "state:jobs", "a") == b"c"  # capped until a lease ends

    client.hdel("pipeline:lease", "a-1")
    assert _taken(client, 2, cap=2) == ["a-2"]


def test_a_grouped_message_back_on_the_plain_list_goes_to_its_group(client: redis.Redis) -> None:
    _enqueue_group(client, "a", ["a-0", "a-1"])
    client.lpush("jobs", _grouped("a-retry", "a"), _grouped("plain", None))  # a retry of a's, then a plain job

    order = _taken(client, 4, cap=1)

    assert order == ["plain", "a-retry"]  # the retry moved to the head of its group; cap 1: a's next job waits
    assert client.hget(GROUP_KEY_PREFIX + "count", "jobs") == b"2"  # a-0 and a-1 still wait in a's list


def test_a_fetch_of_plain_jobs_pops_them_in_one_call_and_trims_no_short_history(client: redis.Redis) -> None:
    """A key with no groups gives up its jobs in one RPOP (not one per job, and no look for a group's turn after
    each), and a delivery history under its length is not trimmed: the calls a fetch makes per job are its records'."""
    client.lpush("jobs", *(_grouped(f"p-{i}", None) for i in range(6)))
    client.config_resetstat()
    reply = _fetch(client, ["jobs"], "0", count=5)
    stats = client.info("commandstats")
    assert [bytes_to_str(reply[i]) for i in range(3, len(reply), 8)] == [f"p-{i}" for i in range(5)]
    assert client.llen("jobs") == 1 and client.llen("hist:p-0") == 1
    assert stats["cmdstat_rpop"]["calls"] == 1 and "cmdstat_ltrim" not in stats
    # the paused set, the keys it could take from (one call), the key's groups once; each tombstone
    assert stats["cmdstat_exists"]["calls"] == 3 + 5


def test_a_grouped_message_among_plain_jobs_of_a_key_without_groups_keeps_its_place(client: redis.Redis) -> None:
    """Popped in one call, the plain jobs ahead of a message naming a group are taken; it and the jobs behind it go
    back where they were, and it moves to its group as one popped alone does: the order is the step-by-step one."""
    client.lpush("jobs", _grouped("p-0", None), _grouped("p-1", None), _grouped("a-retry", "a"))
    client.lpush("jobs", _grouped("p-2", None), _grouped("p-3", None))

    reply = _fetch(client, ["jobs"], "0", count=4)

    assert [bytes_to_str(reply[i]) for i in range(3, len(reply), 8)] == ["p-0", "p-1", "p-2", "a-retry"]
    assert client.lrange("jobs", 0, -1) == [_grouped("p-3", None).encode()]  # the newest, still queued
    assert client.hget(GROUP_KEY_PREFIX + "count", "jobs") == b"0"


def _job(tag: str, task_id: str) -> str:
    return json.dumps(
        {
            "body": "",
            "headers": {"id": task_id, "task": "t"},
            "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "q"}},
        }
    )


def test_cancel_parks_nothing_writes_the_tombstone_and_the_fetch_drops_the_cancelled_job(client: redis.Redis) -> None:
    """`cancel.lua` takes a parked job out of `pipeline:delayed`, writes the tombstone with its TTL and publishes the
    id; the fetch acknowledges a cancelled job's message as it pops it (nothing held, no count, no history) and
    returns it as kind 3, and leases the job beside it as before."""
    client.zadd("pipeline:delayed", {"parked": 1})
    client.hset("pipeline:delayed:message", "parked", "m")
    client.hset("pipeline:delayed:dest", "parked", "q")
    listener = client.pubsub()
    listener.subscribe("pipeline:cancel")
    keys = ["pipeline:cancel:{id}", "pipeline:delayed", "pipeline:delayed:message", "pipeline:delayed:dest"]
    cancel = script("cancel")
    for task_id, parked in (("parked", 1), ("waiting", 0)):
        tombstone = f"pipeline:cancel:{task_id}"
        assert cancel(keys=[tombstone, *keys[1:]], args=[task_id, 120, "pipeline:cancel"], client=client) == parked
        assert client.get(tombstone) == b"1" and 0 < client.ttl(tombstone) <= 120
    assert not client.exists("pipeline:delayed", "pipeline:delayed:message", "pipeline:delayed:dest")
    heard = [listener.get_message(timeout=1) for _ in range(3)]
    assert [m["data"] for m in heard if m and m["type"] == "message"] == [b"parked", b"waiting"]
    listener.close()

    client.lpush("jobs", _job("tag-w", "waiting"), _job("tag-k", "kept"))
    reply = _fetch(client, ["jobs"], "0")
    assert reply[2:7] == [b"jobs", b"tag-w", 1, _job("tag-w", "waiting").encode(), 3]
    assert reply[10:15] == [b"jobs", b"tag-k", 1, _job("tag-k", "kept").encode(), 0]
    assert client.hkeys("unacked") == [b"tag-k"] and client.hkeys("pipeline:lease") == [b"tag-k"]
    assert client.zrange("unacked_index", 0, -1) == [b"tag-k"] and client.hkeys("pipeline:deliveries") == [b"tag-k"]
    assert not client.exists("hist:tag-w") and client.exists("hist:tag-k") and client.llen("jobs") == 0
    # The script names tombstones from the groups' prefix (`pipeline:{<q>}:cancel:` on a cluster): the same prefix.
    assert GROUP_KEY_PREFIX.replace("group:", "cancel:") == CANCEL_KEY.format(id="")
    assert "string.gsub(P, 'group:$', 'cancel:')" in source("fetch").decode()


def test_a_stored_revoked_is_kept_as_a_success_is(client: redis.Redis) -> None:
    """A cancelled job's state (REVOKED) is final: a SUCCESS or FAILURE stored after it does not replace it."""
    client.set("r", '{"status": "REVOKED"}')
    store = script("store")
    for late in ('{"status": "SUCCESS"}', '{"status": "FAILURE"}'):
        assert store(keys=["r", "pipeline:lease"], args=[late, 0, "", ""], client=client) == 0
    assert client.get("r") == b'{"status": "REVOKED"}'


#: The emission interval of the limits `fetch.lua` is given below, in ms.
INTERVAL_MS = 10_000


def _redis_ms(client: redis.Redis) -> float:
    """Redis's clock (TIME), in ms, as the scripts read it."""
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def _rated(tag: str, task: str, **headers: object) -> str:
    return json.dumps(
        {
            "body": "",
            "headers": {"id": tag, "task": task, **headers},
            "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "q"}},
        }
    )


def test_fetch_takes_each_rated_jobs_slot_as_rate_acquire_does_on_the_workers_own_keys_only(
    client: redis.Redis,
) -> None:
    """A job of a task the worker names with a limit takes its slot in the fetch (GCRA, as `rate_acquire.lua`): on the
    key base and its rate key header for a keyed limit, on the base for a keyless one; the second job of one key waits
    one interval. No slot for a keyed job without the header, one deferred with a slot of its own, or a task the
    worker names no limit for; a header cannot make the script write outside the worker's key bases."""
    # An interval of 10 s: the next slot `rate_acquire.lua` gives below is still ahead of Redis's clock however slowly a
    # loaded machine gets from the fetch to that call.
    limits = {
        "limited": [INTERVAL_MS, 0, 1, "pipeline:ratelimit:limited"],
        "open": [INTERVAL_MS, 0, 0, "pipeline:ratelimit:open"],
    }
    jobs = [
        _rated("a1", "limited", pipeline_rate_key="h1"),
        _rated("a2", "limited", pipeline_rate_key="h1"),
        _rated("b1", "limited", pipeline_rate_key="h2"),
        _rated("nokey", "limited"),
        _rated("deferred", "limited", pipeline_rate_key="h1", pipeline_rate_slot=12.5),
        _rated("keyless", "open", pipeline_rate_key="../../pipeline:lease"),
        _rated("other", "other", pipeline_rate_key="h1"),
    ]
    client.lpush("jobs", *jobs)
    with Monitor(client) as seen:
        reply = _fetch(client, ["jobs"], "0", limits=json.dumps(limits))
    got = {reply[i + 1].decode(): reply[i + 5 : i + 8] for i in range(2, len(reply), 8)}
    assert list(got) == ["a1", "a2", "b1", "nokey", "deferred", "keyless", "other"]
    for tag in ("nokey", "deferred", "other"):
        assert got[tag] == [b"", b"", b""], tag
    assert got["a1"][:2] == [b"pipeline:ratelimit:limited:h1", b"0"]
    assert got["a2"][0] == b"pipeline:ratelimit:limited:h1" and float(got["a2"][1]) == pytest.approx(INTERVAL_MS, abs=1)
    assert float(got["a2"][2]) - float(got["a1"][2]) == pytest.approx(INTERVAL_MS, abs=0.01)
    assert got["b1"][:2] == [b"pipeline:ratelimit:limited:h2", b"0"]
    assert got["keyless"][:2] == [b"pipeline:ratelimit:open", b"0"]  # a keyless limit reads no header
    assert sorted(client.keys("pipeline:ratelimit:*")) == [
        b"pipeline:ratelimit:limited:h1",
        b"pipeline:ratelimit:limited:h2",
        b"pipeline:ratelimit:open",
    ]
    # Each slot's SET keeps the key one second past its new TAT (one, then two intervals past the script's clock),
    # rounded up to the ms: what the script sent, not a clock read after it.
    sets = [c["command"].split(" ") for c in seen.mentioning("pipeline:ratelimit:limited:h1")]
    expiries = [int(words[4]) for words in sets if words[0].upper() == "SET" and words[3].upper() == "PX"]
    assert expiries == [pytest.approx(1000 + INTERVAL_MS, abs=1), pytest.approx(1000 + 2 * INTERVAL_MS, abs=1)]
    # One limiter with `rate_acquire.lua`: the next job asking on h1 gets the slot after the two the fetch took.
    # Its wait is to that slot on Redis's clock, read between a TIME before and one after the call.
    before = _redis_ms(client)
    wait, slot = script("rate_acquire")(
        keys=["pipeline:ratelimit:limited:h1"], args=[INTERVAL_MS, 0, ""], client=client
    )
    after = _redis_ms(client)
    assert float(slot) - float(got["a1"][2]) == pytest.approx(2 * INTERVAL_MS, abs=0.01)
    assert float(slot) - after - 0.01 <= float(wait) <= float(slot) - before + 0.01


def test_an_empty_fetch_reads_every_key_it_could_take_from_in_one_call(client: redis.Redis) -> None:
    """An idle worker's fetch (nothing queued, nothing grouped) makes two calls whatever the number of keys: the
    paused set and one EXISTS over the lists and their groups' keys; no RPOP, no TIME. A key with a group's jobs only
    (its list empty) still goes the long way: its job is taken."""
    keys = [f"q{n}" for n in range(20)]
    client.config_resetstat()
    reply = _fetch(client, keys, "0" * len(keys), count=5)
    stats = client.info("commandstats")
    assert len(reply) == 2  # fenced, paused: no element
    script_calls = {k: v["calls"] for k, v in stats.items() if k in ("cmdstat_exists", "cmdstat_rpop", "cmdstat_time")}
    assert script_calls == {"cmdstat_exists": 2}
    _enqueue_group(client, "tenant-a", ["g-1"])  # in its group's list: the queue's own list stays empty
    assert client.llen("jobs") == 0
    reply = _fetch(client, [*keys, "jobs"], "0" * (len(keys) + 1), count=5)
    assert [bytes_to_str(reply[i]) for i in range(3, len(reply), 8)] == ["g-1"]
