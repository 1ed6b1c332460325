"""A vLLM KV connector (``KVConnectorBase_V1``) that moves prefilled KV blocks over kvwire,
for disaggregated prefill and decode.

Load it with ``kv_connector="KvwireConnector"`` and
``kv_connector_module_path="kvwire.integrations.vllm"`` in vLLM's ``KVTransferConfig``;
its settings are the ``kvwire_*`` keys of ``kv_connector_extra_config``.

Producer (prefill instance, ``kv_role="kv_producer"``): ``save_kv_layer`` queues each
layer of a request's full prompt blocks on a kvwire transfer as soon as the layer is
computed, from where the blocks lie (a host cache's not copied, a GPU cache's gathered on
its GPU), so the next layer computes while this one is on the wire.  The save is
asynchronous by default (``kvwire_async_save``): the engine goes on while the KV drains,
and a finished request keeps its blocks until ``get_finished`` reports its send ended.

Consumer (decode instance, ``kv_role="kv_consumer"``): a kvwire server in the worker
receives each transfer into the blocks vLLM allocated for it.  The load is asynchronous
by default: vLLM parks the request until ``get_finished`` reports its KV in, and the other
requests go on decoding meanwhile.  With ``kvwire_load_async: false`` it is layer-wise:
``wait_for_layer_load`` waits for each layer in the step's forward.  A load that fails or
times out reports its blocks through ``get_block_ids_with_load_errors``; vLLM recomputes
them with ``KVTransferConfig(kv_load_failure_policy="recompute")`` (its default,
``"fail"``, fails the request).

Rendezvous: a transfer is named by the request's ``kv_transfer_params["kvwire_id"]`` and a
hash of its prompt's full blocks' tokens (without an id, with ``kvwire_load_all``, by the
hash alone), so only a request whose full blocks hold the same tokens loads it.

docs/integrations.md ("vLLM") gives the exact behaviour (failures and timeouts,
preemption, prefix caching, prefix-block versions, block layout) and every setting.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import difflib
import enum
import hashlib
import numbers
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvwire.aio import read_secret_file
from kvwire.codec import get_codec
from kvwire.errors import (
    ConnectionLostError,
    KvwireError,
    LimitExceededError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.integrations.prefix import SyncRegistry, prefix_block_ids, verify_blocks
from kvwire.paged import DROP, PagedDestination, PagedSpec, layer_rows
from kvwire.session.options import MAX_STREAMS, check_value, shown
from kvwire.sync import Bridge, PendingPeer, ReceiveHandle, SendHandle, SyncPeer, SyncServer
from kvwire.units import split_hostport
from kvwire.wire.connection import MAX_TRANSFERS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger so its logging configuration shows these lines.
logger = init_logger("vllm.kvwire")


@dataclass(frozen=True, slots=True)
class _Move:
    req_id: str
    key: str
    block_ids: list[int]
    codec: str | None = None
    prefix: tuple[bytes, ...] = ()  # the blocks' registry ids (with kvwire_registry)


@dataclass
class KvwireConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers for one step."""

    #: block ids DROP where vLLM's prefix cache holds the block: that part is dropped
    loads: list[_Move] = field(default_factory=list)
    saves: list[_Move] = field(default_factory=list)
    #: transfers for requests computed here (their blocks all cached): received and dropped
    drops: list[_Move] = field(default_factory=list)
    #: requests with a send that vLLM preempted in this step (their blocks are reused now)
    preempted: list[str] = field(default_factory=list)


def _split_addr(addr: str, key: str = "address", *, any_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` included (the brackets are not the host's); the port
    in 1-65535 (0 too with ``any_port``: a listener's "any free port")."""
    try:
        host, port = split_hostport(addr)
    except ValueError:
        raise UsageError(f"kvwire connector: {key} must be HOST:PORT, an IPv6 host in brackets "
                         f"([::1]:7070), got {addr!r}") from None
    if not re.fullmatch(r"[0-9]{1,5}", port):
        raise UsageError(f"kvwire connector: {key} must be HOST:PORT, got {addr!r}")
    number = int(port)
    if not (0 if any_port else 1) <= number <= 65535:
        raise UsageError(f"kvwire connector: {key}'s port must be in {0 if any_port else 1}-65535, got {addr!r}")
    return host, number


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean setting: a bool, or true/false (1/0, yes/no, on/off) as text, as a CLI or a
    YAML file may give it ("false" is not true)."""
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    try:
        text = str(value).strip().lower()
    except ValueError:  # (an int past 4300 digits has no text)
        text = ""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise UsageError(f"kvwire connector: {key} must be true or false, got {shown(value)}")


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    """A time in seconds, > 0 and finite."""
    value: Any = extra.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an int past the largest float)
        raise UsageError(f"kvwire connector: {key} must be a number of seconds, got {shown(value)}") from None
    check_value(key, seconds)
    return seconds


#: The connector's kv_connector_extra_config keys (every other kvwire_* key is refused).
_SETTINGS = frozenset({
    "kvwire_listen", "kvwire_peer", "kvwire_secret", "kvwire_secret_file", "kvwire_codec", "kvwire_streams",
    "kvwire_chunk_bytes", "kvwire_load_timeout", "kvwire_async_save", "kvwire_load_async",
    "kvwire_claim_timeout", "kvwire_max_transfers", "kvwire_load_all", "kvwire_model", "kvwire_registry",
    "kvwire_registry_namespace", "kvwire_registry_ttl", "kvwire_registry_owner", "kvwire_registry_max_connections",
})


def _check_keys(extra: dict[str, Any]) -> None:
    """A ``kvwire_*`` key that is no setting (misspelled: ``kvwire_load_timout``) is a
    UsageError naming it, and the setting it may mean; other keys are left alone (vLLM or
    another connector may share the dict)."""
    for key in extra:
        if isinstance(key, str) and key.startswith("kvwire_") and key not in _SETTINGS:
            # (compared past the prefix, which every key shares)
            close = difflib.get_close_matches(key[7:], sorted(k[7:] for k in _SETTINGS), n=1)
            hint = f" (did you mean 'kvwire_{close[0]}'?)" if close else ""
            raise UsageError(f"kvwire connector: unknown setting {key!r} in kv_connector_extra_config{hint}")


#: The text of a whole number: digits, a sign before them, spaces around.
_WHOLE_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")


def _whole(value: Any) -> int | None:
    """``value`` as a whole number (an int, numpy's too, a float without a fraction, or
    text of an int: digits, a sign before them), or None if it is none: a bool, 2.5 (int()
    would cut it to 2, as it would Fraction(5, 2) and Decimal('2.5'), which are none of
    these), b'12', "2.0", "big"."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None  # (inf and nan are not integers)
    if isinstance(value, str) and _WHOLE_TEXT.fullmatch(value):
        try:
            return int(value)
        except ValueError:  # past 4300 digits (sys.get_int_max_str_digits)
            return None
    return None


def _count(extra: dict[str, Any], key: str, default: int, maximum: int) -> int:
    """A whole number in [1, ``maximum``] (as text too; not a bool, not 2.5)."""
    value: Any = extra.get(key, default)
    number = _whole(value)
    if number is None:
        raise UsageError(f"kvwire connector: {key} must be a whole number, got {shown(value)}")
    if not 1 <= number <= maximum:
        raise UsageError(f"kvwire connector: {key} must be in [1, {maximum}], got {shown(value)}")
    return number


def _log_received(req_id: str, blocks: list[int], handle: ReceiveHandle) -> None:
    """A consumer's load that arrived whole (either load)."""
    wire = getattr(handle.transfer, "wire_bytes", 0)
    logger.info("kvwire: received KV of request %s (%d blocks, %d wire bytes)", req_id, len(blocks), wire)


def _log_refused(req_id: str, reason: str) -> None:
    """A consumer's load refused by the registry check."""
    logger.error("kvwire: refused KV of request %s: %s", req_id, reason)


def _log_failed(req_id: str, error: object) -> None:
    """A consumer's load that failed or timed out."""
    logger.error("kvwire: receiving KV of request %s failed: %s", req_id, error)


#: A transfer named without a ``kvwire_id``: only a consumer with kvwire_load_all loads one.
_UNNAMED = re.compile(r"prompt:[0-9a-f]{32}")


class _DropAll(PagedDestination):
    """A drop's destination for a transfer whose block count this side does not know (one
    named without a ``kvwire_id``): every block DROP, as many as the transfer carries,
    sized by its first chunk (the server checks the destination again then)."""

    def __init__(self, spec: PagedSpec, caches: list[torch.Tensor]) -> None:
        super().__init__(spec, caches, [DROP])

    def check(self, *args: Any, **kwargs: Any) -> Any:
        layer_tokens = args[1] if len(args) > 1 else kwargs.get("layer_tokens")
        rows = self.spec.rows_per_block
        if isinstance(layer_tokens, int) and layer_tokens > 0 and layer_tokens % rows == 0 \
                and layer_tokens // rows != self.block_ids.size:
            super().__init__(self.spec, self.caches, [DROP] * (layer_tokens // rows))
        return super().check(*args, **kwargs)


class _Destination(PagedDestination):
    """A load's destination that tells whether its transfer used it (``used``): a transfer
    that had failed before it was claimed is handed out without its destination ever being
    called, nothing of it written into the blocks.  (A receive calls a destination's
    ``check`` before anything else of it, kvwire.aio's attach.)"""

    used = False

    def check(self, *args: Any, **kwargs: Any) -> Any:
        self.used = True
        return super().check(*args, **kwargs)


@dataclass(slots=True, eq=False)
class _Load:
    """A consumer's load of one request, from its start until it ended (arrived whole,
    refused, failed or given up): its receive, and what a reload needs (see
    :meth:`KvwireConnector._reload`)."""

    handle: ReceiveHandle
    key: str
    block_ids: list[int]  # DROP where the block is not loaded
    dest: _Destination
    since: float  # when it started (the async load's kvwire_load_timeout counts from then)
    #: the blocks' registry ids, to check the transfer's versions against (with kvwire_registry,
    #: until checked)
    expected: tuple[bytes, ...] | None = None
    #: async load: the registry check under way, with its deadline
    verifying: tuple[concurrent.futures.Future[str | None], float] | None = None
    #: async load whose claimed transfer was lost (see :meth:`KvwireConnector._restart_load`):
    #: set by kvwire's loop once the receive of it stopped, then its name is expected again
    restarting: threading.Event | None = None
    #: whether it was restarted so (once)
    restarted: bool = False
    #: restarted: when it fails unless the retry came (_RETRY_WINDOW after the loss)
    retry_by: float = float("inf")

    @property
    def blocks(self) -> list[int]:
        """The blocks loaded into (reported as load errors if it fails)."""
        return [b for b in self.block_ids if b != DROP]

    @property
    def awaiting_retry(self) -> bool:
        """Restarted (see :meth:`KvwireConnector._restart_load`) and its retry not begun:
        the receive of its lost transfer still stopping, or its name expected again and
        no transfer of it come yet.  Its ``retry_by`` is inf until it restarts and the
        retry's deadline from then on (also once the retry began)."""
        return self.restarted and (self.restarting is not None or self.handle.transfer is None)


@dataclass(slots=True, eq=False)
class _Drop:
    """A consumer's drop of a transfer (see KvwireConnector._drop)."""

    handle: ReceiveHandle
    #: named without a kvwire_id, without kvwire_load_all: one of the drops of arrivals no
    #: request loads (see KvwireConnector._sweep_unnamed)
    swept: bool
    #: a load given up (see KvwireConnector._give_up_load): the blocks its transfer carries
    #: and when the drop ends (kvwire_claim_timeout from its start, _RETRY_WINDOW for a
    #: transfer lost mid-way; None: never); it goes
    #: after a later load of its name, which it must not take the transfer of (see
    #: KvwireConnector._yield_drops)
    given_up: tuple[int, float | None] | None = None


class _SendState(enum.Enum):
    """Where a producer's send stands (see :class:`_Send`)."""

    #: its step found the first connect under way: sent whole once the connection is up
    DEFERRED = enum.auto()
    #: waits its turn for room on the session (the consumer's server takes at most
    #: max_transfers of its transfers at once): begun whole, oldest first, as earlier sends end
    QUEUED = enum.auto()
    #: refused at BEGIN for want of room: goes back to the head of the queue (see
    #: KvwireConnector._flush_refused)
    REFUSED = enum.auto()
    #: begun in this step
    SENDING = enum.auto()
    #: async save: past its step
    IN_FLIGHT = enum.auto()
    #: failed on its own while the connection goes on: its frames already queued on the
    #: streams still read its blocks until written past its write marks
    DRAINING = enum.auto()
    #: ended while the connection's close is left to kvwire's loop (held up elsewhere): ends
    #: once that close did, or the loop (its event), as the streams may read its blocks until then
    UNCLOSED = enum.auto()
    #: ended (acknowledged, failed and let go of, or never begun): its blocks are free
    ENDED = enum.auto()


@dataclass(slots=True, eq=False)
class _Send:
    """A producer's send of one request, from its save until get_finished reports it."""

    move: _Move
    #: ``begin``'s versions of its blocks, named in its step (with kvwire_registry)
    versions: dict[str, Any]
    #: when its step found no connection (deferred), or it was first queued: it is begun
    #: within kvwire_load_timeout of that
    since: float
    state: _SendState
    handle: SendHandle | None = None  # once begun
    #: since when it is in flight (its step's end), or draining (when it failed)
    at: float = 0.0
    marks: Any = None  # draining: the streams' write marks it waits past
    closed: threading.Event | None = None  # unclosed: set once the connection's close ended
    told: bool = False  # its refusal for want of room was logged (once)
    finished: bool = False  # its request finished: reported by get_finished once the send ended


@dataclass(frozen=True, slots=True)
class _NotDone:
    """A send that did not end within its wait (see :meth:`KvwireConnector._outcome`)."""

    #: whether the consumer's server had accepted it (answered its BEGIN) by then: a
    #: kvwire server holds that ACCEPT while its buffer budget has no room for a first layer
    accepted: bool
    #: whether it was waiting then for the consumer's server to grant its next layer (a
    #: kvwire server grants layers only within its buffer budget's room), and the layers
    #: granted so far, of how many
    waiting_for_credit: bool
    layers_granted: int
    num_layers: int


def _layer_order(name: str) -> tuple[int, str]:
    m = re.search(r"\d+", name)
    return (int(m.group()) if m else -1, name)


class KvwireConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvwire as vLLM's KV transfer: producer sends by layer, consumer receives into its blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if groups > 1:
            # Each group has its own block table; the connector moves one (the first) for
            # every layer, which would send and fill other groups' layers at wrong blocks.
            raise UsageError(
                f"kvwire connector: the KV cache has {groups} groups (vLLM's hybrid KV cache manager); "
                "it moves one: start vLLM with --disable-hybrid-kv-cache-manager"
            )
        parallel = vllm_config.parallel_config
        for setting, size in (("tensor_parallel_size", parallel.tensor_parallel_size),
                              ("pipeline_parallel_size", parallel.pipeline_parallel_size)):
            if size > 1:
                # Each rank's worker holds a shard of the KV cache (heads, or layers): every
                # rank would bind one kvwire_listen, or send its shard under the same name.
                raise UsageError(
                    f"kvwire connector: {setting} is {size}; the connector moves one worker's whole KV cache "
                    f"and supports neither tensor nor pipeline parallelism: run vLLM with {setting}=1"
                )
        cfg = self._kv_transfer_config
        self._block_size: int = vllm_config.cache_config.block_size
        self._producer: bool = bool(cfg.is_kv_producer)
        self._consumer: bool = bool(cfg.is_kv_consumer)
        dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
        if self._consumer and dp > 1:
            # A producer sends each request's KV to its one kvwire_peer, one engine, while
            # vLLM places the request on any of the data-parallel engines (and those of a
            # host would all bind kvwire_listen): most requests would wait for KV that went
            # elsewhere.  A producer may run data-parallel: its engines send by name.
            raise UsageError(
                f"kvwire connector: data_parallel_size is {dp} on a consumer; a producer sends to one "
                "kvwire_peer, one engine: run each consumer engine on its own (data_parallel_size=1) with its "
                "own kvwire_listen, and send each request's KV to the engine that serves it"
            )
        extra = cfg.kv_connector_extra_config or {}
        _check_keys(extra)
        # Each address is checked on the role that uses it (a consumer listens, a producer
        # connects): a configuration shared by both roles may carry the other's, such as a
        # port 0 to listen on.
        listen = str(extra.get("kvwire_listen", "127.0.0.1:7070"))
        self._listen: tuple[str, int] = _split_addr(listen, "kvwire_listen", any_port=True) if self._consumer else ("", 0)
        self._peer_addr: str = str(extra.get("kvwire_peer", "127.0.0.1:7070"))
        self._peer_host, self._peer_port = _split_addr(self._peer_addr, "kvwire_peer") if self._producer else ("", 0)
        secret = extra.get("kvwire_secret")
        secret_file = extra.get("kvwire_secret_file")
        if secret_file:
            try:
                self._secret = read_secret_file(secret_file)  # less one line ending at the end
            except OSError as exc:
                raise UsageError(f"kvwire connector: cannot read kvwire_secret_file {secret_file!r}: "
                                 f"{exc.strerror or exc}") from None
        elif secret:
            self._secret = str(secret).encode()
        else:
            raise UsageError("kvwire connector: set kvwire_secret or kvwire_secret_file in kv_connector_extra_config")
        if len(self._secret) < 8:
            raise UsageError("kvwire connector: the secret must be at least 8 bytes")
        # Every setting is checked here: a bad one found at the first connect would leave
        # each request unsent, step after step, as if the network were down.
        self._codec: str = str(extra.get("kvwire_codec", "raw"))
        if self._codec != "auto":
            get_codec(self._codec)
        self._streams: int | str = self._stream_count(extra.get("kvwire_streams", 1))
        chunk = extra.get("kvwire_chunk_bytes")
        # unset (None) is the client's default; 0 is refused, not taken as unset
        self._chunk_bytes: int | None = None if chunk is None else _whole(chunk)
        if chunk is not None and self._chunk_bytes is None:
            raise UsageError(f"kvwire connector: kvwire_chunk_bytes must be a number of bytes, got {shown(chunk)}")
        if self._chunk_bytes is not None and self._chunk_bytes <= 0:
            raise UsageError(f"kvwire connector: kvwire_chunk_bytes must be > 0, got {shown(chunk)}")
        self._timeout: float = _seconds(extra, "kvwire_load_timeout", 60.0)
        self._load_all: bool = _flag(extra, "kvwire_load_all", False)
        self._async_save: bool = _flag(extra, "kvwire_async_save", True)
        self._load_async: bool = _flag(extra, "kvwire_load_async", True)
        # A prefill instance usually finishes before the decode instance takes the request.
        self._claim_timeout: float | None = (
            None if extra.get("kvwire_claim_timeout", 600.0) is None else _seconds(extra, "kvwire_claim_timeout", 600.0)
        )
        # Consumer: transfers its server takes from one producer's session at once (a
        # producer learns it from the handshake and begins no more sends at once).
        self._max_transfers: int = _count(extra, "kvwire_max_transfers", 64, MAX_TRANSFERS)
        self._num_blocks: int | None = getattr(kv_cache_config, "num_blocks", None)
        self._model: str = str(extra.get("kvwire_model", ""))
        registry = extra.get("kvwire_registry")
        self._registry_url: str | None = str(registry) if registry else None
        self._registry_namespace: str = str(extra.get("kvwire_registry_namespace", "kvwire"))
        self._registry_ttl: float = _seconds(extra, "kvwire_registry_ttl", 30.0)
        self._owner: str = str(extra.get("kvwire_registry_owner", f"kvwire-vllm-{os.getpid()}"))
        # the registry's pool of Redis connections (unset: the registry's default)
        self._registry_connections: int | None = (
            None if extra.get("kvwire_registry_max_connections") is None
            else _count(extra, "kvwire_registry_max_connections", 1, self._MAX_REGISTRY_CONNECTIONS)
        )
        self._bridge: Bridge | None = None
        self._registry: SyncRegistry | None = None
        # scheduler side
        self._local_hits: dict[str, int] = {}  # tokens vLLM found in its prefix cache
        # key, full blocks cached here, blocks loaded (none: the transfer is only dropped)
        self._pending_loads: dict[str, tuple[str, int, int]] = {}
        self._loaded: set[str] = set()  # requests whose one load (or drop) was scheduled
        # drops of requests finished before their load was scheduled, for the next step
        self._finished_drops: list[_Move] = []
        self._partial: dict[str, tuple[str, list[int], int, str | None, tuple[bytes, ...]]] = {}
        self._saving: set[str] = set()  # requests whose send was scheduled (async save: blocks kept)
        # async load: the loads of requests vLLM parked for their KV (not scheduled, so not
        # in the scheduler output's new requests), for the step's metadata
        self._async_loads: dict[str, _Move] = {}
        # worker side
        self._spec: PagedSpec | None = None
        self._caches: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self._server: SyncServer | None = None
        self._peer: SyncPeer | None = None
        # Producer: the connection is made on the bridge's loop (a consumer that accepts TCP
        # and never answers would otherwise hold the forward for the handshake timeout);
        # after a failed attempt the next waits _retry_delay, doubled per failure up to
        # _RETRY_MAX.  A step whose saves find no connection ends them unsent.
        self._connecting: PendingPeer | None = None
        self._connect_attempts = 0
        self._retry_at = 0.0
        self._retry_delay = self._RETRY_FIRST
        self._connect_error: str | None = None
        self._unconnected: KvwireConnectorMetadata | None = None  # the step that found no connection
        # Producer: every request's send, one record each (see _Send), from its save until
        # get_finished reports it.  The sends of a state are in the order they entered it
        # (_set moves a send to the end): oldest first.  Sends on one connection go first
        # come, first served, so only the oldest in flight can be late: it has
        # kvwire_load_timeout from its step or from the end of the send before it
        # (_last_end), whichever came later.  After a refusal for want of room no send is
        # begun before _room_at (unless another send ends first).
        self._sends: dict[str, _Send] = {}
        self._room_at = 0.0
        self._last_end = 0.0
        self._loading: dict[str, _Load] = {}  # the loads under way
        self._dropping: dict[str, _Drop] = {}
        self._swept = 0  # drops of transfers named without a kvwire_id begun (see _sweep_unnamed)
        # the list of arrivals asked of kvwire's loop by the last step, with the drops that
        # waited for a transfer of each name then (see _sweep_unnamed)
        self._sweep_ask: tuple[concurrent.futures.Future[list[str]], dict[str, int]] | None = None
        self._load_errors: set[int] = set()
        self._aborting: list[str] = []  # receives aborted in this hook, not yet known stopped
        # Async load: loads that ended with their receive aborted, not yet known stopped:
        # each waits for a mark queued on kvwire's loop after its abort (with its blocks to
        # report as load errors, and since when it waits) before its request is reported,
        # so vLLM keeps its blocks until nothing writes into them.
        self._unstopped: dict[str, tuple[threading.Event, set[int], float]] = {}
        # Async load: loads whose receive could not start (the server's bridge closed),
        # with their blocks: reported as failed by the next get_finished.
        self._unstarted: dict[str, set[int]] = {}
        # The step's loads end by this time (set when they start, or at the step's first
        # wait for loads it carried over): every layer's wait shares it; cleared when the
        # step ends (clear_connector_metadata), so the next step sets its own.
        self._load_deadline: float | None = None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: ``wait_for_layer_load`` and ``save_kv_layer`` run as Python around each
        attention layer, which a full CUDA graph's replay skips (the layer read before its
        KV is in, or never sent); vLLM then captures piecewise graphs, which call them."""
        return True

    #: most connections kvwire_registry_max_connections takes (one host's to one Redis address
    #: cannot outnumber its ports)
    _MAX_REGISTRY_CONNECTIONS = 65535

    #: seconds a send refused for want of room on the consumer's server waits before it is begun again
    #: (unless another send ends first)
    _ROOM_WAIT = 0.5

    #: seconds before the first retry of a failed connect; doubled per failure up to _RETRY_MAX
    _RETRY_FIRST = 1.0
    _RETRY_MAX = 30.0

    # -- helpers ----------------------------------------------------------------------------

    def _full_blocks(self, num_prompt_tokens: int) -> int:
        # The last prompt token is always computed locally (vLLM needs one to sample from).
        return max(0, (num_prompt_tokens - 1) // self._block_size)

    def _key(self, prompt: list[int], params: dict[str, Any] | None) -> str:
        """The transfer's name: a digest of the prompt's full blocks' token ids (what is
        sent), after the request's ``kvwire_id`` when it has one.  Both sides name it so:
        a transfer only meets a request whose full blocks hold the same tokens, and a
        reused id, or a transfer left over from another prompt, is not loaded."""
        n = self._full_blocks(len(prompt)) * self._block_size
        digest = hashlib.sha256(torch.tensor(prompt[:n], dtype=torch.int64).numpy().tobytes()).hexdigest()
        if params and params.get("kvwire_id"):
            return f"{params['kvwire_id']}#prompt:{digest[:32]}"
        return f"prompt:{digest[:32]}"

    def _prefix(self, prompt: list[int], num_blocks: int) -> tuple[bytes, ...]:
        if self._registry_url is None:
            return ()
        return tuple(prefix_block_ids(prompt, self._block_size, num_blocks, salt=self._model.encode()))

    def _connect_registry(self) -> None:
        if self._registry_url is None or self._registry is not None:
            return
        owned = self._bridge is None
        bridge = self._bridge = self._bridge or Bridge("kvwire-connector")
        try:
            self._registry = SyncRegistry.connect(self._registry_url, bridge, namespace=self._registry_namespace,
                                                  max_connections=self._registry_connections)
        except BaseException:
            if owned:
                bridge.close()
                self._bridge = None
            raise
        logger.info("kvwire: prefix-block versions through the registry at %s", self._registry_url)

    def _wants_load(self, params: dict[str, Any] | None) -> bool:
        return self._load_all or bool(params and params.get("kvwire_id"))

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self._consumer or not self._wants_load(request.kv_transfer_params):
            return 0, False
        tokens = self._full_blocks(len(request.prompt_token_ids or [])) * self._block_size
        if tokens == 0 or request.request_id in self._loaded:
            # A request back in the queue after its load (preempted, its blocks freed):
            # its one transfer was taken, so it is computed here.  (A hit reported for it
            # would have its new blocks taken as loaded: no load is scheduled for a
            # resumed request.)
            return 0, False
        # ``num_computed_tokens``: whole blocks found in this instance's prefix cache.  The
        # rest of the full blocks are loaded (the transfer carries them all: the cached
        # ones' part is dropped on arrival).
        self._local_hits[request.request_id] = num_computed_tokens
        hit = max(0, tokens - num_computed_tokens)
        # Async load: vLLM parks a request with a hit (WAITING_FOR_REMOTE_KVS, its blocks
        # allocated) until the worker reports its KV in (get_finished); no hit, no wait.
        return hit, self._load_async and hit > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        if not self._consumer or not self._wants_load(request.kv_transfer_params) or req_id in self._loaded:
            return
        prompt = list(request.prompt_token_ids or [])
        n = self._full_blocks(len(prompt))
        if n == 0:
            return  # nothing is sent for it
        key = self._key(prompt, request.kv_transfer_params)
        cached = min(n, self._local_hits.pop(req_id, 0) // self._block_size)
        # Logged here, once: vLLM asks get_num_new_matched_tokens again every step a
        # request waits for blocks.
        if num_external_tokens > 0:
            logger.info("kvwire: external KV hit for request %s: %d tokens to receive%s", req_id, num_external_tokens,
                        f" ({cached} blocks cached here)" if cached else "")
        else:
            # Computed here (its full blocks in the prefix cache, or vLLM took no hit): its
            # transfer is taken all the same, or it would wait on the server until the
            # claim timeout.
            logger.info("kvwire: request %s is computed here (%d of its %d full blocks cached): its KV is "
                        "received and dropped", req_id, cached, n)
        loaded = min(n - cached, num_external_tokens // self._block_size)
        if self._load_async and num_external_tokens > 0:
            # Parked until its KV is in, not scheduled: its load goes in this step's
            # metadata from here, into the blocks vLLM allocated for it now.
            self._loaded.add(req_id)
            block_ids = list(blocks.get_block_ids()[0])
            ids = [DROP] * cached + block_ids[cached : cached + loaded]
            ids += [DROP] * (n - len(ids))
            self._async_loads[req_id] = _Move(req_id, key, ids, prefix=self._prefix(prompt, n))
            return
        self._pending_loads[req_id] = (key, cached, loaded)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvwireConnectorMetadata()
        # Async loads, each in one step's metadata, even for a request finished meanwhile:
        # vLLM keeps a parked request's blocks until the worker reports it (get_finished),
        # which the worker does once it started, and aborted, its receive.
        meta.loads.extend(self._async_loads.values())
        self._async_loads.clear()
        meta.drops.extend(self._finished_drops)
        self._finished_drops.clear()
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            n = self._full_blocks(len(prompt))
            block_ids = list(new.block_ids[0])
            if new.req_id in self._pending_loads:
                self._loaded.add(new.req_id)
                # The transfer carries every full block: those cached here, and any past
                # the tokens vLLM took as loaded (it computes them), are dropped.
                key, in_cache, loaded = self._pending_loads.pop(new.req_id)
                ids = [DROP] * in_cache + block_ids[in_cache : in_cache + loaded]
                ids += [DROP] * (n - len(ids))
                if loaded:
                    meta.loads.append(_Move(new.req_id, key, ids, prefix=self._prefix(prompt, n)))
                    continue
                meta.drops.append(_Move(new.req_id, key, ids))
            # Sent once: a request preempted after its send was scheduled and resumed comes
            # back here as new with some schedulers (vLLM's model runner V2); a second send
            # would read its blocks past the point get_finished reports them free.
            if self._producer and n > 0 and new.req_id not in self._saving:
                extra = new.sampling_params.extra_args if new.sampling_params is not None else None
                params = (extra or {}).get("kv_transfer_params")
                key = self._key(prompt, params)
                codec = str(params["kvwire_codec"]) if params and params.get("kvwire_codec") else None
                done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                prefix = self._prefix(prompt, n)
                if done >= n * self._block_size:
                    meta.saves.append(_Move(new.req_id, key, block_ids[:n], codec, prefix))
                    self._saving.add(new.req_id)
                else:  # chunked prefill: send once the full blocks are computed
                    self._partial[new.req_id] = (key, block_ids, n, codec, prefix)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._partial:
                continue
            key, block_ids, n, codec, prefix = self._partial[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                # Preempted, its blocks freed, and now resumed: ``new_block_ids`` are all
                # of its blocks (found in the prefix cache or new), not more of them.
                if new_ids is None:  # none named: nothing of it can be sent
                    del self._partial[req_id]
                    continue
                block_ids = list(new_ids[0])
            elif new_ids is not None:
                block_ids = block_ids + list(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done >= n * self._block_size:
                del self._partial[req_id]
                meta.saves.append(_Move(req_id, key, block_ids[:n], codec, prefix))
                self._saving.add(req_id)
            else:
                self._partial[req_id] = (key, block_ids, n, codec, prefix)
        for req_id in scheduler_output.finished_req_ids & self._pending_loads.keys():
            del self._pending_loads[req_id]
        meta.preempted = sorted(set(scheduler_output.preempted_req_ids or ()) & self._saving)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if self._consumer and req_id not in self._loaded and self._wants_load(request.kv_transfer_params):
            # Finished (aborted) before its load, or its drop, was scheduled: the producer
            # sent its KV all the same, which would wait on the server, holding memory and
            # a slot of the producer's session, until kvwire_claim_timeout: dropped as it comes.
            prompt = list(request.prompt_token_ids or [])
            n = self._full_blocks(len(prompt))
            if n > 0:
                self._finished_drops.append(_Move(req_id, self._key(prompt, request.kv_transfer_params), [DROP] * n))
        self._partial.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        saving = request.request_id in self._saving
        self._saving.discard(request.request_id)
        # Async save: the blocks stay until the worker's get_finished reports the send
        # ended.  Otherwise wait_for_save returned only once they were sent, or the
        # connection that read them was closed: vLLM may free them now.
        return saving and self._async_save, None

    @staticmethod
    def _stream_count(value: object) -> int | str:
        """kvwire_streams: an int in [1, 64] (as text too; not a float, 4.0 neither) or "auto"."""
        if isinstance(value, str) and value == "auto":
            return "auto"
        count = None if isinstance(value, float) else _whole(value)
        if count is None or not 1 <= count <= MAX_STREAMS:
            raise UsageError(f"kvwire connector: kvwire_streams must be an int in [1, {MAX_STREAMS}] or 'auto', "
                             f"got {shown(value)}")
        return count

    # -- worker side --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_order)
        self._caches = [kv_caches[n] for n in names]
        self._index = {n: i for i, n in enumerate(names)}
        first = self._caches[0]
        if any(tuple(c.shape[1:]) != tuple(first.shape[1:]) or c.dtype != first.dtype for c in self._caches):
            raise UsageError("kvwire connector: every layer's KV cache must have the same block geometry")
        if self._num_blocks is not None and first.shape[0] != self._num_blocks:
            # e.g. [2, num_blocks, ...]: K and V in leading planes, whose blocks are not slabs
            raise UsageError(
                f"kvwire connector: the KV cache is shaped {tuple(first.shape)}, but its first axis must be "
                f"the block index ({self._num_blocks} blocks): this attention backend's layout is not supported"
            )
        if first.shape[0] == 2 and first.ndim >= 3 and tuple(first.shape[1:2]) != (self._block_size,):
            logger.warning("kvwire: cache shaped %s; blocks are taken along the first axis", tuple(first.shape))
        model = self._identity(names[0])
        # vLLM hands kvwire logical [num_blocks, 2, block_size, num_kv_heads, head_size]
        # caches (a physically HND cache arrives permuted and non-contiguous, and is
        # refused as such when its blocks are sent or received), so a block of 4+ dims
        # whose axis 1 is block_size holds its tokens there: token_axis=1 makes each cache
        # token one wire row of all its heads, so the codecs' per-head groups (int4 keys
        # per channel over tokens) never mix heads.  Any other block keeps opaque rows.
        block = tuple(first.shape[1:])
        axis = 1 if len(block) >= 4 and block[1] == self._block_size else None
        self._spec = PagedSpec.of(first, num_layers=len(self._caches), model=model, token_axis=axis)
        logger.info(
            "kvwire: %d layers, blocks of %s %s (%d bytes each); producer=%s consumer=%s",
            len(self._caches), self._spec.block_shape, self._spec.dtype, self._spec.block_bytes,
            self._producer, self._consumer,
        )
        self._connect_registry()
        self._connect()  # producer: on the bridge's loop, so the first save finds it up
        if self._consumer:
            host, port = self._listen
            versioned: dict[str, Any] = {}
            if self._registry is not None:
                versioned = {"bridge": self._bridge, "registry": self._registry.registry}
            self._server = SyncServer(
                host, port, secret=self._secret, spec=self._spec.wire_spec(), claim_timeout=self._claim_timeout,
                max_transfers=self._max_transfers, **versioned,
            )
            from kvwire.aio._logtext import address  # (IPv6 as [host]:port)

            logger.info("kvwire: receiving on %s", address((host, self._server.port)))

    def _identity(self, layer_name: str) -> str:
        """The spec's ``model`` field: what, beside the block shape and dtype, both sides
        must share to read each other's blocks.  The model (``kvwire_model`` when set,
        else vLLM's ``model_config.model``), the attention backend, the layout it writes
        its blocks in where it has a choice (the CPU backend's ISA, ``amx`` or ``vec``
        among others: same shape, other bytes), the KV cache dtype and the vLLM version;
        readable, with a digest of them all (the field is at most 255 bytes, and a long
        model path is cut), so that sides that differ fail at the handshake or BEGIN
        (``INCOMPATIBLE_SPEC``, the error naming the layouts' fingerprints) instead of
        loading blocks they cannot read; the fields are logged (``kvwire: KV layout
        ...``), each instance its own, to compare."""
        import vllm

        config = self._vllm_config
        model_config = getattr(config, "model_config", None)
        model = self._model or str(getattr(model_config, "model", "") or "")
        layer = config.compilation_config.static_forward_context.get(layer_name)
        backend = getattr(layer, "attn_backend", None)
        backend_name = str(backend.get_name()) if backend is not None else "-"
        isa = getattr(layer, "isa", None)
        fields = {"model": model, "backend": backend_name, "layout": "-" if isa is None else str(isa),
                  "kv": str(config.cache_config.cache_dtype), "vllm": str(vllm.__version__)}
        digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:12]
        short = model if len(model.encode()) <= 64 else "..." + model.encode()[-61:].decode(errors="ignore")
        text = (f"{short};{backend_name[:32]};{fields['layout'][:16]};kv={fields['kv'][:16]};"
                f"vllm={fields['vllm'][:32]};{digest}")
        logger.info("kvwire: KV layout %s (both instances must match)", fields)
        return text

    @property
    def listen_port(self) -> int | None:
        """The port the consumer worker's kvwire server listens on, once its caches are
        registered (``kvwire_listen`` may name port 0: the system picks a free one); None on
        a producer or the scheduler side."""
        return None if self._server is None else self._server.port

    def server_statistics(self) -> dict[str, Any] | None:
        """The consumer worker's kvwire server's :meth:`~kvwire.Server.statistics`
        (``pending_arrivals``: transfers arrived that no request took; bytes held; event
        counts); None on a producer or the scheduler side."""
        if self._server is None:
            return None
        server = self._server.server

        async def snapshot() -> dict[str, Any]:
            return dict(server.statistics())

        return self._server.bridge.run(snapshot(), 10)

    def _meta(self) -> KvwireConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwireConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._server is None or self._spec is None:
            return
        meta = self._meta()
        now = time.monotonic()
        if meta.loads and not self._load_async:
            # One kvwire_load_timeout for all of the step's loads, every layer of them: a
            # transfer that trickles in (each layer just inside a timeout of its own) holds
            # the step that long at most, not once per layer.
            self._load_deadline = now + self._timeout
        for move in meta.loads:
            dest = _Destination(self._spec, self._caches, move.block_ids)
            blocks = [b for b in move.block_ids if b != DROP]
            try:
                handle = self._expect_load(move.key, dest)
            except KvwireError as exc:  # the server's bridge is closed: the load fails, not the step
                _log_failed(move.req_id, exc)
                if self._load_async:  # reported by get_finished (vLLM takes it out of its wait)
                    self._unstarted[move.req_id] = set(blocks)
                else:
                    self._load_errors.update(blocks)
                continue
            # (async load: nothing waits for it, get_finished reports it once it ended)
            self._loading[move.req_id] = _Load(handle, move.key, move.block_ids, dest, now,
                                               move.prefix if self._registry is not None else None)
        for move in meta.drops:  # nothing waits for these: get_finished lets them go
            self._drop(move.req_id, move.key, move.block_ids)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        # The step is over: its load deadline is not the next step's, which sets its own
        # (a deadline left over would have passed, giving every wait of a load carried
        # into a step without loads no time at all).
        self._load_deadline = None

    def _drop(self, req_id: str, key: str, block_ids: list[int] | None) -> bool:
        """Take ``key``'s transfer as it comes and drop it (every id DROP; None: as many
        as the transfer carries), so that it does not wait on the server until the claim
        timeout.  As long as the server would keep an arrived transfer for a request,
        kvwire_claim_timeout: a drop for a transfer that never comes (kvwire_load_all, a
        producer that did not send) is let go of then (with no claim timeout, at
        shutdown).  A drop begun anew, not one of a load given up (unless that says so
        after).  Whether it began."""
        drop = self._dropping.get(req_id)
        if drop is not None:
            drop.given_up = None
        return self._expect_drop(req_id, key, block_ids, self._claim_timeout)

    def _drop_given_up(self, req_id: str, key: str, total: int, left: float | None, ends: float | None) -> bool:
        """Begin the drop of a load given up (:meth:`_give_up_load`), or begin it again
        once :meth:`_yield_drops` stopped it (:meth:`_requeue_drops`): expect ``key``'s
        transfer, its ``total`` blocks DROP, let go of after ``left`` seconds, at ``ends``
        (both None: never), and record it as given up (``given_up``).  Whether it began."""
        if not self._expect_drop(req_id, key, [DROP] * total, left):
            return False
        self._dropping[req_id].given_up = (total, ends)
        return True

    def _expect_drop(self, req_id: str, key: str, block_ids: list[int] | None, timeout: float | None) -> bool:
        """Expect ``key``'s transfer for ``req_id``'s drop, let go of after ``timeout``."""
        assert self._server is not None and self._spec is not None
        dest = (_DropAll(self._spec, self._caches) if block_ids is None
                else PagedDestination(self._spec, self._caches, block_ids))
        try:
            handle = self._server.expect(key, into=dest, num_layers=self._spec.num_layers, timeout=timeout)
        except ConnectionLostError:  # the server's bridge is closed: no transfer comes to drop
            return False
        swept = not self._load_all and _UNNAMED.fullmatch(key) is not None
        drop = self._dropping.get(req_id)
        if drop is None:
            self._dropping[req_id] = _Drop(handle, swept)
        else:
            drop.handle, drop.swept = handle, swept
        return True

    def _expect_load(self, key: str, dest: _Destination) -> ReceiveHandle:
        """Expect ``key``'s transfer into ``dest`` for a load, ahead of the drops of loads
        given up that still wait for a transfer of that name (see :meth:`_yield_drops`)."""
        assert self._server is not None and self._spec is not None
        yielded = self._yield_drops(key)
        try:
            return self._server.expect(key, into=dest, num_layers=self._spec.num_layers)
        finally:
            self._requeue_drops(key, yielded)

    def _yield_drops(self, key: str) -> list[str]:
        """Stop the drops of loads given up that wait for a transfer of ``key`` and none was
        handed to yet, as a load of that name starts: their receives are stopped on
        kvwire's loop before the load's expect runs there, so its transfer goes to the
        load, not to a drop of an earlier load (names are shared: kvwire_load_all's
        ``prompt:<digest>``, a reused kvwire_id; the server hands the transfers of a name
        to its expects in the order they were made).  Each is begun again after the load
        (:meth:`_requeue_drops`): the transfer it waited for, should it come after all, is
        the load's, and the load's own is dropped then.  The drops of requests computed
        here do not yield: their transfer is sure to come, and is theirs."""
        yielded: list[str] = []
        for req_id, drop in list(self._dropping.items()):
            handle = drop.handle
            if drop.given_up is not None and handle.request_id == key and handle.transfer is None and handle.error is None and not handle.done:
                # (a stop issued to the loop, which runs it before the load's expect; the
                # drop's destination writes into no block: nothing to wait for)
                handle.abort("a later load of its name goes first", timeout=0)
                yielded.append(req_id)
        return yielded

    def _requeue_drops(self, key: str, yielded: list[str]) -> None:
        """Begin again, behind the load just expected, the drops :meth:`_yield_drops`
        stopped, each for what is left of its kvwire_claim_timeout (one past it ends)."""
        now = time.monotonic()
        for req_id in yielded:
            given_up = self._dropping[req_id].given_up
            assert given_up is not None
            total, ends = given_up
            left = None if ends is None else ends - now
            if (left is not None and left <= 0) or not self._drop_given_up(req_id, key, total, left, ends):
                del self._dropping[req_id]

    #: seconds a hook waits, once for all the receives it aborted, for kvwire's loop to stop them
    #: (and for the close of the producer's connection, on a loop held up elsewhere)
    _ABORT_WAIT = 5.0

    #: seconds a transfer lost mid-way (its producer died) is waited for again, its prefill
    #: retried: an async load restarted so fails this long after the loss at most (not at
    #: its kvwire_load_timeout), and the drop a load given up on such a loss sets for the
    #: retry lasts this long from the loss (see :meth:`_give_up_load`)
    _RETRY_WINDOW = 10.0

    def _abort(self, req_id: str, handle: ReceiveHandle, reason: str) -> None:
        """Stop a load whose blocks vLLM will recompute into.  Issued at once; the hook
        waits for it, with the other aborts it issued, in :meth:`_settle_aborts` before it
        returns (with the async load it does not wait: :meth:`_finished_loads` reports the
        request once the loop stopped it)."""
        if not handle.abort(reason, timeout=0):
            self._aborting.append(req_id)

    def _settle_aborts(self) -> None:
        """Wait once, at most ``_ABORT_WAIT``, for kvwire's loop to have stopped every
        receive this hook aborted (its stops run in the order issued: a mark queued after
        them runs after them all), so that none writes into blocks vLLM reuses once the
        hook returns; say which may still write if the loop is held up past that."""
        pending, self._aborting = self._aborting, []
        if not pending or (stopped := self._loop_mark()) is None:
            return
        if not stopped.wait(self._ABORT_WAIT):
            for req_id in pending:
                logger.error("kvwire: the receive of request %s was not stopped in time (kvwire's loop is held up): "
                             "a late chunk may still be written into its blocks", req_id)

    def _loop_mark(self) -> threading.Event | None:
        """An event kvwire's loop sets once it ran what was queued on it before (the stops
        of the receives aborted so far, run in the order issued), also set once the loop
        ended (nothing runs on it any more); None without a server.  A closed bridge is no
        exception: its loop runs until its close ended (one closed by another thread, or
        whose close gave up on a loop held up elsewhere), and may write into the blocks
        until then, so the mark is queued after the stops all the same."""
        if self._server is None:
            return None
        bridge = self._server.bridge
        mark = threading.Event()
        bridge.when_ended(mark)
        try:
            bridge.call_soon(mark.set)
        except ConnectionLostError:  # closed: run by the loop if it still runs, else set by its end
            bridge.call_soon_while_running(mark.set)
        return mark

    def _give_up_load(self, req_id: str, reason: str) -> None:
        """Abort ``req_id``'s load; if its transfer has not come yet, drop it when it does
        (until kvwire_claim_timeout), and so, for ``_RETRY_WINDOW``, if the transfer it
        claimed was lost (``ConnectionLostError``: its producer died mid-transfer, say):
        the prefill retried sends its name again, whole, and that transfer, which no load
        takes, is dropped as it comes instead of held (memory and a slot of
        ``max_transfers``) until kvwire_claim_timeout.  The drop is that short because a
        new request of the same name (a reused kvwire_id, kvwire_load_all's
        ``prompt:<digest>``) whose transfer comes before its load starts is dropped by it
        too.  The window counts from the loss: an async load restarted on it
        (:meth:`_restart_load`) whose retry has not begun drops until its ``retry_by``
        (none once that passed: a retry later than it is held as any transfer no load
        takes), one whose retry was lost too for ``_RETRY_WINDOW`` from now.  (One
        aborted healthy, its retry's claimed transfer too, its request finished, or whose
        claimed transfer failed otherwise, is not sent again: nothing waits for its name.)"""
        load = self._loading.pop(req_id)
        handle, total = load.handle, len(load.block_ids)
        if load.verifying is not None:
            load.verifying[0].cancel()
        now = time.monotonic()
        # (its own error, before the abort's)
        awaiting_retry = load.awaiting_retry
        lost = awaiting_retry or (handle.transfer is not None and isinstance(handle.error, ConnectionLostError))
        life = self._RETRY_WINDOW if lost else self._claim_timeout
        if awaiting_retry:
            life = load.retry_by - now
        self._abort(req_id, handle, reason)
        if life is not None and life <= 0:
            return  # (the retry window passed: nothing is dropped)
        if (lost or handle.transfer is None) and self._server is not None:
            self._drop_given_up(req_id, handle.request_id, total, life, None if life is None else now + life)

    def _reload(self, req_id: str, handle: ReceiveHandle) -> bool:
        """``req_id``'s receive ``handle`` failed: if the transfer handed to it had failed
        already when it was handed out (one that failed after it arrived and before any
        load claimed it, handed out oldest first, its destination never called: a send
        of the same name that failed, its prefill retried since), expect the name again,
        so that a later transfer of it is loaded, and True; as many times as such
        transfers are handed to it (the server keeps a bounded number of them), all
        within the load's deadline, which its callers check.  Any other failure is
        the load's: a transfer refused at BEGIN (``STALE_VERSION``: no transfer is
        handed out), or one that failed after the load claimed it."""
        load = self._loading.get(req_id)
        if load is None or load.handle is not handle or self._server is None or self._spec is None:
            return False
        # A transfer handed out healthy is given the destination at once (its check()
        # called, before any failure of it can reach the load): one never used had failed.
        if handle.error is None or handle.transfer is None or load.dest.used:
            return False
        again = _Destination(self._spec, self._caches, load.block_ids)
        try:
            new = self._expect_load(load.key, again)
        except KvwireError:  # the server's bridge is closed
            return False
        logger.warning("kvwire: the transfer handed to request %s had failed before it was claimed (%s): "
                       "waiting for another transfer of its name", req_id, handle.error)
        load.handle, load.dest = new, again
        return True

    def _restart_load(self, req_id: str, load: _Load, error: KvwireError) -> bool:
        """Async load whose claimed transfer was lost (``ConnectionLostError``: its producer
        died or its connection was lost mid-transfer, after it wrote into the blocks):
        once, abort its receive and, once kvwire's loop ran a mark queued after that stop
        (nothing of the lost transfer is written into the blocks after it), expect its
        name again (:meth:`_resume_restarted`), so that the prefill retried (its name sent
        again, whole, rewriting every block) is loaded, within the load's
        kvwire_load_timeout and of ``_RETRY_WINDOW`` from now (a producer that died with
        no retry fails the load then, not at kvwire_load_timeout); True.  vLLM has not
        read the blocks (the request waits for its KV).  False (the load fails) otherwise."""
        if (not self._load_async or load.restarted or not isinstance(error, ConnectionLostError)
                or load.handle.transfer is None or not load.dest.used):
            return False
        load.handle.abort(f"its transfer was lost: {error}", timeout=0)
        mark = self._loop_mark()
        if mark is None:
            return False
        load.restarted, load.restarting = True, mark
        load.retry_by = time.monotonic() + self._RETRY_WINDOW
        logger.warning("kvwire: the transfer of request %s was lost mid-way (%s): waiting for another transfer of "
                       "its name (its prefill retried) for %g s", req_id, error,
                       min(self._RETRY_WINDOW, load.since + self._timeout - time.monotonic()))
        return True

    def _late(self, load: _Load, now: float) -> KvwireError | None:
        """Async load: its timeout error if it is past its kvwire_load_timeout, or, once
        restarted, past the ``_RETRY_WINDOW`` its retry is waited for with none begun
        (one that came in time has what is left of the kvwire_load_timeout); else None."""
        if load.awaiting_retry and now >= load.retry_by and load.retry_by < load.since + self._timeout:
            return TransferTimeoutError(f"transfer of {load.key!r} lost mid-way and not sent again within "
                                        f"{self._RETRY_WINDOW:g} s")
        if now >= load.since + self._timeout:
            return TransferTimeoutError(f"transfer of {load.key!r} not ready after {self._timeout:g} s")
        return None

    def _resume_restarted(self, load: _Load) -> KvwireError | None:
        """The receive of ``load``'s lost transfer stopped: expect its name again, into
        the same blocks; the error if it cannot be (the server's bridge is closed)."""
        assert self._spec is not None
        again = _Destination(self._spec, self._caches, load.block_ids)
        try:
            new = self._expect_load(load.key, again)
        except KvwireError as exc:
            return exc
        load.handle, load.dest, load.restarting = new, again, None
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loading or self._load_async:  # async load: the request runs once its KV is in
            return
        index = self._index.get(layer_name)
        if index is None:
            return
        # One kvwire_load_timeout for the step's loads, from when they started, whatever the
        # number of requests and layers: each wait gets what is left of it (a request whose
        # layer is in does not wait).  Loads carried over from an earlier step, in a step
        # that started none, get one from this step's first wait.
        if self._load_deadline is None:
            self._load_deadline = time.monotonic() + self._timeout
        deadline = self._load_deadline
        for req_id, load in list(self._loading.items()):
            blocks = load.blocks
            failed: KvwireError | None = None
            while True:
                try:
                    load.handle.wait_layer(index, timeout=max(0.0, deadline - time.monotonic()))
                except KvwireError as exc:
                    if time.monotonic() < deadline and self._reload(req_id, load.handle):
                        continue
                    failed = exc
                break
            if failed is not None:
                _log_failed(req_id, failed)
                self._give_up_load(req_id, str(failed))
                self._load_errors.update(blocks)
                continue
            handle = load.handle
            expected, load.expected = load.expected, None
            if expected is not None and self._registry is not None:
                # Before the model reads the first layer: the cache must be this prompt's, fresh.
                try:
                    reason = self._registry.verify(expected, getattr(handle.transfer, "blocks", None) or [])
                except KvwireError as exc:
                    reason = f"registry check failed: {exc}"
                if reason is not None:
                    _log_refused(req_id, reason)
                    self._abort(req_id, handle, reason)
                    self._load_errors.update(blocks)
                    del self._loading[req_id]
                    continue
            if index == len(self._caches) - 1:
                _log_received(req_id, blocks, handle)
                del self._loading[req_id]
        self._settle_aborts()

    def _connect(self) -> None:
        """Producer: start connecting to the consumer on the bridge's loop, unless a connect
        is under way, the connection is up, or the back-off after a failure has not passed.
        Returns at once."""
        if (not self._producer or self._peer is not None or self._connecting is not None
                or time.monotonic() < self._retry_at):
            return
        if self._bridge is None:
            self._bridge = Bridge("kvwire-connector")
        options: dict[str, Any] = {"chunk_bytes": self._chunk_bytes} if self._chunk_bytes else {}
        streams: Any = self._streams  # an int in 1-64 or "auto", checked in __init__
        self._connect_attempts += 1
        try:
            self._connecting = PendingPeer(self._bridge, self._peer_host, self._peer_port, secret=self._secret,
                                           streams=streams, codec=self._codec, **options)
        except KvwireError as exc:  # the bridge is closed (shut down)
            self._connect_error = str(exc)

    def _poll_connect(self) -> None:
        """Take the connect's outcome if it ended (never waits): the peer, or the error and
        the time of the next attempt."""
        pending = self._connecting
        if pending is None or not pending.done():
            self._connect()
            return
        self._connecting = None
        try:
            peer = pending.result()
        except BaseException as exc:  # any failure: the connect is tried again later
            self._connect_error = str(exc) or type(exc).__name__
            self._retry_at = time.monotonic() + self._retry_delay
            logger.error("kvwire: connecting to %s failed: %s (next attempt in %g s)",
                         self._peer_addr, self._connect_error, self._retry_delay)
            self._retry_delay = min(self._retry_delay * 2, self._RETRY_MAX)
            return
        self._peer = peer
        self._connect_error = None
        self._retry_delay = self._RETRY_FIRST
        logger.info("kvwire: connected to %s", self._peer_addr)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self._producer or self._spec is None:
            return
        index = self._index.get(layer_name)
        meta = self._meta()
        saves = meta.saves
        if index is None or not saves or meta is self._unconnected:
            return
        if index == 0:
            self._renew_ended_session()  # (this step's saves then wait for the new connection)
        if self._peer is None:
            self._poll_connect()
        if self._peer is None:
            self._unconnected = meta
            if self._connecting is not None and self._connect_error is None:
                # The first connect since startup (or since the last connection ended) is
                # under way: the saves wait for it, not the forward.  Their blocks are
                # kept, and each is sent whole from the registered caches once it is up
                # (or ends unsent if it fails, or past kvwire_load_timeout).
                now = time.monotonic()
                for move in saves:
                    send = self._sends.get(move.req_id)
                    if send is not None and send.state is _SendState.DEFERRED:
                        continue
                    versions = self._versions(move)  # named now, as a save in its step is
                    state = _SendState.DEFERRED if versions is not None else _SendState.ENDED
                    self._set(move.req_id, _Send(move, versions or {}, now, state), state)
                logger.info("kvwire: KV of requests %s waits for the connection to %s",
                            ", ".join(m.req_id for m in saves), self._peer_addr)
                return
            # Not the engine's step to wait or fail: after a failed connect, this step's
            # saves end unsent (their blocks are let go of as any failed send's); the
            # connect is tried again after its back-off, on the bridge's loop.
            why = self._connect_error or "not connected"
            logger.error("kvwire: not sending KV of requests %s to %s: %s",
                         ", ".join(m.req_id for m in saves), self._peer_addr, why)
            return
        for move in saves:
            self._save_layer(move, index, kv_layer)

    def _renew_ended_session(self) -> None:
        """Before a send is begun: if the session with the consumer ended (its server
        restarted or closed it, the connection lost: ``broken`` set, see
        :attr:`kvwire.Peer.broken`), close it and connect again (logged once, at WARNING),
        so that no send is begun on it (one would fail there, unsent).  The sends waiting
        their turn then: with the async save, they wait for the new connection as the
        saves of a step before the first connect do (``DEFERRED``, each sent whole from
        the registered caches once it is up, within kvwire_load_timeout); with the
        synchronous save, they end unsent: vLLM frees their blocks once wait_for_save
        returned (request_finished keeps none), so one sent later from the caches would
        carry another request's KV; the consumer's load of each fails (a load error), it
        is not loaded with wrong KV.  The saves of the step under way wait for the new
        connection (:meth:`save_kv_layer`); those begun on the ended session end as any
        send whose connection was closed.  Not while shutting down (nothing connects
        again)."""
        peer = self._peer
        if peer is None or (cause := peer.broken) is None:
            return
        logger.warning("kvwire: the session with the consumer at %s ended (%s): closing it and connecting again; "
                       "the KV not sent yet %s", self._peer_addr, cause,
                       "waits for the new connection" if self._async_save
                       else "ends unsent (its blocks are freed once wait_for_save returned)")
        if self._async_save and self._retry_at != float("inf"):
            self._flush_refused()
            for req_id, send in self._sends_in(_SendState.QUEUED).items():
                self._set(req_id, send, _SendState.DEFERRED)
        self._let_go_of_blocks(wait=not self._async_save)  # (connects again: see _connect)

    def _versions(self, move: _Move) -> dict[str, Any] | None:
        """``begin``'s versions of ``move``'s blocks: named in the registry now, when the KV
        was computed (none without kvwire_registry); None (logged) if naming failed."""
        if self._registry is None:
            return {}
        try:
            return {"blocks": self._registry.name(list(move.prefix), owner=self._owner, ttl=self._registry_ttl)}
        except KvwireError as exc:
            logger.error("kvwire: not sending KV of request %s: naming its blocks failed: %s", move.req_id, exc)
            return None

    def _sends_in(self, *states: _SendState) -> dict[str, _Send]:
        """The sends in any of ``states``, oldest first (each in the order it entered its state)."""
        return {req_id: send for req_id, send in self._sends.items() if send.state in states}

    def _set(self, req_id: str, send: _Send, state: _SendState) -> None:
        """``send`` (``req_id``'s) goes to ``state``, the newest there."""
        self._sends.pop(req_id, None)
        self._sends[req_id] = send
        send.state = state

    def _save_layer(self, move: _Move, index: int, kv_layer: torch.Tensor, send: _Send | None = None,
                    *, its_turn: bool = False) -> None:
        """Queue layer ``index`` of ``move``'s blocks on its send (begun at layer 0, with
        ``send``'s versions when it has a record, else its blocks named now); a failure
        ends that request's send alone, unsent.  A send that finds the session full (as
        many sends open as the consumer's server takes at once), or sends queued before
        it, waits its turn queued (``its_turn``: it is begun now, by :meth:`_start_queued`)."""
        assert self._peer is not None and self._spec is not None
        req_id = move.req_id
        if index == 0 and send is None:
            versions = self._versions(move)
            if versions is None:
                return
            send = _Send(move, versions, time.monotonic(), _SendState.QUEUED)
        elif send is None:
            send = self._sends.get(req_id)
        if send is None:
            return
        if index == 0 and not its_turn and (self._sends_in(_SendState.QUEUED)
                                            or self._open_sends() >= self._send_limit()):
            self._set(req_id, send, _SendState.QUEUED)
            return
        try:
            if index == 0:
                send.handle = self._peer.begin(
                    move.key, self._spec.wire_spec(), codec=move.codec or self._codec, **send.versions,
                )
                self._set(req_id, send, _SendState.SENDING)
            if send.state is _SendState.SENDING and send.handle is not None:
                send.handle.send_layer(*layer_rows(self._spec, kv_layer, move.block_ids))
        except KvwireError as exc:
            # One request's send failing is not the engine's step failing: it ends
            # unsent (its blocks let go of as any failed send's).
            logger.error("kvwire: not sending KV of request %s: %s", req_id, exc)
            if send.state is _SendState.SENDING and send.handle is not None:
                send.handle.abort()
            self._set(req_id, send, _SendState.ENDED)

    def _send_limit(self) -> int:
        """Sends the consumer's server takes from this session at once (its handshake
        said: its max_transfers)."""
        assert self._peer is not None
        return max(1, int(self._peer.peer.max_transfers))

    def _open_sends(self) -> int:
        """Sends begun on the session that have not ended yet."""
        return sum(1 for send in self._sends.values() if send.state is _SendState.SENDING
                   or (send.state is _SendState.IN_FLIGHT and send.handle is not None and not send.handle.done))

    def _start_queued(self) -> None:
        """Begin the sends waiting their turn, oldest first, while the session has room
        (each whole, every layer from the registered caches, where their blocks are kept);
        with the async save they go in flight from now, their turn.  One that fails at
        its start ends unsent (logged).  After a refusal for want of room (see
        :meth:`_requeue`) none is begun before ``_room_at``."""
        if self._sends_in(_SendState.QUEUED):
            # (async save: they wait for the new connection; sync save: they end unsent)
            self._renew_ended_session()
        now = time.monotonic()
        if self._peer is None or not self._sends_in(_SendState.QUEUED) or now < self._room_at:
            return
        limit = self._send_limit()
        while self._peer is not None and (queued := self._sends_in(_SendState.QUEUED)) \
                and self._open_sends() < limit:
            req_id, send = next(iter(queued.items()))
            for index, cache in enumerate(self._caches):
                self._save_layer(send.move, index, cache, send, its_turn=True)
            if send.state is _SendState.SENDING and self._async_save:
                send.at = now
                self._set(req_id, send, _SendState.IN_FLIGHT)

    def _requeue(self, req_id: str, send: _Send, outcome: Any) -> bool:
        """``req_id``'s send ended (``outcome``, see :meth:`_outcome`): if the consumer's
        server refused it at BEGIN for want of room (LIMIT_EXCEEDED: it takes max_transfers
        transfers of the session at once, those arrived that no request loaded yet
        included, and keeps nothing of a refused one), it goes back to the head of the
        queue (refused, see :meth:`_flush_refused`), to be begun again once another send
        ended or ``_ROOM_WAIT`` passed, and True (logged once, at INFO); not past
        kvwire_load_timeout from when it was first queued (False: it failed).  The one way
        a send goes back to the queue."""
        if not isinstance(outcome, LimitExceededError):  # (a send refused is done: its error is the refusal)
            return False
        if time.monotonic() >= send.since + self._timeout:
            return False  # (its failure is logged as any send's)
        if not send.told:
            send.told = True
            logger.info("kvwire: the consumer at %s has no room for the KV of request %s yet (%s): it is sent "
                        "once there is, within %g s", self._peer_addr, req_id, outcome, self._timeout)
        self._set(req_id, send, _SendState.REFUSED)
        self._room_at = time.monotonic() + self._ROOM_WAIT
        return True

    def _flush_refused(self) -> None:
        """The sends :meth:`_requeue` took back go to the head of the queue, oldest first."""
        refused = self._sends_in(_SendState.REFUSED)
        if refused:
            for send in refused.values():
                send.state = _SendState.QUEUED
            self._sends = {**refused, **self._sends}

    def _wait_for_room(self, deadline: float) -> bool:
        """Sends queued, none begun (after a refusal for want of room): wait until they may
        be begun again, and True; False, the queued sends ended unsent, if that is past
        ``deadline`` or past the oldest one's kvwire_load_timeout."""
        self._flush_refused()
        queued = self._sends_in(_SendState.QUEUED)
        if not queued or self._peer is None:
            return False
        since = min(send.since for send in queued.values())
        now = time.monotonic()
        if self._room_at >= min(deadline, since + self._timeout):
            self._end_queued(f"the consumer's server had no room for them within {self._timeout:g} s")
            return False
        time.sleep(max(0.0, self._room_at - now))
        return True

    def _end_queued(self, why: str) -> None:
        """The sends waiting their turn end unsent (none of their blocks was read, or the
        refused send that read them ended)."""
        self._flush_refused()
        queued = self._sends_in(_SendState.QUEUED)
        if queued:
            logger.error("kvwire: not sending KV of requests %s to %s: %s", ", ".join(queued),
                         self._peer_addr, why)
            for req_id, send in queued.items():
                self._set(req_id, send, _SendState.ENDED)

    def _send_deferred(self, deadline: float | None = None) -> None:
        """The saves that wait for the connection: each sent whole, every layer from the
        registered caches, once it is up (waited for until ``deadline`` if given); each
        ended unsent once the connect failed or kvwire_load_timeout after its step (by
        ``deadline``, all that are left)."""
        if not self._sends_in(_SendState.DEFERRED):
            return
        # (the sends waiting their turn on it: deferred too with the async save, ended
        # unsent with the sync save)
        self._renew_ended_session()
        deferred = self._sends_in(_SendState.DEFERRED)
        if self._peer is None:
            if deadline is not None and self._connecting is not None:
                self._connecting.wait(max(0.0, deadline - time.monotonic()))
            self._poll_connect()
        now = time.monotonic()
        for req_id, send in deferred.items():
            if self._peer is not None:
                # queued, begun, or ended unsent if it failed at its start (logged)
                for index, cache in enumerate(self._caches):
                    self._save_layer(send.move, index, cache, send)
            elif (self._connecting is None or self._connect_error is not None or now >= send.since + self._timeout
                  or deadline is not None):
                why = self._connect_error or f"not connected within {self._timeout:g} s"
                logger.error("kvwire: not sending KV of request %s to %s: %s", req_id, self._peer_addr, why)
                self._set(req_id, send, _SendState.ENDED)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before this step's forward: a preempted request's blocks may be written by it,
        # so a send still reading them must end first (or be let go of), and one still
        # waiting for the connection ends unsent (none of it was read yet).
        for req_id in getattr(connector_metadata, "preempted", ()):
            send = self._sends.get(req_id)
            if send is not None and send.state is _SendState.DEFERRED:
                logger.error("kvwire: not sending KV of request %s: preempted before the connection to %s was up",
                             req_id, self._peer_addr)
                self._set(req_id, send, _SendState.ENDED)
            elif send is not None and send.state is _SendState.QUEUED:
                logger.error("kvwire: not sending KV of request %s: preempted while its send waited its turn", req_id)
                self._set(req_id, send, _SendState.ENDED)
        flying = self._sends_in(_SendState.IN_FLIGHT)
        preempted = [r for r in getattr(connector_metadata, "preempted", ()) if r in flying]
        if not preempted:
            return
        # One kvwire_load_timeout for all of them, not one each.
        deadline = time.monotonic() + self._timeout
        failed = False
        for req_id in preempted:
            logger.info("kvwire: request %s preempted with its send in flight: waiting for the send", req_id)
            send = flying[req_id]
            handle = send.handle
            assert handle is not None
            self._set(req_id, send, _SendState.ENDED)
            if not self._ended_well(req_id, send, self._outcome(send, max(0.0, deadline - time.monotonic()))):
                if handle.done and self._drained(deadline):
                    continue  # failed on its own; the streams hold nothing of it now
                failed = True
                if not handle.done:
                    # Not ended in its time: its frames may still be queued on the streams,
                    # reading its blocks; only closing the connection drops them (and ends
                    # the sends still in flight, the other preempted ones too, so none is
                    # waited for).
                    break
        if failed:
            self._let_go_of_blocks()

    def wait_for_save(self) -> None:
        if self._producer and self._peer is None:
            self._poll_connect()
        if self._async_save:
            self._send_deferred()
            self._fly()
            if self._producer and self._spec is not None:
                # a scheduled save that never began (its blocks could not be named) has ended
                for move in self._meta().saves:
                    send = self._sends.get(move.req_id)
                    if send is None:
                        self._set(move.req_id, _Send(move, {}, 0.0, _SendState.ENDED), _SendState.ENDED)
                    elif send.state not in (_SendState.IN_FLIGHT, _SendState.DEFERRED, _SendState.QUEUED):
                        self._set(move.req_id, send, _SendState.ENDED)
            self._reap()
            self._start_queued()  # in the room the sends that ended left (after the drafter's forward)
            return
        deadline = time.monotonic() + self._timeout  # one for the step's sends, not one each
        self._send_deferred(deadline)
        self._wait_sends(_SendState.SENDING, deadline, in_step=True)

    def _wait_sends(self, state: _SendState, deadline: float, each: float | None = None, *,
                    in_step: bool = False) -> None:
        """Wait for the sends begun (those in ``state``: with IN_FLIGHT, each begun goes in
        flight first), oldest first, each up to ``each`` seconds (None: what is left of
        ``deadline``), beginning the queued ones as their turn comes; a send refused for
        want of room goes back to the head of the queue, begun again once there may be room
        (by ``deadline``).  A send that did not end acknowledged lets go of every block
        (:meth:`_let_go_of_blocks`) once the loop is over.  ``in_step`` (wait_for_save's
        wait for its step's sends): one that failed on its own is no failure once the
        streams wrote what they held of it by ``deadline``; after a failure the loop goes on
        waiting for the sends begun, none more begun, unless the send did not end at all
        (the sends behind it cannot end before it).  Otherwise (shutdown) the loop stops at
        the first failure.  The sends refused in a pass over those begun go back to the
        head of the queue together once it is over, oldest first (one at a time, each
        would go ahead of those refused before it), none queued begun before them."""
        failed = False
        while not failed or in_step:
            if not failed and not self._sends_in(_SendState.REFUSED):
                self._start_queued()  # as the sends before them end
            if state is _SendState.IN_FLIGHT:
                self._fly()
            begun = self._sends_in(state)
            if not begun:
                self._flush_refused()  # (the pass is over)
                if not failed and self._sends_in(_SendState.QUEUED) and self._wait_for_room(deadline):
                    continue  # refused for want of room: begun again
                break
            req_id, send = next(iter(begun.items()))
            handle = send.handle
            assert handle is not None
            del self._sends[req_id]
            outcome = self._outcome(send, max(0.0, deadline - time.monotonic()) if each is None else each)
            if self._requeue(req_id, send, outcome):  # at the head of the queue again, once the pass is over
                continue
            if self._ended_well(req_id, send, outcome):
                continue
            if in_step and handle.done and self._drained(deadline):
                continue  # failed on its own; the streams hold nothing of it now
            failed = True
            if in_step and not handle.done:
                # Not ended in its time: the sends behind it on the connection cannot
                # end before it, and closing the connection ends them all (their turn
                # never comes); none is waited for.
                self._flush_refused()
                if waiting := [*self._sends_in(_SendState.SENDING), *self._sends_in(_SendState.QUEUED)]:
                    logger.error("kvwire: not sending KV of requests %s: the send before them did not end "
                                 "within %g s", ", ".join(waiting), self._timeout)
                break
        self._flush_refused()  # (none is left refused, out of the queue)
        if failed:
            self._let_go_of_blocks()

    def _fly(self) -> None:
        """Async save: the sends begun go in flight, from now."""
        now = time.monotonic()
        for req_id, send in self._sends_in(_SendState.SENDING).items():
            send.at = now
            self._set(req_id, send, _SendState.IN_FLIGHT)

    @staticmethod
    def _outcome(send: _Send, timeout: float | None) -> Any:
        """How ``send`` ended, waited for up to ``timeout``: its receipt, its error, or
        :class:`_NotDone` if it did not end in time (its sends have no timeout of their
        own: the connector's waits give them kvwire_load_timeout)."""
        handle = send.handle
        assert handle is not None
        try:
            return handle.wait(timeout)
        except KvwireError:
            if not handle.done:
                return _NotDone(handle.accepted, handle.waiting_for_credit, handle.layers_granted,
                                handle.num_layers)
        try:  # its own error, or it ended just past the wait: how it ended
            return handle.wait(0)
        except KvwireError as exc:
            return exc

    def _ended_well(self, req_id: str, send: _Send, outcome: Any) -> bool:
        """Log how a send ended (``outcome``, see :meth:`_outcome`); False unless the
        receiver acknowledged it.  One that did not end in its time says how long it has
        waited since it was first queued (or deferred), and whether the consumer's server
        ever accepted it."""
        if isinstance(outcome, _NotDone):
            waited = time.monotonic() - send.since
            if outcome.accepted and outcome.waiting_for_credit:
                logger.error(
                    "kvwire: sending KV of request %s failed: not acknowledged after %.3g s: the consumer's server at %s "
                    "has granted %d of its %d layers and holds the rest while its buffer budget has no room: the "
                    "consumer's application is not taking KV as fast as it comes; raise max_buffer_bytes on the "
                    "consumer's server, or kvwire_load_timeout (%g s) here",
                    req_id, waited, self._peer_addr, outcome.layers_granted, outcome.num_layers, self._timeout)
            elif outcome.accepted:
                logger.error("kvwire: sending KV of request %s failed: not acknowledged after %.3g s", req_id, waited)
            else:
                logger.error(
                    "kvwire: sending KV of request %s failed: not started after %.3g s: the consumer's server at %s "
                    "has not accepted it (a kvwire server holds its ACCEPT while its buffer budget has no room for "
                    "the transfer's first layer): the consumer's application is not taking KV as fast as it comes; "
                    "raise max_buffer_bytes on the consumer's server, or kvwire_load_timeout (%g s) here",
                    req_id, waited, self._peer_addr, self._timeout)
            return False
        if isinstance(outcome, KvwireError):
            logger.error("kvwire: sending KV of request %s failed: %s", req_id, outcome)
            return False
        assert send.handle is not None
        logger.info(
            "kvwire: sent KV of request %s as %r: %d bytes, %d on the wire, %.1f ms",
            req_id, send.handle.request_id, outcome.kv_bytes, outcome.wire_bytes, outcome.seconds * 1e3,
        )
        return True

    def _reap(self) -> None:
        """Async save: the sends that ended leave the flight, and the oldest too once it is
        past its time.  One that failed on its own, the connection still up, ends once the
        streams wrote what they held of it; any other that did not end acknowledged (or a
        drain past its time) lets go of every block.  It begins none of the sends waiting
        their turn: wait_for_save does (:meth:`_start_queued`), get_finished not, as vLLM
        may run it before a speculative drafter's forward, whose layer of a send queued
        in this step is not computed yet (each is begun whole from the caches)."""
        now = time.monotonic()
        failed = False
        for req_id, send in self._sends_in(_SendState.UNCLOSED).items():
            if send.closed is not None and send.closed.is_set():
                self._set(req_id, send, _SendState.ENDED)
        for req_id, send in self._sends_in(_SendState.IN_FLIGHT).items():
            if send.handle is not None and send.handle.done:
                outcome = self._outcome(send, 0)
                if self._requeue(req_id, send, outcome):
                    continue
                self._last_end = now
                if self._ended_well(req_id, send, outcome):
                    self._room_at = 0.0  # (room for a send refused for want of it, perhaps)
                    self._set(req_id, send, _SendState.ENDED)
                elif (marks := self._write_marks()) is not None:
                    send.marks, send.at = marks, now
                    self._set(req_id, send, _SendState.DRAINING)
                else:
                    failed = True
                    self._set(req_id, send, _SendState.ENDED)
        for req_id, send in self._sends_in(_SendState.DRAINING).items():
            if self._written_past(send.marks):
                self._set(req_id, send, _SendState.ENDED)
            elif now >= send.at + self._timeout:
                logger.error("kvwire: the failed send of request %s still holds its blocks after %.0f s",
                             req_id, self._timeout)
                failed = True
        flying = self._sends_in(_SendState.IN_FLIGHT)
        if flying and not failed:
            req_id, send = next(iter(flying.items()))
            if now >= max(send.at, self._last_end) + self._timeout:
                failed = not self._ended_well(req_id, send, self._outcome(send, 0))  # a timeout, unless it just ended
                self._set(req_id, send, _SendState.ENDED)
        self._flush_refused()
        if failed and self._peer is not None and self._peer.broken is not None:
            # The session ended (the consumer restarted, say): the sends waiting their turn
            # wait for the new connection with the async save (DEFERRED) and end unsent with
            # the sync save, as :meth:`_start_queued` would have them.
            self._renew_ended_session()
        elif failed:
            self._let_go_of_blocks(wait=False)  # (the sends waiting their turn end unsent)

    def _drained(self, deadline: float) -> bool:
        """After a send that failed on its own: whether the connection is healthy and its
        streams wrote (or dropped) what they held, by ``deadline``; then its blocks are
        read no more and the connection, which other sends share, need not be closed."""
        # Each look asks kvwire's loop, within what is left of the deadline (a held-up
        # loop keeps the step no longer than that, give or take _LOOP_CALL_FLOOR).
        marks = self._write_marks(self._left(deadline))
        if marks is None:
            return False
        while not self._written_past(marks, self._left(deadline)):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    #: seconds a call on kvwire's loop is given at least, however little of its deadline is left
    _LOOP_CALL_FLOOR = 0.05

    def _left(self, deadline: float) -> float:
        return max(self._LOOP_CALL_FLOOR, deadline - time.monotonic())

    def _write_marks(self, timeout: float = 5.0) -> Any:
        """The streams' write marks, or None when there is no healthy connection to wait
        on (then only closing it frees the blocks) or the loop did not answer within
        ``timeout``."""
        peer = self._peer
        if peer is None or peer.broken is not None:
            return None
        try:
            return peer.write_marks(timeout)
        except KvwireError:
            return None

    def _written_past(self, marks: Any, timeout: float = 5.0) -> bool:
        """Whether the streams wrote (or dropped) what they held at ``marks``; False when
        there is no connection or kvwire's loop did not answer within ``timeout``."""
        if self._peer is None:
            return False
        try:
            return self._peer.written_past(marks, timeout)
        except KvwireError:  # the loop did not answer: not known to be past them yet
            return False

    def _let_go_of_blocks(self, wait: bool = True) -> None:
        """After a send that did not end with the receiver's acknowledgement: close the
        connection, which ends every send on it and drops the bytes its streams still
        hold, so nothing reads the blocks once vLLM frees them (see :meth:`_close_peer`
        for a loop held up elsewhere; ``wait``: the hook may wait for it)."""
        for req_id, send in self._sends_in(_SendState.DRAINING).items():
            self._set(req_id, send, _SendState.ENDED)
        self._end_queued("the connection was closed before their turn")
        self._room_at = 0.0
        for req_id, send in self._sends_in(_SendState.SENDING, _SendState.IN_FLIGHT).items():
            handle = send.handle
            assert handle is not None
            if send.state is _SendState.SENDING:
                handle.abort()
            elif handle.done:
                self._ended_well(req_id, send, self._outcome(send, 0))
            else:
                handle.abort()
                logger.error("kvwire: sending KV of request %s failed: its connection was closed", req_id)
            self._set(req_id, send, _SendState.ENDED)
        self._close_peer(wait)
        self._connect()  # the next saves' connection, on the bridge's loop

    def _close_peer(self, wait: bool) -> None:
        """Close the connection, which runs on kvwire's loop: until that close ended its
        streams write what they hold (reading the blocks).  On a loop held up elsewhere
        (a callback blocking it; the bridge open, or closed by another thread whose close
        gave up on it) the close waited for (at most ``_ABORT_WAIT``) may not have run
        yet; it is left to the loop, which still runs it.  A close not ended by then is
        logged (with ``wait`` the hook waits up to ``_ABORT_WAIT`` for it; without, its
        own call on the loop waited as long), and with the async save the sends that
        ended are reported only once it has, or the loop ended (their blocks kept)."""
        peer, self._peer = self._peer, None
        if peer is None:
            return
        bridge = peer.bridge
        closed = threading.Event()
        bridge.when_ended(closed)  # nothing runs on the loop any more: the close is over too

        def ended(close: concurrent.futures.Future[None]) -> None:
            if not close.cancelled():  # (cancelled: by the bridge's close, the peer's close left to the loop's end)
                closed.set()

        # Queued before the peer's own close, on the same close task: it ends (on the loop
        # thread) before that one's waiter is told, so a close that ended in time is seen.
        with contextlib.suppress(KvwireError):  # a closed bridge: its loop ends once the close under way ended
            bridge.submit(bridge.close_owned(peer.peer)).add_done_callback(ended)
        deadline = time.monotonic() + self._ABORT_WAIT
        peer.close(self._ABORT_WAIT)  # (fails its sends' waiters at once, a loop held up too)
        if closed.is_set() or (wait and closed.wait(max(0.0, deadline - time.monotonic()))):
            return
        if not self._async_save:
            logger.error("kvwire: the connection to %s was not closed in time (kvwire's loop is held up): "
                         "its sends may still read their blocks", self._peer_addr)
            return
        unclosed = self._sends_in(_SendState.ENDED)
        logger.error("kvwire: the connection to %s is not closed yet (kvwire's loop is held up): requests %s "
                     "keep their blocks until it is", self._peer_addr, ", ".join(sorted(unclosed)) or "-")
        for req_id, send in unclosed.items():
            send.closed = closed
            self._set(req_id, send, _SendState.UNCLOSED)

    def _reap_drops(self) -> None:
        """The drops that ended (the transfer taken and dropped, or failed) are let go of."""
        for req_id, drop in list(self._dropping.items()):
            handle = drop.handle
            if drop.swept and (handle.done or handle.error is not None):
                logger.debug("kvwire: dropped the transfer %s, named without a kvwire_id (%s)",
                             handle.request_id, "whole" if handle.done else handle.error)
            elif handle.done:
                logger.info("kvwire: dropped the KV of request %s (computed here)", req_id)
            elif handle.error is not None:
                logger.warning("kvwire: dropping the KV of request %s failed: %s", req_id, handle.error)
            else:
                continue
            del self._dropping[req_id]

    def _sweep_unnamed(self) -> None:
        """Consumer without kvwire_load_all, once per step: drop (see :meth:`_drop`) each
        arrived transfer named without a ``kvwire_id`` that no drop takes yet.  A producer
        sends every request's KV, and only kvwire_load_all loads those: unclaimed, each
        would hold memory and a slot of its producer's session until the claim timeout.
        The hook waits for no round trip to kvwire's loop: it posts the server's list to
        be read there and takes what the last step's read (a loop held up, or a closed
        server, leaves them to a later step).  The drops that waited for a transfer of a
        name when the list was asked for each take one of the arrivals listed of it (one
        handed its transfer before the list was read leaves an arrival to a later step:
        none is dropped twice)."""
        if self._server is None or self._spec is None or self._load_all:
            return
        asked, self._sweep_ask = self._sweep_ask, None
        if asked is not None and not asked[0].done():
            self._sweep_ask = asked  # (the loop has not read it yet)
            return
        if asked is not None:
            try:
                self._drop_unnamed(asked[0].result(), dict(asked[1]))
            except Exception as exc:  # (a closed server, a cancelled read)
                logger.debug("kvwire: no look for transfers no request loads in this step: %s", exc)
        # drops begun whose transfer was not handed to them yet: each takes one of those listed
        waiting: dict[str, int] = {}
        for drop in self._dropping.values():
            handle = drop.handle
            if drop.swept and handle.transfer is None and handle.error is None:
                waiting[handle.request_id] = waiting.get(handle.request_id, 0) + 1
        server = self._server.server

        async def arrived() -> list[str]:
            return list(server.unclaimed_request_ids())

        try:
            self._sweep_ask = (self._server.bridge.submit(arrived()), waiting)
        except KvwireError as exc:  # the server's bridge is closed
            logger.debug("kvwire: no look for transfers no request loads: %s", exc)

    def _drop_unnamed(self, arrived: list[str], waiting: dict[str, int]) -> None:
        """Begin a drop for each of the arrivals ``arrived`` named without a ``kvwire_id``
        beyond the drops ``waiting`` for one of its name."""
        for name in arrived:
            if not _UNNAMED.fullmatch(name):
                continue
            if waiting.get(name, 0) > 0:
                waiting[name] -= 1
                continue
            self._swept += 1
            self._drop(f"{name}/{self._swept}", name, None)

    def _verified(self, load: _Load, now: float) -> tuple[bool, str | None]:
        """Async load: whether the registry check of ``load``'s transfer, arrived whole,
        ended (it runs on kvwire's loop; the hook does not wait for it), and the reason to
        refuse the cache (None: fresh, or no check).  A check not done within the
        registry's timeout refuses it, as a registry error does (fail closed)."""
        expected = load.expected
        if expected is None or self._registry is None:
            return True, None
        pending = load.verifying
        if pending is None:
            announced = getattr(load.handle.transfer, "blocks", None) or []
            try:
                future = self._registry.bridge.submit(verify_blocks(self._registry.registry, expected, announced))
            except KvwireError as exc:
                load.expected = None
                return True, f"registry check failed: {exc}"
            pending = load.verifying = (future, now + self._registry.timeout)
        future, deadline = pending
        if future.done():
            try:
                reason = future.result()
            except Exception as exc:  # (a cancelled check too)
                reason = f"registry check failed: {str(exc) or type(exc).__name__}"
        elif now >= deadline:
            future.cancel()
            reason = f"registry check failed: not done in {self._registry.timeout:g} s"
        else:
            return False, None
        load.verifying = load.expected = None
        return True, reason

    def _ended_loads(self, now: float) -> dict[str, set[int]]:
        """Async load: the loads that ended, each with the blocks to report as load errors
        (none when its KV is in): arrived whole (and, with a registry, checked fresh),
        failed, refused, or not in within kvwire_load_timeout of its start.  One that did
        not arrive whole is aborted (a transfer that comes later is dropped)."""
        ended: dict[str, set[int]] = {}
        for req_id, load in list(self._loading.items()):
            if load.restarting is not None:  # (its lost transfer's receive stopping)
                failed: KvwireError | None = self._late(load, now)
                if failed is None and (not load.restarting.is_set()
                                       or (failed := self._resume_restarted(load)) is None):
                    continue
                _log_failed(req_id, failed)
                self._give_up_load(req_id, str(failed))
                ended[req_id] = set(load.blocks)
                continue
            handle, blocks = load.handle, load.blocks
            if handle.done:
                checked, reason = self._verified(load, now)
                if not checked:
                    continue
                del self._loading[req_id]
                if reason is None:
                    _log_received(req_id, blocks, handle)
                    ended[req_id] = set()
                else:  # every layer is in, nothing writes into its blocks any more
                    _log_refused(req_id, reason)
                    ended[req_id] = set(blocks)
                continue
            error: KvwireError | None = handle.error
            if error is not None and self._late(load, now) is None and (
                    self._reload(req_id, handle) or self._restart_load(req_id, load, error)):
                continue
            if error is None:
                error = self._late(load, now)
            if error is None:
                continue
            _log_failed(req_id, error)
            self._give_up_load(req_id, str(error))
            ended[req_id] = set(blocks)
        return ended

    def _finished_loads(self, gone: set[str]) -> set[str] | None:
        """Async load: the requests to report in finished_recving now, their failed blocks
        added to the load errors: the loads that ended (or could not start), and those of
        requests that finished (``gone``, aborted: no blocks to report).  A load whose
        receive this hook aborted is reported once kvwire's loop ran a mark queued after
        the abort (the hook does not wait for it: a later one reports it), so nothing
        writes into its blocks once vLLM may reuse them."""
        now = time.monotonic()
        ended: dict[str, set[int]] = {req_id: set() for req_id in gone}
        ended.update(self._unstarted)
        self._unstarted.clear()
        ended.update(self._ended_loads(now))
        aborted, self._aborting = set(self._aborting), []
        mark = self._loop_mark() if aborted else None
        finished: set[str] = set()
        for req_id, blocks in ended.items():
            if mark is not None and req_id in aborted:
                self._unstopped[req_id] = (mark, blocks, now)
            else:
                finished.add(req_id)
                self._load_errors.update(blocks)
        for req_id, (stopped, blocks, since) in list(self._unstopped.items()):
            if stopped.is_set():
                del self._unstopped[req_id]
                finished.add(req_id)
                self._load_errors.update(blocks)
            elif now >= since + self._ABORT_WAIT:
                logger.error("kvwire: the receive of request %s is not stopped yet (kvwire's loop is held up): "
                             "its blocks are kept until it is", req_id)
                self._unstopped[req_id] = (stopped, blocks, float("inf"))  # said once
        return finished or None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._reap_drops()
        self._sweep_unnamed()
        gone: set[str] = set()  # async load: finished requests whose load is aborted now
        for req_id in finished_req_ids:
            if req_id in self._loading:
                self._give_up_load(req_id, "request finished")
                if self._load_async:  # vLLM keeps its blocks until it is reported
                    gone.add(req_id)
            if req_id in self._unstarted:  # (no request to recompute now)
                self._unstarted[req_id] = set()
            if req_id in self._unstopped:  # failed before it finished: no request to recompute now
                stopped, _, since = self._unstopped[req_id]
                self._unstopped[req_id] = (stopped, set(), since)
            send = self._sends.get(req_id)
            if send is not None and send.state is _SendState.SENDING:
                logger.error("kvwire: request %s finished while its KV was being sent", req_id)
                self._let_go_of_blocks(wait=not self._async_save)
            if send is not None:  # (none is sending, or refused, now)
                send.finished = True
        recving: set[str] | None = None
        if self._load_async:
            recving = self._finished_loads(gone)
        else:
            self._settle_aborts()
        if not self._async_save:  # every send ended in wait_for_save
            for req_id in self._sends_in(_SendState.ENDED):
                del self._sends[req_id]
            for send in self._sends.values():
                send.finished = False
            return None, recving
        self._reap()
        sent = {req_id for req_id, send in self._sends_in(_SendState.ENDED).items() if send.finished}
        for req_id in sent:
            del self._sends[req_id]
        return sent or None, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._retry_at = float("inf")  # nothing connects again
        if self._sends_in(_SendState.DEFERRED):  # the connection they wait for, within kvwire_load_timeout
            self._send_deferred(time.monotonic() + self._timeout)
            self._fly()
        if self._connecting is not None:
            self._connecting.cancel(10)  # its sockets closed before the bridge goes
        self._connecting = None  # (a peer it opened is closed with the bridge)
        self._reap_drops()
        for req_id, drop in self._dropping.items():
            self._abort(req_id, drop.handle, "shutting down")
        self._dropping.clear()
        self._settle_aborts()
        # let them finish, oldest first, the queued ones too as their turn comes
        self._wait_sends(_SendState.IN_FLIGHT, float("inf"), self._timeout)
        if self._peer is not None:
            self._peer.close()
            self._peer = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._registry is not None:
            self._registry.close()
            self._registry = None
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None


__all__ = ["KvwireConnector", "KvwireConnectorMetadata"]
