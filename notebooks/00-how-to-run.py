# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 00 · How to run: real ranks from a notebook, from `torchrun`, and when one of them crashes
#
# Every later chapter runs *real* distributed training: several processes ("ranks") joined by
# PyTorch's gloo backend, sending real bytes to each other over sockets. This chapter shows the
# three ways of starting them and how to read what they did. The long explanation is in
# [tutorial/00-how-to-run.md](../tutorial/00-how-to-run.md); here is the code and what it measured.
#
# <details><summary>中文</summary>
#
# 后面每一章跑的都是*真实*的分布式训练：多个进程（rank）通过 PyTorch 的 gloo 后端连成一组，经 socket
# 互相发送真实的字节。本章演示启动它们的三种方式，以及怎样看懂它们做了什么。详细讲解见
# [tutorial/zh/00-how-to-run.md](../tutorial/zh/00-how-to-run.md)；这里是代码和它测出的结果。
#
# </details>
#
# **The one-line "syntax"**
#
# ```python
# with Ranks(N) as R:                     # N processes, started once, kept warm
#     out = R.run(task, **kwargs)         # task(rank_ctx, **kwargs) on every rank -> N results
# ```
#
# <details><summary>中文</summary>
#
# **一行"语法"**：`Ranks(N)` 启动 N 个进程，只启动一次、一直常驻；`R.run(task, **kwargs)` 在每个 rank 上
# 执行 `task(rank_ctx, **kwargs)`，返回 N 个结果。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import plotly.io as pio
from IPython.display import display

from minishard import RankError, Ranks
from minishard.course.ch00 import fail_on_rank, hello
from minishard.course.glue import glue
from minishard.training.loop import TrainConfig, train
from minishard.viz import Player, static_player_figure, timeline_figure

pio.renderers.default = "plotly_mimetype+notebook_connected"   # small files; renders offline in Lab
WORK = Path(tempfile.mkdtemp(prefix="minishard-00-"))

# %% [markdown]
# ## 1. A warm pool of ranks
# `Ranks(2)` starts two processes from a forkserver that has already imported torch, joins them
# into one process group, and keeps them. Starting costs a second or two (the cell prints this
# run's time); every `R.run` after that reuses the same processes.

# %%
# NBVAL_IGNORE_OUTPUT
t0 = time.perf_counter()
R = Ranks(2)
start_s = time.perf_counter() - t0
first = R.run(hello, payload_mb=1.0)
t0 = time.perf_counter()
second = R.run(hello, payload_mb=1.0)
task_s = time.perf_counter() - t0
print(f"pool up in {glue('pool-start-s', start_s, '{:.2f}')} s; a task on the warm pool takes {task_s:.2f} s")
print("rank pids:", [r["pid"] for r in first])
assert [r["pid"] for r in first] == [r["pid"] for r in second] == R.pids   # the same processes

# %% [markdown]
# `hello` (in [`minishard/course/ch00.py`](../minishard/course/ch00.py)) has every rank contribute
# `rank + 1` to one all-reduce of a 1 MiB buffer. Both ranks get 1 + 2 = 3, and each sent
# 2(N−1)/N · S = S bytes (the ring all-reduce of chapter 02).

# %%
# NBVAL_CHECK_OUTPUT
for r in second:
    sent = glue("hello-sent-bytes", r["wire"], "{:,}") if r["rank"] == 0 else f"{r['wire']:,}"
    print(f"rank {r['rank']} of {r['world_size']}: value {r['value']}, sent {sent} bytes")
assert all(r["value"] == 1 + 2 for r in second)
assert all(r["wire"] == 2 * (2 - 1) * 2**20 // 2 for r in second)

# %% [markdown]
# ## 2. Watching a run live
# Pass `on_event=` and every event a rank records (an allocation entered in its memory ledger,
# a collective, a phase beginning or ending) reaches the notebook while the ranks train. The
# player below fills up as they go: memory per rank on the left, the collective in flight on the
# ring, the per-rank timeline underneath.

# %%
live = Player(title="live: 2 ranks, DDP, nano model, 2 steps")
display(live.widget)
out = R.run(train, TrainConfig(strategy="ddp", steps=2, model="nano"), on_event=live.feed)
live.flush()

# %% [markdown]
# Before the first step, DDP broadcasts rank 0's parameters so that every replica starts
# identical; after that, each step is one all-reduce per gradient bucket.

# %%
kinds = collections.Counter(e["kind"] for e in R.last_events)
ops = collections.Counter((e["op"], e.get("step")) for e in R.last_events if e["kind"] == "collective")
glue("live-collectives", kinds["collective"])     # printed as the dict's 'collective' entry
print(f"{glue('live-events', live.replay.n)} events streamed:", dict(sorted(kinds.items())))
print("collectives (op, step):", dict(ops))
assert live.replay.n == len(R.last_events) and live.replay.ranks == [0, 1]
assert {op for op, step in ops if step is None} == {"broadcast"}          # set-up only
assert all(ops[("all_reduce", s)] == 2 * out[0]["calls"][s] for s in (0, 1))   # 2 ranks x buckets

# %% [markdown]
# The player is driven from code as well as from its buttons. Jump to the moment each rank begins
# step 1's backward pass: it holds its parameters, its gradient buckets, the Adam moments made in
# step 0 and the activations its forward saved — and nothing else. (The ranks are not in
# lock-step: at rank 0's moment, rank 1 may still be finishing its optimizer step; they only meet
# in collectives.)

# %%
# NBVAL_CHECK_OUTPUT
def at_backward(player, step=1):
    """Each rank's ledger at the moment *it* begins backward in ``step``."""
    snaps = {}
    for r in player.replay.ranks:
        player.jump_to_phase("backward", step=step, rank=r)
        snaps[r] = player.snapshot()[r]
    return snaps

snap = at_backward(live)
for rank, cats in snap.items():
    print(f"rank {rank}:", ", ".join(f"{c} {b:,}" for c, b in cats.items() if b))
assert snap[0] == snap[1]                          # DDP: both ranks hold the same amounts
assert snap[0]["grads"] == snap[0]["params"] == 4 * out[0]["n_params"]

# %% [markdown]
# The same replay as a plain figure with its own Play button and slider (memory bars only): it
# needs no kernel, so it also plays on an exported HTML page.

# %%
static_player_figure(R.last_events, max_frames=60).show()

# %% [markdown]
# ## 3. The same job under `torchrun`
# On a cluster you start ranks with `torchrun`, one process per device. `python -m minishard demo`
# is written for that: each rank joins the process group from torchrun's environment, trains,
# and writes its events to `DIR/rank{r}.jsonl` — and its last collectives to
# `DIR/flight_rank{r}.json`, the flight recorder `python -m minishard doctor DIR` reads when a run
# breaks. Here the notebook runs it as a subprocess (with a timeout, always) and then replays the
# trace files in the same player.

# %%
# NBVAL_IGNORE_OUTPUT
trace_dir = WORK / "torchrun-ddp-nano"
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
       "-m", "minishard", "demo", "--strategy", "ddp", "--steps", "2", "--model", "nano",
       "--trace", str(trace_dir)]
print("$", " ".join(["torchrun"] + cmd[3:]))
t0 = time.perf_counter()
proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
print(proc.stdout)
print(f"torchrun took {time.perf_counter() - t0:.1f} s (a cold start: each rank imports torch)")
assert proc.returncode == 0, proc.stderr[-3000:]
assert sorted(p.name for p in trace_dir.iterdir()) == ["flight_rank0.json", "flight_rank0.ring",
                                                       "flight_rank1.json", "flight_rank1.ring",
                                                       "rank0.jsonl", "rank1.jsonl", "trace.json"]

# %% [markdown]
# Same model, same seeds, same data, two launchers: the losses agree to every digit `torchrun`
# printed (four decimals), and the two traces hold the same events and the same ledger.

# %%
replay = Player(trace_dir, title="replayed from torchrun's trace files")
display(replay.widget)

# %%
loss_line = next(line for line in proc.stdout.splitlines() if line.startswith("losses"))
torchrun_losses = [float(x) for x in loss_line.split(":")[1].split()]   # the global batch's loss
assert torchrun_losses == [round(sum(o["losses"][s] for o in out) / len(out), 4) for s in range(2)]
same = collections.Counter(e["kind"] for e in replay.replay.events)
print("events by kind, pool :", dict(sorted(kinds.items())))
print("events by kind, torchrun:", dict(sorted(same.items())))
print("losses of the global batch, torchrun:",
      glue("torchrun-losses", tuple(torchrun_losses), "{:.4f} {:.4f}"), "(the pool's, rounded alike: the same)")
assert same == kinds
assert at_backward(replay) == snap                 # the same ledger at the same moment

# %% [markdown]
# The trace directory also opens in [Perfetto](https://ui.perfetto.dev): convert it once, then
# drag the JSON file onto the page. Each rank is a process with a compute track (phases), a
# communication track (collectives) and a memory counter per ledger category.

# %%
# NBVAL_IGNORE_OUTPUT
perfetto_json = WORK / "ddp-nano.perfetto.json"
done = subprocess.run([sys.executable, "-m", "minishard", "perfetto", str(trace_dir), str(perfetto_json)],
                      capture_output=True, text=True, timeout=60)
assert done.returncode == 0, done.stderr
chrome = json.loads(perfetto_json.read_text())["traceEvents"]
print(done.stdout.strip(), f"({len(chrome)} trace events, {perfetto_json.stat().st_size:,} bytes)")
assert {e["args"]["name"] for e in chrome if e["name"] == "process_name"} == {"rank 0", "rank 1"}

# %% [markdown]
# A static timeline of the same run (it needs no kernel, so it also shows on an exported page):

# %%
timeline_figure(replay.replay.events).update_layout(title="torchrun, 2 ranks: compute and communication").show()

# %% [markdown]
# ## 4. When a rank crashes
# `fail_on_rank` runs three all-reduces; at step 1 one rank raises instead of joining. Its peer is
# left inside the all-reduce and then dies of "Connection closed by peer" — a symptom. The
# launcher reports the rank that failed *first*, with that rank's own traceback.

# %%
# NBVAL_CHECK_OUTPUT
t0 = time.perf_counter()
try:
    R.run(fail_on_rank, bad_rank=1)
    raise AssertionError("the task should have failed")
except RankError as e:
    err = e
fail_s = time.perf_counter() - t0
print(f"RankError: rank {err.rank} failed first: {err.error}")
print("last line of rank 1's own traceback:", err.rank_traceback.strip().splitlines()[-1])
assert err.rank == 1 and "simulated crash on rank 1 at step 1" in err.error
assert "fail_on_rank" in err.rank_traceback       # the failing rank's frame, not its peer's
assert fail_s < 30

# %% [markdown]
# A failed pool is torn down — its process group may be stuck halfway through a collective — and
# refuses further work. Start a new one.

# %%
# NBVAL_CHECK_OUTPUT
print("pool alive after the crash:", R.alive)
try:
    R.run(hello)
except RuntimeError as e:
    print("R.run ->", e)
R = Ranks(2)
print("new pool:", [r["value"] for r in R.run(hello)])
assert R.alive
R.close()

# %% [markdown]
# > **Takeaway.** A task is a module-level function `task(rank_ctx, ...)`, importable by the rank
# > processes (not defined in a notebook cell). `Ranks(N)` keeps N processes warm for many tasks;
# > `on_event=` streams their events live; `torchrun -m minishard demo --trace DIR` produces the
# > same events as files, which the player and Perfetto replay. When a rank crashes you get *its*
# > error as `RankError`, and you start a new pool.
#
# <details><summary>中文</summary>
#
# > **要点。** 任务是模块级函数 `task(rank_ctx, ...)`，必须能被 rank 进程导入（不能定义在 notebook 单元格里）。
# > `Ranks(N)` 让 N 个进程常驻，供许多任务复用；`on_event=` 把它们的事件实时流式传回；
# > `torchrun -m minishard demo --trace DIR` 以文件形式产出同样的事件，由回放器和 Perfetto 回放。某个 rank
# > 崩溃时，你拿到的是*它自己*的错误 `RankError`，然后新建一个进程池。
#
# </details>
#
# **Questions**
#
# 1. Why must the task function live in a `.py` file rather than in a notebook cell?
#
# <details><summary>Answer</summary>
#
# The rank processes are separate Python interpreters. They receive the task *by name*
# (`minishard.course.ch00:hello`) and import it; a function defined in the notebook lives only in the
# kernel's `__main__` and cannot be imported by another process.
# </details>
#
# 2. In the crash above, rank 0 also failed. Why is rank 0's error the wrong one to debug?
#
# <details><summary>Answer</summary>
#
# Rank 0 was waiting inside an all-reduce for a partner that had already died, so it failed with
# "Connection closed by peer". That error says *that* a peer vanished, not *why*. The cause is
# rank 1's own exception, which it reported before its socket closed; the launcher raises the
# earliest report.
# </details>

# %% [markdown]
# ## Exercise: predict, then run
# Before starting any rank, write down what `hello` will report: the value every rank holds after
# its all-reduce, and the bytes each rank sends for it. The check then runs `hello` on 2 and on 3
# real ranks and compares, rank by rank.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch00.py`](../minishard/course/exercises/ch00.py)), then run the check. A
# reference solution is in [`solutions/ch00.py`](../solutions/ch00.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：先预测，再运行。** 在启动任何 rank 之前，先写下 `hello` 会报告什么：all-reduce 之后每个 rank 持有的值，
# 以及每个 rank 为此发送的字节数。检查程序随后在 2 个和 3 个真实 rank 上运行 `hello`，逐 rank 比对。
# 答案写在下面的单元格里（或者编辑 [`minishard/course/exercises/ch00.py`](../minishard/course/exercises/ch00.py)
# 里的桩函数），然后运行检查。参考答案在 [`solutions/ch00.py`](../solutions/ch00.py)：先自己试。
#
# </details>

# %%
def predict_hello(world_size: int, payload_mb: float) -> tuple[float, int]:
    """(the value every rank holds after hello's all-reduce, the bytes each rank sends for it —
    whole bytes, rounded down). hello: every rank fills payload_mb MiB of fp32 with rank + 1."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch00

ch00.check_predict_hello(predict_hello)
