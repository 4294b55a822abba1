"""The course's code, one module per chapter — apart from the engine, which never imports it.

``minishard.course.chNN`` holds chapter NN's rank tasks (run them with ``Ranks(N).run(task, ...)``;
they return plain data a notebook prints and asserts on) and its small views of traces;
``minishard.course.exercises`` the exercises and their checks. Everything a chapter measures is
allocated, sent and recorded by the engine (``minishard.strategies.ddp``, ``zero``, ``fsdp``, ...); nothing
here is a strategy. Installed with the ``course`` extra (``pip install minishard[course]``),
with the widgets of ``minishard.viz``.
"""
