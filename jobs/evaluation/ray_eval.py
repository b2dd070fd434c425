"""`selfrag eval --ray`: the selfrag-* systems' missing records answered on the batch path
(`jobs.batch.batch_answers`), appended to the evaluation's records for `run_evaluation` to
report; the baselines stay in-process."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from selfrag.jobs.batch.batch_answers import BatchJob, stream_answers
from selfrag.jobs.batch.batch_records import RecordSink
from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.jobs.evaluation.eval_report import RECORDS_FILE, read_records
from selfrag.jobs.evaluation.eval_runner import make_record, system_request
from selfrag.jobs.first_use import answering_runtime
from selfrag.jobs.ray_pool import ensure_ray
from selfrag.runtime.answer_client import LocalAnswerClient
from selfrag.runtime.answering import query_key
from selfrag.runtime.ray_cluster import shutdown_private_ray
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.records import BASELINES
from selfrag.schemas.settings import Settings


def _eval_jobs(
    settings: Settings,
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig,
    done: set[tuple[str, str]],
) -> tuple[dict[str, BatchJob], dict[str, list[tuple[str, EvalQuestion]]]]:
    """One job per distinct (question, settled config) among the selfrag-* systems' records
    not in `done`, and for each job's key the (system, question) pairs it answers."""
    jobs: dict[str, BatchJob] = {}
    owners: dict[str, list[tuple[str, EvalQuestion]]] = {}
    selfrag = [s for s in systems if s not in BASELINES]  # the baselines stay in-process
    if not questions or not selfrag:
        return jobs, owners
    # Settled as the in-process runner's client settles them (a missing threshold calibrated
    # on first use); a config does not depend on the question.
    with answering_runtime(settings) as here:
        client = LocalAnswerClient.for_runtime(here)
        cfgs = {s: client.config(system_request(questions[0].question, s, config)) for s in selfrag}
    for system, cfg in cfgs.items():
        for q in questions:
            if (system, q.id) in done:
                continue
            key = query_key(q.question, cfg, "", "")
            jobs.setdefault(key, BatchJob(key, q.question, cfg, []))
            owners.setdefault(key, []).append((system, q))
    return jobs, owners


def run_eval_systems(
    settings: Settings,
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    out: Path,
    config: DecodingConfig,
    *,
    actors: int | None = None,
    progress: bool = True,
    address: str | None = None,
) -> None:
    """`selfrag eval --ray`: answer the selfrag-* systems' missing records on the batch path,
    appending them to `out/records.jsonl` (`run_evaluation` then skips them and writes the
    report). p_ret is the first segment's (no extra probe), and latency is the decoder's own
    total time, batched with others."""
    path = out / RECORDS_FILE
    out.mkdir(parents=True, exist_ok=True)
    done = {(r["system"], r["id"]) for r in read_records(path)}
    jobs, owners = _eval_jobs(settings, questions, systems, config, done)
    if not jobs:
        return
    sink = RecordSink(path)
    bar = tqdm(
        total=sum(len(v) for v in owners.values()),
        desc="eval (ray)",
        unit="answer",
        file=sys.stderr,
        disable=not progress,
    )
    started_ray = ensure_ray(address)
    try:
        for job, outcome in stream_answers(settings, list(jobs.values()), actors=actors):
            for system, q in owners[job.key]:
                bar.update(1)
                if outcome["status"] != "ok":
                    # Left without a record: run_evaluation answers it in-process.
                    print(
                        f"eval --ray: {system} {q.id}: {outcome['error']['message']}",
                        file=sys.stderr,
                    )
                    continue
                r = AnswerResponse.model_validate(outcome["response"])
                p_ret = r.segments[0].p_ret if r.segments else None
                sink.write(make_record(system, q, r, p_ret, 0, r.timings_ms.get("total", 0.0)))
    finally:
        bar.close()
        sink.close()
        if started_ray:
            shutdown_private_ray()
