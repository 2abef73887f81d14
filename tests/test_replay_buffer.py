"""ReplayBuffer: whole groups, staleness eviction, bounded size, DAPO filter; and its actor."""

import asyncio

import pytest
import torch

from forge_rl.runtime.actor import stop
from forge_rl.buffer.replay_buffer import ReplayBuffer, ReplayBufferActor
from forge_rl.core.types import Episode


def episode(group_id: str, version: int, reward: float) -> Episode:
    return Episode(
        tokens=torch.tensor([1, 2, 3, 4]),
        loss_mask=torch.tensor([0, 0, 1, 1]),
        behaviour_logprobs=torch.tensor([0.0, 0.0, -0.5, -0.7]),
        reward=reward,
        policy_version=version,
        group_id=group_id,
    )


def group(group_id: str, version: int, rewards=(0.0, 1.0)) -> list[Episode]:
    return [episode(group_id, version, r) for r in rewards]


def test_sample_returns_whole_groups_oldest_first_or_none():
    buf = ReplayBuffer(batch_size=2, max_policy_age=5)
    assert buf.sample(current_version=0) is None  # never blocks
    buf.add(group("a", 0, rewards=(0, 1, 1)))
    assert buf.sample(0) is None and len(buf) == 1  # one group is not a batch; nothing consumed
    buf.add(group("b", 0, rewards=(1, 0, 0)))
    buf.add(group("c", 0, rewards=(1, 0, 1)))
    batch = buf.sample(0)
    assert [e.group_id for e in batch] == ["a"] * 3 + ["b"] * 3  # FIFO, flat, whole groups
    assert len(buf) == 1 and buf.sample(0) is None  # sampled groups are removed
    assert buf.stats()["sampled"] == 2


def test_stale_groups_are_evicted_and_never_sampled():
    buf = ReplayBuffer(batch_size=2, max_policy_age=1)
    buf.add(group("v0", 0))
    buf.add(group("v1", 1))
    buf.add([episode("mixed", 3, 0.0), episode("mixed", 1, 1.0)])  # as old as its oldest episode: 1
    buf.add(group("v2", 2))
    batch = buf.sample(current_version=2)  # allowed versions: >= 1
    assert [e.group_id for e in batch] == ["v1", "v1", "mixed", "mixed"]
    assert buf.stats()["evicted_stale"] == 1
    assert buf.sample(current_version=4) is None  # v2 is now too old as well
    assert buf.stats()["evicted_stale"] == 2 and len(buf) == 0


def test_on_policy_only_with_max_policy_age_zero():
    buf = ReplayBuffer(batch_size=1, max_policy_age=0)
    buf.add(group("old", 4))
    buf.add(group("new", 5))
    assert {e.group_id for e in buf.sample(5)} == {"new"}


def test_bounded_size_drops_oldest():
    buf = ReplayBuffer(batch_size=1, max_policy_age=10, max_groups=2)
    for name in "abc":
        buf.add(group(name, 0))
    assert buf.stats()["evicted_overflow"] == 1 and len(buf) == 2
    assert buf.sample(0)[0].group_id == "b"


def test_zero_spread_filter():
    buf = ReplayBuffer(batch_size=1, max_policy_age=1, filter_zero_spread=True)
    assert buf.add(group("flat", 0, rewards=(1.0, 1.0, 1.0))) is False
    assert buf.add(group("spread", 0, rewards=(1.0, 0.0, 1.0))) is True
    assert buf.stats()["filtered_zero_spread"] == 1 and len(buf) == 1
    unfiltered = ReplayBuffer(batch_size=1, max_policy_age=1)
    assert unfiltered.add(group("flat", 0, rewards=(1.0, 1.0))) is True


def test_bad_input_is_refused_with_a_reason():
    buf = ReplayBuffer(batch_size=1, max_policy_age=1)
    with pytest.raises(ValueError, match="several groups"):
        buf.add([episode("a", 0, 0.0), episode("b", 0, 1.0)])
    buf.add(group("a", 0))
    with pytest.raises(ValueError, match="added twice"):
        buf.add(group("a", 0))
    with pytest.raises(ValueError, match="empty"):
        buf.add([])
    with pytest.raises(ValueError, match="max_groups"):
        ReplayBuffer(batch_size=4, max_policy_age=1, max_groups=2)
    with pytest.raises(ValueError, match="one entry per token"):
        Episode(torch.tensor([1, 2]), torch.tensor([0]), torch.tensor([0.0, 0.0]), 0.0, 0, "x")


def test_actor_endpoints():
    async def main():
        actor = await ReplayBufferActor.options().as_actor(batch_size=2, max_policy_age=1, filter_zero_spread=True)
        try:
            assert await actor.add.call_one(group("a", 3)) is True
            assert await actor.add.call_one(group("flat", 3, rewards=(0.0, 0.0))) is False
            assert await actor.sample.call_one(3) is None
            await actor.add.call_one(group("b", 4))
            batch = await actor.sample.call_one(4)
            assert [e.group_id for e in batch] == ["a", "a", "b", "b"]
            torch.testing.assert_close(batch[0].behaviour_logprobs, torch.tensor([0.0, 0.0, -0.5, -0.7]))
            # a round's groups in one message: kept in the order given (the batch is then the first ones)
            added = await actor.add_groups.call_one([group("e", 4), group("flat2", 4, (1.0, 1.0)), group("d", 4), group("f", 4)])
            assert added == [True, False, True, True]
            assert [e.group_id for e in await actor.sample.call_one(4)] == ["e", "e", "d", "d"]
            await actor.add.call_one(group("c", 4))
            await actor.clear.call_one()
            stats = await actor.stats.call_one()
            assert stats["groups"] == 0 and stats["filtered_zero_spread"] == 2 and stats["sampled"] == 4
        finally:
            await stop(actor)

    asyncio.run(main())


def test_episodes_cross_processes_exactly():
    """Episodes go controller -> buffer -> controller -> trainer each step. They pickle their tensors as raw
    bytes (Monarch's torch.save per tensor cost 72 ms a way for 256 episodes; bench/loop.py times it): values,
    dtypes and shapes must survive exactly, mixed token versions and a chat agent's rollout_id included."""
    import io

    from monarch._src.actor.pickle import torch_dump, torch_loads

    mixed = Episode(
        tokens=torch.tensor([5, 6, 7, 8, 9]), loss_mask=torch.tensor([0, 1, 1, 0, 1]).bool(),
        behaviour_logprobs=torch.tensor([0.0, -0.1, -0.2, 0.0, -1e-30]).bfloat16(), reward=-1.5, policy_version=2,
        group_id="g", token_versions=torch.tensor([-1, 2, 3, -1, 3]), rollout_id="r7",
    )
    batch = [mixed] + [episode(f"g{i // 4}", 1, i / 7) for i in range(255)]
    buffer = io.BytesIO()
    torch_dump(batch, buffer)
    back = torch_loads(buffer.getvalue())
    for a, b in zip(batch, back):
        for name in ("tokens", "loss_mask", "behaviour_logprobs", "token_versions"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
        assert (a.reward, a.policy_version, a.group_id, a.rollout_id) == (b.reward, b.policy_version, b.group_id, b.rollout_id)

    async def through_the_actor():
        actor = await ReplayBufferActor.options().as_actor(batch_size=1, max_policy_age=5, filter_zero_spread=False)
        try:
            await actor.add_groups.call_one([[mixed]])
            return await actor.sample.call_one(2)
        finally:
            await stop(actor)

    (sampled,) = asyncio.run(through_the_actor())
    assert torch.equal(sampled.token_versions, mixed.token_versions) and sampled.behaviour_logprobs.dtype == torch.bfloat16
