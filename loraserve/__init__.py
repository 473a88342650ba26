"""loraserve: multi-LoRA LLM serving, an adapter store and GPU inference workers over gRPC."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("loraserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
