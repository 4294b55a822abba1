"""Shared fixtures: warm rank pools, one per world size, kept for the whole test session.

Starting ranks costs seconds; a pool (``minishard.core.launch.Ranks``) starts once and runs every
scenario of every test for its world size. A test that breaks its pool on purpose (a failing
rank) uses its own pool, never these.
"""
import pytest

from minishard.core.launch import Pools


@pytest.fixture(scope="session")
def pools():
    with Pools() as p:
        yield p
