"""A small cluster whose simulated figures the scheduler tests work out by hand."""

from __future__ import annotations

from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import ModelProfile
from kvwire.scheduler.simulator import SimulationConfig

# 1 s of remote and 10 s of local prefill per 1000 tokens; 1000 bytes of KV per token.
REMOTE = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(1.0, 2.0))
LOCAL = ModelProfile(name="l", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(10.0, 20.0))


def config(local_instances: int = 2, prefill_instances: int = 1) -> SimulationConfig:
    """One remote server, ``local_instances`` local ones (``prefill_instances`` of them
    prefill), a link of 1 MB/s and no RTT: figures worked out by hand."""
    return SimulationConfig(
        cluster=ClusterConfig(
            remote_profile=REMOTE,
            local_profile=LOCAL,
            remote_instances=1,
            local_instances=local_instances,
            decode_step_s=0.05,
            decode_batch_max=64,
        ),
        link=LinkSchedule.constant(8e6),
        rtt_s=0.0,
        prefill_instances=prefill_instances,
    )
