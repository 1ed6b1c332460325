"""Errors specific to the prefix registry.

They all derive from :class:`kvwire.KvwireError`; the ones that mean "this data must not be
used" derive from :class:`kvwire.StaleVersionError`, so a caller that only cares about
freshness catches one class.
"""

from __future__ import annotations

from kvwire.errors import KvwireError, RegistryUnavailableError, StaleVersionError


class LeaseExpiredError(StaleVersionError):
    """The lease is no longer live (expired, already committed, or released).

    Committing it could overwrite newer data, so the commit was refused and nothing changed.
    """


class NotificationsLostError(KvwireError):
    """A watcher fell behind or lost its subscription; some notifications were dropped.

    Re-read the state with ``lookup``/``check_many`` before trusting cached blocks again.
    """


__all__ = [
    "LeaseExpiredError",
    "NotificationsLostError",
    "RegistryUnavailableError",
]
