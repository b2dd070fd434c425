"""Answering batch jobs on Ray Data: each distinct (question, settled config) a `BatchJob`, a
pool of `jobs.batch.batch_actors.BatchAnswerer` actors sized to the cluster answering them batch
by batch, and with the embedded store the one `PassageService` actor that owns it. Used by the
batch driver (`jobs.batch.batch_driver`) and `selfrag eval --ray`
(`jobs.evaluation.ray_eval`)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from selfrag.infra.engine.engine_threads import ray_runtime_env
from selfrag.jobs.batch.batch_actors import BatchAnswerer
from selfrag.jobs.ray_pool import (
    RETRIEVER_CPUS,
    NodeLost,
    NodeWatch,
    Resources,
    plan_on_cluster,
    rows_watched,
)
from selfrag.runtime.passage_service import PassageService
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import Settings


@dataclass(frozen=True)
class BatchJob:
    """One distinct (question, settled config): answered once for all its ids."""

    key: str
    question: str
    config: DecodingConfig
    ids: list[str]


def stream_answers(
    settings: Settings,
    jobs: Sequence[BatchJob],
    *,
    actors: int | None = None,
    per_actor: int = 8,
    actor_cpus: float | None = None,
) -> Iterator[tuple[BatchJob, dict[str, Any]]]:
    """Answer `jobs` on Ray Data (Ray must be initialised); yields (job, outcome) as each
    batch completes, in completion order."""
    import ray

    if not jobs:
        return
    embedded = not settings.retrieval.qdrant_url
    # Checked before anything starts: actors that fit no node would wait silently for ever.
    plan = plan_on_cluster(
        actors,
        per_actor,
        settings.model.n_threads,
        actor_cpus,
        reserve=RETRIEVER_CPUS if embedded else 0.0,
    )
    # Settings travel pickled: their secrets (qdrant_api_key, redis_url) stay secret types,
    # masked in any repr or log; a JSON dump would replace them by the mask for good.
    retriever = _store_actor(settings) if embedded else None
    by_key = {j.key: j for j in jobs}
    ds = _answer_dataset(settings, jobs, retriever, plan, per_actor)
    watch = NodeWatch(plan, RETRIEVER_CPUS if embedded else 0.0)
    try:
        for row in rows_watched(ds, watch):
            yield by_key[str(row["key"])], json.loads(str(row["result"]))
    except NodeLost:
        # The abandoned Dataset's executor thread logs tracebacks of its own as the driver
        # disconnects; NodeLost's message says what happened, once.
        logging.getLogger("ray.data").setLevel(logging.CRITICAL)
        raise
    finally:
        if retriever is not None:
            # Release the folder lock before returning: ray.kill alone is asynchronous, and the
            # next user of the embedded store (a rerun, eval's baselines) would find it locked.
            try:
                ray.get(retriever.close.remote(), timeout=30)
            finally:
                ray.kill(retriever)


def _answer_dataset(
    settings: Settings,
    jobs: Sequence[BatchJob],
    retriever: Any,
    plan: Resources,
    per_actor: int,
) -> Any:
    """The Ray Dataset that answers `jobs` on a pool of `BatchAnswerer` actors, one batch of
    up to `per_actor` questions per task, in completion order."""
    import ray
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False  # the driver draws its own, per question
    ctx.execution_options.preserve_order = False
    rows = [
        {"key": j.key, "question": j.question, "config": j.config.model_dump_json()} for j in jobs
    ]
    # One block per batch and whole blocks as batches (batch_size=None): each batch is its own
    # task, so results stream back batch by batch instead of a task per several batches.
    blocks = max(1, math.ceil(len(rows) / per_actor))
    return ray.data.from_items(rows, override_num_blocks=blocks).map_batches(
        BatchAnswerer,
        fn_constructor_kwargs={
            "settings": settings,
            "retriever": retriever,
            "n_threads": plan.n_threads,
        },
        batch_size=None,
        compute=ray.data.ActorPoolStrategy(size=plan.actors, max_concurrent_calls_per_actor=1),
        num_cpus=plan.actor_cpus,
        batch_format="numpy",
        # OMP_WAIT_POLICY in each actor's process from its start (infra.engine.engine_threads).
        **ray_runtime_env(settings.model),
    )


def _store_actor(settings: Settings) -> Any:
    """The one `PassageService` actor that owns the embedded store: the store is a folder on
    the driver's machine, owned by one process, so on a cluster it runs on the driver's node,
    never elsewhere."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(PassageService)
        .options(
            num_cpus=RETRIEVER_CPUS,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            **ray_runtime_env(settings.model),
        )
        .remote(settings)
    )
