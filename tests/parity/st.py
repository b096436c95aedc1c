"""Minimal safetensors reader/writer (pure Python + numpy + torch).

Kept deliberately independent of the `safetensors` package (not installed here)
and of Alloy's C++ implementation, so the parity tests check one implementation
of the format against another.

File layout:
    u64 little-endian N | N bytes of JSON header | raw tensor bytes
The header maps each tensor name to {"dtype", "shape", "data_offsets": [b, e]}
(offsets relative to the first byte after the header) and may carry a
"__metadata__" object of string -> string. The header is padded with spaces so
the data section starts 8-byte aligned. All data is little-endian, row-major.
"""

import json
import struct

import numpy as np
import torch

# safetensors dtype tag -> (numpy little-endian dtype, torch dtype).
# BF16 has no numpy dtype: it is moved as raw int16 bits and reinterpreted.
_DTYPES = {
    "F64": ("<f8", torch.float64),
    "F32": ("<f4", torch.float32),
    "F16": ("<f2", torch.float16),
    "BF16": ("<i2", torch.bfloat16),
    "I64": ("<i8", torch.int64),
    "I32": ("<i4", torch.int32),
    "I16": ("<i2", torch.int16),
    "I8": ("i1", torch.int8),
    "U8": ("u1", torch.uint8),
    "BOOL": ("?", torch.bool),
}
_TORCH_TO_TAG = {tdt: tag for tag, (_, tdt) in _DTYPES.items()}

# Refuse absurd headers instead of trying to allocate them (the reference
# implementation uses the same 100 MB cap).
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    pass


def load(path):
    """Read a .safetensors file. Returns (tensors: dict[str, Tensor], metadata: dict)."""
    with open(path, "rb") as f:
        buf = f.read()
    return loads(buf, where=str(path))


def loads(buf, where="<bytes>"):
    if len(buf) < 8:
        raise SafetensorsError(f"{where}: file too short ({len(buf)} bytes)")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > _MAX_HEADER or 8 + n > len(buf):
        raise SafetensorsError(f"{where}: header length {n} exceeds file size {len(buf)}")
    try:
        header = json.loads(buf[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{where}: bad JSON header: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    data = memoryview(buf)[8 + n:]
    tensors = {}
    spans = []
    for name, info in header.items():
        try:
            tag, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{where}: malformed entry for {name!r}: {info!r}") from None
        if tag not in _DTYPES:
            raise SafetensorsError(f"{where}: {name}: unsupported dtype {tag}")
        np_dt, t_dt = _DTYPES[tag]
        itemsize = np.dtype(np_dt).itemsize
        count = 1
        for d in shape:
            if not isinstance(d, int) or d < 0:
                raise SafetensorsError(f"{where}: {name}: bad shape {shape}")
            count *= d
        if not (0 <= b <= e <= len(data)) or e - b != count * itemsize:
            raise SafetensorsError(
                f"{where}: {name}: offsets [{b},{e}] inconsistent with "
                f"{tag}{shape} ({count * itemsize} bytes) / data size {len(data)}")
        spans.append((b, e, name))
        # .copy(): frombuffer views are read-only and would alias the file buffer.
        arr = np.frombuffer(data[b:e], dtype=np_dt, count=count).copy().reshape(shape)
        t = torch.from_numpy(arr)
        if t_dt is torch.bfloat16:
            t = t.view(torch.bfloat16)
        tensors[name] = t

    # The format requires tensors to tile the data section without overlap.
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b != pos:
            raise SafetensorsError(f"{where}: {name}: gap or overlap at offset {b} (expected {pos})")
        pos = e
    if pos != len(data):
        raise SafetensorsError(f"{where}: {len(data) - pos} trailing bytes after last tensor")
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError(f"{where}: __metadata__ must map strings to strings")
    return tensors, metadata


def dumps(tensors, metadata=None):
    """Serialise dict[str, Tensor] (+ optional str->str metadata) to bytes."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    offset = 0
    # Sorted names: deterministic output regardless of dict order.
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _TORCH_TO_TAG:
            raise SafetensorsError(f"{name}: unsupported torch dtype {t.dtype}")
        tag = _TORCH_TO_TAG[t.dtype]
        if t.dtype is torch.bfloat16:
            t = t.view(torch.int16)
        raw = t.numpy().astype(_DTYPES[tag][0], copy=False).tobytes()
        header[name] = {"dtype": tag, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson + b"".join(chunks)


def save(path, tensors, metadata=None):
    with open(path, "wb") as f:
        f.write(dumps(tensors, metadata))
