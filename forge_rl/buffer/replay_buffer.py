"""Replay buffer: complete groups wait here between the rollout loop and the trainer.

    rollout loop --add(group)--> ReplayBuffer --sample(current_version)--> trainer.train_step

The unit is the GROUP, never a single episode: GRPO's advantages compare the episodes of a group.
"""

from collections import OrderedDict

from monarch.actor import endpoint

from forge_rl.core.types import Episode
from forge_rl.runtime.actor import ForgeActor


class ReplayBuffer:
    """FIFO store of whole groups, each stamped with the oldest policy version in it.

    Invariants:
    - `sample(v)` never returns a group with policy_version < v - max_policy_age; such
      groups are evicted when seen (counted in stats()["evicted_stale"]).
    - at most `max_groups` groups are held, the oldest dropped first ("evicted_overflow"); oldest-first is
      also the sampling order, so the groups closest to going stale are trained on first.
    - a sampled group is removed: every group is trained on at most once (on-policy GRPO).
    - with `filter_zero_spread`, groups with all rewards equal are refused (DAPO dynamic sampling: their
      advantages are all zero).
    """

    def __init__(self, batch_size: int, max_policy_age: int, max_groups: int = 1024, filter_zero_spread: bool = False):
        if batch_size <= 0 or max_policy_age < 0 or max_groups < batch_size:
            raise ValueError(
                f"ReplayBuffer needs batch_size > 0, max_policy_age >= 0, max_groups >= batch_size; "
                f"got {batch_size}, {max_policy_age}, {max_groups}"
            )
        self.batch_size = batch_size
        self.max_policy_age = max_policy_age
        self.max_groups = max_groups
        self.filter_zero_spread = filter_zero_spread
        self._groups: OrderedDict[str, list[Episode]] = OrderedDict()  # insertion order = age
        self._counts = dict(added=0, sampled=0, evicted_stale=0, evicted_overflow=0, filtered_zero_spread=0)

    def add(self, group: list[Episode]) -> bool:
        """Store one complete group; returns False when the DAPO filter refused it."""
        if not group:
            raise ValueError("ReplayBuffer.add: empty group")
        group_id = group[0].group_id
        if any(e.group_id != group_id for e in group):
            raise ValueError(f"ReplayBuffer.add: episodes of several groups in one add ({group_id!r}, ...)")
        if group_id in self._groups:
            raise ValueError(f"ReplayBuffer.add: group {group_id!r} added twice; give each prompt/seed its own id")
        if self.filter_zero_spread and len({float(e.reward) for e in group}) == 1:
            self._counts["filtered_zero_spread"] += 1
            return False
        self._groups[group_id] = list(group)
        self._counts["added"] += 1
        while len(self._groups) > self.max_groups:
            self._groups.popitem(last=False)
            self._counts["evicted_overflow"] += 1
        return True

    def sample(self, current_version: int) -> list[Episode] | None:
        """The `batch_size` oldest fresh groups as one flat list, or None if there are fewer."""
        self._evict_stale(current_version)
        if len(self._groups) < self.batch_size:
            return None
        batch = [e for _ in range(self.batch_size) for e in self._groups.popitem(last=False)[1]]
        self._counts["sampled"] += self.batch_size
        return batch

    def stats(self) -> dict[str, int]:
        return dict(self._counts, groups=len(self._groups), episodes=sum(map(len, self._groups.values())))

    def clear(self) -> None:
        self._groups.clear()

    def __len__(self) -> int:
        return len(self._groups)

    def _evict_stale(self, current_version: int) -> None:
        oldest_allowed = current_version - self.max_policy_age
        for group_id in [g for g, eps in self._groups.items() if group_version(eps) < oldest_allowed]:
            del self._groups[group_id]
            self._counts["evicted_stale"] += 1


def group_version(group: list[Episode]) -> int:
    """A group is as old as its oldest episode, an episode as its oldest sampled token (partial
    rollouts mix versions within one answer)."""
    return min(e.policy_version for e in group)


class ReplayBufferActor(ForgeActor):
    """One instance on its own proc; every endpoint returns immediately."""

    def __init__(self, batch_size: int, max_policy_age: int, max_groups: int = 1024, filter_zero_spread: bool = False):
        super().__init__()
        self.buffer = ReplayBuffer(batch_size, max_policy_age, max_groups, filter_zero_spread)

    @endpoint
    async def add(self, group: list[Episode]) -> bool:
        """Rollout workers: store one complete group (False if filtered)."""
        return self.buffer.add(group)

    @endpoint
    async def add_groups(self, groups: list[list[Episode]]) -> list[bool]:
        """One message, in the order given, so which groups make the batch does not depend on how messages raced."""
        return [self.buffer.add(group) for group in groups]

    @endpoint
    async def sample(self, current_version: int) -> list[Episode] | None:
        """Training loop: a batch of whole groups, or None (never waits)."""
        return self.buffer.sample(current_version)

    @endpoint
    async def stats(self) -> dict[str, int]:
        return self.buffer.stats()

    @endpoint
    async def clear(self) -> None:
        self.buffer.clear()
