"""Reference solution, chapter 02 (``minishard.course.exercises.ch02``)."""


def ring_bytes(op: str, nbytes: int, world_size: int) -> int:
    n = world_size
    rounds = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}[op]
    return rounds * nbytes // n             # every round, every rank sends one chunk of S/N
