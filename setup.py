"""Package discovery for the repository's fixed layout (the rest is in pyproject.toml).

`connectors/`, `ops/` and `monitoring/` are top-level folders of the repository
but install under one name, as `stream_ctr.connectors`, `stream_ctr.ops` and
`stream_ctr.monitoring`, so the wheel puts no generic top-level package into
site-packages. pyproject.toml alone cannot find subpackages of a mapped
folder (find_packages names them `connectors.kafka`, not
`stream_ctr.connectors.kafka`); this does, so a new subpackage needs no edit here.
"""
from setuptools import find_packages, setup

MAPPED = {"stream_ctr.connectors": "connectors", "stream_ctr.ops": "ops",
          "stream_ctr.monitoring": "monitoring"}

packages = find_packages(include=["stream_ctr", "stream_ctr.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]

setup(packages=packages, package_dir={"stream_ctr": "stream_ctr", **MAPPED})
