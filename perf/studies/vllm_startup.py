"""How long does startup through the vLLM plugin's path take for an fp8 n-gram table, stage by stage?

``python3 perf/studies/vllm_startup.py [--gib 48] [--dir DIR] [--segment-dir DIR] [--out DIR]``

1. A safetensors checkpoint holding the table (160-B fp8 rows) is written to ``--dir`` (not timed).
2. The file is read to ``/dev/null`` (the reading rate the fill is held to), in the same run.
3. The plugin's :class:`~uvaple.integration.models.vllm.tables.ShardTable` is opened as a serving rank opens it:
   ``HostTable.shared(defer_ready=True)`` creates the segment (in ``--segment-dir``, default
   ``/dev/shm``) and checks registration on one page (stage ``open``).
4. The rows are written as vLLM's loader hands them to the plugin: the checkpoint tensor (a safetensors
   mmap) through ``ShardTable.write``; the writes allocate the pages they fill (stage ``fill``).
5. ``finish()`` checks every row, commits what the fill left, marks the segment ready and registers it
   (stage ``finish``).

"Ready to serve, the file read excluded" is ``open + finish``: what startup costs beyond reading the
checkpoint into the table. Prints the stages and writes ``vllm_startup.json``. ``--gib 0.25`` runs
anywhere (registration only with CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time

import torch

from uvaple.integration.models.vllm.config import PluginConfig
from uvaple.integration.models.vllm.tables import ShardTable
from uvaple.perf.vllm_shapes import random_blocks
from uvaple.uva import system

ROW_BYTES = 160
GIB = 1 << 30


def _write_checkpoint(path: str, rows: int) -> None:
    """A safetensors file of one ``[rows, 160]`` fp8 tensor, written 64 MiB at a time (the table never exists
    whole in memory here)."""
    nbytes = rows * ROW_BYTES
    header = json.dumps({"ngram_embedding.weight": {"dtype": "F8_E4M3", "shape": [rows, ROW_BYTES],
                                                    "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for blk in random_blocks(nbytes, 64 << 20, seed=0):
            f.write(blk.numpy())


def run(gib: float, ckpt_dir: str, out_dir: str | None, keep: bool, segment_dir: str | None = None,
        tag: str = "") -> dict:
    rows = int(gib * GIB) // ROW_BYTES // 128 * 128
    nbytes = rows * ROW_BYTES
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"ngram_{rows}.safetensors")
    stages: dict[str, float] = {}
    if not os.path.exists(path):
        t0 = time.perf_counter()
        _write_checkpoint(path, rows)
        stages["write_checkpoint_s (not part of startup)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    read_s = time.perf_counter() - t0
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = PluginConfig(shared=True, segment=f"startup-{os.getpid()}", timeout_s=600, segment_dir=segment_dir)
    t0 = time.perf_counter()
    shard = ShardTable(cfg, layer="model.layers.0.ple.ple_embedding.ngram_embedding", rows=rows, cols=ROW_BYTES,
                       dtype=torch.float8_e4m3fn, loaded_rows=rows, rank=0, size=1, identity="startup" * 8,
                       device=device)
    open_s = time.perf_counter() - t0
    from safetensors import safe_open

    t0 = time.perf_counter()
    with safe_open(path, framework="pt") as f:  # what vLLM's safetensors iterator hands the loader
        w = f.get_tensor("ngram_embedding.weight")
        shard.write(w, 0)
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    shard.finish()
    finish_s = time.perf_counter() - t0
    timings = dict(shard.table.timings)
    sample = torch.cat([torch.arange(1000), torch.randint(0, rows, (100_000,)), torch.arange(rows - 1000, rows)])
    check = torch.equal(shard.tensor[sample].view(torch.uint8), w[sample].view(torch.uint8))
    del w
    ready_s = open_s + finish_s
    seg_dir = segment_dir or "/dev/shm"
    res = {"gib": nbytes / GIB, "rows": rows, "device": str(device), "registered": shard.table.registered,
           "segment_dir": seg_dir, "segment_dir_huge_pages": system.huge_pages_in(seg_dir),
           "file_read_to_dev_null_s": read_s, "file_read_gib_s": nbytes / GIB / read_s,
           "open_s": open_s, "fill_s": fill_s, "finish_s": finish_s, "table_stages_s": timings,
           "ready_excluding_file_read_s": ready_s, "ready_gib_s": nbytes / GIB / ready_s,
           "fill_gib_s": nbytes / GIB / fill_s, "fill_over_file_read": read_s / fill_s,
           "total_startup_s": open_s + fill_s + finish_s, "sampled_rows_exact": check, **stages}
    shard.close()
    if not keep:
        os.unlink(path)
    for k, v in res.items():
        print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}", flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"vllm_startup{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=48.0)
    p.add_argument("--dir", default="/tmp/uvaple-startup", help="where the checkpoint is written")
    p.add_argument("--out", help="directory for vllm_startup.json")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint file")
    p.add_argument("--segment-dir", help="tmpfs directory of the segment (default /dev/shm)")
    p.add_argument("--tag", default="", help="suffix of the JSON file's name")
    a = p.parse_args(argv)
    res = run(a.gib, a.dir, a.out, a.keep, a.segment_dir, a.tag)
    return 0 if res["sampled_rows_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
