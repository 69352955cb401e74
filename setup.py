"""Packages by walking the source tree: fxdream/ as fxdream, passes/ as fxdream.passes and
models/ as fxdream.models (the project's design card keeps those two at the top). Every folder
with an __init__.py is a package, so a new subpackage cannot be left out of the wheel."""
from setuptools import find_packages, setup

PACKAGE_DIRS = {"fxdream": "fxdream", "fxdream.passes": "passes", "fxdream.models": "models"}


def packages() -> list[str]:
    found = []
    for package, folder in PACKAGE_DIRS.items():
        found.append(package)
        found += [f"{package}.{sub}" for sub in find_packages(where=folder)]
    return found


# data files the code reads at run time: the fitted GPU parameters (fxdream.sim.cost.devices)
PACKAGE_DATA = {"fxdream.sim.cost": ["fits/*.json"]}

setup(packages=packages(), package_dir=PACKAGE_DIRS, package_data=PACKAGE_DATA)
