"""Reference solution, chapter 11 (``minishard.course.exercises.ch11``)."""


def first_desync(held):
    by_seq = {r: {e["seq"]: e for e in entries} for r, entries in held.items()}
    common = set.intersection(*(set(s) for s in by_seq.values())) if by_seq else set()
    for seq in sorted(common):
        sides = {}
        for r in sorted(by_seq):
            e = by_seq[r][seq]
            what = (e["op"], tuple(map(tuple, e["shapes"])), tuple(e["dtypes"]), e.get("tag"), e.get("step"))
            sides.setdefault(what, []).append(r)
        if len(sides) == 1:
            continue
        groups = sorted(sides.values(), key=len, reverse=True)
        if len(groups[0]) == len(groups[1]):            # no majority: every rank is named
            return seq, sorted(by_seq)
        return seq, sorted(r for g in groups[1:] for r in g)
    return None
