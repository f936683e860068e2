"""A checkpoint's state.json edited and its stamp remade to match, as a tamperer (or a GPU
machine whose checkpoint a CPU loads) could: what the checkpoint tests and the bad-input table
feed the loader."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from suite.arms.checkpoint import META, STATE, stamp_digest
from suite.arms.checkpoint_files import ChunkedSha256


def rewrite_state(root: Path, edit: Callable[[dict], object]) -> None:
    state = json.loads((root / STATE).read_text())
    edit(state)
    data = json.dumps(state).encode()
    (root / STATE).write_bytes(data)
    meta = json.loads((root / META).read_text())
    with ThreadPoolExecutor(1) as pool:
        digest = ChunkedSha256(pool, meta["files"][STATE]["chunk_bytes"])
        digest.update(memoryview(data))
        meta["files"][STATE].update(bytes=len(data), sha256=digest.hexdigest())
    meta["stamp_sha256"] = stamp_digest(meta)
    (root / META).write_text(json.dumps(meta))
