"""Compiling recorded Triton launches for Hopper (sm_90) without a GPU, and reading the registers
and stack each compiled kernel uses. Shared by the compile tests of kernels/ and of the worker.

A `Recorder` stands in for a JIT kernel while the code under test runs on CPU tensors: each launch
is recorded with its real arguments, constexprs and options instead of running, then compiled
here with the matching signature. Triton's NVIDIA backend ships ptxas and cuobjdump, so this works
on a machine with no GPU and no CUDA toolkit.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

# `make check-gpu-compile` runs the compile tests with the GPU image's Triton put first on the
# path; this makes sure that is the Triton they got.
if os.environ.get("LORASERVE_EXPECT_TRITON", triton.__version__) != triton.__version__:
    raise ImportError(
        f"expected Triton {os.environ['LORASERVE_EXPECT_TRITON']}, got {triton.__version__} "
        f"from {triton.__file__}"
    )

HOPPER = GPUTarget("cuda", 90, 32)
OPTIONS = ("num_warps", "num_stages", "launch_pdl")


class Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self.launches.append((self.kernel, args, kwargs))

        return launch


def record_launches(monkeypatch, module: Any, *names: str, into: list | None = None) -> list:
    """Replace the JIT kernels `names` of `module` by Recorders for the test; -> the list (`into`,
    or a new one) of (kernel, args, kwargs) they record, in launch order."""
    launches: list = [] if into is None else into
    for name in names:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), launches))
    return launches


def compile_launch(kernel: Any, args: tuple, kwargs: dict) -> Any:
    """Compile one recorded launch for sm_90 the way Triton's launcher would: each argument is
    typed and specialized by Triton's own rules (16-byte aligned pointers and ints divisible by 16
    get divisibility hints, ints equal to 1 become constants); constexprs and launch options as
    given, defaults where not given."""
    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    bound = dict(zip(names, args, strict=False))
    constexprs = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name not in bound:  # a constexpr left at its default
            default = params[name].default
            constexprs[name] = default.value if hasattr(default, "value") else default
            signature[name] = "constexpr"
        else:
            ty, key = native_specialize_impl(BaseBackend, bound[name], False, True, True)
            signature[name] = ty
            if ty == "constexpr":
                constexprs[name] = key
            elif isinstance(key, str) and key:
                attrs[(i,)] = BaseBackend.parse_attr(key)
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options=options)


def resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack/local bytes per thread of a cubin, from cuobjdump -res-usage (the
    tool ships with Triton's NVIDIA backend)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("Triton's cuobjdump is not available")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", out)}
