"""Rates and rate schedules for the scheduler: re-exported from :mod:`kvwire.units`.

``parse_rate_schedule`` is the name the scheduler has used for :func:`kvwire.units.parse_schedule`.
"""

from __future__ import annotations

from kvwire.units import format_rate, parse_rate
from kvwire.units import parse_schedule as parse_rate_schedule

__all__ = ["format_rate", "parse_rate", "parse_rate_schedule"]
