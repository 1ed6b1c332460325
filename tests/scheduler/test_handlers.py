"""The simulator's event handlers, each on a hand-built state, and hand-computed traces
for prefix hits at prefill start and the finite LRU cache."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import ModelProfile
from kvwire.scheduler.simulator import (
    Event,
    EventKind,
    PolicyName,
    SimState,
    SimulationConfig,
    egress_demand,
    new_state,
    on_arrival,
    on_decode_end,
    on_decode_start,
    on_link_change,
    on_prefill_end,
    on_prefill_start,
    on_transfer_end,
    on_transfer_start,
    planned_egress,
    simulate,
)
from kvwire.scheduler.workload import TraceRequest

# Prefill: 1 s per 1000 tokens remote, 10 s per 1000 local (latency proportional to the
# length: the two points lie on a line through the origin). KV: 1000 bytes per token.
REMOTE = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(1.0, 2.0))
LOCAL = ModelProfile(name="l", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(10.0, 20.0))


def cluster(*, remote: int = 1, local: int = 2) -> ClusterConfig:
    return ClusterConfig(
        remote_profile=REMOTE,
        local_profile=LOCAL,
        remote_instances=remote,
        local_instances=local,
        decode_step_s=0.01,
        decode_batch_max=2,
    )


def config(**kw: object) -> SimulationConfig:
    base: dict[str, object] = {
        "cluster": cluster(),
        "link": LinkSchedule.constant(8e6),  # 1 MB/s
        "rtt_s": 0.0,
        "prefill_instances": 1,
        "remote_cache_blocks": 100,
        "local_cache_blocks": 100,
    }
    base.update(kw)
    return SimulationConfig(**base)  # type: ignore[arg-type]


def approx(events: list[Event]) -> list[tuple[object, EventKind, int]]:
    return [(pytest.approx(t), k, i) for t, k, i in events]


def req(t: float, blocks: tuple[int, ...], out: int = 1) -> TraceRequest:
    return TraceRequest(arrival_s=t, input_length=512 * len(blocks), output_length=out, hash_ids=blocks)


# -- each handler alone ----------------------------------------------------------------------


def test_arrival_queues_and_starts_a_free_server() -> None:
    st = new_state([req(0, (1, 2))], config(), PolicyName.LOCAL, prefill_instances=1)
    st.now = 0.0
    assert on_arrival(st, 0) == [(0.0, EventKind.PREFILL_START, 0)]
    assert st.local_free == [] and not st.remote[0]
    # A second arrival finds no free server: it waits in the queue.
    st2 = new_state([req(0, (1,)), req(0, (2,))], config(), PolicyName.LOCAL, prefill_instances=1)
    on_arrival(st2, 0)
    assert on_arrival(st2, 1) == [] and list(st2.local_queue) == [1]


def test_offload_all_arrival_goes_remote() -> None:
    st = new_state([req(0, (1,))], config(), PolicyName.OFFLOAD_ALL, prefill_instances=1)
    assert on_arrival(st, 0) == [(0.0, EventKind.PREFILL_START, 0)]
    assert st.remote[0] and st.remote_free == 0


def test_prefill_start_looks_up_the_cache_now() -> None:
    st = new_state([req(0, (1, 2, 3, 4))], config(), PolicyName.OFFLOAD_ALL, prefill_instances=1)
    st.remote[0] = True
    st.remote_cache.insert([1, 2])
    st.now = 5.0
    # 2048 tokens, 1024 cached: 1024 tokens at 1 ms each.
    assert approx(on_prefill_start(st, 0)) == [(pytest.approx(5.0 + 1.024), EventKind.PREFILL_END, 0)]
    assert st.hit_tokens[0] == 1024


def test_prefill_end_local_goes_to_decode_and_caches() -> None:
    st = new_state([req(0, (7, 8))], config(), PolicyName.LOCAL, prefill_instances=1)
    st.local_free = []
    st.speed[0] = 1.0
    st.now = 3.0
    assert on_prefill_end(st, 0) == [(3.0, EventKind.DECODE_START, 0)]
    assert st.local_free == [1.0] and st.local_cache.peek([7, 8]) == 2


def test_prefill_end_remote_takes_the_link() -> None:
    st = new_state([req(0, (7,))], config(), PolicyName.OFFLOAD_ALL, prefill_instances=1)
    st.remote[0] = True
    st.remote_free = 0
    st.now = 2.0
    assert on_prefill_end(st, 0) == [(2.0, EventKind.TRANSFER_START, 0)]
    assert st.link_busy and st.remote_free == 1 and st.remote_cache.peek([7]) == 1


def test_transfer_start_ships_what_decode_does_not_hold() -> None:
    st = new_state([req(0, (1, 2))], config(), PolicyName.OFFLOAD_ALL, prefill_instances=1)
    st.remote[0] = True
    st.local_cache.insert([1])  # 512 tokens already at the decode side
    st.now = 1.0
    # 1024 tokens of KV (1.024 MB) less 512 tokens held: 512,000 bytes at 1 MB/s.
    assert approx(on_transfer_start(st, 0)) == [(pytest.approx(1.512), EventKind.TRANSFER_END, 0)]
    assert st.ship_bytes[0] == pytest.approx(512_000)


def test_transfer_end_frees_the_link_and_lands_after_half_the_rtt() -> None:
    st = new_state([req(0, (1,)), req(0, (2,))], config(rtt_s=0.2), PolicyName.OFFLOAD_ALL,
                   prefill_instances=1)
    st.link_busy = True
    st.link_queue.append(1)
    st.now = 4.0
    assert approx(on_transfer_end(st, 0)) == [
        (pytest.approx(4.1), EventKind.DECODE_START, 0),
        (4.0, EventKind.TRANSFER_START, 1),
    ]


def test_decode_start_takes_a_slot_or_waits() -> None:
    st = new_state([req(0, (1,), out=100), req(0, (2,))], config(), PolicyName.LOCAL,
                   prefill_instances=1)
    st.slots_free = 1
    st.now = 2.0
    assert approx(on_decode_start(st, 0)) == [(pytest.approx(3.0), EventKind.DECODE_END, 0)]
    assert st.ttft_s[0] == 2.0
    assert on_decode_start(st, 1) == [] and list(st.decode_queue) == [1]


def test_decode_end_hands_the_slot_on() -> None:
    st = new_state([req(0, (1,)), req(1, (2,), out=50)], config(), PolicyName.LOCAL,
                   prefill_instances=1)
    st.slots_free = 0
    st.decode_queue.append(1)
    st.now = 6.0
    assert approx(on_decode_end(st, 0)) == [(pytest.approx(6.5), EventKind.DECODE_END, 1)]
    assert st.finish_order == [0] and st.ttft_s[1] == 5.0 and st.slots_free == 0


def test_link_change_updates_the_rate_the_policy_sees() -> None:
    link = LinkSchedule(starts_s=(0.0, 10.0), rates_bps=(8e6, 1e6))
    st = new_state([req(0, (1,))], config(link=link), PolicyName.SELECTIVE, prefill_instances=1)
    assert st.link_rate_bps == 8e6
    assert on_link_change(st, 1) == [] and st.link_rate_bps == 1e6


def test_fractional_split_is_a_slower_server() -> None:
    # At GPU granularity (2 GPUs an instance): 3 prefill GPUs are 1.5 instances.
    cfg = config(cluster=replace(cluster(local=3), split_granularity="gpu", gpus_per_instance=2),
                 prefill_instances=1.5)
    st = new_state([req(0, (1, 2))], cfg, PolicyName.LOCAL, prefill_instances=1.5)
    assert sorted(st.local_free) == [0.5, 1.0]
    assert st.slots_free == 3  # 1.5 decode instances x 2 slots


# -- hand-computed traces --------------------------------------------------------------------


def test_prefix_hit_at_prefill_start() -> None:
    # One local prefill server. A (blocks 1,2 = 1024 tokens) arrives at 0 and takes
    # 10.24 s; B (blocks 1,2,3) arrives at 1 and queues behind A. When B starts at 10.24,
    # A's prefix is cached: B computes 512 tokens (5.12 s) and ends at 15.36. Deciding the
    # hit at arrival would have charged B all 1536 tokens (15.36 s, ending at 25.6).
    trace = [req(0.0, (1, 2), out=1), req(1.0, (1, 2, 3), out=1)]
    r = simulate(trace, config(), PolicyName.LOCAL)
    assert r.cache_hit_ratio == pytest.approx(1024 / (1024 + 1536))
    step = 0.01
    assert r.ttft_p50_s == pytest.approx((10.24 + 15.36 - 1.0) / 2)
    assert r.ttft_mean_s == pytest.approx((10.24 + 14.36) / 2)
    assert r.makespan_s == pytest.approx(15.36 + step)


def test_finite_lru_cache_evicts_the_least_recently_used() -> None:
    # Cache of 2 blocks. A caches (1,2); C caches (3,4), evicting both; B (1,2) then
    # misses. With 4 blocks B hits.
    trace = [req(0.0, (1, 2)), req(20.0, (3, 4)), req(40.0, (1, 2))]
    small = simulate(trace, config(local_cache_blocks=2), PolicyName.LOCAL)
    big = simulate(trace, config(local_cache_blocks=4), PolicyName.LOCAL)
    assert small.cache_hit_ratio == 0.0
    assert big.cache_hit_ratio == pytest.approx(1024 / 3072)
    # Eviction is per block, least recently used first, and a prefix's blocks are
    # refreshed last first: after A and B (both 1,2) block 2 is the least recent; C
    # inserts 3 and evicts only block 2, so D=(1,2) still hits its first block.
    trace2 = [req(0.0, (1, 2)), req(20.0, (1, 2)), req(40.0, (3,)), req(60.0, (1, 2))]
    r = simulate(trace2, config(local_cache_blocks=2), PolicyName.LOCAL)
    assert r.cache_hit_ratio == pytest.approx((1024 + 512) / (1024 * 3 + 512))


def test_profile_sets_the_cache_size() -> None:
    prof = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6),
                        prefill_s=(1.0, 2.0), cache_blocks=3)
    cfg = SimulationConfig(cluster=ClusterConfig(remote_profile=prof, remote_instances=2))
    assert cfg.cache_blocks("remote") == 6
    assert cfg.cache_blocks("local") == 3 * 8
    assert SimulationConfig(cluster=cfg.cluster, local_cache_blocks=5).cache_blocks("local") == 5


def test_offloaded_request_times_add_up() -> None:
    # Offload-all, one request of 1024 tokens: remote prefill 1.024 s, transfer 1.024 MB
    # at 1 MB/s = 1.024 s, RTT/2 = 0.05 s: TTFT 2.098 s.
    r = simulate([req(0.0, (1, 2))], config(rtt_s=0.1), PolicyName.OFFLOAD_ALL)
    assert r.ttft_p50_s == pytest.approx(1.024 + 1.024 + 0.05)
    # One arrival: no window to average egress over (n/a), but the peak is there.
    assert math.isnan(r.egress_gbps_mean) and r.egress_gbps_peak > 0


def test_egress_mean_and_p99_share_the_arrival_window() -> None:
    # Arrivals at 0 and 2.5 s, offload-all, 1000 tokens each: transfers of 1 MB at 1 MB/s
    # over 1-2 s and 3.5-4.5 s. The window's whole seconds are [0, 1) and [1, 2): 0 and
    # 1 MB/s, so the mean is 0.5 MB/s (it was 1 MB / 2.5 s while P99 took 3 bins).
    trace = [TraceRequest(arrival_s=t, input_length=1000, output_length=1, hash_ids=(i,))
             for i, t in enumerate((0.0, 2.5))]
    r = simulate(trace, config(), PolicyName.OFFLOAD_ALL)
    assert r.egress_gbps_mean == pytest.approx(0.5 * 8e6 / 1e9)
    assert r.egress_gbps_p99 == pytest.approx(0.99 * 8e6 / 1e9)
    assert r.egress_gbps_peak == pytest.approx(8e6 / 1e9)
    assert r.saturated is not None


def test_a_burst_under_a_second_has_no_egress_or_saturation_figures() -> None:
    # Five arrivals at one instant: the egress mean was 0 but its P99 not, and the policy
    # was flagged saturated against an infinite offered rate. Both are n/a now.
    trace = [req(7.0, (i,)) for i in range(5)]
    r = simulate(trace, config(), PolicyName.OFFLOAD_ALL)
    assert math.isnan(r.egress_gbps_mean) and math.isnan(r.egress_gbps_p99)
    assert r.saturated is None
    doc = r.as_json()
    assert doc["egress_gbps_mean"] is None and doc["egress_gbps_p99"] is None
    assert doc["saturated"] is None
    assert doc["egress_gbps_peak"] == pytest.approx(8e6 / 1e9)


def _place_all(st: SimState) -> list[float]:
    demands = []
    for i, r in enumerate(st.requests):
        st.now = r.arrival_s
        for k, start in enumerate(st.config.link.starts_s):
            if start <= st.now and st.link_rate_bps != st.config.link.rates_bps[k]:
                on_link_change(st, k)
        demands.append(egress_demand(st))
        on_arrival(st, i)
    return demands


FIVE = [req(t, tuple(range(10 * i, 10 * i + 8))) for i, t in enumerate((0, 1, 2, 3, 10.5))]
"""Five 4096-token prompts sharing nothing: each ships 4.096 MB (32.768 Mbit)."""


def test_the_policy_sees_the_egress_demand_of_recent_offloads() -> None:
    # Link 1 MB/s (8 Mbit/s), a 10 s window, threshold 500. The demand is the KV offloaded
    # in the last 10 s, per second: 3.28, 6.55, then 9.83 Mbit/s after three offloads.
    # The plan: every prompt is above 500, so p = 1 and the egress binds (the remote
    # instances are twice as fast as the link), Lambda_max = 8 / 32.768 req/s and the
    # planned egress is the whole link: 8 Mbit/s. Demand beyond it (9.83) is load beyond
    # Lambda_max, not a link short of the plan: u = min(9.83, 8) / 8 = 1.0, the plan's own
    # level, and nothing is refused.
    cfg = config(egress_window_s=10.0, cluster=cluster(remote=2))
    st = new_state(FIVE, cfg, PolicyName.SELECTIVE, prefill_instances=1, threshold_tokens=500)
    plan = planned_egress(st, 500)
    assert plan is not None and plan == pytest.approx((8e6, 8e6))
    demands = _place_all(st)
    assert demands[:4] == pytest.approx([0.0, 8 * 4.096e5, 8 * 8.192e5, 8 * 12.288e5])
    assert st.reasons == ["long"] * 5
    # With no plan (the rules against the link alone, as the simulator used to pass them)
    # u = 9.83 / 8 = 1.23 >= 0.97 refuses the fourth offload, until the first leaves the
    # window; after two u = 0.82 raised the threshold to 1383, still below 4096.
    st = new_state(FIVE, cfg, PolicyName.SELECTIVE, prefill_instances=1, threshold_tokens=500)
    st.plan_lengths = None
    assert planned_egress(st, 500) is None
    _place_all(st)
    assert st.reasons == ["long", "long", "long", "link-saturated", "long"]
    assert st.remote == [True, True, True, False, True]
    # Window 0 (the default): no demand, no rule fires.
    st = new_state(FIVE, config(cluster=cluster(remote=2)), PolicyName.SELECTIVE,
                   prefill_instances=1, threshold_tokens=500)
    _place_all(st)
    assert st.reasons == ["long"] * 5


def test_the_link_rules_fire_when_the_link_carries_less_than_planned() -> None:
    # As above, but the link drops to 2 Mbit/s at 2.5 s for good. The plan is for the
    # link's mean rate over the arrivals, (2.5 x 8 + 8 x 2) / 10.5 = 3.43 Mbit/s, all of
    # it planned egress (u_plan = 1, levels 1.0 and 1.27). Before the drop u = 3.28 / 8
    # and min(6.55, 3.43) / 8 = 0.43: long. After it, u = min(9.83, 3.43) / 2 = 1.71 >=
    # 1.27: nothing more goes remote, and at 10.5 s (6.55 Mbit/s in the window) still not.
    link = LinkSchedule(starts_s=(0.0, 2.5), rates_bps=(8e6, 2e6))
    cfg = config(egress_window_s=10.0, cluster=cluster(remote=2), link=link)
    st = new_state(FIVE, cfg, PolicyName.SELECTIVE, prefill_instances=1, threshold_tokens=500)
    plan = planned_egress(st, 500)
    assert plan is not None and plan == pytest.approx((36e6 / 10.5, 36e6 / 10.5))
    _place_all(st)
    assert st.reasons == ["long", "long", "long", "link-saturated", "link-saturated"]
    assert st.remote == [True, True, True, False, False]
