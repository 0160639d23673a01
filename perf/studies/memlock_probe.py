"""Does ``cudaHostRegister`` of a host table honour a low ``ulimit -l`` (RLIMIT_MEMLOCK)?

Each case runs in a child process whose RLIMIT_MEMLOCK is set low before it starts: it builds a host
table of ``--gib`` GiB with ``register=True`` and gathers rows from it on the GPU (exact against the
table), or reports the named error it got. The cases:

* ``low_limit``: RLIMIT_MEMLOCK at ``--limit-kib`` KiB; the process keeps its capabilities (as root,
  CAP_IPC_LOCK lifts the limit for ``mlock``).
* ``low_limit_no_ipc_lock``: the same with CAP_IPC_LOCK dropped from the child's capability bounding set
  (``setpriv``), so that the limit applies to whatever checks it. Only where ``setpriv`` exists.

A case ends ``registered`` (the table registered and read exactly: the limit was not applied to the
registration), ``refused`` (a :class:`~uvaple.uva.errors.RegistrationError`, its message logged: it must
name ``ulimit -l``), ``no_gpu``, or ``failed`` (anything else: a defect). Nothing is left registered or
mapped either way: the child exits.

Usage: ``python3 perf/studies/memlock_probe.py [--gib 1] [--limit-kib 64] [--json FILE]``. Exit 0 when no
case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, resource, sys, torch
    from uvaple.uva import HostTable
    from uvaple.uva.errors import DeviceCapabilityError, RegistrationError
    gib = float(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    rep = {"memlock_soft": soft, "memlock_hard": hard}
    if not torch.cuda.is_available():
        rep["outcome"] = "no_gpu"
    else:
        cols = 4096
        rows = max(1, int(gib * (1 << 30)) // cols)
        try:
            t = HostTable.empty(rows, cols, torch.uint8, register=True)
        except RegistrationError as e:
            rep.update(outcome="refused", error=str(e))
        except DeviceCapabilityError as e:
            rep.update(outcome="no_gpu", error=str(e))
        else:
            with t:
                g = torch.Generator().manual_seed(5)
                ids = torch.randint(0, rows, (257,), generator=g)
                t.tensor[ids] = torch.randint(1, 256, (257, cols), generator=g, dtype=torch.uint8)
                from uvaple.kernels import gather_rows
                got = gather_rows(t.cuda_view(), ids.cuda()).cpu()
                rep.update(outcome="registered" if torch.equal(got, t.tensor[ids]) else "failed",
                           registered_bytes=t.nbytes, exact=bool(torch.equal(got, t.tensor[ids])))
    print(json.dumps(rep), flush=True)
""")


def cases() -> list[tuple[str, list[str]]]:
    """(name, command prefix) of each case this machine can run."""
    out = [("low_limit", [])]
    setpriv = shutil.which("setpriv")
    if setpriv and os.geteuid() == 0:
        out.append(("low_limit_no_ipc_lock", [setpriv, "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", "--"]))
    return out


def run_case(prefix: list[str], gib: float, limit_bytes: int, timeout_s: float = 300) -> dict:
    def lower() -> None:  # in the child, before exec: soft and hard limits both low
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit_bytes, limit_bytes))

    try:
        r = subprocess.run([*prefix, sys.executable, "-c", CHILD, str(gib)], capture_output=True, text=True,
                           timeout=timeout_s, preexec_fn=lower)
    except subprocess.TimeoutExpired:
        return {"outcome": "failed", "error": f"no answer within {timeout_s:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"outcome": "failed", "error": f"exit {r.returncode}: {r.stderr[-2000:]}"}
    rep = json.loads(lines[-1])
    if rep["outcome"] == "refused" and "ulimit -l" not in rep.get("error", ""):
        rep["outcome"] = "failed"  # refused, but the message does not say what to do
        rep["why_failed"] = "the RegistrationError does not name `ulimit -l`"
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="table size (default 1 GiB)")
    p.add_argument("--limit-kib", type=int, default=64, help="RLIMIT_MEMLOCK of the children (default 64 KiB)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    limit = a.limit_kib << 10
    res = {"uid": os.geteuid(), "parent_memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK), "gib": a.gib,
           "limit_bytes": limit, "cases": {}}
    print(f"uid {res['uid']}, this process's RLIMIT_MEMLOCK {res['parent_memlock']}; children: {a.limit_kib} KiB, "
          f"a {a.gib:g} GiB table registered")
    for name, prefix in cases():
        rep = run_case(prefix, a.gib, limit)
        res["cases"][name] = rep
        print(f"{name}: {rep['outcome']}" + (f" ({rep['error'][:300]})" if rep.get("error") else ""), flush=True)
    if "low_limit_no_ipc_lock" not in res["cases"]:
        print("low_limit_no_ipc_lock: not run (needs root and setpriv)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if any(c["outcome"] == "failed" for c in res["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
