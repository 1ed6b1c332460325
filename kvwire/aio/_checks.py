"""The one check of numeric option values, shared by ``ServerOptions`` and ``ClientOptions``."""

from __future__ import annotations

from kvwire.errors import UsageError


def check_number(owner: object, name: str, *, none_ok: bool = False, zero_ok: bool = False) -> None:
    """:class:`~kvwire.UsageError` unless ``owner.<name>`` is a number > 0 (>= 0 with
    ``zero_ok``; None is also accepted with ``none_ok``).  Booleans and NaN are refused."""
    value = getattr(owner, name)
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise UsageError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise UsageError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")
