"""Stateful, resumable, rank-sharded sampler of dataset indices (prompts, not samples).

All ``n`` samples of a prompt are made from one drawn index, so a group never spans ranks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the run config imports this package before anything heavy (flowrl/config.py)
    import numpy as np


class PromptSampler:
    """Deterministic epoch-based sampling of prompt indices for one data-parallel rank.

    Epoch ``e`` uses the permutation ``np.random.default_rng([seed, e]).permutation(num_items)``
    (the identity when ``shuffle=False``), cut to a multiple of ``world_size`` (at most
    ``world_size - 1`` items are left out per epoch, a different set each epoch), and rank ``r``
    takes every ``world_size``-th entry starting at ``r``: shards are disjoint and equal in size,
    so every rank draws the same number of prompts per step. A batch that runs past the end of a
    shard continues with the next epoch's shard.

    Args:
        num_items: dataset size (>= world_size).
        seed: base seed; with the epoch it fixes the permutation.
        shuffle: permute each epoch (False: file order, same every epoch).
        rank, world_size: this rank and the number of data-parallel ranks.

    Raises:
        ValueError: invalid rank/world size, or fewer items than ranks.
    """

    def __init__(self, num_items: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"sampler.world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"sampler.rank must be in [0, {world_size}), got {rank}")
        if num_items < world_size:
            raise ValueError(f"sampler.num_items must be >= world_size ({world_size}), got {num_items}")
        self.num_items, self.seed, self.shuffle = num_items, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.shard_size = num_items // world_size
        self.epoch = 0
        self.position = 0  # next entry of the current epoch's shard
        self._cache: "tuple[int, np.ndarray] | None" = None

    def shard(self, epoch: int) -> "np.ndarray":
        """This rank's dataset indices for ``epoch``: (shard_size,) int64."""
        if self._cache is None or self._cache[0] != epoch:
            import numpy as np

            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            else:
                perm = np.arange(self.num_items)
            used = perm[: self.shard_size * self.world_size]
            self._cache = (epoch, used[self.rank::self.world_size].astype(np.int64))
        return self._cache[1]

    def next_batch(self, num_prompts: int) -> list[int]:
        """The next ``num_prompts`` dataset indices of this rank (may cross an epoch boundary).

        Raises:
            ValueError: ``num_prompts < 1``.
        """
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        out: list[int] = []
        while len(out) < num_prompts:
            shard = self.shard(self.epoch)
            take = min(num_prompts - len(out), self.shard_size - self.position)
            out.extend(int(i) for i in shard[self.position:self.position + take])
            self.position += take
            if self.position == self.shard_size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position"}`` plus the settings a resume must match."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_items": self.num_items, "world_size": self.world_size}

    def check_state(self, state: dict[str, Any], world_size: bool = True) -> None:
        """A saved state's seed, shuffle, num_items (and ``world_size``) must be this sampler's.

        Raises:
            ValueError: naming the first that differs.
        """
        for key in ("seed", "shuffle", "num_items", *(("world_size",) if world_size else ())):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state {key}={state[key]!r} does not match this "
                                 f"sampler's {key}={getattr(self, key)!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the saved sampler stopped.

        Raises:
            ValueError: the saved seed/shuffle/num_items/world_size differ from this sampler's
                (the continuation would not be the uninterrupted sequence), or a bad position.
        """
        self.check_state(state)
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.shard_size:
            raise ValueError(f"sampler state epoch={epoch}, position={position} out of range "
                             f"(shard_size {self.shard_size})")
        self.epoch, self.position = epoch, position
