"""Errors raised by the communication layer."""


class DistributedInitError(RuntimeError):
    """The launch environment cannot form a process group: variables missing or inconsistent.

    Raised before any rendezvous is attempted, so a bad launch fails at once instead of
    waiting for peers that will never arrive.
    """


class TopologyError(ValueError):
    """The requested parallel degrees do not fit the world (their product is not the world size)."""
