"""A decode instance whose KV arrives late, while other requests decode: what the layer-wise
and the asynchronous load cost those other requests, and what the late request waits.

Needs vLLM (``pip install 'kvwire[vllm]'``, or the environment ``.ci/vllm`` builds) and
runs every engine through ``tests/integration/vllm_run.py``:

    python benchmarks/vllm_late_kv.py [--local 4] [--prompt-tokens 2048] [--rounds 2]
                                      [--layers 8] [--hidden 1024] [--json out.json]

In the consumer, ``--local`` requests (short prompts, long outputs) decode; once the first
has ``--after`` tokens, a request with a long prompt and a ``kvwire_id`` is added, and only
then is the producer (an engine already up, waiting) told to prefill that prompt and send
its KV: the transfer starts late, by the producer's prefill, as when a decode instance is
handed a request before its prefill is done.  Each request is stepped through the engine
and each token timed as it comes (``vllm_run.py --steps``).  Modes, one after the other,
``--rounds`` times:

- ``layer-wise``: ``kvwire_load_async: false``; the step that schedules the late request
  waits for its layers to arrive.
- ``async``: the connector's default; the late request is parked until its KV is in.
- ``recompute``: the same request without a ``kvwire_id``, prefilled by the consumer
  itself (no producer runs).

Reported per mode (medians over rounds): the late request's time to first token from its
arrival at the consumer; the other requests' longest gap between two tokens once it has
arrived, and their tokens per second from then until its first token, against their rate
before it arrived.  The producer's prefill shares the host's cores with the consumer's
decode in the two kvwire modes unless ``--pin`` (the default on a host of two or more
CPUs) puts each on a CPU of its own, as on two hosts: the consumer on CPU 0, the producer on
CPU 1 (``taskset`` and ``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_ttft import make_model  # noqa: E402

MODES = ("layer-wise", "async", "recompute")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(proc: subprocess.Popen[bytes], out: Path, name: str, log: Path) -> None:
    deadline = time.monotonic() + 900
    while not Path(f"{out}.ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} failed, see {log}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _pinned(cmd: list[str], cpu: int | None) -> tuple[list[str], dict[str, str]]:
    """``cmd`` on CPU ``cpu`` (its engine's threads too); as it is for None."""
    env = dict(os.environ)
    if cpu is None:
        return cmd, env
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    return ["taskset", "-c", str(cpu), *cmd], env


def run_mode(tmp: Path, mode: str, common: list[str], local: list[list[int]], late: list[int],
             args: argparse.Namespace, tag: str) -> list[dict[str, Any]]:
    """One consumer run (and its producer for the kvwire modes); the consumer's results."""
    port = str(_free_port())
    producer_out = tmp / f"{tag}_producer.out"
    late_req: dict[str, Any] = {"prompt": late, "max_tokens": args.late_tokens, "after": args.after}
    if mode != "recompute":
        late_req |= {"kvwire_id": tag, "signal": f"{producer_out}.go"}
    job = [{"prompt": p, "max_tokens": args.local_tokens} for p in local] + [late_req]
    (tmp / f"{tag}_c.json").write_text(json.dumps(job))
    (tmp / f"{tag}_p.json").write_text(json.dumps([{"prompt": late, "kvwire_id": tag, "max_tokens": 1}]))
    out = tmp / f"{tag}_consumer.out"
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []
    try:
        clog = tmp / f"{tag}_consumer.log"
        consumer_cmd = [sys.executable, str(RUN), "consumer", "--job", str(tmp / f"{tag}_c.json"),
                        "--out", str(out), "--steps", "--port", port, *common]
        if mode != "recompute":
            consumer_cmd += ["--load", mode]
        consumer_cmd, env = _pinned(consumer_cmd, 0 if args.pin else None)
        f = clog.open("w")
        procs.append((subprocess.Popen(consumer_cmd, stdout=f, stderr=subprocess.STDOUT, env=env), f))
        _wait_ready(procs[0][0], out, f"{tag} consumer", clog)
        if mode != "recompute":
            plog = tmp / f"{tag}_producer.log"
            producer_cmd, env = _pinned(
                [sys.executable, str(RUN), "producer", "--job", str(tmp / f"{tag}_p.json"), "--out",
                 str(producer_out), "--wait-go", "--port", port, *common], 1 if args.pin else None)
            g = plog.open("w")
            procs.append((subprocess.Popen(producer_cmd, stdout=g, stderr=subprocess.STDOUT, env=env), g))
            _wait_ready(procs[1][0], producer_out, f"{tag} producer", plog)
        Path(f"{out}.go").write_text("go")
        for proc, _log in procs:
            if proc.wait(900) != 0:
                raise SystemExit(f"{tag} failed, see the logs in {tmp}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    results: list[dict[str, Any]] = json.loads(out.read_text())
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    """The late request's TTFT from its arrival; the others' longest gap after it arrived,
    and their token rates before it arrived and while it waited for its first token.

    Tokens are stamped once per engine step, so the others' tokens of the step that gave
    the late request its first token carry that token's stamp: they are not counted as
    made while it waited.  A request's rate before is its tokens' intervals over their
    span (0 for fewer than two tokens, or all in one step); the rates are summed."""
    late, local = results[-1], results[:-1]
    arrived, first = late["added"], late["times"][0]
    gaps: list[float] = []
    during, rate_before = 0, 0.0
    for r in local:
        times = r["times"]
        gaps += [b - a for a, b in itertools.pairwise(times) if b > arrived]
        early = [t for t in times if t <= arrived]
        if len(early) > 1 and early[-1] > early[0]:
            rate_before += (len(early) - 1) / (early[-1] - early[0])
        during += sum(arrived < t < first for t in times)
    return {
        "ttft_s": first - arrived,
        "longest_gap_s": max(gaps) if gaps else 0.0,
        "rate_before": rate_before,
        "rate_while_waiting": during / (first - arrived),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local", type=int, default=4, help="requests decoding when the late one arrives")
    ap.add_argument("--local-tokens", type=int, default=1024, help="tokens each of them generates")
    ap.add_argument("--after", type=int, default=32, help="the late request arrives once the first has this many")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="the late request's prompt")
    ap.add_argument("--late-tokens", type=int, default=8, help="tokens the late request generates")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                    help="the consumer on CPU 0 and the producer on CPU 1, as on two hosts")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        ap.error(f"--modes takes some of {', '.join(MODES)}, each once")
    if args.local < 1 or args.after < 1:
        ap.error("--local and --after must be at least 1 (the late request comes while others decode)")

    summaries: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="kvwire-late-") as d:
        tmp = Path(d)
        model = make_model(tmp, args.dtype, args.layers, args.hidden)
        common = ["--dir", str(model), "--dtype", args.dtype]
        for rnd in range(args.rounds):
            rng = random.Random(rnd)
            local = [[rng.randrange(512) for _ in range(32)] for _ in range(args.local)]
            late = [rng.randrange(512) for _ in range(args.prompt_tokens)]
            for mode in modes:
                results = run_mode(tmp, mode, common, local, late, args, f"r{rnd}-{mode}")
                s = summarize(results)
                summaries[mode].append(s)
                print(f"round {rnd + 1} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()), flush=True)

    med = statistics.median
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}, {args.dtype}; {args.local} requests decoding, "
          f"a late one of {args.prompt_tokens} prompt tokens; medians over {args.rounds} rounds")
    print("| mode | late request's TTFT | others' longest gap | others' tokens/s while it waits | before it came |")
    print("|---|---|---|---|---|")
    for mode, rows in summaries.items():
        print(f"| {mode} | {med(r['ttft_s'] for r in rows) * 1e3:.0f} ms "
              f"| {med(r['longest_gap_s'] for r in rows) * 1e3:.0f} ms "
              f"| {med(r['rate_while_waiting'] for r in rows):.0f} | {med(r['rate_before'] for r in rows):.0f} |")
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
