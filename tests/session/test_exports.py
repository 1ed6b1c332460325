"""``kvwire.session`` re-exports every event its cores hand out (``TransferDropped`` and
``ConnectionDropped`` of the receiver were missing, with four other receiver events), and
nothing in ``__all__`` is missing from it."""

from __future__ import annotations

import typing

import pytest

import kvwire.session
from kvwire.session import receiver, sender


@pytest.mark.parametrize(
    "event", [*typing.get_args(receiver.ReceiverEvent), *typing.get_args(sender.SenderEvent)],
    ids=lambda cls: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}",
)
def test_every_event_is_exported(event: type) -> None:
    exported = [name for name in kvwire.session.__all__ if getattr(kvwire.session, name) is event]
    assert exported, f"{event.__module__}.{event.__name__} is not exported by kvwire.session"


def test_every_name_in_all_is_there() -> None:
    for name in kvwire.session.__all__:
        assert hasattr(kvwire.session, name), name
    assert len(set(kvwire.session.__all__)) == len(kvwire.session.__all__)
