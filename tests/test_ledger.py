"""The analytic ledger reproduces the course's figures, and the live ledger measures them."""
import pytest
import torch

from minishard.core.ledger import LiveLedger, track_optimizer_state
from minishard.planner.analytic import conventions, count_params, estimate, gpt_activation_bytes
from minishard.core.model import GPT, batch, config

PSI = 6_868_992      # the tiny GPT (docs/reference-figures.md)


def test_bf16_mixed_adamw_keeps_16_bytes_per_param():
    est = estimate(n_params=1000, precision="bf16_mixed", optimizer="adamw")
    assert est.per_rank == {"params": 2000, "grads": 2000, "master": 4000,
                            "exp_avg": 4000, "exp_avg_sq": 4000}
    assert est.bytes_per_param == 16


def test_8b_model_needs_128_gb_under_ddp():
    net = GPT("llama3-8b", device="meta")
    assert count_params(net) == 8_030_261_248           # Llama 3 8B's published count
    est = estimate(net, world_size=8, strategy="ddp")
    assert est.per_rank["params"] == 2 * 8_030_261_248   # the "16 GB" of bf16 weights
    assert est.state_bytes == 16 * 8_030_261_248         # 128.5 GB on *every* rank
    assert est.state_bytes > 80e9


@pytest.mark.parametrize("N", [1, 2, 4, 8, 64, 1024])
def test_zero_stage_formulas(N):
    psi = 7_500_000_000   # the ZeRO paper's example
    shard = -(-psi // N)  # ceil: the last rank's shard is padded when N does not divide psi
    bpp = {s: estimate(n_params=psi, world_size=N, strategy=s).state_bytes for s in
           ("ddp", "zero1", "zero2", "zero3")}
    assert bpp["ddp"] == 16 * psi
    assert bpp["zero1"] == 4 * psi + 12 * shard
    assert bpp["zero2"] == 2 * psi + 14 * shard
    assert bpp["zero3"] == 16 * shard


def test_zero_paper_table_7_5b_on_64_gpus():
    # ZeRO paper, Figure 1: 120 GB (DDP), 31.4 GB (Pos), 16.6 GB (Pos+g), 1.9 GB (Pos+g+p)
    got = [estimate(n_params=7_500_000_000, world_size=64, strategy=s).state_bytes / 1e9
           for s in ("ddp", "zero1", "zero2", "zero3")]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_uneven_world_size_pads_the_last_shard():
    est = estimate(n_params=10, world_size=3, strategy="zero3", precision="fp32")
    assert est.per_rank["params"] == 4 * 4               # ceil(10/3) = 4 elements each


def test_each_quoted_bytes_per_param_comes_from_its_own_setting():
    quoted = {(c.bytes_per_param, c.precision, c.optimizer) for c in conventions()}
    assert quoted == {(16, "bf16_mixed", "adamw"), (16, "fp32", "adamw"), (16, "bf16_fsdp", "adamw"),
                      (18, "bf16_mixed_fp32_grads", "adamw"), (20, "fp16_mixed", "adamw"),
                      (10, "bf16_mixed", "adamw_8bit"), (12, "fp32", "sgd_momentum"), (8, "fp32", "sgd")}
    for c in conventions():              # the breakdown a row prints adds up to its figure
        assert sum(int(t) for t in c.breakdown.split(":")[0].split(" + ")) == c.bytes_per_param, c
        assert c.source


@pytest.mark.parametrize("kw", [dict(strategy="zero4"), dict(precision="fp8"),
                                dict(optimizer="lion"), dict(world_size=0), dict(world_size=1.5)])
def test_bad_input_names_the_problem(kw):
    with pytest.raises(ValueError, match=list(kw)[0].replace("_", ".?")):
        estimate(n_params=100, **kw)


def test_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match="no trainable parameters"):
        estimate(torch.nn.ReLU())


@pytest.mark.parametrize("name,kw,mb", [
    ("nano", {}, 3),
    ("tiny", {"n_layer": 2}, 2),
    ("tiny", dict(n_layer=2, mlp="swiglu", norm="rmsnorm", n_kv_head=2, bias=False,
                  learned_pos=False), 2),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_formula_equals_what_autograd_saves(name, kw, mb, dtype):
    cfg = config(name, **kw)
    net = GPT(cfg).to(dtype)
    ledger = LiveLedger()
    for n, p in net.named_parameters():
        ledger.track("params", p, n)
    with ledger.activations():
        loss = net(*batch(cfg, 0, mb))
    x = torch.finfo(dtype).bits // 8
    assert ledger.current()["activations"] == gpt_activation_bytes(cfg, mb, dtype_bytes=x)
    loss.backward()                                      # backward releases every saved tensor
    assert ledger.current().get("activations", 0) == 0


def test_live_ledger_tracks_optimizer_state_and_peaks():
    net = GPT("nano")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ledger = LiveLedger()
    for n, p in net.named_parameters():
        ledger.track("params", p, n)
    net(*batch(net.cfg, 0, 1)).backward()
    opt.step()
    track_optimizer_state(ledger, opt, net)
    track_optimizer_state(ledger, opt, net)              # idempotent
    n = count_params(net)
    assert ledger.current() == {"params": 4 * n, "exp_avg": 4 * n, "exp_avg_sq": 4 * n}
    with pytest.raises(KeyError, match="already live"):
        ledger.alloc("params", 1, "tok_emb.weight")
    with pytest.raises(ValueError, match="unknown ledger category"):
        ledger.alloc("weights", 1, "x")


def test_out_of_memory_carries_what_it_allocated_and_what_the_device_held():
    """The exception is data (the course reads its fields, not its message), and its message
    is the report the notebooks print, unchanged."""
    import pickle

    from minishard.core.ledger import DeviceOutOfMemory
    led = LiveLedger(budget=10 * 2**20)
    led.alloc("params", 6 * 2**20, "p")
    led.alloc("activations", 3 * 2**20, "act1")
    led.alloc("grads", 2**20, "g", device="host")              # not on the device: not held
    with pytest.raises(DeviceOutOfMemory) as info:
        led.alloc("unsharded", 2 * 2**20, "blocks.3 (full)")
    e = info.value
    assert (e.category, e.tag, e.nbytes) == ("unsharded", "blocks.3 (full)", 2 * 2**20)
    assert (e.budget, e.would_be) == (10 * 2**20, 11 * 2**20)
    assert e.held == {"params": 6 * 2**20, "activations": 3 * 2**20}
    assert str(e) == ("allocating 2.0 MiB of unsharded (blocks.3 (full)) would take the device to "
                      "11.0 MiB, over its budget of 10.0 MiB; held now (MiB): activations 3.0, params 6.0")
    back = pickle.loads(pickle.dumps(e))                       # a rank can send it whole
    assert (back.held, back.would_be, str(back)) == (e.held, e.would_be, str(e))
    assert not led.is_live("blocks.3 (full)") and led.total == 9 * 2**20


def test_the_meter_counts_the_page_faults_of_a_fresh_buffer():
    """A step that fills a fresh 64 MiB buffer touches pages the OS must map: the meter counts
    them (4 KiB pages: ~16 K faults; with transparent huge pages, fewer), a step that does not
    takes fewer."""
    from minishard.training.meter import Meter
    meter = Meter([])
    with meter.step():
        torch.ones(16 * 2**20)
    with meter.step():
        pass
    fresh, idle = meter.steps["page_faults"]
    assert fresh >= 32 and idle < fresh


def test_the_device_budget_counts_only_the_device():
    """Offloading to host or disk is how a run fits a device budget: state entered on another
    device must not take room on the device, however large it is — or offload would raise the
    very out-of-memory it is meant to avoid."""
    from minishard.core.ledger import DeviceOutOfMemory
    MiB = 2**20
    led = LiveLedger(budget=10 * MiB)
    led.alloc("params", 6 * MiB, "p")
    led.alloc("master", 8 * MiB, "m", device="host")             # more than the device has left
    led.alloc("exp_avg", 64 * MiB, "a", device="disk")           # more than the whole budget
    assert led.total == 6 * MiB
    assert led.by_device() == {"device": {"params": 6 * MiB}, "host": {"master": 8 * MiB},
                               "disk": {"exp_avg": 64 * MiB}}
    led.alloc("grads", 4 * MiB, "g")                             # the device's last 4 MiB
    with pytest.raises(DeviceOutOfMemory) as info:               # and not one byte more
        led.alloc("activations", 1, "act1")
    assert info.value.would_be == 10 * MiB + 1


def test_optimizer_state_of_every_param_group_is_entered():
    """The usual AdamW set-up has two parameter groups (decayed weights, undecayed biases and
    norms); both groups' moments are model-sized state. Entering only the first group's (the
    second's i-th parameter mistaken for the first's) would understate the optimizer's memory."""
    net = GPT("nano")
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    assert decay and no_decay
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    net(*batch(net.cfg, 0, 1)).backward()
    opt.step()
    moment = sum(p.numel() * p.element_size() for p in net.parameters())   # one fp32 copy
    for module in (net, None):          # named by the module, or by place (a master's copies)
        ledger = LiveLedger()
        track_optimizer_state(ledger, opt, module)
        assert ledger.current() == {"exp_avg": moment, "exp_avg_sq": moment}


def test_mixed_precision_ddp_names_the_moments_for_the_master_they_step():
    """bf16 DDP steps an fp32 master copy: the moments belong to it (fp32, its size), and their
    tags say so — what chapter 03 prints of DDP's optimizer allocations."""
    from minishard.core.comm import Comm
    from minishard.strategies.registry import build
    from minishard.training.config import TrainConfig
    net, ledger = GPT("nano"), LiveLedger()
    built = build(net, TrainConfig(strategy="ddp", model="nano", precision="bf16_mixed", optimizer="adamw"),
                  Comm(), ledger)
    built.model(*batch(net.cfg, 0, 1)).backward()
    built.optimizer.step()
    built.track_state(ledger)
    moments = [t for t in ledger._live if t.split(":")[0].endswith(("exp_avg", "exp_avg_sq"))]
    assert len(moments) == 2 * len(list(net.parameters()))
    assert all(t.startswith("master_") for t in moments), moments[:3]
    now = ledger.current()
    assert now["exp_avg"] == now["exp_avg_sq"] == now["master"] == 4 * count_params(net)


def test_the_optimizer_state_is_entered_on_the_device_asked_for():
    """Offloaded moments live in host memory: ``device="host"`` enters them there, not on the
    ledger's device."""
    net = GPT("nano")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(*batch(net.cfg, 0, 1)).backward()
    opt.step()
    ledger = LiveLedger()
    track_optimizer_state(ledger, opt, net, device="host")
    moment = sum(p.numel() * p.element_size() for p in net.parameters())
    assert ledger.by_device() == {"host": {"exp_avg": moment, "exp_avg_sq": moment}}


def test_sgds_momentum_buffers_are_entered_as_momentum():
    net = GPT("nano")
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    net(*batch(net.cfg, 0, 1)).backward()
    opt.step()
    ledger = LiveLedger()
    track_optimizer_state(ledger, opt, net)
    assert ledger.current() == {"momentum": sum(p.numel() * p.element_size() for p in net.parameters())}
