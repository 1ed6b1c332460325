"""A hold (``mark_app_limited``: a ProbeRTT drain and the round trip after it) ends when its
round trip is over, also when chunks it waited for were lost (fake time).

The hold's marks count the bytes in flight when it was set; a chunk among them that is
lost (its stream broke; re-sent, if at all, under a new key) was never delivered, and the
marks waited for its bytes from whatever came next: a stream that broke with 8 MiB of a
drain in flight, its transfer failed, kept the next transfer's first 8 MiB held (their
samples app-limited, ``hold_limited`` set: ``auto`` measured no goodput and, where the
producer set the pace, took no raw probe), and chunks re-sent in a drain held it until
every one of them was acknowledged instead of the first."""

from __future__ import annotations

from kvwire.aio._send import chooser_app_limited
from kvwire.control import CodecChooser, DeliveryRateEstimator
from kvwire.control.goodput import GoodputMeter

MIB = 1 << 20


def _flowing(est: DeliveryRateEstimator, chunks: int = 100, in_flight: int = 8) -> float:
    """A steady flow, one MiB chunk acknowledged every ms with ``in_flight`` in flight;
    returns the time. Keys 0, 1, ...: the last ``in_flight`` are still in flight."""
    t = 0.0
    for k in range(in_flight):
        est.on_send(k, MIB, t, app_limited=False)
    for k in range(chunks):
        t += 0.001
        est.on_ack(k, t)
        est.on_send(k + in_flight, MIB, t, app_limited=False)
    return t


def test_a_hold_whose_stream_broke_does_not_hold_the_next_transfer() -> None:
    est = DeliveryRateEstimator()
    t = _flowing(est)
    est.mark_app_limited()  # a drain: 8 MiB in flight
    assert est.hold_limited
    assert est.forget_all() == 8  # the streams broke; the transfer failed, nothing re-sent
    assert not est.hold_limited and not est.app_limited
    # The next transfer, a second later, at half the rate: its samples are the path's.
    t += 1.0
    for k in range(6):
        est.on_send(("next", k), MIB, t, app_limited=False)
    meter = GoodputMeter(sample_acks=4, min_acks=2)
    chooser = CodecChooser.from_ratios({"raw": 1.0, "int8": 0.516}, measure_goodput=True, meter=meter)
    meter.chosen("raw")
    for k in range(6):
        t += 0.002
        sample = est.on_ack(("next", k), t)
        assert sample is not None and not sample.app_limited, k
        assert not est.hold_limited
        chooser.observe_delivered("raw", MIB, t, held=est.hold_limited)  # as the client feeds it
    assert meter.rate("raw") is not None  # a run measured the transfer
    goodput = est.goodput_bps
    assert goodput is not None and goodput < 0.6 * 8 * MIB / 0.001


def test_a_producer_paced_transfer_after_a_broken_hold_is_app_limited_not_held() -> None:
    # The producer sets the pace of the next transfer (each send marked app-limited): the
    # chooser is told so (and may probe raw), not that the sender holds data back.
    est = DeliveryRateEstimator()
    t = _flowing(est)
    est.mark_app_limited()
    est.forget_all()
    t += 1.0
    for k in range(3):
        est.on_send(("next", k), MIB, t + k * 0.005, app_limited=True)
        assert est.app_limited and not est.hold_limited
        assert chooser_app_limited(est)


def test_chunks_re_sent_in_a_drain_end_it_at_the_first_of_them_acknowledged() -> None:
    est = DeliveryRateEstimator()
    t = _flowing(est)  # keys 100..107 in flight
    est.mark_app_limited()
    for k in range(102, 108):  # a stream broke: 6 chunks lost, re-sent under new keys
        assert est.on_loss(k)
        est.on_send(("again", k), MIB, t, app_limited=False)
    for k in (100, 101):  # the rest of the hold's flight
        t += 0.001
        est.on_ack(k, t)
        assert est.hold_limited
    t += 0.001
    est.on_ack(("again", 102), t)  # the first chunk sent after the mark: its round trip is over
    assert not est.hold_limited and not est.app_limited
    for k in range(103, 108):
        t += 0.001
        est.on_ack(("again", k), t)
        assert not est.hold_limited


def test_a_chunk_lost_that_was_sent_after_the_hold_does_not_shorten_it() -> None:
    est = DeliveryRateEstimator()
    t = _flowing(est, in_flight=4)  # keys 100..103 in flight
    est.mark_app_limited()
    est.on_send("later", MIB, t, app_limited=False)
    est.on_send("later2", MIB, t, app_limited=False)
    assert est.on_loss("later")  # not among the bytes the hold waits for
    for k in range(100, 104):
        t += 0.001
        est.on_ack(k, t)
        assert est.hold_limited
    t += 0.001
    est.on_ack("later2", t)
    assert not est.hold_limited


def test_a_drain_still_under_way_marks_again_after_a_loss() -> None:
    # The in-flight controller calls mark_app_limited at every update while it drains: a
    # loss that ended the marks (nothing left in flight) does not end the drain's hold.
    est = DeliveryRateEstimator()
    t = _flowing(est)
    est.mark_app_limited()
    est.forget_all()
    assert not est.hold_limited
    est.mark_app_limited()  # the controller's next update, still draining
    est.on_send("resent", MIB, t, app_limited=True)
    assert est.hold_limited
    assert not chooser_app_limited(est)
