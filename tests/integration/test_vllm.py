"""End to end on a real vLLM (CPU build): a prefill process sends KV over kvwire, a decode
process receives it into its paged cache and continues from it.

Run by ``bash .ci/vllm`` (its own virtual environment with the ``[vllm]`` extra).  Per
model dtype: a plain run (no connector), then a consumer process (kvwire server in its
worker) and a producer process over loopback.  The consumer's greedy tokens must equal the
plain run's with the raw codec; fp8's agreement is reported.  A negative control must
change the output, which proves the received cache is what the consumer attends to: a
second producer, on a model of other weights, sends prompt a's KV under the name the
consumer asks for (a transfer is named by its id and its prompt's tokens, so only KV of
the same prompt is ever loaded), and every run of the pair sets the same ``kvwire_model``
so that KV is accepted.  A request whose cache never comes is recomputed after the load
timeout (``kv_load_failure_policy="recompute"``).  With a registry (a private
redis-server) and a producer of other weights (the same ``kvwire_model`` on both sides, so
its KV passes BEGIN), a cache whose prefix block was invalidated after the send is refused
by the consumer and recomputed.  Engines with small caches preempt requests on either
side; with vLLM's prefix cache on, a producer sends cached blocks and a consumer loads
only the blocks it lacks.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.integrations.prefix import prefix_block_ids
from kvwire.sync import Bridge
from kvwire.testing import FaultPlan, FaultProxy, Faults
from tests.consistency.conftest import find_redis_server, start_redis

pytestmark = pytest.mark.timeout(1200)

RUN = Path(__file__).with_name("vllm_run.py")
PROMPT_TOKENS = 300  # two full 128-token blocks are sent; the last 44 tokens computed locally
MAX_TOKENS = 8
# kvwire_model on both sides where their weights lie in different directories: the KV spec
# names the model by its path otherwise, and transfers between them are refused at BEGIN.
MODEL_NAME = "kvwire-test-llama"


def _run(args: list[str], log: Path, timeout: float) -> None:
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, str(RUN), *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{args[0]} failed:\n{log.read_text()[-4000:]}"


def _job(path: Path, requests: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(requests))
    return path


def _prompts() -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(7)
    a, b, other = ([rng.randrange(512) for _ in range(PROMPT_TOKENS)] for _ in range(3))
    return a, b, other


def run_pair(tmp: Path, dtype: str, load: str) -> dict[str, Any]:
    """The plain run, then a consumer (loading as ``load`` says: ``async`` or
    ``layer-wise``), a producer of the model and one of other weights (``--seed 1``) that
    sends prompt a's KV of those weights under "a-wrong-kv": all three with the same
    ``--kvwire-model``, so that KV is accepted and loaded as a's."""
    model, other_model = tmp / "model", tmp / "other-model"
    _run(["model", "--dir", str(model), "--dtype", dtype], tmp / "model.log", 300)
    _run(["model", "--dir", str(other_model), "--dtype", dtype, "--seed", "1"], tmp / "other-model.log", 300)
    a, b, _ = _prompts()
    plain_job = _job(tmp / "plain_job.json", [{"prompt": p, "max_tokens": MAX_TOKENS} for p in (a, b)])
    sent = [{"prompt": a, "kvwire_id": "a-raw"}, {"prompt": b, "kvwire_id": "b-raw"},
            {"prompt": a, "kvwire_id": "a-fp8", "codec": "fp8"}]
    producer_job = _job(tmp / "producer_job.json", [{**r, "max_tokens": 1} for r in sent])
    wrong_job = _job(tmp / "wrong_job.json", [{"prompt": a, "kvwire_id": "a-wrong-kv", "max_tokens": 1}])
    consumer_job = _job(tmp / "consumer_job.json", [
        {"prompt": p, "kvwire_id": i, "max_tokens": MAX_TOKENS}
        for p, i in ((a, "a-raw"), (b, "b-raw"), (a, "a-fp8"), (a, "a-wrong-kv"), (a, "never-sent"))
    ])

    def producers(args: list[str]) -> None:
        _run(args, tmp / "producer.log", 600)
        # the same prompt under the name the consumer asks for, its KV from other weights
        wrong = ["--job", str(wrong_job), "--out", str(tmp / "wrong-producer.json"), "--dir", str(other_model)]
        _run([*args, *wrong], tmp / "wrong-producer.log", 600)  # the later --job, --out, --dir count

    _consume_after_produce(tmp, model, dtype, plain_job, producer_job, consumer_job,
                           extra=["--kvwire-model", MODEL_NAME, "--load", load], producer_run=producers)
    plain = [r["tokens"] for r in json.loads((tmp / "plain.json").read_text())]
    got = [r["tokens"] for r in json.loads((tmp / "consumer.json").read_text())]
    return {
        "plain": plain, "raw": got[:2], "fp8": got[2], "wrong_kv": got[3], "never_sent": got[4],
        "consumer_log": (tmp / "consumer.log").read_text(), "producer_log": (tmp / "producer.log").read_text(),
        "wrong_producer_log": (tmp / "wrong-producer.log").read_text(),
    }


def _consume_after_produce(
    tmp: Path, model: Path, dtype: str, plain_job: Path, producer_job: Path, consumer_job: Path,
    extra: list[str] | None = None, after_producer: Callable[[], None] | None = None,
    producer_model: Path | None = None, producer_port: Callable[[str], str] | None = None,
    producer_run: Callable[[list[str]], None] | None = None,
) -> None:
    """A consumer starts (its kvwire server up), the plain run and then the producer run
    (on ``producer_model`` if given; sent to the port ``producer_port`` gives for the
    consumer's, and run by ``producer_run`` if given), ``after_producer`` runs, and the
    consumer generates."""
    out = tmp / "consumer.json"
    common = ["--dir", str(model), "--dtype", dtype, *(extra or [])]
    consumer_log = tmp / "consumer.log"
    with consumer_log.open("w") as f:
        # Port 0: the consumer's server binds a free port and names it in its ready file.  A
        # port probed here could be taken by then (both vLLMs open ephemeral ports meanwhile).
        consumer = subprocess.Popen(
            [sys.executable, str(RUN), "consumer", "--job", str(consumer_job), "--out", str(out), "--port", "0", *common],
            stdout=f, stderr=subprocess.STDOUT,
        )
    try:
        _run(["plain", "--job", str(plain_job), "--out", str(tmp / "plain.json"), "--dir", str(model), "--dtype", dtype],
             tmp / "plain.log", 600)
        deadline = time.monotonic() + 600
        while not Path(f"{out}.ready").exists():
            assert consumer.poll() is None, consumer_log.read_text()[-4000:]
            assert time.monotonic() < deadline, "consumer did not start"
            time.sleep(0.5)
        port = Path(f"{out}.ready").read_text()
        if producer_port is not None:
            port = producer_port(port)
        producer = [*common, "--port", port] if producer_model is None else [*common, "--port", port, "--dir", str(producer_model)]
        args = ["producer", "--job", str(producer_job), "--out", str(tmp / "producer.json"), *producer]
        if producer_run is not None:
            producer_run(args)
        else:
            _run(args, tmp / "producer.log", 600)
        if after_producer is not None:
            after_producer()
        Path(f"{out}.go").write_text("go")
        assert consumer.wait(600) == 0, consumer_log.read_text()[-4000:]
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait(30)


@pytest.mark.parametrize(("dtype", "load"), [("float32", "layer-wise"), ("bfloat16", "async")])
def test_consumer_continues_from_kv_received_over_kvwire(dtype: str, load: str, tmp_path: Path) -> None:
    """Both loads: layer-wise (each step waits for its loads) in float32, asynchronous (the
    connector's default: a request waits for its KV, parked) in bfloat16."""
    r = run_pair(tmp_path, dtype, load)
    plain_a, plain_b = r["plain"]
    assert len(plain_a) == MAX_TOKENS
    # raw: bit-exact KV, so the decode instance generates exactly what a plain run does
    assert r["raw"] == [plain_a, plain_b]
    # fp8: quantized KV; report how many greedy tokens agree with the plain run
    agree = sum(x == y for x, y in zip(r["fp8"], plain_a, strict=True))
    print(f"\n{dtype}: fp8-over-the-wire greedy token agreement {agree}/{MAX_TOKENS}")
    report = Path(os.environ.get("KVWIRE_VLLM_REPORT", tmp_path / "report.json"))
    old = json.loads(report.read_text()) if report.exists() else {}
    old[dtype] = {"fp8_agreement": agree, "tokens": MAX_TOKENS}
    report.write_text(json.dumps(old))
    # negative control: prompt a's KV of other weights, received as a's, changes the output
    assert r["wrong_kv"] != plain_a
    # a cache that never comes: the load times out, its blocks are reported, vLLM recomputes
    assert r["never_sent"] == plain_a
    # the producers' sends first: a send missing there is the cause of a load missing below
    assert r["producer_log"].count("kvwire: sent KV of request") == 3, kvwire_lines(r["producer_log"])
    assert r["wrong_producer_log"].count("kvwire: sent KV of request") == 1, kvwire_lines(r["wrong_producer_log"])
    log = r["consumer_log"]
    assert log.count("kvwire: external KV hit") == 5, kvwire_lines(log)
    assert log.count("kvwire: received KV of request") == 4, kvwire_lines(log)  # a-wrong-kv's among them
    assert log.count("kvwire: receiving KV of request") == 1, kvwire_lines(log)
    assert re.search(r"'never-sent#prompt:[0-9a-f]{32}' not ready after", log)  # its transfer's name


def test_consumer_loading_asynchronously_continues_from_kv_and_recomputes_what_never_came(tmp_path: Path) -> None:
    """A consumer loading asynchronously takes three requests at once: two whose
    KV was sent and one whose KV never comes.  Each waits for its KV (vLLM parks it), its
    steps do not: the two loads are taken (logged received) while the third still waits,
    not after its timeout as when a step waits for every load, and their tokens equal the
    plain run's with the raw codec; the third's load fails after kvwire_load_timeout, its
    blocks are recomputed and its tokens equal the plain run's too."""
    model = tmp_path / "model"
    _run(["model", "--dir", str(model), "--dtype", "float32"], tmp_path / "model.log", 300)
    a, b, _ = _prompts()
    plain_job = _job(tmp_path / "plain_job.json", [{"prompt": p, "max_tokens": MAX_TOKENS} for p in (a, b)])
    sent = [{"prompt": a, "kvwire_id": "a-async"}, {"prompt": b, "kvwire_id": "b-async"}]
    producer_job = _job(tmp_path / "producer_job.json", [{**r, "max_tokens": 1} for r in sent])
    consumer_job = _job(tmp_path / "consumer_job.json", [
        {**r, "max_tokens": MAX_TOKENS} for r in [*sent, {"prompt": a, "kvwire_id": "never-sent"}]
    ])
    # (the producer ignores --load, a consumer's setting)
    _consume_after_produce(tmp_path, model, "float32", plain_job, producer_job, consumer_job,
                           extra=["--load", "async", "--batch"])
    plain_a, plain_b = [r["tokens"] for r in json.loads((tmp_path / "plain.json").read_text())]
    got = [r["tokens"] for r in json.loads((tmp_path / "consumer.json").read_text())]
    assert got == [plain_a, plain_b, plain_a]
    assert (tmp_path / "producer.log").read_text().count("kvwire: sent KV of request") == 2
    log = (tmp_path / "consumer.log").read_text()
    assert log.count("kvwire: external KV hit") == 3, kvwire_lines(log)
    received = [m.start() for m in re.finditer("kvwire: received KV of request", log)]
    failed = [m.start() for m in re.finditer("kvwire: receiving KV of request", log)]
    assert len(received) == 2 and len(failed) == 1, kvwire_lines(log)
    assert re.search(r"'never-sent#prompt:[0-9a-f]{32}' not ready after", log)
    assert max(received) < failed[0], kvwire_lines(log)  # taken while the third still waited


def kvwire_lines(log: str) -> str:
    """The connector's lines of a log (and vLLM's about KV loads), for a failed assertion."""
    return "\n".join(line for line in log.splitlines() if "kvwire" in line or "KV load" in line)[-6000:]


def _tight_pair(tmp: Path, prompts: list[list[int]], max_tokens: int, *, side: str,
                producer_args: list[str] | None = None, extra: list[str] | None = None) -> dict[str, Any]:
    """Each prompt produced (one token) and consumed (``max_tokens``) under its own id,
    with ``producer_args`` for the producer and ``extra`` for both (one of them with
    ``--kv-blocks``): vLLM's counters on ``side`` (``producer`` or ``consumer``: its
    preemptions and prefix-cache hits), the plain and the consumer's tokens, and the two
    logs."""
    model = tmp / "model"
    _run(["model", "--dir", str(model), "--dtype", "float32"], tmp / "model.log", 300)
    plain_job = _job(tmp / "plain_job.json", [{"prompt": p, "max_tokens": max_tokens} for p in prompts])
    sent = [{"prompt": p, "kvwire_id": f"tight-{i}"} for i, p in enumerate(prompts)]
    producer_job = _job(tmp / "producer_job.json", [{**r, "max_tokens": 1} for r in sent])
    consumer_job = _job(tmp / "consumer_job.json", [{**r, "max_tokens": max_tokens} for r in sent])

    def producer(args: list[str]) -> None:
        _run([*args, *(producer_args or [])], tmp / "producer.log", 600)

    _consume_after_produce(tmp, model, "float32", plain_job, producer_job, consumer_job, extra=extra,
                           producer_run=producer)
    return {
        **json.loads(Path(f"{tmp / side}.json.metrics.json").read_text()),
        "plain": [r["tokens"] for r in json.loads((tmp / "plain.json").read_text())],
        "got": [r["tokens"] for r in json.loads((tmp / "consumer.json").read_text())],
        "consumer_log": (tmp / "consumer.log").read_text(), "producer_log": (tmp / "producer.log").read_text(),
    }


def test_kv_of_requests_the_producer_preempts_mid_prefill(tmp_path: Path) -> None:
    """A producer with a cache of 16 blocks of 128 tokens prefills four prompts of 900
    tokens at once, 128 tokens a step each: vLLM preempts some of them (their blocks
    freed) and resumes them later on other blocks, some in their chunked prefill before
    their send, some with their send under way.  Every request's KV reaches the consumer
    as the prompt's own: its tokens equal the plain run's for each prompt."""
    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(900)] for _ in range(4)]
    r = _tight_pair(tmp_path, prompts, MAX_TOKENS, side="producer",
                    producer_args=["--kv-blocks", "16", "--prefill-chunk", "128", "--batch"])
    assert r["preemptions"] > 0, "the producer preempted nothing: the test did not test preemption"
    assert r["got"] == r["plain"]
    assert r["consumer_log"].count("kvwire: received KV of request") == 4
    assert r["producer_log"].count("kvwire: sent KV of request") == 4


@pytest.mark.parametrize("load", ["async", "layer-wise"])
def test_consumer_preempting_a_request_after_its_load_computes_it(load: str, tmp_path: Path) -> None:
    """A consumer with a cache of 16 blocks of 128 tokens decodes three requests at once,
    whose received prompts (630 tokens: 5 blocks each) fill it; their decodes need a
    sixth block, so vLLM preempts one after its load and resumes it later.  Its one
    transfer was taken: resumed, it is computed locally (one external hit per request),
    and every request's tokens equal the plain run's.  (Reported as a hit again, its
    prompt's new blocks were taken as loaded though no load came for a resumed request:
    they held whatever they held, and its tokens went wrong.)  Both loads (with the
    asynchronous one a request runs, and can be preempted, only once its KV is in)."""
    rng = random.Random(13)
    prompts = [[rng.randrange(512) for _ in range(630)] for _ in range(3)]
    r = _tight_pair(tmp_path, prompts, 16, side="consumer", extra=["--kv-blocks", "16", "--batch", "--load", load])
    assert r["preemptions"] > 0, "the consumer preempted nothing: the test did not test preemption"
    assert r["got"] == r["plain"]
    log = r["consumer_log"]
    assert log.count("kvwire: external KV hit") == 3
    assert log.count("kvwire: received KV of request") == 3
    assert "not ready" not in log


def _repeated_and_shared(seed: int) -> list[list[int]]:
    """A 900-token prompt, the same again, and one sharing its first 640 tokens (5 blocks)."""
    rng = random.Random(seed)
    a = [rng.randrange(512) for _ in range(900)]
    return [a, a, a[:640] + [rng.randrange(512) for _ in range(260)]]


def test_producer_with_its_prefix_cache_sends_cached_blocks(tmp_path: Path) -> None:
    """A producer with vLLM's prefix cache on (its default) prefills a prompt, the same
    prompt again (its blocks found in the cache, not computed) and a prompt sharing its
    first 640 tokens, one after the other: each send names the request's blocks, cached
    ones included, and the consumer's tokens equal the plain run's for all three."""
    r = _tight_pair(tmp_path, _repeated_and_shared(17), MAX_TOKENS, side="producer",
                    producer_args=["--kv-blocks", "64", "--prefix-caching"])
    assert r["got"] == r["plain"]
    assert r["consumer_log"].count("kvwire: received KV of request") == 3
    assert r["producer_log"].count("kvwire: sent KV of request") == 3
    assert r["prefix_cache_hit_tokens"] >= 640 + 896, "the producer's prefix cache was not hit"


def test_consumer_with_its_prefix_cache_loads_only_the_blocks_it_lacks(tmp_path: Path) -> None:
    """A consumer with vLLM's prefix cache on decodes a prompt (loaded whole), the same
    prompt again (its full blocks all cached here: computed here, its transfer received and
    dropped) and a prompt sharing the first 640 tokens (5 blocks cached here: their part of
    the transfer dropped, the other 2 loaded).  The tokens equal the plain run's for all
    three, and no transfer is left waiting on the consumer's server.  (Before, a request
    with any block cached here loaded nothing, and its transfer waited on the server until
    the claim timeout, ten minutes.)"""
    r = _tight_pair(tmp_path, _repeated_and_shared(19), MAX_TOKENS, side="consumer",
                    extra=["--kv-blocks", "64", "--prefix-caching"])
    assert r["got"] == r["plain"]
    assert r["prefix_cache_hit_tokens"] >= 896 + 640, "the consumer's prefix cache was not hit"
    assert r["pending_arrivals"] == 0
    log = r["consumer_log"]
    assert log.count("kvwire: external KV hit") == 2 and "256 tokens to receive (5 blocks cached here)" in log
    assert log.count("kvwire: received KV of request") == 2
    assert log.count("is computed here (7 of its 7 full blocks cached)") == 1
    assert log.count("kvwire: dropped the KV of request") == 1
    assert r["producer_log"].count("kvwire: sent KV of request") == 3


def test_consumer_refuses_kv_whose_prefix_blocks_went_stale(tmp_path: Path) -> None:
    """With a registry.  The producer runs an older model (other weights: its KV is stale
    for the consumer's model) and names the prompts' blocks with their versions; then the
    new weights invalidate prompt a's blocks (what a deployment does on a weight update),
    not b's.  The consumer refuses a's cache and recomputes it (the plain run's tokens);
    b's cache, still named fresh, is received and used, and the old weights' KV changes
    its output: the check is what kept a's output right.  Both sides set the same
    ``kvwire_model`` (the weights lie in different directories, which the KV spec would
    name otherwise), so the old weights' KV passes BEGIN and the registry is what refuses
    a's.  The producer waits for each send in ``wait_for_save`` here
    (``kvwire_async_save: false``)."""
    binary = find_redis_server()
    assert binary is not None, "redis-server not found (PATH or KVWIRE_REDIS_SERVER)"
    redis = start_redis(binary, tmp_path / "redis")
    try:
        model, old_model = tmp_path / "model", tmp_path / "old-model"
        _run(["model", "--dir", str(model), "--dtype", "float32"], tmp_path / "model.log", 300)
        _run(["model", "--dir", str(old_model), "--dtype", "float32", "--seed", "1"], tmp_path / "old-model.log", 300)
        a, b, _ = _prompts()
        plain_job = _job(tmp_path / "plain_job.json", [{"prompt": p, "max_tokens": MAX_TOKENS} for p in (a, b)])
        sent = [{"prompt": a, "kvwire_id": "a-versioned"}, {"prompt": b, "kvwire_id": "b-versioned"}]
        producer_job = _job(tmp_path / "producer_job.json", [{**r, "max_tokens": 1} for r in sent])
        consumer_job = _job(tmp_path / "consumer_job.json", [{**r, "max_tokens": MAX_TOKENS} for r in sent])
        # kvwire_model seeds the block ids
        a_blocks = prefix_block_ids(a, 128, (PROMPT_TOKENS - 1) // 128, salt=MODEL_NAME.encode())

        async def new_weights_for_a() -> None:
            async with await RedisRegistry.connect(redis.url) as reg:
                named = await reg.lookup(a_blocks)
                assert [blk for blk, _ in named] == a_blocks  # named by the producer, complete
                await reg.invalidate_many(a_blocks)

        _consume_after_produce(
            tmp_path, model, "float32", plain_job, producer_job, consumer_job,
            extra=["--registry", redis.url, "--sync-save", "--kvwire-model", MODEL_NAME], after_producer=lambda: asyncio.run(new_weights_for_a()),
            producer_model=old_model,
        )
    finally:
        redis.stop()
    plain_a, plain_b = [r["tokens"] for r in json.loads((tmp_path / "plain.json").read_text())]
    got_a, got_b = [r["tokens"] for r in json.loads((tmp_path / "consumer.json").read_text())]
    assert got_a == plain_a  # stale cache refused, prompt recomputed
    assert got_b != plain_b  # the old weights' cache, not invalidated, was used
    log = (tmp_path / "consumer.log").read_text()
    assert log.count("kvwire: external KV hit") == 2
    assert log.count("kvwire: refused KV of request") == 1 and "2 of its 2 prefix blocks are stale" in log
    assert log.count("kvwire: received KV of request") == 1
    assert (tmp_path / "producer.log").read_text().count("kvwire: sent KV of request") == 2


def test_producer_goes_on_while_its_kv_is_on_the_wire(tmp_path: Path) -> None:
    """The producer's engine does not wait for the wire (``kvwire_async_save``, the
    default).  Between producer and consumer a proxy stalls the KV mid-transfer until the
    test resumes it: the producer's ``generate()`` returns (its results are written) while
    the path is still stalled, its blocks kept for the send; once the path resumes, its
    shutdown lets the sends finish, and the consumer continues from that KV exactly as a
    plain run does.  (Were the engine waiting for the send, ``generate()`` could not
    return before the resume, and the send would time out.)"""
    model = tmp_path / "model"
    _run(["model", "--dir", str(model), "--dtype", "float32"], tmp_path / "model.log", 300)
    a, b, _ = _prompts()
    plain_job = _job(tmp_path / "plain_job.json", [{"prompt": p, "max_tokens": MAX_TOKENS} for p in (a, b)])
    sent = [{"prompt": a, "kvwire_id": "a-stalled"}, {"prompt": b, "kvwire_id": "b-stalled"}]
    producer_job = _job(tmp_path / "producer_job.json", [{**r, "max_tokens": 1} for r in sent])
    consumer_job = _job(tmp_path / "consumer_job.json", [{**r, "max_tokens": MAX_TOKENS} for r in sent])
    bridge = Bridge("stall-proxy")
    proxy: FaultProxy | None = None

    def between(port: str) -> str:
        nonlocal proxy
        stall = FaultPlan(forward=Faults(stall_at=200_000))  # until resume()
        proxy = FaultProxy("127.0.0.1", int(port), plan=lambda i: stall)
        bridge.run(proxy.start(), 10)
        return str(proxy.port)

    def produce(args: list[str]) -> None:
        log = tmp_path / "producer.log"
        out = tmp_path / "producer.json"
        with log.open("w") as f:
            producer = subprocess.Popen([sys.executable, str(RUN), *args], stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while not out.exists():
                assert producer.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, "the producer's generate() did not return"
                time.sleep(0.2)
            assert proxy is not None
            assert proxy.statistics().bytes_forward <= 200_000  # the KV is not through
            while not proxy.statistics().stalls:  # a resume before the stall began would not end it
                assert time.monotonic() < deadline, "the path never stalled"
                time.sleep(0.1)
            bridge.call_soon(proxy.resume)  # on the proxy's loop
            assert producer.wait(600) == 0, log.read_text()[-4000:]
        finally:
            if producer.poll() is None:
                producer.kill()
                producer.wait(30)

    try:
        _consume_after_produce(tmp_path, model, "float32", plain_job, producer_job, consumer_job,
                               producer_port=between, producer_run=produce)
    finally:
        if proxy is not None:
            bridge.run(proxy.close(), 10)
        bridge.close()
    plain = [r["tokens"] for r in json.loads((tmp_path / "plain.json").read_text())]
    got = [r["tokens"] for r in json.loads((tmp_path / "consumer.json").read_text())]
    assert got == plain  # raw KV, bit-exact, received after the stall
    assert (tmp_path / "producer.log").read_text().count("kvwire: sent KV of request") == 2
    assert (tmp_path / "consumer.log").read_text().count("kvwire: received KV of request") == 2
