"""pyproject.toml declares exactly what requirements/*.txt list, so both ways of installing agree."""

import glob
import os
import re
import tomllib

from packaging.requirements import Requirement

from script_runs import ROOT


def requirements(name):
    with open(os.path.join(ROOT, "requirements", name)) as f:
        return sorted(line.split("#")[0].strip() for line in f if line.split("#")[0].strip())


def test_pyproject_extras_match_the_requirements_files():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert sorted(project["dependencies"]) == requirements("requirements.txt")
    extras = project["optional-dependencies"]
    for extra in ("mujoco", "dm-control", "atari", "envpool", "ray", "video", "wandb", "tune", "dev"):
        assert sorted(extras[extra]) == requirements(f"requirements-{extra}.txt"), extra
    assert set(re.findall(r"[\w-]+", extras["all"][0].split("[")[1])) == {
        "mujoco",
        "dm-control",
        "atari",
        "envpool",
        "ray",
        "video",
        "wandb",
        "tune",
        "dev",
    }
    for requirement in sum((extras[e] for e in extras if e != "all"), project["dependencies"]):
        assert ">=" in requirement and "==" not in requirement  # lower bounds, no exact pins


def test_the_install_commands_spell_each_extra_as_the_package_metadata_does():
    """pip before 23.3 looks an extra up as spelled: `.[dm_control]` found no `dm-control` (the name the metadata
    holds, PEP 685) and installed nothing for it, with only a warning."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    named = set()
    for path in ("README.md", ".ci/run", *glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(os.path.join(ROOT, path)) as f:
            named |= {name for group in re.findall(r'"\.\[([^\]]+)\]"', f.read()) for name in group.split(",")}
    assert {"mujoco", "dm-control", "envpool"} <= named
    assert {name for name in named if name not in extras or name != re.sub(r"[-_.]+", "-", name).lower()} == set()


def test_the_gpu_machines_packages_meet_the_requirements():
    """The H100 machine has torch 2.11 (CUDA 13) and no package index; ../shared/gpu/pack.sh brings the rest at these
    versions. Requirements that they meet install nothing over them: no multi-GB torch download on a GPU machine."""
    ran_there = {
        "torch": "2.11.0",
        "tensordict": "0.15.3",
        "tyro": "1.0.17",
        "gymnasium": "1.4.0",
        "mujoco": "4.0.0",
        "envpool": "1.2.7",
    }
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = [
        Requirement(r)
        for r in project["dependencies"]
        + project["optional-dependencies"]["mujoco"]
        + project["optional-dependencies"]["envpool"]
    ]
    checked = {r.name: r.specifier.contains(ran_there[r.name]) for r in requirements if r.name in ran_there}
    assert checked == dict.fromkeys(ran_there, True)
