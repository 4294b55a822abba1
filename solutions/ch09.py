"""Reference solution, chapter 09 (``minishard.course.exercises.ch09``)."""
import math


def read_plan(numel, saved_world_size, world_size):
    old, new = math.ceil(numel / saved_world_size), math.ceil(numel / world_size)
    plan = []
    for r in range(world_size):
        lo, hi = r * new, min((r + 1) * new, numel)            # what new rank r must hold
        reads = []
        for s in range(saved_world_size):
            a, b = max(lo, s * old), min(hi, (s + 1) * old, numel)  # overlap with saved rank s
            if a < b:
                reads.append((s, a, b))
        plan.append(reads)
    return plan


def survivor(entries):
    if entries.get("ck"):                       # a complete checkpoint under its name: that one
        return "ck"
    if entries.get(".ck.old"):                  # died between the two renames: the old one, aside
        return ".ck.old"
    return None                                 # .ck.saving is never loaded, complete or not
