"""Every rank fails alike: a save or a load is a collective, and a rank that failed alone would
leave the others waiting in its next collective, or committing a checkpoint it did not finish.
So each step of the protocol ends with the ranks agreeing whether all succeeded, and if one did
not, every rank raises the same error (the first rank's)."""
from __future__ import annotations

from minishard.core.comm import Comm
from .format import CheckpointError


def raise_if_any(errors: list) -> None:
    """Every rank gathered every rank's error: all raise the first, so all fail alike."""
    for e in errors:
        if e:
            raise CheckpointError(e)


def agree(comm: Comm, error: str | None) -> None:
    """Did every rank succeed? One 4-byte all-reduce answers it; only if some rank failed are
    the messages gathered (a larger exchange), and every rank raises the first."""
    if comm.anyone(error is not None):
        raise_if_any(comm.all_gather_object(error))
