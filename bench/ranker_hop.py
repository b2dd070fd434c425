"""What the `Ranker` deployment's hop costs a step: one `rank` call of a step's real shape (one
live hypothesis, K = 3 grounded drafts with scores and citations) through a Ray Serve handle,
against `pipeline.ranking.rank_step` in the caller's process, on one machine. Reported: the
median of each (after a warm-up) and the bytes the call moves. The last line holds the figures
as name=value.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.ranker_hop --calls 200
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import statistics
import time
from collections.abc import Sequence

from selfrag.pipeline.ranking import Drafted, Hypothesis, rank_step
from selfrag.schemas.answer import Citation
from selfrag.schemas.decoding import DecodingConfig

K = 3


def step_inputs() -> tuple[list[Hypothesis], list[Hypothesis], list[Drafted], DecodingConfig]:
    beam = [Hypothesis()]
    drafted = [
        Drafted(
            parent=0,
            retrieved=True,
            p_ret=None,
            citation=Citation(passage_id=f"squad:Normans:{i}", title="Normans", url=None),
            text="The Normans were descended from Norse raiders led by Rollo, who founded it.",
            logprob=-4.2 - i,
            n_tokens=18,
            finished=False,
            rel={"relevant": 0.8 - 0.1 * i, "irrelevant": 0.2 + 0.1 * i},
            sup={"full": 0.5, "partial": 0.3, "none": 0.2},
            use={str(j): 0.2 for j in range(1, 6)},
        )
        for i in range(K)
    ]
    return beam, list(beam), drafted, DecodingConfig(mode="always", top_k=K, max_segments=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(call: object, n: int) -> float:
    """Median seconds of `call()` over `n` calls, after 10 unmeasured ones."""
    assert callable(call)
    for _ in range(10):
        call()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)
    inputs = step_inputs()
    local_s = timed(lambda: rank_step(*inputs), args.calls)
    moved = len(pickle.dumps(inputs, protocol=5)) + len(
        pickle.dumps(rank_step(*inputs), protocol=5)
    )

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from selfrag.actors.deployments import Ranker

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        handle = serve.run(Ranker.bind(), name="ranker-hop", route_prefix=None)
        hop_s = timed(lambda: handle.rank.remote(*inputs).result(), args.calls)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        f"rank_step in process: {local_s * 1e6:.0f} us; through the Ranker deployment: "
        f"{hop_s * 1e3:.2f} ms; {moved / 1024:.1f} KiB moved per call"
    )
    print(
        f"calls={args.calls} local_us={local_s * 1e6:.0f} hop_ms={hop_s * 1e3:.2f} "
        f"hop_kib={moved / 1024:.1f} hop_over_local={hop_s / local_s:.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
