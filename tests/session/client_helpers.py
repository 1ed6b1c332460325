"""A client session of its own talking to a receiver core in memory."""

from __future__ import annotations

from kvwire.errors import ErrorCode
from kvwire.wire import State, TransferReset, chunk_frame_size
from tests.session.receiver_harness import BPT, Harness, begin, chunk, join


class Client:
    """A client on a session of its own, its connection ``cid`` of ``h.core``."""

    def __init__(self, h: Harness, cid: int) -> None:
        self.h, self.cid = h, cid
        self.conn, _ = join(h.core, cid, h.now)
        self.resets: list[TransferReset] = []

    @property
    def open(self) -> bool:
        return self.conn.state is State.OPEN

    def flush(self) -> None:
        h = self.h
        data = b"".join(bytes(p) for p in self.conn.data_to_send())
        if data:
            h.core.receive_data(self.cid, data, h.now)
        out = h.core.data_to_send(self.cid)
        if out:
            self.conn.receive_data(out, h.now)
        self.resets += [e for e in iter(self.conn.next_event, None) if isinstance(e, TransferReset)]
        h.pump()

    def send_whole(self, tid: int, request: str) -> None:
        """A transfer of one layer, sent whole (it arrives complete unless refused)."""
        self.conn.send_begin(begin(tid=tid, layers=1, request=request))
        self.flush()
        if any(r.transfer_id == tid for r in self.resets):
            return
        for kind in (0, 1):
            c = chunk(tid=tid, layer=0, kind=kind)
            self.conn.send_chunk(c, chunk_frame_size(0, 8 * BPT))
        self.flush()

    def goodbye(self) -> None:
        """The client closes its session cleanly (GOAWAY(NO_ERROR) on its one stream)."""
        self.conn.close(ErrorCode.NO_ERROR, "done")
        self.flush()
        self.h.core.forget(self.cid)
