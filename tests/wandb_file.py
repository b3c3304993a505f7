"""Read the records of a W&B run file (`run-<id>.wandb`), for checking what an offline run recorded.

wandb (written against 0.31) stores a run as a LevelDB-style log: a 7-byte header (b":W&B", magic 0xBEE1,
version 0), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of type byte + data, length, type:
1 full, 2 first, 3 middle, 4 last) holding one serialized `wandb.proto.wandb_internal_pb2.Record`. Space too small
for a chunk header at the end of a block is zero padding.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")


def read_records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path} is not a W&B run file (header {ident!r} {magic:#x} v{version})")
    records, pos, pending = [], HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:
            pos += left
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # padding up to the next block
            pos += left
            continue
        chunk = data[pos + CHUNK.size:pos + CHUNK.size + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: corrupt chunk at byte {pos}")
        pos += CHUNK.size + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(path: str | Path) -> list[dict]:
    """The logged rows ({"_step": int, key: value, ...}), W&B's own keys (_timestamp, _runtime) dropped."""
    rows = []
    for r in read_records(path):
        if r.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            rows.append({k: v for k, v in row.items() if k not in ("_timestamp", "_runtime")})
    return rows


def run_id(path: str | Path) -> str | None:
    for r in read_records(path):
        if r.WhichOneof("record_type") == "run":
            return r.run.run_id
    return None
