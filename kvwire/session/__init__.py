"""kvwire sessions, sans-IO: the protocol logic above one connection.

:mod:`kvwire.session.sender` runs a client session (N connections, transfers, credit,
striping, resume), :mod:`kvwire.session.receiver` a server's sessions (admission, storage,
acknowledgements, tombstones, the registry gate, every deadline).  Bytes and ``now`` in;
bytes, events and ``get_timer()`` out.  ``kvwire.testing.SessionPair`` wires the two
together in memory for deterministic fault tests.
"""

from kvwire.session.receiver import (
    AuthenticationFailed,
    ConnectionDropped,
    GoawayReceived,
    InternalError,
    LayerReady,
    ReceiverConfig,
    ReceiverCore,
    RegistryCheck,
    RegistryPublish,
    StreamResumed,
    TransferAborted,
    TransferArrived,
    TransferDropped,
)
from kvwire.session.receiver import TransferFailed as IncomingFailed
from kvwire.session.sender import (
    ChunkDelivered,
    ChunkLost,
    ChunkSent,
    ReceiverCosts,
    SenderConfig,
    SenderCore,
    SessionFailed,
    StreamClosed,
    StreamGivenUp,
    StreamOpened,
    StreamWanted,
    TransferCredit,
    TransferDone,
)
from kvwire.session.sender import TransferFailed as OutgoingFailed

__all__ = [
    "AuthenticationFailed",
    "ChunkDelivered",
    "ChunkLost",
    "ChunkSent",
    "ConnectionDropped",
    "GoawayReceived",
    "IncomingFailed",
    "InternalError",
    "LayerReady",
    "OutgoingFailed",
    "ReceiverConfig",
    "ReceiverCore",
    "ReceiverCosts",
    "RegistryCheck",
    "RegistryPublish",
    "SenderConfig",
    "SenderCore",
    "SessionFailed",
    "StreamClosed",
    "StreamGivenUp",
    "StreamOpened",
    "StreamResumed",
    "StreamWanted",
    "TransferAborted",
    "TransferArrived",
    "TransferCredit",
    "TransferDone",
    "TransferDropped",
]
