"""Measuring kvwire: the link emulator, kernel shaping, and ``kvwire bench`` / ``kvwire serve``."""
