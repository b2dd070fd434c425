"""The llama.cpp engine's slot planner, without a model: a fake KV memory records every call."""

from __future__ import annotations

from selfrag.infra.engine.kv_slots import KVJob, SlotPlanner, common_prefix


class FakeMemory:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def seq_cp(self, src: int, dest: int, length: int) -> None:
        self.calls.append(("cp", src, dest, length))

    def seq_rm(self, seq: int, n_keep: int) -> None:
        self.calls.append(("rm", seq, n_keep))

    def clear(self) -> None:
        self.calls.append(("clear",))


def planner(n_ctx: int = 64, n_seq_max: int = 4, **kw: bool) -> tuple[SlotPlanner, FakeMemory]:
    memory = FakeMemory()
    return SlotPlanner(memory, n_ctx=n_ctx, n_seq_max=n_seq_max, **kw), memory


def job(tokens: list[int], reserve: int = 0) -> KVJob:
    return KVJob(
        tokens=tokens, reuse_limit=len(tokens) - 1, out_from=len(tokens) - 1, reserve=reserve
    )


def fill(p: SlotPlanner, seq_id: int, tokens: list[int]) -> None:
    slot = p.slots[seq_id]
    slot.tokens = list(tokens)
    slot.cells = p.fresh_cells(len(tokens))
    slot.last_used = p.clock


def test_common_prefix_is_bounded_by_the_limit() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 9], 10) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4], 2) == 2
    assert common_prefix([5], [1], 3) == 0
    assert common_prefix([], [1], 3) == 0


def test_groups_hold_at_most_n_seq_max_jobs() -> None:
    p, _ = planner(n_seq_max=2)
    jobs = [job([1, 2, 3]) for _ in range(5)]
    assert p.groups(list(range(5)), jobs) == [[0, 1], [2, 3], [4]]


def test_groups_split_where_the_cells_would_not_fit() -> None:
    p, _ = planner(n_ctx=20, n_seq_max=8, share_prefix=False)
    jobs = [job(list(range(i * 10, i * 10 + 8)), reserve=2) for i in range(3)]  # 10 cells each
    assert p.groups([0, 1, 2], jobs) == [[0, 1], [2]]


def test_a_shared_prefix_is_counted_once_per_group() -> None:
    p, _ = planner(n_ctx=20, n_seq_max=8)
    shared = list(range(12))
    jobs = [job([*shared, 100 + i, 200 + i]) for i in range(3)]  # 12 shared + 2 own each
    assert p.groups([0, 1, 2], jobs) == [[0, 1, 2]]
    assert p.shared_prefix(jobs) == 12


def test_a_job_extending_a_slot_continues_in_that_slot() -> None:
    p, memory = planner()
    fill(p, 2, [1, 2, 3])
    j = job([1, 2, 3, 4, 5])
    p.tick()
    plan = p.place([j], 0)
    assert plan is not None and plan.cached == [3] and plan.starts == [3]
    assert j.slot is p.slots[2]
    assert not [c for c in memory.calls if c[0] == "cp"]


def test_a_job_sharing_part_of_a_slot_copies_it_and_leaves_the_source_whole() -> None:
    p, memory = planner()
    fill(p, 0, [1, 2, 3, 7, 8])
    j = job([1, 2, 3, 4])
    plan = p.place([j], 0)
    assert plan is not None and plan.cached == [3]
    assert j.slot is not p.slots[0] and j.slot is not None
    assert ("cp", 0, j.slot.seq_id, 3) in memory.calls
    assert p.slots[0].tokens == [1, 2, 3, 7, 8]


def test_a_group_prefix_is_decoded_by_one_root_and_copied_to_the_others() -> None:
    p, _ = planner()
    jobs = [job([1, 2, 3, 4, 10 + i]) for i in range(3)]
    shared = p.shared_prefix(jobs)
    plan = p.place(jobs, shared)
    assert shared == 4 and plan is not None
    assert plan.root >= 0 and sorted(plan.copies) == sorted(set(range(3)) - {plan.root})
    assert plan.starts == [4, 4, 4]
    assert len({j.slot.seq_id for j in jobs if j.slot is not None}) == 3


def test_without_the_prefix_cache_nothing_is_reused() -> None:
    p, _ = planner(prefix_cache=False)
    fill(p, 1, [1, 2, 3])
    plan = p.place([job([1, 2, 3, 4])], 0)
    assert plan is not None and plan.cached == [0] and plan.starts == [0]


def test_room_is_made_by_evicting_the_least_recently_used_slot() -> None:
    p, memory = planner(n_ctx=10, n_seq_max=3)
    fill(p, 0, [1, 2, 3, 4])
    p.tick()
    fill(p, 1, [5, 6, 7, 8])
    assert p.make_room({2}, 5)
    assert p.slots[0].tokens == [] and p.slots[1].tokens == [5, 6, 7, 8]
    assert ("rm", 0, 0) in memory.calls
    assert not p.make_room({1}, 7)  # 4 kept + 7 new > 10, even with everything else evicted


def test_a_placement_that_cannot_fit_is_refused() -> None:
    p, _ = planner(n_ctx=8, n_seq_max=2)
    assert p.place([job(list(range(9)))], 0) is None


def test_holder_and_staging_slot() -> None:
    p, _ = planner(n_seq_max=2)
    fill(p, 0, [1, 2, 3])
    assert p.holder_of([1, 2]) is p.slots[0]
    assert p.holder_of([1, 9]) is None
    assert p.staging_slot(set()) is p.slots[1]  # the empty one first
    assert p.staging_slot({1}) is p.slots[0]
    assert p.staging_slot({0, 1}) is None


def test_clear_forgets_every_slot() -> None:
    p, memory = planner()
    fill(p, 0, [1, 2])
    p.clear()
    assert memory.calls[-1] == ("clear",)
    assert all(not s.tokens and not s.cells for s in p.slots)
