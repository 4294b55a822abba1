"""minishard's own strategies under watch: they record themselves; the watch lends its tracer.

minishard's ``DDP``, ``ZeroOptimizer`` and ``fully_shard`` units send every collective and unit
state to their :class:`~minishard.core.comm.Comm`'s tracer, and every byte to their
:class:`~minishard.core.ledger.LiveLedger`'s. Inside the ``with`` both are the watch's tracer. What
the ledger held before the watch opened comes in as one ``alloc`` per category (tag ``before
watch``), so the timeline starts where the ledger stands; forward runs inside the ledger's
``activations()``, as ``train_step`` runs it. Built without a ledger, the strategy's memory is
counted by the watch itself, as for torch's jobs.
"""
from __future__ import annotations


def recorders(model, optimizer) -> tuple[list, list]:
    """The communicators and ledgers of minishard's strategies in this job (each once); empty
    lists when nothing in it is minishard's. Each of minishard's wrappers answers
    ``recorders()`` itself — ``DDP``, ``NaiveDDP``, ``ZeroOptimizer``, every FSDP unit — so a
    strategy built from new classes is watched once its classes answer it too."""
    from minishard.strategies.fsdp import units
    comms, ledgers = [], []

    def add(found: list, obj) -> None:
        if obj is not None and all(o is not obj for o in found):
            found.append(obj)
    for owner in [*units(model), *model.modules(), optimizer]:
        ask = getattr(owner, "recorders", None)
        if callable(ask):
            its_comms, its_ledgers = ask()
            for c in its_comms:
                add(comms, c)
            for led in its_ledgers:
                add(ledgers, led)
    for c in list(comms):
        add(ledgers, c.ledger)
    return comms, ledgers


def attach(w, comms: list, ledgers: list) -> None:
    """Point every recorder at the watch's tracer (restored on exit)."""
    for obj in comms + ledgers:
        w._undo.append(lambda obj=obj, old=obj.tracer: setattr(obj, "tracer", old))
        obj.tracer = w.tracer
    for ledger in ledgers:
        for device, held in ledger.by_device().items():
            for category, nbytes in held.items():
                w._emit("alloc", category=category, bytes=nbytes, tag=f"before watch:{category}",
                        device=device)


def activations(w, ledgers: list) -> None:
    """Count activations in the first ledger, by its own rule, from each forward to the next
    forward's start (autograd frees them during backward; the context only decides what is
    entered)."""
    if not ledgers:
        return
    ledger, open_ = ledgers[0], []

    def begin(module, args):
        if not open_:
            ctx = ledger.activations()
            ctx.__enter__()
            open_.append(ctx)

    def end(module, args, out):
        if open_:
            open_.pop().__exit__(None, None, None)
    w._undo += [w.model.register_forward_pre_hook(begin).remove,
                w.model.register_forward_hook(end).remove,
                lambda: end(None, None, None)]


def optimizer_state(w, ledgers: list) -> None:
    """Enter the moments a torch optimizer creates at its first step in the first ledger, as
    ``train_step`` does (minishard's ZeroOptimizer enters its own)."""
    from minishard.core.ledger import track_optimizer_state
    from minishard.strategies.zero import ZeroOptimizer
    if not ledgers or w._stepped is None or isinstance(w.optimizer, ZeroOptimizer):
        return
    w._undo.append(w._stepped.register_step_post_hook(
        lambda o, a, k: track_optimizer_state(ledgers[0], w._stepped, w.model)).remove)
