"""Shared fixtures: warm rank pools, one per world size, kept for the whole test session.

Starting ranks costs seconds; a pool (``minishard.launch.Ranks``) starts once and runs every
scenario of every test for its world size. A test that breaks its pool on purpose (a failing
rank) uses its own pool, never these.
"""
import pytest

from minishard.launch import Ranks


class Pools:
    def __init__(self):
        self._pools: dict[int, Ranks] = {}

    def __call__(self, world_size: int) -> Ranks:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = Ranks(world_size, timeout=300)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
