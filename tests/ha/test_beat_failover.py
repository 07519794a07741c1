"""Beat across a lossy failover: a slot is sent only once the replica holds its reservation, so none fires twice.

The replica is stopped (SIGSTOP, by PID) while beat runs an every-second entry with REDIS_WAIT_REPLICAS=1, so what the
primary writes meanwhile never reaches it; then the primary is SIGKILLed and the replica continued and promoted: the
last writes before the kill are lost, as in the failover the issue describes. redbeat on its own sends a slot whose
reservation is lost with the primary and sends it again after the failover. Here beat sends nothing the replica does
not hold ("nothing sent" while it is stopped), and it goes on firing on the new primary with no slot twice.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ha.test_failover import beat_sends
from tests.support.beat import Beat
from tests.support.procs import wait_for
from tests.support.topology import Topology

EVERY = 1.0
HELD_BACK_S = 2.5


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    topo = Topology(tmp_path / "topology").start()
    yield topo
    for node in topo.nodes:  # a stopped node does not take SIGTERM
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)
    topo.stop()


def test_beat_sends_no_slot_the_replica_does_not_hold(topology: Topology, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:6]
    entry = f"ha-tick-{run}"
    env = topology.beat_env(entry, f"tick-{run}", EVERY, wait_timeout_ms=300)
    beat = Beat(run, tmp_path / "logs", env).start()
    try:
        wait_for(lambda: len(beat_sends(beat, entry)) >= 3, 30, 0.1, what="three sends")
        primary = topology.primary()
        (replica,) = [node for node in topology.nodes if node is not primary]
        assert replica.proc is not None
        replica.proc.send_signal(signal.SIGSTOP)
        stopped = time.time()
        time.sleep(HELD_BACK_S)
        primary.kill()
        killed = time.time()
        replica.proc.send_signal(signal.SIGCONT)
        topology.wait_promoted(primary)
        topology.restart_as_replica(primary, replica)
        wait_for(lambda: len([t for t in beat_sends(beat, entry) if t > killed]) >= 3, 30, 0.2, what="sends after")

        sends = beat_sends(beat, entry)
        held_back = [t for t in sends if stopped + 0.1 < t < killed]
        gaps = [b - a for a, b in itertools.pairwise(sends)]
        print("BEAT", json.dumps({"sends": len(sends), "held_back": len(held_back), "min_gap": round(min(gaps), 2)}))
        assert not held_back, f"beat sent {len(held_back)} slot(s) the replica never held"
        assert "nothing sent" in beat.log()
        assert min(gaps) > EVERY / 2, f"a slot fired twice: gaps {gaps}"
        assert beat.proc is not None and beat.proc.poll() is None, "beat died"
    finally:
        beat.stop()
