"""Measuring kvwire: the link emulator, kernel shaping, and ``kvwire bench`` / ``kvwire serve``."""

EMULATOR_PUMPS = ("auto", "splice", "copy")
"""The userspace link emulator's pumps (``kvwire bench --emulator``): splice(2) through
kernel pipes, the bytes through Python, or splice where the platform has it."""
