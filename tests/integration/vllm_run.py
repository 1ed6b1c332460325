"""One vLLM process of the end-to-end check: ``model``, ``plain``, ``producer``, ``consumer``.

Run as a script (vLLM spawns workers, hence the ``__main__`` guard):

    python tests/integration/vllm_run.py model --dir D --dtype float32
    python tests/integration/vllm_run.py plain --dir D --job J.json --out O.json
    python tests/integration/vllm_run.py producer --dir D --job J.json --out O.json --port P
    python tests/integration/vllm_run.py consumer --dir D --job J.json --out O.json --port P
    (producer and consumer: ``--registry redis://...`` names prefix blocks with versions,
    ``--kvwire-model NAME`` names the model in the KV spec in place of the ``--dir`` path;
    consumer: ``--load async|layer-wise`` sets ``kvwire_load_async``; producer: ``--wait-go``
    waits as a consumer does; ``--steps``: requests stepped together and timed per token)

A job lists requests ``{"prompt": [token ids], "kvwire_id": str | null, "codec": str | null,
"max_tokens": int}``; the output holds each request's greedy tokens and its latency.
The consumer writes ``<out>.ready`` (its kvwire server's port: ``--port 0`` binds a free
one) once its engine and server are up, and waits for ``<out>.go`` before generating.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SECRET = "integration-test-secret"
CONNECTOR_MODULE = "kvwire.integrations.vllm"


def make_model(directory: Path, dtype: str, *, layers: int = 4, hidden: int = 256, seed: int = 0) -> None:
    """A tiny randomly initialised Llama (head_dim 64), written with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(directory)


def connector_config(role: str, port: int, extra: dict[str, Any] | None = None, peer_host: str = "127.0.0.1") -> Any:
    from vllm.config import KVTransferConfig

    # Each role's own address (the connector checks both it is given): the consumer listens
    # on PORT (0: a free one), the producer sends to PORT.
    address = {"kvwire_listen": f"127.0.0.1:{port}"} if role == "kv_consumer" else {"kvwire_peer": f"{peer_host}:{port}"}
    return KVTransferConfig(
        kv_connector="KvwireConnector",
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role=role,
        kv_load_failure_policy="recompute",  # a KV load that fails is recomputed, not fatal
        kv_connector_extra_config={
            **address,
            "kvwire_secret": SECRET,
            # The consumer generates only after the producer's sends were acknowledged, so
            # every cache is already there; a request whose KV never comes waits this long.
            "kvwire_load_timeout": 20,
            **(extra or {}),
        },
    )


def engine(model: Path, dtype: str, kv_transfer_config: Any = None, *, kv_blocks: int | None = None,
           prefill_chunk: int | None = None, prefix_caching: bool = False) -> Any:
    """The engine; with ``kv_blocks`` a cache of that many blocks (prompts of 1024 tokens
    at most) and its statistics kept, with ``prefill_chunk`` prompts prefilled that many
    tokens a step each, four of them at a time, with ``prefix_caching`` vLLM's prefix
    cache on."""
    from vllm import LLM

    tight: dict[str, Any] = {}
    if kv_blocks is not None:
        tight = {"num_gpu_blocks_override": kv_blocks, "disable_log_stats": False}
    if prefill_chunk is not None:
        tight |= {"enable_chunked_prefill": True, "long_prefill_token_threshold": prefill_chunk,
                  "max_num_batched_tokens": 4 * prefill_chunk}
    # One process (engine core and worker in-process): starts in a third of the time.
    return LLM(
        model=str(model), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
        gpu_memory_utilization=0.3, enable_prefix_caching=prefix_caching, max_model_len=1024 if kv_blocks else 4096,
        seed=0, distributed_executor_backend="uni", kv_transfer_config=kv_transfer_config, **tight,
    )


def _sampling(req: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    params: dict[str, Any] = {}
    if req.get("kvwire_id"):
        params["kvwire_id"] = req["kvwire_id"]
    if req.get("codec"):
        params["kvwire_codec"] = req["codec"]
    return SamplingParams(
        temperature=0.0, max_tokens=req.get("max_tokens", 8), ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params else None,
    )


def generate(llm: Any, job: list[dict[str, Any]], *, batch: bool = False) -> list[dict[str, Any]]:
    """Each request of ``job`` in a ``generate()`` of its own, or all in one (``batch``)."""
    if batch:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in job], [_sampling(r) for r in job],
                            use_tqdm=False)
        seconds = time.perf_counter() - t0
        return [{"tokens": list(o.outputs[0].token_ids), "seconds": seconds} for o in outs]
    results = []
    for req in job:
        sp = _sampling(req)
        started = time.time()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": req["prompt"]}], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        results.append({"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds, "started": started})
    return results


def generate_steps(llm: Any, job: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's requests stepped through the engine together, each token timed as it comes.

    A request with ``"after": N`` is added once the job's first request (which starts at
    once) has N tokens, or nothing else is left to run (others at the start); with ``"signal": PATH`` that file is written as it is added (a
    producer waiting with ``--wait-go`` then prefills it and sends its KV: a transfer that
    starts late).  Each result has ``added`` and ``times`` (one per token: the end of the
    step that made it) on ``time.perf_counter``'s clock."""
    from vllm.sampling_params import RequestOutputKind

    engine_ = llm.llm_engine
    results: list[dict[str, Any]] = [{"tokens": [], "times": [], "added": None} for _ in job]
    if job and job[0].get("after"):
        raise ValueError("the job's first request starts at once: it cannot wait for tokens of its own")

    def add(i: int) -> None:
        sp = _sampling(job[i])
        sp.output_kind = RequestOutputKind.DELTA
        engine_.add_request(str(i), {"prompt_token_ids": job[i]["prompt"]}, sp)
        results[i]["added"] = time.perf_counter()
        if job[i].get("signal"):
            Path(job[i]["signal"]).write_text("go")

    for i, req in enumerate(job):
        if not req.get("after"):
            add(i)
    while engine_.has_unfinished_requests() or any(r["added"] is None for r in results):
        outs = engine_.step()
        now = time.perf_counter()  # one stamp per step: its tokens came out together
        for out in outs:
            r = results[int(out.request_id)]
            new = list(out.outputs[0].token_ids)
            r["tokens"] += new
            r["times"] += [now] * len(new)
        for i, req in enumerate(job):
            if results[i]["added"] is None and (
                len(results[0]["tokens"]) >= req["after"] or not engine_.has_unfinished_requests()
            ):
                add(i)
    return results


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["model", "plain", "producer", "consumer"])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--job", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--connector", default="kvwire", choices=["kvwire", "example"])
    ap.add_argument("--seed", type=int, default=0, help="model: the random weights' seed")
    ap.add_argument("--registry", help="kvwire_registry: a Redis URL for prefix-block versions")
    ap.add_argument("--sync-save", action="store_true", help="kvwire_async_save: false (wait_for_save waits)")
    ap.add_argument("--load", choices=["async", "layer-wise"],
                    help="consumer: kvwire_load_async true (a request waits for its KV, no step does) or false "
                         "(each step waits for its loads, layer by layer); the connector's default if not given")
    ap.add_argument("--kvwire-model", help="kvwire_model: the model's name in the KV spec, in place of its path")
    ap.add_argument("--peer-host", default="127.0.0.1", help="producer: the consumer's kvwire server address")
    ap.add_argument("--kv-blocks", type=int,
                    help="a KV cache of this many blocks; preemptions and prefix-cache hits (a consumer: transfers "
                         "left pending on its server too) counted in OUT.metrics.json")
    ap.add_argument("--prefill-chunk", type=int, help="chunked prefill: tokens per request per step, four at a time")
    ap.add_argument("--batch", action="store_true", help="the job's requests in one generate()")
    ap.add_argument("--steps", action="store_true",
                    help="the job's requests stepped together, each token timed (generate_steps)")
    ap.add_argument("--wait-go", action="store_true",
                    help="producer: write OUT.ready once up and wait for OUT.go, as a consumer does")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix cache on")
    args = ap.parse_args(argv)
    if args.mode == "model":
        make_model(args.dir, args.dtype, layers=args.layers, hidden=args.hidden, seed=args.seed)
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    job = json.loads(args.job.read_text())
    if args.mode == "plain":
        llm = engine(args.dir, args.dtype)
    elif args.connector == "example":
        from vllm.config import KVTransferConfig

        cfg = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(args.out.parent / "shared_storage")},
        )
        llm = engine(args.dir, args.dtype, cfg)
    else:
        role = "kv_producer" if args.mode == "producer" else "kv_consumer"
        extra: dict[str, Any] = {"kvwire_registry": args.registry} if args.registry else {}
        if args.sync_save:
            extra["kvwire_async_save"] = False
        if args.load is not None:
            extra["kvwire_load_async"] = args.load == "async"
        if args.kvwire_model:
            extra["kvwire_model"] = args.kvwire_model
        llm = engine(args.dir, args.dtype, connector_config(role, args.port, extra, args.peer_host),
                     kv_blocks=args.kv_blocks, prefill_chunk=args.prefill_chunk, prefix_caching=args.prefix_caching)
    if args.mode == "consumer" or args.wait_go:
        # The server's port (bound as --port says, 0 for a free one), for the producer; the
        # example connector has none (its KV goes through files).
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        ready, partial = Path(f"{args.out}.ready"), Path(f"{args.out}.ready.tmp")
        partial.write_text(str(getattr(get_kv_transfer_group(), "listen_port", args.port)))
        partial.replace(ready)  # whole, never seen half-written
        go = Path(f"{args.out}.go")
        deadline = time.monotonic() + 600
        while not go.exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.2)
    results = generate_steps(llm, job) if args.steps else generate(llm, job, batch=args.batch)
    args.out.write_text(json.dumps(results))
    if args.kv_blocks is not None:
        counters = {"vllm:num_preemptions": "preemptions", "vllm:prefix_cache_hits": "prefix_cache_hit_tokens"}
        metrics = dict.fromkeys(counters.values(), 0)
        for m in llm.get_metrics():
            if m.name in counters:
                metrics[counters[m.name]] += m.value
        if args.mode == "consumer":  # transfers that arrived and that no request took
            stats = get_kv_transfer_group().server_statistics()
            metrics["pending_arrivals"] = stats["pending_arrivals"]
        Path(f"{args.out}.metrics.json").write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
