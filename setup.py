"""Package discovery only; every other setting is in pyproject.toml.

The kernels live in the top-level ``kernels/`` folder and are imported as ``transfer_engine.kernels``:
the wheel and an editable install both map that one subpackage to its folder and find the rest.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["transfer_engine", "transfer_engine.*"])
packages.append("transfer_engine.kernels")
packages += [f"transfer_engine.kernels.{sub}" for sub in find_packages(where="kernels")]

setup(
    packages=packages,
    package_dir={"transfer_engine.kernels": "kernels"},
    package_data={"transfer_engine": ["py.typed"]},
)
