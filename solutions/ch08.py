"""Reference solution, chapter 08 (``minishard.course.exercises.ch08``)."""


def offload_bytes(block_shard, root_shard, n_blocks):
    into_device = 2 * n_blocks * block_shard + root_shard     # every gather brings its shard in
    out_of_device = n_blocks * block_shard + root_shard       # every reduce-scatter sends its slice out
    return into_device, out_of_device
