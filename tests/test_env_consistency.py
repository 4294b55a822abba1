"""environment.yml (for conda users) and pyproject.toml declare the same dependencies."""
import pathlib
import tomllib

import yaml
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _norm(reqs):
    return {Requirement(r).name.lower().replace("_", "-"): str(Requirement(r).specifier) for r in reqs}


def test_environment_yml_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert _norm([r for r in pip if not r.startswith("-")]) == _norm(py["project"]["dependencies"])
    pyv = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert Requirement("python" + py["project"]["requires-python"]).specifier.contains(pyv.split("=")[-1])


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make test" in readme


def test_make_test_fails_when_either_part_of_its_second_lane_fails(tmp_path):
    """The lane beside the tests runs the notebooks, then the static site's tests: both run
    whatever the first did, and ``make test``'s command fails if either failed (a status lost
    between make's shell and the lane's would pass a failing notebook). The command as make
    runs it, with a stand-in python for everything but scripts/alongside.py."""
    import subprocess
    import sys
    out = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    line = next(x for x in out.replace("\\\n", " ").splitlines() if "scripts/alongside.py" in x)
    assert "notebooks" in line and "tests/test_site.py" in line
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    for notebooks, site in ((1, 0), (0, 1), (1, 1), (0, 0)):
        python.write_text(
            f'#!/bin/sh\ncase "$1" in scripts/alongside.py) shift; exec {sys.executable} '
            f'{ROOT}/scripts/alongside.py "$@";; esac\n'
            f'case "$*" in *" tests --ignore="*) exit 0;; *notebooks*) echo nb >> ran; exit {notebooks};; '
            f'*test_site*) echo site >> ran; exit {site};; esac\nexit 3\n')
        python.chmod(0o755)
        (tmp_path / "ran").unlink(missing_ok=True)
        status = subprocess.run(["sh", "-c", line], cwd=tmp_path, capture_output=True, timeout=60).returncode
        assert (status != 0) == bool(notebooks or site), (notebooks, site, status)
        assert (tmp_path / "ran").read_text().split() == ["nb", "site"]


def test_make_course_starts_jupyterlab_as_root_and_as_anyone_else():
    """JupyterLab refuses root without ``--allow-root`` (containers and many cloud machines run
    as root); anyone else gets no such flag. ``make course``'s command as make runs it, for the
    user id the Makefile reads (``id -u``, overridden here as ``USER_ID``)."""
    import subprocess

    def jupyter_line(uid: str) -> list[str]:
        out = subprocess.run(["make", "-n", "course", f"USER_ID={uid}"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60).stdout
        return next(x for x in out.splitlines() if "jupyter lab" in x).split()

    assert "--allow-root" in jupyter_line("0")
    assert "--allow-root" not in jupyter_line("1000")
    assert "USER_ID ?= $(shell id -u)" in (ROOT / "Makefile").read_text()    # (who runs make decides)
