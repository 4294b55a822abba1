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
    lists when nothing in it is minishard's."""
    from minishard.strategies.ddp import DDP, NaiveDDP
    from minishard.strategies.zero import ZeroOptimizer
    comms, ledgers = [], []

    def add(found: list, obj) -> None:
        if obj is not None and all(o is not obj for o in found):
            found.append(obj)
    owners = [m for m in model.modules() if hasattr(m, "_fsdp_unit")]
    for u in (m._fsdp_unit for m in owners):
        add(comms, u.comm), add(comms, u.replicate), add(ledgers, u.ledger)
    if isinstance(model, (DDP, NaiveDDP)):
        add(comms, model.comm), add(ledgers, getattr(model, "ledger", None))
    if isinstance(optimizer, ZeroOptimizer):
        add(comms, optimizer.comm), add(ledgers, optimizer.ledger)
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
