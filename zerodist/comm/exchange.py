"""Exchange a small string with every rank under a deadline, through the world's key-value store.

A collective that some ranks never call waits for the backend's whole timeout (30 minutes by
default) and then fails without saying who was missing; worse, if the absent ranks issue other
collectives meanwhile, those may pair up with it. `exchange_with_deadline` never issues a
collective: each rank publishes its value in the store and waits at most `timeout_s` for
everyone else's, so a call made by only some ranks fails on those ranks, naming the absent
ones, and the process group stays usable.

[Note: exchange keys] Call n of a given `name` on a rank uses the key
`zerodist/exchange/<attempt>/<name>/<n>/<rank>` (attempt: torchrun's restart count), so ranks
that make the same calls in the same order meet at the same n. A rank that gives up overwrites
its key with an abort note, so a rank that arrives later fails at once instead of waiting out
its own deadline for a peer that already left. Once a rank has read everyone's value of call n,
every rank has finished reading call n-1 (each reads before it writes the next), so it deletes
its own key of call n-1: the store holds at most two keys per rank and name.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from zerodist import compat
from zerodist.comm.init import ensure_initialized
from zerodist.comm.watchdog import Ticket, watchdog

_calls: dict[str, int] = {}
_store: Any = None
_store_waits = False  # True when the store could not be cloned with its own timeout


class ExchangeTimeoutError(RuntimeError):
    """Some ranks did not reach the same exchange within the deadline (or gave up before)."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


def _key(name: str, call: int, rank: int) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"zerodist/exchange/{attempt}/{name}/{call}/{rank}"


def _get_store(timeout_s: float) -> Any:
    global _store, _store_waits
    if _store is None:
        store = compat.default_store()
        try:
            # A private connection, so our short deadline leaves the group's own timeout alone.
            _store = store.clone()
        except (AttributeError, RuntimeError):
            _store, _store_waits = store, True
    if not _store_waits:
        _store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return _store


def exchange_with_deadline(name: str, value: str, timeout_s: float,
                           ranks: Sequence[int] | None = None) -> list[str]:
    """Every rank's `value` for this call of `name`, in rank order; raises `ExchangeTimeoutError`
    when a rank has not made the same call within `timeout_s` seconds. `ranks`: only among those
    global ranks (this one included; values in their order), e.g. one pipeline stage's expert
    group, whose peers on other stages reach the call at another time."""
    ensure_initialized()
    rank, world = dist.get_rank(), dist.get_world_size()
    members = list(range(world)) if ranks is None else list(ranks)
    if ranks is not None:
        name = f"{name}@{'-'.join(str(r) for r in members)}"  # each group counts its own calls
    call = _calls.get(name, 0)
    _calls[name] = call + 1
    if len(members) == 1:
        return [value]
    store = _get_store(timeout_s)
    store.set(_key(name, call, rank), json.dumps({"value": value}))
    peers = [r for r in members if r != rank]
    # The hang watchdog names this wait like a collective's: who has not come, and where they are.
    ticket = Ticket(f"exchange '{name}'", f"exchange:{name}", tuple(members), call)
    try:
        with watchdog.blocked(ticket):
            if _store_waits:
                store.wait([_key(name, call, r) for r in peers], datetime.timedelta(seconds=timeout_s))
            raw = store.multi_get([_key(name, call, r) for r in peers])
    except dist.DistStoreError:
        store.set(_key(name, call, rank), json.dumps({"aborted": f"rank {rank} gave up after {timeout_s:g} s"}))
        missing = [r for r in peers if not store.check([_key(name, call, r)])]
        raise ExchangeTimeoutError(
            f"rank(s) {missing or peers} did not reach '{name}' call #{call} within {timeout_s:g} s "
            f"(rank {rank} did)", missing or peers) from None
    decoded = {r: json.loads(v) for r, v in zip(peers, raw)}
    aborted = {r: d["aborted"] for r, d in decoded.items() if "aborted" in d}
    if aborted:
        notes = "; ".join(aborted.values())
        raise ExchangeTimeoutError(f"rank {rank} reached '{name}' call #{call} after the others gave up: {notes}",
                                   sorted(aborted))
    if call > 0:
        store.delete_key(_key(name, call - 1, rank))
    values = {r: d["value"] for r, d in decoded.items()}
    values[rank] = value
    return [values[r] for r in members]
