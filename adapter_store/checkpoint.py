"""A PEFT checkpoint as read from a source: adapter_config.json + adapter_model.safetensors.

The safetensors header is parsed and checked here before any tensor is materialised: an 8-byte
little-endian header length, then a JSON object `{name: {dtype, shape, data_offsets}}` whose
offsets are relative to the end of the header. Sizes, counts, dtypes and offsets are bounded
first, so a hostile file cannot make the store allocate more than the file holds.
Hand-written because the safetensors library cannot do this: its loaders copy every tensor out
before the caller sees a count, dtype or shape (and view without a copy only from a file).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass

import torch

from loraserve.adapter_store.errors import InvalidArgument

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
# The header is bounded by the tensor count before it is parsed (parsing holds the interpreter
# lock): a real entry takes ~150 bytes (name, dtype, shape, offsets), plus __metadata__.
HEADER_BYTES_PER_TENSOR = 512
HEADER_METADATA_BYTES = 64 << 10
# Longest tensor name accepted: PEFT's names of a Llama-family model take ~70 characters.
MAX_TENSOR_NAME_CHARS = 512
# Deepest nesting of arrays/objects accepted in adapter_config.json or a safetensors header; real
# ones nest 3 levels. Deeper input is refused, never a RecursionError.
MAX_JSON_DEPTH = 32
# Bounds of a tensor's shape, checked before its size is computed: a LoRA factor is 2-D, and no
# dimension of a real one passes a few hundred thousand. Within them the size has at most ~120
# digits (unbounded, the product of two 2,200-digit dimensions passes int-to-str's 4,300 digits).
MAX_TENSOR_RANK = 8
MAX_TENSOR_DIM = 1 << 48

# safetensors dtype tag -> (torch dtype, bytes per element); only float types are accepted.
FLOAT_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
}

PICKLE_MESSAGE = (
    "adapter_model.bin is a pickle checkpoint and is refused (loading pickles can execute code). "
    "Convert it in a trusted environment: load it with torch and save it as safetensors, e.g. "
    "`PeftModel.from_pretrained(base, path).save_pretrained(out, safe_serialization=True)` or "
    "`safetensors.torch.save_file(torch.load(path), 'adapter_model.safetensors')`"
)


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte range in the data section
    end: int


@dataclass
class PeftCheckpoint:
    config: dict
    tensors: dict[str, torch.Tensor]


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def load_json(data: bytes, what: str, *, unique_keys: bool = False) -> object:
    """Parse untrusted JSON: any malformed or too deeply nested input is InvalidArgument, and so is
    a key repeated in one object where `unique_keys` (json.loads would keep the last silently)."""
    try:
        value = json.loads(data, object_pairs_hook=_unique_keys if unique_keys else None)
    except _DuplicateKey as exc:
        raise InvalidArgument(f"{what} repeats the key {str(exc)[:200]!r}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int past int()'s digit limit
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from exc
    except RecursionError:  # the C decoder stops at the interpreter's recursion limit
        raise InvalidArgument(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    # iterative walk: no recursion on input shape
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def parse_config(data: bytes) -> dict:
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidArgument(f"{CONFIG_FILE} is {len(data)} bytes, over the {MAX_CONFIG_BYTES} byte limit")
    config = load_json(data, CONFIG_FILE)
    if not isinstance(config, dict):
        raise InvalidArgument(f"{CONFIG_FILE} must hold a JSON object")
    return config


def header_limit(max_tensors: int) -> int:
    return min(MAX_HEADER_BYTES, max_tensors * HEADER_BYTES_PER_TENSOR + HEADER_METADATA_BYTES)


def parse_header(data: bytes | memoryview, *, max_tensors: int) -> tuple[list[TensorHeader], int]:
    """Checked tensor headers (sorted by offset) and the byte offset where the data section starts."""
    size = len(data)
    if size < 8:
        raise InvalidArgument(f"{WEIGHTS_FILE} is truncated: {size} bytes, no header")
    header_len = int.from_bytes(bytes(data[:8]), "little")
    limit = header_limit(max_tensors)
    if header_len > limit and 8 + header_len <= size:
        raise InvalidArgument(
            f"{WEIGHTS_FILE} header is {header_len} bytes, over the limit of {limit} bytes "
            f"({HEADER_BYTES_PER_TENSOR} per tensor of max_tensors {max_tensors}, plus metadata)"
        )
    if header_len > limit or 8 + header_len > size:
        raise InvalidArgument(
            f"{WEIGHTS_FILE} header claims {header_len} bytes but the file holds {size} bytes "
            "(truncated or corrupt)"
        )
    header = load_json(
        bytes(data[8 : 8 + header_len]), f"{WEIGHTS_FILE} header (corrupt file?)", unique_keys=True
    )
    if not isinstance(header, dict):
        raise InvalidArgument(f"{WEIGHTS_FILE} header must be a JSON object")
    header.pop("__metadata__", None)
    if len(header) > max_tensors:
        raise InvalidArgument(f"{WEIGHTS_FILE} holds {len(header)} tensors, over the limit of {max_tensors}")
    data_start = 8 + header_len
    data_len = size - data_start
    entries = [_tensor_header(name, info, data_len) for name, info in header.items()]
    # As the safetensors format requires (and its library checks): the byte ranges, in order,
    # tile the data section, no gap, no overlap, nothing after the last.
    entries.sort(key=lambda e: (e.begin, e.end))
    end = 0
    for prev, cur in zip([None, *entries], entries, strict=False):
        if cur.begin < end:
            assert prev is not None
            raise InvalidArgument(f"tensors {prev.name!r} and {cur.name!r} overlap in {WEIGHTS_FILE}")
        if cur.begin > end:
            before = f"after tensor {prev.name!r}" if prev is not None else "at the start of the data"
            raise InvalidArgument(
                f"{WEIGHTS_FILE} has {cur.begin - end} unused bytes {before}, before tensor {cur.name!r}"
            )
        end = cur.end
    if end != data_len:
        raise InvalidArgument(
            f"{WEIGHTS_FILE} has {data_len - end} bytes after its last tensor's data (corrupt file?)"
        )
    return entries, data_start


def _tensor_header(name: str, info: object, data_len: int) -> TensorHeader:
    if len(name) > MAX_TENSOR_NAME_CHARS:
        raise InvalidArgument(
            f"a tensor name is {len(name)} characters, over the limit of {MAX_TENSOR_NAME_CHARS}: "
            f"{name[:100]!r}..."
        )
    if not isinstance(info, dict):
        raise InvalidArgument(f"tensor {name!r}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in FLOAT_DTYPES:
        raise InvalidArgument(
            f"tensor {name!r} has dtype {dtype!r}; only float dtypes {sorted(FLOAT_DTYPES)} are accepted"
        )
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_TENSOR_RANK
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise InvalidArgument(f"tensor {name!r} has a malformed shape {str(shape)[:200]}")
    if any(d > MAX_TENSOR_DIM for d in shape):
        raise InvalidArgument(
            f"tensor {name!r} has a dimension over {MAX_TENSOR_DIM} in its shape "
            f"(rank {len(shape)}; no LoRA factor is that large)"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise InvalidArgument(f"tensor {name!r} has malformed data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * FLOAT_DTYPES[dtype][1]
    if nbytes > data_len:
        raise InvalidArgument(
            f"tensor {name!r} claims {nbytes} bytes (shape {shape}) but the file holds only {data_len}"
        )
    if not 0 <= begin <= end <= data_len:
        raise InvalidArgument(
            f"tensor {name!r} has data_offsets [{begin}, {end}] outside the {data_len} byte data section "
            "(truncated or corrupt file)"
        )
    if end - begin != nbytes:
        raise InvalidArgument(
            f"tensor {name!r} spans {end - begin} bytes but shape {shape} x {dtype} needs {nbytes}"
        )
    return TensorHeader(name, dtype, tuple(shape), begin, end)


def load_tensors(data: bytes, *, max_tensors: int) -> dict[str, torch.Tensor]:
    """Parse and check the header, then view each tensor in `data` (no copy where aligned)."""
    entries, data_start = parse_header(data, max_tensors=max_tensors)
    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        torch_dtype, itemsize = FLOAT_DTYPES[e.dtype]
        count = (e.end - e.begin) // itemsize
        if count == 0:
            t = torch.empty(0, dtype=torch_dtype)
        elif (data_start + e.begin) % itemsize == 0:
            # a read-only view of `data` (kept alive by the tensor): nothing here writes to it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(data, dtype=torch_dtype, count=count, offset=data_start + e.begin)
        else:  # misaligned for its dtype: copy
            t = torch.frombuffer(
                bytearray(data[data_start + e.begin : data_start + e.end]), dtype=torch_dtype
            )
        tensors[e.name] = t.reshape(e.shape)
    return tensors


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """No NaN or Inf in any tensor. A sum is finite only when every term is (NaN and Inf carry
    through it), so the elements are looked at only when a tensor's float32 sum is not (NaN, Inf,
    or finite values past float32's range): one pass and no [numel] mask for a good tensor."""
    for name, t in tensors.items():
        if not math.isfinite(float(t.sum(dtype=torch.float32))) and not bool(torch.isfinite(t).all()):
            raise InvalidArgument(f"tensor {name!r} contains NaN or Inf values")


def read_checkpoint(config_bytes: bytes, weights_bytes: bytes, *, max_tensors: int) -> PeftCheckpoint:
    config = parse_config(config_bytes)
    tensors = load_tensors(weights_bytes, max_tensors=max_tensors)
    check_finite(tensors)
    return PeftCheckpoint(config, tensors)
