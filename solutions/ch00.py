"""Reference solution, chapter 00 (``minishard.course.exercises.ch00``)."""


def predict_hello(world_size: int, payload_mb: float) -> tuple[float, int]:
    value = world_size * (world_size + 1) / 2              # 1 + 2 + ... + N
    nbytes = int(payload_mb * 2**20) // 4 * 4              # the fp32 buffer hello allocates
    return value, 2 * (world_size - 1) * nbytes // world_size
