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
