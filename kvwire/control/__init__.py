"""Bandwidth and RTT estimation, in-flight targets, stream count and codec choice.

Sans-IO: every time-dependent call takes ``now`` (seconds); nothing here reads a clock,
touches a socket or starts a task.
"""

from kvwire.control.codec_choice import CodecCandidate, CodecChoice, CodecChooser
from kvwire.control.estimator import DeliveryRateEstimator, EstimatorSnapshot, RateSample
from kvwire.control.pacing import PROBE_CYCLE, InflightController, InflightTarget, Pacer
from kvwire.control.streams import (
    StreamController,
    StreamDecision,
    StreamSample,
    StreamVerdict,
    window_limited_from_counters,
)

__all__ = [
    "PROBE_CYCLE",
    "CodecCandidate",
    "CodecChoice",
    "CodecChooser",
    "DeliveryRateEstimator",
    "EstimatorSnapshot",
    "InflightController",
    "InflightTarget",
    "Pacer",
    "RateSample",
    "StreamController",
    "StreamDecision",
    "StreamSample",
    "StreamVerdict",
    "window_limited_from_counters",
]
