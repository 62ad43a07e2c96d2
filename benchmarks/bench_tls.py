"""What mutual TLS on the control plane costs: two LocalClusters side by side, one with TLS
(the default) and one in the clear, each training the same small GPT over two worker
processes, in alternating blocks of steps.

    .venv/bin/python benchmarks/bench_tls.py [--rounds 8] [--block 10]

Prints, per cluster, the median step time (spread min-max) over the counted steps and the
median round trip of an empty RPC (Heartbeat, alternating calls), then TLS / clear for
both. The data plane is the same in both (shared memory between the two workers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.timing

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mpmd  # noqa: E402
from mpmd import models  # noqa: E402
from mpmd.runtime.control.rpc import call  # noqa: E402
from mpmd.runtime.wire import verbs  # noqa: E402
from benchmarks.timing import alternating_blocks  # noqa: E402


def trainer(tls: bool) -> mpmd.Trainer:
    model = models.GPT(vocab_size=256, d_model=64, num_heads=2, num_layers=4, seq_len=64, rngs=nnx.Rngs(0))
    return mpmd.Trainer(
        mpmd.Pipeline(mpmd.split(model, num_stages=2), models.lm_loss),
        optimizer=optax.sgd(1e-2, momentum=0.9),
        schedule="1f1b",
        num_microbatches=4,
        cluster=mpmd.LocalCluster(tls=tls),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--pings", type=int, default=300)
    args = p.parse_args()
    tokens = np.random.default_rng(0).integers(0, 256, (16, 65), dtype=np.int32)
    trainers = {"tls": trainer(True), "clear": trainer(False)}
    try:
        for t in trainers.values():
            for _ in range(3):  # start, compile, settle
                t.step(tokens[:, :-1], tokens[:, 1:])
        steps = {k: (lambda i, t=t: t.step(tokens[:, :-1], tokens[:, 1:])) for k, t in trainers.items()}
        times = alternating_blocks(steps, args.rounds, args.block)
        rtt = {k: [] for k in trainers}
        for i in range(args.pings):
            for k in list(trainers) if i % 2 else list(reversed(trainers)):
                client = trainers[k].cluster.clients[0]
                start = time.perf_counter()
                call(client, verbs.Empty(), timeout_s=10.0, verb="Heartbeat")
                rtt[k].append(time.perf_counter() - start)
    finally:
        for t in trainers.values():
            t.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    ping = {k: statistics.median(v) for k, v in rtt.items()}
    for k, v in times.items():
        print(
            f"{k:5s} step median {med[k] * 1e3:.1f} ms (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f}) "
            f"over {len(v)} steps; Heartbeat round trip median {ping[k] * 1e6:.0f} us "
            f"(min {min(rtt[k]) * 1e6:.0f}, max {max(rtt[k]) * 1e6:.0f})"
        )
    print(f"tls / clear: step {med['tls'] / med['clear']:.3f}, Heartbeat {ping['tls'] / ping['clear']:.2f}")


if __name__ == "__main__":
    main()
