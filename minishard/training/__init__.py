"""The training loop every chapter runs, and what it is configured and measured with.

    step.py         ``train_step``: forward, backward, synchronise, clip, step, zero
    loop.py         ``train``: the run around the step (build, resume, steps, saves)
    report.py       what a run returns: the measurements, the ledger beside its formula
    config.py       ``TrainConfig``: one run, checked before any rank starts
    meter.py        step times, communication per step, losses
    parity.py       how close two trainings ended (drift, bit-equality)
    hooks.py        what a caller may wrap around a run's objects (chapter 11 plants its faults so)
"""
