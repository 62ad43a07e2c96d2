"""The control plane's wire format: JSON header + raw array bytes. Nothing is pickled.

Every RPC request and reply body is one *frame*:

    uint32 big-endian  header length H
    H bytes            header: a UTF-8 JSON object
    rest               blobs, back to back, in the order the header lists them

The header's "blobs" entry lists each blob as {"nbytes": N} for raw bytes (a serialized
program) or {"nbytes": N, "shape": [...], "dtype": "float32"} for an array (C order). In
the rest of the header a blob is referenced as {"$blob": i}. The token travels in gRPC
metadata (`mpmd-token`), not in the frame.

`decode` checks everything it reads (lengths, dtype names, shapes against sizes) and raises
ValueError naming what is wrong, so a malformed message gets an error reply.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np

MAX_HEADER_BYTES = 64 * 2**20
_DTYPES = {
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
}


def encode(header: dict, blobs: list) -> bytes:
    """`blobs` holds bytes or numpy-convertible arrays; reference them as {"$blob": i}."""
    described, payload = [], []
    for b in blobs:
        if isinstance(b, (bytes, bytearray, memoryview)):
            described.append({"nbytes": len(b)})
            payload.append(bytes(b))
        else:
            a = np.asarray(b, order="C")  # not ascontiguousarray: it makes a scalar 1-d
            described.append({"nbytes": a.nbytes, "shape": list(a.shape), "dtype": a.dtype.name})
            payload.append(a.tobytes())
    head = json.dumps({**header, "blobs": described}, separators=(",", ":")).encode()
    return struct.pack(">I", len(head)) + head + b"".join(payload)


def decode(frame: bytes) -> tuple[dict, list]:
    """(header, blobs) with blobs as bytes or numpy arrays."""
    if len(frame) < 4:
        raise ValueError(f"frame of {len(frame)} bytes is shorter than its 4-byte header length")
    (n,) = struct.unpack(">I", frame[:4])
    if n > MAX_HEADER_BYTES or 4 + n > len(frame):
        raise ValueError(f"frame header length {n} exceeds the frame ({len(frame)} bytes)")
    try:
        header = json.loads(frame[4 : 4 + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"frame header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("blobs", []), list):
        raise ValueError("frame header must be a JSON object with a 'blobs' list")
    blobs, offset = [], 4 + n
    for i, d in enumerate(header.pop("blobs", [])):
        nbytes = d.get("nbytes") if isinstance(d, dict) else None
        if not isinstance(nbytes, int) or nbytes < 0 or offset + nbytes > len(frame):
            raise ValueError(f"blob {i}: bad or out-of-frame nbytes {nbytes!r}")
        raw = frame[offset : offset + nbytes]
        offset += nbytes
        if "dtype" not in d:
            blobs.append(raw)
            continue
        dtype, shape = d.get("dtype"), d.get("shape")
        if dtype not in _DTYPES:
            raise ValueError(f"blob {i}: dtype {dtype!r} not allowed; allowed: {sorted(_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"blob {i}: shape must be a list of non-negative integers, got {shape!r}")
        dt = numpy_dtype(dtype)
        if int(np.prod(shape, dtype=np.int64)) * dt.itemsize != nbytes:
            raise ValueError(f"blob {i}: shape {shape} of {dtype} does not match {nbytes} bytes")
        blobs.append(np.frombuffer(raw, dtype=dt).reshape(shape))
    if offset != len(frame):
        raise ValueError(f"frame has {len(frame) - offset} trailing bytes after its blobs")
    return header, blobs


def blob(blobs: list, ref, kind=None):
    """Resolve a {"$blob": i} reference; `kind` bytes or np.ndarray checks what it must be."""
    if not isinstance(ref, dict) or not isinstance(ref.get("$blob"), int) or not 0 <= ref["$blob"] < len(blobs):
        raise ValueError(f"expected a blob reference {{\"$blob\": i}} with i < {len(blobs)}, got {ref!r:.100}")
    value = blobs[ref["$blob"]]
    if kind is not None and not isinstance(value, kind):
        raise ValueError(f"blob {ref['$blob']} must be {'raw bytes' if kind is bytes else 'an array'}")
    return value


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name, bfloat16 included (ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def nbytes(specs) -> int:
    """Bytes of the arrays `specs` describe (anything with .shape and a dtype name, e.g.
    mpmd.runtime.worker.instructions.Spec)."""
    return sum(math.prod(s.shape) * numpy_dtype(s.dtype).itemsize for s in specs)


class Builder:
    """Collects blobs while a header is built: `ref = b.add(array)`, then
    `encode(header, b.blobs)`."""

    def __init__(self):
        self.blobs: list = []

    def add(self, value) -> dict:
        self.blobs.append(value)
        return {"$blob": len(self.blobs) - 1}
