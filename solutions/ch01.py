"""Reference solution, chapter 01 (``minishard.course.exercises.ch01``)."""


def ddp_state_bytes(n_params: int, precision: str) -> dict[str, int]:
    if precision == "fp32":          # the weights are their own master copy
        per = {"params": 4, "grads": 4, "exp_avg": 4, "exp_avg_sq": 4}
    elif precision == "bf16_mixed":
        per = {"params": 2, "grads": 2, "master": 4, "exp_avg": 4, "exp_avg_sq": 4}
    else:
        raise ValueError(precision)
    return {c: b * n_params for c, b in per.items()}
