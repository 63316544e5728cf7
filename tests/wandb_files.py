"""Reads W&B's offline run files (``run-<id>.wandb``): a leveldb-style log of protobuf records.

Layout: a 7-byte file header (``:W&B``, a uint16 magic, a uint8 version), then 32 KiB blocks of
records, each a 7-byte header (crc32 uint32, length uint16, type uint8: 1 full, 2 first,
3 middle, 4 last) and its data; a block's tail shorter than a header is padding.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def records(path: Path, wait: float = 60.0) -> list[Any]:
    """Every protobuf ``Record`` in a ``.wandb`` file, in order, once the file holds its run's
    ``exit`` record: W&B's service writes the file after ``run.finish()`` returns (seen here: 7
    bytes just after it, the whole run a moment later), so a reader in the same process waits up to
    ``wait`` seconds for it."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + wait
    while True:
        try:
            out = _parse(Path(path).read_bytes())
        except DecodeError:  # a record cut off mid-write
            out = []
        if any(r.WhichOneof("record_type") == "exit" for r in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _parse(data: bytes) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    if len(data) < HEADER:
        return []
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, out, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:
            pos += left  # zero padding to the end of the block
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def run_summary(path: Path) -> dict[str, Any]:
    """What a run logged: its identity, config, summary, history keys and artifact files."""
    info: dict[str, Any] = {"config": {}, "summary": {}, "history": set(), "artifacts": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            info.update(id=r.run_id, group=r.run_group, job_type=r.job_type, name=r.display_name)
            info["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "config":
            info["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                info["summary"][key] = json.loads(item.value_json)
        elif kind == "history":
            info["history"].update(i.key or "/".join(i.nested_key) for i in record.history.item)
        elif kind == "artifact":
            info["artifacts"][record.artifact.name] = [e.path for e in record.artifact.manifest.contents]
    return info
