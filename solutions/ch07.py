"""Reference solution, chapter 07 (``minishard.course.exercises.ch07``)."""


def prefetch_targets(blocks, unit, depth, forward):
    order = list(blocks) if forward else list(reversed(blocks))
    if unit == "root":                  # the root runs first in both passes
        return order[:depth]
    i = order.index(unit)
    return order[i + 1:i + 1 + depth]
