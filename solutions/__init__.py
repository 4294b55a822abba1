"""Reference solutions to the exercises in ``minishard/course/exercises/`` (one module per chapter).

Look here after trying: each function is what the matching stub's docstring asks for, and
``tests/test_exercises.py`` runs every check with it.
"""
