"""Package layout only (metadata: pyproject.toml). The kernels' CUDA sources stay in the top-level
cuda/ of the design card, and the wheel carries them as package data under pwctl/cuda, where
pwctl/kernels/build.py finds them in an installed package (in a checkout: beside pwctl/).
pyproject.toml alone cannot map one folder into a package that `packages.find` discovers."""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["pwctl*"]) + ["pwctl.cuda"],
    package_dir={"pwctl.cuda": "cuda"},
)
