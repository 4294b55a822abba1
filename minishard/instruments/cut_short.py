"""Traces cut short by a death, lined up with the others before they are compared.

A run that left only traces is compared from them (``records.from_trace``): each rank's
collectives as its trace holds them — those it *completed*, a line written as each completed —
numbered in the order it issued them. A rank that dies keeps only what it had completed: the
collectives it had issued and not completed are not in its trace, and where collectives complete
out of order (prefetched all-gathers, gloo's several threads) a later one may be there while an
earlier one is not. Numbered as they stand, every collective after the gap would sit one seq too
early, and the doctor would call the gap a desync of a rank that only died.

So a trace shorter than another's is lined up with the longest one (:func:`lined_up`): its
collectives are matched in order, skipping only collectives that cannot have been complete on
its rank when its trace ended — ones the longer trace's rank completed after the short trace's
last completion — and matching only collectives that could have completed (none before the
longer trace's rank issued it: a collective completes once every rank issued it). A trace that
lines up so is renumbered, its gaps left out of the comparison; one that does not is compared as
it stands, and the difference is a desync. (Times are the ranks' shared clock: ranks started
together share one origin.)
"""
from __future__ import annotations


def lined_up(held: dict[int, dict[int, dict]], ranks: list[int], same) -> dict[int, dict[int, dict]]:
    """``held`` (rank -> seq -> entry, one group's, read from traces) with each shorter trace
    renumbered against the longest where it lines up; ``same(a, b)``: two entries are one
    collective."""
    if len(ranks) < 2:
        return held
    longest = max(ranks, key=lambda r: (len(held.get(r, {})), -r))
    ref = [held[longest][s] for s in sorted(held.get(longest, {}))]
    out = dict(held)
    for r in ranks:
        mine = held.get(r, {})
        if r != longest and 0 < len(mine) < len(ref):
            short = [mine[s] for s in sorted(mine)]
            if (seqs := _matched(short, ref, same)) is not None:
                out[r] = dict(zip(seqs, short))
    return out


def _matched(short: list[dict], ref: list[dict], same) -> list[int] | None:
    """The seq in ``ref`` of each of ``short``, or None where ``short`` does not line up: every
    collective of ``ref`` matched in order but those its rank completed after ``short`` ended
    (which ``short``'s rank may not have completed), none matched before it was issued."""
    ended = max(e["t_completed"] for e in short)
    late = [e["t_completed"] > ended for e in ref]
    fits = lambda i, j: same(short[i], ref[j]) and short[i]["t_completed"] >= ref[j]["t_issued"]  # noqa: E731
    # before the first collective that may be missing, the two are one list, seq for seq (a
    # difference there is the desync the comparison names): the table spans the tails only
    first = late.index(True) if any(late) else len(ref)
    if len(short) < first:
        return None
    # after it, can[i][j]: short[i:] lines up with ref[j:] (a table over the tails only)
    a, b = len(short) - first, len(ref) - first
    can = [[False] * (b + 1) for _ in range(a + 1)]
    can[a][b] = True
    for j in range(b - 1, -1, -1):
        can[a][j] = late[first + j] and can[a][j + 1]
    for i in range(a - 1, -1, -1):
        for j in range(b - 1, -1, -1):
            can[i][j] = (late[first + j] and can[i][j + 1]) or (
                fits(first + i, first + j) and can[i + 1][j + 1])
    if not can[0][0]:
        return None
    seqs, j = [e["seq"] for e in ref[:first]], 0
    for i in range(a):
        while not (fits(first + i, first + j) and can[i + 1][j + 1]):
            j += 1
        seqs.append(ref[first + j]["seq"])
        j += 1
    return seqs
