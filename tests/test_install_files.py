"""pyproject.toml declares exactly what requirements/*.txt list, so both ways of installing agree."""

import os
import re
import tomllib

from conftest import ROOT


def requirements(name):
    with open(os.path.join(ROOT, "requirements", name)) as f:
        return sorted(line.split("#")[0].strip() for line in f if line.split("#")[0].strip())


def test_pyproject_extras_match_the_requirements_files():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert sorted(project["dependencies"]) == requirements("requirements.txt")
    extras = project["optional-dependencies"]
    for extra in ("mujoco", "atari", "envpool", "ray", "video", "dev"):
        assert sorted(extras[extra]) == requirements(f"requirements-{extra}.txt"), extra
    assert set(re.findall(r"\w+", extras["all"][0].split("[")[1])) == {"mujoco", "atari", "envpool", "ray", "video", "dev"}
    for requirement in sum((extras[e] for e in extras if e != "all"), project["dependencies"]):
        assert ">=" in requirement and "==" not in requirement  # lower bounds, no exact pins
