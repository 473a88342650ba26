"""One import namespace over the design's top-level folders: `loraserve` itself (command line,
launcher, contract, serving plumbing, generated stubs in loraserve/v1) and each service's and the
clients' folder mapped under it, so `kernels/` installs as `loraserve.kernels`."""

from setuptools import find_packages, setup

ROOTS = {
    "loraserve": "loraserve",
    "loraserve.adapter_store": "adapter_store",
    "loraserve.inference_worker": "inference_worker",
    "loraserve.kernels": "kernels",
    "loraserve.clients": "clients",
    "loraserve.gateway": "gateway",
}

packages = []
for name, folder in ROOTS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(package_dir=ROOTS, packages=packages)
