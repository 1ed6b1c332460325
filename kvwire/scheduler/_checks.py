"""Checks of the scheduler's numeric inputs, shared by the model, the policy and the
workload readers. Dependency-free (no numpy): the policy imports it."""

from __future__ import annotations

import math
import numbers

from kvwire.errors import UsageError

__all__ = ["check_number", "check_whole"]


def check_number(name: str, value: object, *, above: float | None = None,
                 at_least: float | None = None) -> float:
    """``value`` as a float when it is a finite real number (not a bool) ``> above`` and
    ``>= at_least``; else :class:`UsageError` naming the field. A check written ``x < 0``
    lets NaN through (every comparison with it is false)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    x = float(value) if ok else math.nan  # type: ignore[arg-type]
    if not (ok and math.isfinite(x) and (above is None or x > above)
            and (at_least is None or x >= at_least)):
        low = f" > {above:g}" if above is not None else f" >= {at_least:g}" if at_least is not None else ""
        raise UsageError(f"{name} must be a finite number{low} (got {value!r})")
    return x


def check_whole(name: str, value: object, *, at_least: int) -> int:
    """``value`` as an int when it is a whole number (an int, a numpy one, or a float such
    as ``4000.0``; not ``4.5``, a bool, NaN or infinity) ``>= at_least``; else
    :class:`UsageError` naming the field."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        n = int(value)
    elif (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(float(value)) and float(value).is_integer()):
        n = int(float(value))
    else:
        raise UsageError(f"{name} must be a whole number >= {at_least} (got {value!r})")
    if n < at_least:
        raise UsageError(f"{name} must be a whole number >= {at_least} (got {value!r})")
    return n
