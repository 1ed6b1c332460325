"""Public helpers for testing code built on kvwire.

- :class:`FakeClock` and :class:`MemoryPair`: drive the sans-IO core without sockets.
- :class:`SessionPair`: a sender and a receiver session core in memory, with faults at
  frame boundaries (drops, bit flips, black holes, receiver restarts) in fake time.
- :class:`FaultProxy`: a TCP proxy that drops, corrupts, stalls, trickles or rate-caps
  a connection, for testing deployments against real faults.
"""

from kvwire.testing.fault_proxy import CLEAN, FaultPlan, FaultProxy, Faults, FaultStatistics
from kvwire.testing.memory import FakeClock, MemoryPair
from kvwire.testing.session_pair import SessionPair

__all__ = ["CLEAN", "FakeClock", "FaultPlan", "FaultProxy", "FaultStatistics", "Faults", "MemoryPair", "SessionPair"]
