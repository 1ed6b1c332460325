"""Time to first token of a vLLM decode instance: KV received over kvwire vs recomputing the
prefill vs vLLM's own shared-storage example connector, on the same prompts.

Needs vLLM (``pip install 'kvwire[vllm]'``, or the environment ``.ci/vllm`` builds) and
runs every engine through ``tests/integration/vllm_run.py``:

    python benchmarks/vllm_ttft.py [--prompt-tokens 2048] [--prompts 5] [--layers 8]
                                   [--hidden 1024] [--dtype bfloat16] [--json out.json]

1. kvwire: a consumer process (kvwire server in its worker) and a producer process that
   prefills the prompts and sends their KV over loopback; then, in the consumer, per
   prompt: ``generate(max_tokens=1)`` with its KV received over kvwire, and the same for a
   second prompt of the same length without a ``kvwire_id`` (recomputed prefill).  Both
   measured in the same process, interleaved.  Run twice: with the layer-wise load
   (``kvwire_load_async: false``) and with the asynchronous load (the connector's
   default: the request waits for its KV, parked, and is scheduled once ``get_finished``
   reported it: here the KV is there already, so this shows what the extra step costs;
   ``benchmarks/vllm_late_kv.py`` measures a transfer that comes late).
2. shared storage: vLLM's ``ExampleConnector`` (``kv_both``): one process prefills and
   writes the KV to disk, a second one loads it; timed the same way.

TTFT here is the wall time of a one-token ``generate()`` call (prefill of the prompt's last
partial block, or of the whole prompt, plus one sampling step).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN = Path(__file__).resolve().parents[1] / "tests" / "integration" / "vllm_run.py"


def _run(args: list[str], log: Path) -> None:
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, str(RUN), *args], stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise SystemExit(f"{args[0]} failed, see {log}:\n{log.read_text()[-3000:]}")


def make_model(tmp: Path, dtype: str, layers: int, hidden: int) -> Path:
    """A tiny random Llama written to ``tmp/model`` (``vllm_run.py model``); its path."""
    model = tmp / "model"
    _run(["model", "--dir", str(model), "--dtype", dtype, "--layers", str(layers), "--hidden", str(hidden)],
         tmp / "model.log")
    return model


def _pair(tmp: Path, name: str, common: list[str], consumer_job: list[dict[str, Any]],
          producer_job: list[dict[str, Any]], extra: list[str]) -> list[dict[str, Any]]:
    (tmp / f"{name}_c.json").write_text(json.dumps(consumer_job))
    (tmp / f"{name}_p.json").write_text(json.dumps(producer_job))
    out = tmp / f"{name}_consumer.out"
    log = (tmp / f"{name}_consumer.log").open("w")
    consumer = subprocess.Popen(
        [sys.executable, str(RUN), "consumer", "--job", str(tmp / f"{name}_c.json"), "--out", str(out), *common, *extra],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        while not Path(f"{out}.ready").exists():
            if consumer.poll() is not None:
                raise SystemExit(f"{name} consumer failed, see {tmp}/{name}_consumer.log")
            time.sleep(0.5)
        _run(["producer", "--job", str(tmp / f"{name}_p.json"), "--out", str(tmp / f"{name}_producer.out"), *common, *extra],
             tmp / f"{name}_producer.log")
        Path(f"{out}.go").write_text("go")
        if consumer.wait(1200) != 0:
            raise SystemExit(f"{name} consumer failed, see {tmp}/{name}_consumer.log")
    finally:
        if consumer.poll() is None:
            consumer.kill()
        log.close()
    results: list[dict[str, Any]] = json.loads(out.read_text())
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvwire-ttft-") as d:
        tmp = Path(d)
        model = make_model(tmp, args.dtype, args.layers, args.hidden)
        rng = random.Random(3)

        def prompt() -> list[int]:
            return [rng.randrange(512) for _ in range(args.prompt_tokens)]

        warm = {"prompt": prompt(), "max_tokens": 1}
        sent = [prompt() for _ in range(args.prompts)]
        fresh = [prompt() for _ in range(args.prompts)]
        def free_port() -> str:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return str(s.getsockname()[1])

        common = ["--dir", str(model), "--dtype", args.dtype, "--port", free_port()]

        consumer_job = [warm]
        for i, (p, q) in enumerate(zip(sent, fresh, strict=True)):
            consumer_job += [{"prompt": p, "kvwire_id": f"p{i}", "max_tokens": 1}, {"prompt": q, "max_tokens": 1}]
        producer_job = [{"prompt": p, "kvwire_id": f"p{i}", "max_tokens": 1} for i, p in enumerate(sent)]
        kv = _pair(tmp, "kvwire", common, consumer_job, producer_job, ["--load", "layer-wise"])[1:]
        kvwire_s = [r["seconds"] for r in kv[0::2]]
        recompute_s = [r["seconds"] for r in kv[1::2]]
        common_async = [*common[:-1], free_port()]
        kv_async = _pair(tmp, "kvwire-async", common_async, consumer_job, producer_job, ["--load", "async"])[1:]
        async_s = [r["seconds"] for r in kv_async[0::2]]
        async_recompute_s = [r["seconds"] for r in kv_async[1::2]]

        # vLLM's shared-storage example: loads need the identical prompt, so its own
        # recompute baseline uses the fresh prompts in the same process.
        ex_consumer = [warm]
        for p, q in zip(sent, fresh, strict=True):
            ex_consumer += [{"prompt": p, "max_tokens": 1}, {"prompt": q, "max_tokens": 1}]
        ex = _pair(tmp, "example", common, ex_consumer, [{"prompt": p, "max_tokens": 1} for p in sent],
                   ["--connector", "example"])[1:]
        example_s = [r["seconds"] for r in ex[0::2]]
        example_recompute_s = [r["seconds"] for r in ex[1::2]]

    med = statistics.median
    rows = {
        "recompute (kvwire layer-wise process)": recompute_s,
        "kvwire, layer-wise load": kvwire_s,
        "recompute (kvwire async-load process)": async_recompute_s,
        "kvwire, asynchronous load": async_s,
        "recompute (example connector process)": example_recompute_s,
        "shared-storage example connector": example_s,
    }
    print(f"model: {args.layers} layers, hidden {args.hidden}, head_dim 64, {args.dtype}; "
          f"prompts of {args.prompt_tokens} tokens, {args.prompts} each; median TTFT")
    for name, xs in rows.items():
        print(f"  {name:40s} {med(xs) * 1e3:9.1f} ms   (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})")
    print(f"  kvwire layer-wise / recompute (same process): {med(kvwire_s) / med(recompute_s):.3f}")
    print(f"  kvwire async load / recompute (same process): {med(async_s) / med(async_recompute_s):.3f}")
    print(f"  example connector / recompute (same process): {med(example_s) / med(example_recompute_s):.3f}")
    print(f"  kvwire layer-wise / example connector:        {med(kvwire_s) / med(example_s):.3f}")
    print(f"  kvwire async load / example connector:        {med(async_s) / med(example_s):.3f}")
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
