"""How RayLauncher asks Ray for one slot's worker (or gang), without ever blocking on Ray.

Every slot is one placement group of k bundles (k = processes_per_slice; 1 for a plain
worker), each bundle what one actor reserves. A group is asked of Ray once and then only
looked at: `SlotRequest.advance(place_wait_s, start_wait_s)` waits at most `place_wait_s`
for Ray to place the group (capacity) and at most `start_wait_s` for its actors to start,
and says whether the slot is ready. So a replacement asked while the cluster is full stays
asked: when a node joins, Ray places the pending group and the next look (a checkpoint
boundary of a narrow run, mpmd/train/relayout.py) starts the actors in it, and the one after
hands them out, with no step or save ever waiting for capacity.

Strategy. A gang spreads one process per node (STRICT_SPREAD) only when at least k nodes
each hold a whole bundle by their total resources: a 0-CPU head node is a node, but not one
that holds a {CPU: 1} bundle. Else its bundles are packed (PACK) onto the nodes there are
(one machine standing in for k hosts), and when not even the sum of the nodes holds k
bundles, the first start refuses with what each node offers (`Unplaceable`); a replacement
is asked anyway (a node may join).

The connection itself: `check_reachable` bounds connecting to a Ray cluster's address by
cluster.connect_timeout_s, since ray.init retries an unreachable address for minutes.
"""

from __future__ import annotations

import math
import socket
import time

from mpmd.runtime.control.cluster import ClusterUnavailable

CONNECT_POLL_S = 0.5  # how often an address that refused is tried again


class Unplaceable(ClusterUnavailable):
    """No node set of this Ray cluster can hold a slot's bundles; the message says what was
    asked and what each node offers."""


class StartFailed(RuntimeError):
    """A slot's actors died or did not start in time after Ray placed their group."""


def node_offers(ray) -> list[tuple[str, dict]]:
    """(node IP, total resources) of every live node, Ray's own bookkeeping keys left out."""
    return [
        (
            n["NodeManagerAddress"],
            {
                k: v
                for k, v in n.get("Resources", {}).items()
                if not k.startswith("node:") and k != "object_store_memory"
            },
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def bundles_held(bundle: dict, resources: dict) -> int | float:
    """How many copies of `bundle` a node of `resources` holds (inf for an empty bundle)."""
    return min((math.floor(resources.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0), default=math.inf)


def strategy(bundle: dict, k: int, offers: list[tuple[str, dict]]) -> str | None:
    """STRICT_SPREAD when at least k nodes each hold a bundle, PACK when the nodes hold k
    bundles between them, None when they do not (see the module docstring)."""
    held = [bundles_held(bundle, res) for _, res in offers]
    if k > 1 and sum(h >= 1 for h in held) >= k:
        return "STRICT_SPREAD"
    return "PACK" if sum(held) >= k else None


def describe_offers(offers: list[tuple[str, dict]], bundle: dict) -> str:
    """What each live node offers of the bundle's resources, one `node IP {CPU: 4}` each."""
    return (
        "; ".join(
            f"node {ip} {{" + ", ".join(f"{k}: {r.get(k, 0.0):g}" for k in sorted(bundle)) + "}" for ip, r in offers
        )
        or "no live node"
    )


def missing(bundle: dict, k: int, offers: list[tuple[str, dict]]) -> str:
    """Which of the bundle's resources the nodes lack for k bundles, and on how many nodes."""
    short = [
        f"{name} (needs {amount * k:g} in all, {sum(r.get(name, 0.0) for _, r in offers):g} there; "
        f"{sum(r.get(name, 0.0) < amount for _, r in offers)} of {len(offers)} node(s) lack {amount:g})"
        for name, amount in sorted(bundle.items())
        if amount > 0 and sum(math.floor(r.get(name, 0.0) / amount + 1e-9) for _, r in offers) < k
    ]
    return ", ".join(short) or "a node that holds every resource of one bundle at once"


def check_reachable(address: str, timeout_s: float) -> None:
    """ClusterUnavailable unless `address` ("HOST:PORT" or "ray://HOST:PORT") accepts a TCP
    connection within timeout_s (tried every CONNECT_POLL_S: a head may be starting)."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return  # not HOST:PORT ("auto" and the like): ray.init resolves and checks it
    deadline, why = time.monotonic() + timeout_s, "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(min(left, 5.0), 0.1)):
                return
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
        if left <= CONNECT_POLL_S:
            raise ClusterUnavailable(
                f"cannot reach the Ray cluster at {address} within connect_timeout_s={timeout_s:g} s ({why}): check "
                f"that its head runs (`ray start --head` there), that the address and port are right (Ray's "
                f"default port is 6379) and that this machine may connect to it"
            )
        time.sleep(CONNECT_POLL_S)


class SlotRequest:
    """One slot's placement group as asked of Ray, and its actors once Ray placed it.

    new_actor(group, bundle_index) makes the actor of one bundle (RayLauncher._new_actor);
    start_timeout_s bounds the start from placement to ready (a gang: all its processes
    joined). `ready`: [(address, pid)] per process once advance returned True."""

    def __init__(self, ray, slot: int, bundle: dict, k: int, strategy_name: str, start_timeout_s: float, new_actor):
        self._ray, self.slot, self.bundle, self.k = ray, slot, bundle, k
        self.group = ray.util.placement_group([bundle] * k, strategy=strategy_name)
        # Resolved once Ray placed the group. A look goes through this reference, never
        # group.wait(0.0): that asks Ray's GCS with a 0 s deadline and says False for a
        # group already placed (on Ray 2.60: 3 of 5 calls on an idle machine; under load,
        # right after wait(60) said True), so a look that only looks missed the node
        # that joined.
        self._placed = self.group.ready()
        self.strategy = strategy_name
        self._new_actor, self._start_timeout_s = new_actor, start_timeout_s
        self.asked_at = time.monotonic()
        self.placed_at: float | None = None
        self.actors: list = []
        self._refs: list = []
        self._joining = False
        self.ready: list[tuple[str, int]] | None = None

    def advance(self, place_wait_s: float, start_wait_s: float) -> bool:
        """Wait up to place_wait_s for the group to be placed and up to start_wait_s for its
        actors to start; True once every actor is ready. StartFailed if an actor died or the
        start took longer than start_timeout_s."""
        ray = self._ray
        if self.placed_at is None:
            done, _ = ray.wait([self._placed], timeout=max(place_wait_s, 0.0))
            if not done:
                return False
            self.placed_at = time.monotonic()
            self.actors = [self._new_actor(self.group, j) for j in range(self.k)]
            self._refs = (
                [a.ready.remote() for a in self.actors] if self.k == 1 else [self.actors[0].coordinator.remote()]
            )
        from ray.exceptions import RayActorError, RayError

        while True:
            deadline = self.placed_at + self._start_timeout_s
            left = min(max(deadline - time.monotonic(), 0.0), max(start_wait_s, 0.0))
            done, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=left)
            if len(done) < len(self._refs):
                if time.monotonic() >= deadline:
                    raise StartFailed(
                        f"its {self.k} actor(s) did not start within start_timeout_s="
                        f"{self._start_timeout_s:g} s of being placed"
                    )
                return False
            try:
                values = ray.get(self._refs)
            except (RayActorError, RayError) as e:
                raise StartFailed(f"an actor died while starting: {' '.join(str(e).split())[:300]}") from None
            if self.k > 1 and not self._joining:  # process 0 picked the gang's coordinator port
                self._joining = True
                self._refs = [
                    a.join.remote(values[0], self.k, j, self._start_timeout_s) for j, a in enumerate(self.actors)
                ]
                continue
            self.ready = values
            return True

    def waiting_for(self) -> str:
        """What the request still waits for, for a message."""
        since = time.monotonic() - self.asked_at
        if self.placed_at is None:
            return (
                f"Ray has not placed its {self.k} bundle(s) of {self.bundle} ({self.strategy}) in the "
                f"{since:.0f} s since it was asked"
            )
        return f"its actor(s) are starting ({time.monotonic() - self.placed_at:.0f} s since placed)"

    def cancel(self) -> None:
        """Kill its actors and remove its group (it must not start later and serve nobody)."""
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # already gone, or Ray itself is shutting down
                pass
        try:
            self._ray.util.remove_placement_group(self.group)
        except Exception:  # Ray itself is shutting down
            pass
