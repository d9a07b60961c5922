"""Ray Serve's routing by scope: a request goes to the replica that holds what its client's earlier requests left.

Each replica keeps its own suffix indexes and prefix cache, scoped by the client's API key (``scopes``); Ray's default
router (the less busy of two random replicas) spreads one client's conversation over all of them, so its next turn
mostly lands where neither its K/V nor its earlier answers are. ``ScopeRouter`` sends each client's requests to one
replica: the one its last request went to (its K/V and latest answer are there), else the first in the key's order of
the replicas by rendezvous hashing (a replica that joins or leaves moves only the keys it takes or held). Loads are
bounded: a replica holding more than ``load_factor`` times its share of the requests in flight is passed over for the
next in that order, so a busy client spills onto others rather than queueing behind itself (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018), and stays where it spilled to, where its state now is:
keys that hashing piled onto one replica move off it once each, then stick.

The key is the hash of the request's bearer token (``scopes.key_scope``), read from the HTTP headers the proxy
forwards: the scope a replica files the request under with ``--suffix-scope key``, and with ``global`` still the unit
whose conversations continue one another. Requests that come without HTTP headers (a Python handle's) are routed as
Ray's default router routes them. Each proxy's router keeps its own record of where keys went.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .scopes import key_scope

LOAD_FACTOR = 1.25  # the bound's slack over an even share (the paper's and Vimeo's choice)
HOMES = 65_536  # keys whose last replica a router remembers (the least recently routed forgotten first)


def preference(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` (ids) in ``key``'s order of preference: by a hash of (key, replica), highest first (rendezvous
    hashing). A replica added or removed changes no other replica's place in any key's order."""
    return sorted(replicas, key=lambda replica: hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(),
                  reverse=True)


def ranked(key: str, loads: Mapping[str, int], load_factor: float = LOAD_FACTOR, home: str | None = None) -> list[list[str]]:
    """Replica ids in the order ``key``'s request should try them, given each replica's requests in flight ``loads``
    and the replica its last request went to (``home``, first if it is one of them): one rank each for those under the
    bound (``load_factor`` times an even share of the requests in flight, this one included), in ``preference`` order,
    then all the others as one last rank (the least loaded of it wins)."""
    if load_factor < 1:
        raise ValueError(f"load_factor: got {load_factor}; expected at least 1 (1: an even share)")
    bound = math.ceil(load_factor * (sum(loads.values()) + 1) / max(1, len(loads)))
    order = preference(key, list(loads))
    if home in loads:
        order = [home, *(replica for replica in order if replica != home)]
    under = [replica for replica in order if loads[replica] < bound]
    over = [replica for replica in order if loads[replica] >= bound]
    return [[replica] for replica in under] + ([over] if over else [])


def request_key(request: PendingRequest | None) -> str | None:
    """The routing key of a request from Ray's HTTP proxy (its client's ``key_scope``); None for any other."""
    if request is None or not request.args:
        return None
    argument = request.args[0]
    if isinstance(argument, bytes):  # the proxy sends its request pickled, to skip Ray's own serialization
        try:
            argument = pickle.loads(argument)
        except Exception:  # not the proxy's request: routed as Ray routes any
            return None
    scope = getattr(argument, "asgi_scope", None)  # the proxy's StreamingHTTPRequest carries the request's ASGI scope
    if not isinstance(scope, dict):
        return None
    headers = dict(scope.get("headers", ()))
    return key_scope(headers.get(b"authorization", b"").decode("latin-1"))


class ScopeRouter(RequestRouter):
    """Ray Serve's request router for specdeploy replicas: each client's requests to the replica its key prefers, under
    bounded loads (``ranked``); a replica at its ``max_ongoing_requests`` takes none. Loads are the requests this router
    sent to each replica that have not finished, counted here: Ray's own cache of replicas' queue lengths forgets an
    entry 10 s after its last update, so that under requests that run longer (a chat turn on a CPU) a busy replica read
    as idle and keys spilled off replicas that had room. The replica chosen goes to the request it was chosen for (Ray's
    FIFOMixin would hand it to the oldest request waiting, whatever its key)."""

    def initialize_state(self, load_factor: float = LOAD_FACTOR, **kwargs) -> None:
        if load_factor < 1:
            raise ValueError(f"ScopeRouter load_factor: got {load_factor}; expected at least 1")
        self.load_factor = load_factor
        self.homes: OrderedDict[str, str] = OrderedDict()  # key -> the replica its last request went to
        self.loads: Counter[str] = Counter()  # replica -> requests sent to it and not completed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = request_key(pending_request)
        if key is None:  # Ray's default: the less busy of two at random
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        self._state()
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        loads = {name: self.loads[name] for name in by_id}
        ranks = [[by_id[name] for name in rank] for rank in ranked(key, loads, self.load_factor, self.homes.get(key))]
        # every rank tried: back off before the next round (all replicas full), as Ray's own routers do
        pending_request.routing_context.should_backoff = True
        return ranks

    def on_send_request(self, replica_id) -> None:
        """A request is sent to ``replica_id`` (which may still refuse it): in flight there until it completes. Ray calls
        this before anything can complete the request, and ``on_request_completed`` once for every request sent."""
        super().on_send_request(replica_id)
        self._state()
        self.loads[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """A request sent to ``replica_id`` ended (answered, failed, or refused by the replica): no longer in flight."""
        super().on_request_completed(replica_id, internal_request_id)
        self._state()
        replica = replica_id.unique_id
        self.loads[replica] -= 1
        if self.loads[replica] <= 0:  # 0, or a send that failed before Ray counted it
            del self.loads[replica]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """A replica took the request: its key's state is there now (its next request goes there first)."""
        super().on_request_routed(pending_request, replica_id, result)
        self._state()
        key = request_key(pending_request)
        if key is not None:
            self.homes[key] = replica_id.unique_id
            self.homes.move_to_end(key)
            while len(self.homes) > HOMES:
                self.homes.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Replicas gone (stopped, or lost with their node) take their counts with them."""
        super().update_replicas(replicas)
        self._state()
        running = {replica.replica_id.unique_id for replica in replicas}
        for replica in [name for name in self.loads if name not in running]:
            del self.loads[replica]

    def _state(self) -> None:
        if not hasattr(self, "load_factor"):  # Ray calls initialize_state first; a router made otherwise starts here
            self.initialize_state()
