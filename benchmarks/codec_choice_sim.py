"""The ``auto`` codec's model on a simulated host whose speed drifts: which codecs it sends.

Run::

    python benchmarks/codec_choice_sim.py                    # this tree, a minute or so
    python benchmarks/codec_choice_sim.py --tree prev=DIR    # and another tree's chooser

No sockets and no clocks: a :class:`kvwire.control.codec_choice.CodecChooser` chooses
the codec of every 4 MiB chunk at a fake time 10 ms apart, over a link of a fixed rate
(``pipeline="full"``), and is fed the encode speed of the codec it chose, as the
transport feeds it. Every codec's true encode speed is its base speed times one host
factor, a random walk in log space (3% a chunk, pulled back to 1 over about 300 chunks,
held within 0.4 to 1.6): a host whose load comes and goes slows and speeds every codec
alike. Each measurement adds noise of its own (15% log-normal unless a scenario says
otherwise). A codec's delivered rate is its encode speed, or the link's rate over its
size ratio if that is lower.

Per scenario, over the seeds: the share of chunks sent with the truly fastest codec at
that moment (mean, and the lowest seed's), the mean true rate of the codecs sent over the
best's (``eff``; probes counted), and how many times a run the codec sent (probes aside)
changed. ``--tree NAME=DIR`` adds a row per scenario for the chooser of another source
tree (its ``kvwire/control/codec_choice.py``, loaded as a module of its own).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from kvwire.units import argument_type, whole_number

GB = 1e9
CHUNK = 4 << 20
STEP = 0.01  # seconds between chunks

#: name -> codecs (name, size ratio, base encode speed; None: raw), link bit/s, and options:
#: ``noise`` (a sample's log-normal sigma), ``prior`` (the priors over the base speeds),
#: ``own`` (each codec's own drift per chunk, besides the host's), ``flip`` (factors on
#: the base speeds from half-way on)
SCENARIOS: dict[str, dict[str, Any]] = {
    "int8, int4 9% faster": dict(codecs=[("int8", .5, 2.2 * GB), ("int4", .375, 2.4 * GB)], link=80e9),
    "fp8, int8, int4": dict(codecs=[("fp8", .52, 2.0 * GB), ("int8", .5, 2.2 * GB), ("int4", .375, 2.4 * GB)],
                            link=80e9),
    "raw and three, 10 Gbit/s": dict(codecs=[("raw", 1.0, None), ("fp8", .52, 2.0 * GB), ("int8", .5, 2.2 * GB),
                                             ("int4", .375, 2.4 * GB)], link=10e9),
    "int4 4% faster": dict(codecs=[("int8", .5, 2.3 * GB), ("int4", .375, 2.4 * GB)], link=80e9),
    "int8 10% faster, then int4": dict(codecs=[("int8", .5, 2.4 * GB), ("int4", .375, 2.18 * GB)], link=80e9,
                                       flip={"int4": 1.21}),
    "three, each drifting too": dict(codecs=[("fp8", .52, 2.0 * GB), ("int8", .5, 2.2 * GB),
                                             ("int4", .375, 2.4 * GB)], link=80e9, own=0.01),
    "three, 20% noise, priors x0.5": dict(codecs=[("fp8", .52, 2.0 * GB), ("int8", .5, 2.2 * GB),
                                                  ("int4", .375, 2.4 * GB)], link=80e9, noise=0.2, prior=0.5),
    "fp8 8% faster than int4": dict(codecs=[("fp8", .52, 2.6 * GB), ("int8", .5, 2.2 * GB),
                                            ("int4", .375, 2.4 * GB)], link=80e9),
    "three, priors x2": dict(codecs=[("fp8", .52, 2.0 * GB), ("int8", .5, 2.2 * GB), ("int4", .375, 2.4 * GB)],
                             link=80e9, prior=2.0),
    "int8 10% faster, priors x2": dict(codecs=[("int8", .5, 2.64 * GB), ("int4", .375, 2.4 * GB)], link=80e9,
                                       prior=2.0),
    "three, 10% noise": dict(codecs=[("fp8", .52, 2.0 * GB), ("int8", .5, 2.2 * GB), ("int4", .375, 2.4 * GB)],
                             link=80e9, noise=0.1),
}


def load_chooser(name: str, tree: Path) -> Any:
    """``kvwire/control/codec_choice.py`` of ``tree`` as a module of its own."""
    path = tree / "kvwire" / "control" / "codec_choice.py"
    spec = importlib.util.spec_from_file_location(f"_codec_choice_{name}", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise SystemExit(f"no chooser at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(module: Any, sc: dict[str, Any], seed: int, chunks: int) -> tuple[float, float, int]:
    """(share of chunks with the truly fastest codec, mean true rate over the best's,
    changes of the codec sent) of one simulated run."""
    rng = random.Random(seed)
    base = {name: speed for name, _, speed in sc["codecs"]}
    ratio = {name: r for name, r, _ in sc["codecs"]}
    prior = sc.get("prior", 1.0)
    chooser = module.CodecChooser(
        [module.CodecCandidate(name=n, size_ratio=r, encode_bytes_per_s=s * prior if s else None)
         for n, r, s in sc["codecs"]],
        pipeline="full",
    )
    wire = sc["link"] / 8.0
    host, own = 0.0, dict.fromkeys(base, 0.0)
    best_chunks, eff, changes, last = 0, 0.0, 0, None
    for i in range(chunks):
        host = max(math.log(0.4), min(math.log(1.6), host * (1 - 1 / 300) + rng.gauss(0, 0.03)))
        for name in own:
            own[name] = own[name] * (1 - 1 / 50) + rng.gauss(0, sc.get("own", 0.0))

        flip = sc.get("flip", {}) if i >= chunks // 2 else {}
        speeds = {name: math.inf if s is None else s * flip.get(name, 1.0) * math.exp(host + own[name])
                  for name, s in base.items()}
        rates = {name: min(speeds[name], wire / ratio[name]) for name in base}
        best = max(rates.values())
        choice = chooser.choose(sc["link"], now=i * STEP)
        best_chunks += rates[choice.codec] >= 0.999 * best
        eff += rates[choice.codec] / best
        if not choice.probe:
            changes += last is not None and choice.codec != last
            last = choice.codec
        true = speeds[choice.codec]
        if true != math.inf:
            sample = true * math.exp(rng.gauss(0, sc.get("noise", 0.15)))
            chooser.observe_encode(choice.codec, CHUNK, CHUNK / sample)
    return best_chunks / chunks, eff / chunks, changes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=argument_type(whole_number, "int"), default=20)
    ap.add_argument("--chunks", type=argument_type(whole_number, "int"), default=3000,
                    help="chunks per run (10 ms apart)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="also the chooser of another source tree")
    args = ap.parse_args()
    trees = {"this": Path(__file__).resolve().parent.parent}
    for item in args.tree:
        name, _, path = item.partition("=")
        if not name or not path or name in trees:
            ap.error(f"--tree wants NAME=DIR with a new NAME, got {item!r}")
        trees[name] = Path(path)
    modules = {name: load_chooser(name, tree) for name, tree in trees.items()}
    print(f"{args.seeds} seeds x {args.chunks} chunks; best: share of chunks with the truly fastest codec "
          "(mean, lowest seed); eff: true rate sent / best's; changes of the codec sent per run")
    print("| scenario | tree | best | eff | changes |\n|---|---|---|---|---|")
    for scenario, sc in SCENARIOS.items():
        for name, module in modules.items():
            runs = [run(module, sc, seed, args.chunks) for seed in range(args.seeds)]
            best = [r[0] for r in runs]
            print(f"| {scenario} | {name} | {statistics.fmean(best):.3f} ({min(best):.3f}) | "
                  f"{statistics.fmean(r[1] for r in runs):.4f} | {statistics.fmean(r[2] for r in runs):.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
