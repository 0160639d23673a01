"""Build, on a CPU machine with PyPI, the parts that carry vLLM 0.33.0 onto the lent H200 (no network there).

``python3 perf/vllm_carry/build.py [--out .vllm-carry] [--part-mib MIB] [--jobs 2] [--resolve] [--clean]``

The H200 has Python 3.12, torch 2.11.0, Triton 3.6.0, transformers 5.17.0 and the packages that
``/work/.library/device/KINDS.md`` lists ("Python packages already there"); vLLM 0.33.0 pins torch 2.14.0.
Its extensions are built against the stable libtorch ABI targeting torch 2.11 (``check_abi.py`` checks
their symbols against a torch 2.11 libtorch), so its wheel is installed there with ``--no-deps`` beside the
packages the H200 lacks. What this script does:

1. Downloads (``pip download --no-deps``, cp312 manylinux x86-64) vLLM's wheel and :data:`EXTRAS`: vLLM's
   requirements and theirs that the H200 lacks, as pip's resolver picked them (``--resolve`` does it again
   and prints what changed), minus :data:`EXCLUDED`.
2. Unpacks every wheel into ``OUT/tree/<wheel name>/`` and trims vLLM's (:data:`TRIM`: the FlashAttention
   ``.so`` files, ``deep_gemm``, ``fmha_sm100``, the Rust front end; its ``RECORD`` is rewritten). The
   Python side of ``vllm_flash_attn``, ``third_party/flash_linear_attention`` and
   ``third_party/pynvml.py`` stay.
3. Packs the trees into parts ``OUT/parts/pNN/pNN.tar.xz`` of at most ``--part-mib`` MiB each (one call
   to the GPU machine carries one part beside the working tree, 64 MiB in all; by default the largest part that
   leaves the tree 8 MiB to grow by). Each part is a
   self-contained xz tar: whole files, or pieces of a file too big for one part (``<path>.__piece.K.N``,
   joined by ``assemble.py`` once all N have arrived). Each part folder holds its ``part.json`` and a copy
   of ``manifest.json`` (sizes and sha256 of every part, piece and joined file).
4. Prints the sequence of device calls (also in ``OUT/parts/CALLS.txt``).

``OUT`` (default ``.vllm-carry`` in the repository root) is added to ``.git/info/exclude``: nothing of
it is tracked. ``--clean`` removes the unpacked trees afterwards (the wheels and parts stay).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MIB = 1 << 20

VLLM = "vllm==0.33.0"
PYTHON = "3.12"
#: pip matches manylinux tags exactly: every glibc level up to the H200 image's (Ubuntu 24.04: 2.39)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]

#: vLLM 0.33.0's requirements left behind: torch/torchaudio/torchvision/triton are the H200's (2.11.0 /
#: 2.11.0 / 0.26.0 / 3.6.0); the rest are CUDA kernel packages whose users are not on the paths checked
#: (Triton attention, Triton fused MoE, Triton GDN) or the H200 has them (grpcio, opencv-python-headless)
EXCLUDED = ["torch", "torchaudio", "torchvision", "triton", "flashinfer-python", "tilelang", "quack-kernels",
            "nvidia-cutlass-dsl", "humming-kernels", "tokenspeed-mla", "PyNvVideoCodec", "torchcodec",
            "nvidia-cudnn-frontend", "opencv-python-headless", "instanttensor", "fastsafetensors", "grpcio"]

#: fastapi[standard]'s cloud CLI and what only it needs: vLLM never imports them
DROPPED = ["fastapi-cloud-cli", "rignore", "fastar", "sentry-sdk", "agent-detector", "detect-installer",
           "truststore"]

#: What the H200 lacks of vLLM 0.33.0's requirements (and theirs), as pip's resolver picked them for
#: CPython 3.12 on 2026-12-03 against the H200's torch/Triton/transformers (``--resolve`` repeats it)
EXTRAS = [
    "annotated-types==0.8.0", "anthropic==2.16.0", "apache-tvm-ffi==0.1.11", "astor==0.8.1", "blake3==1.0.11",
    "cachetools==8.0.2", "cbor2==6.3.0", "cffi==2.1.1", "compressed-tensors==0.17.0", "cryptography==50.0.2",
    "depyf==0.20.0", "dill==0.4.1", "dnspython==2.9.2", "docstring-parser==0.18.0", "email-validator==2.4.0",
    "fastapi==0.136.3", "fastapi-cli==0.0.34", "googleapis-common-protos==1.76.0", "httpcore2==2.16.2",
    "httptools==0.9.0", "httpx2==2.16.2", "ijson==3.6.0", "interegular==0.3.3", "jiter==0.19.0",
    "jmespath==1.1.0", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "lark==1.2.2",
    "llguidance==1.7.6", "lm-format-enforcer==0.11.3", "loguru==0.7.3", "mcp==2.3.0", "mcp-types==2.3.0",
    "mistral-common==1.13.1", "model-hosting-container-standards==0.1.16", "msgspec==0.23.0", "nvtx==0.2.15",
    "openai==3.60.0", "opentelemetry-api==1.45.2", "opentelemetry-exporter-http-transport==0.66b2",
    "opentelemetry-exporter-otlp==1.45.2", "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2", "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2", "opentelemetry-proto==1.45.2", "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2", "opentelemetry-semantic-conventions-ai==0.5.1",
    "orjson==3.13.0", "oss-harmony==0.0.11", "outlines-core==0.2.14", "partial-json-parser==0.2.1.1.post7",
    "prometheus-fastapi-instrumentator==8.1.0", "pybase64==1.5.1", "pycountry==26.2.16", "pycparser==3.12",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "pydantic-extra-types==2.11.1", "pydantic-settings==2.16.3",
    "pyjwt==2.15.1", "python-dotenv==1.2.4", "python-json-logger==4.2.0", "python-multipart==0.0.34",
    "pyzmq==27.3.0", "referencing==0.37.0", "rich-toolkit==0.20.6", "rpds-py==2026.9.1",
    "setproctitle==1.3.8", "sniffio==1.3.1", "sse-starlette==3.7.1", "starlette==1.10.0", "supervisor==4.3.0",
    "typing-inspection==0.4.5", "uvicorn==0.55.0", "watchfiles==1.3.0", "websockets==17.4",
    "xgrammar==0.2.8",
]

#: Removed from vLLM's wheel (paths in the wheel, fnmatch patterns): FlashAttention's kernels (a Triton
#: attention backend is used instead), DeepGEMM and the SM100 FMHA (fp8 / Blackwell paths), and the
#: optional Rust front end (``VLLM_USE_RUST_FRONTEND=1`` only)
TRIM = ["vllm/vllm_flash_attn/*.so", "vllm/third_party/deep_gemm/*", "vllm/third_party/fmha_sm100/*",
        "vllm/vllm-rs"]

#: Versions already on the H200 that the resolver is held to (KINDS.md's pip list)
H200_PINS = ["torch==2.11.0", "triton==3.6.0", "transformers==5.17.0", "torchvision==0.26.0",
             "torchaudio==2.11.0", "huggingface_hub==1.33.0", "safetensors==0.8.0", "sentencepiece==0.2.2",
             "tiktoken==0.14.0", "tokenizers==0.23.2"]
KINDS_MD = "/work/.library/device/KINDS.md"

BLOCK = 1 * MIB  # the unit a big file is split at, and whose compressed size is estimated
PRESET = 9 | lzma.PRESET_EXTREME
DEVICE_LIMIT = 64 * MIB  # what one device call carries: the working tree and the carried paths
STAGE = "/tmp/vllm_carry"


def log(msg: str) -> None:
    print(f"[build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


def canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pip_base() -> list[str]:
    return [sys.executable, "-m", "pip"]


def platform_args() -> list[str]:
    out = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


# ---------------------------------------------------------------------------------------------- download
def download(pins: list[str], dest: str) -> list[str]:
    """``pip download --no-deps`` of each pin for CPython 3.12 manylinux x86-64; returns the wheel paths."""
    os.makedirs(dest, exist_ok=True)
    env = dict(os.environ, PIP_CONSTRAINT="")  # a machine-wide constraints file must not veto a pin
    cmd = pip_base() + ["download", "--no-deps", "--disable-pip-version-check", "-q", "-d", dest] + \
        platform_args() + pins
    log(f"pip download {len(pins)} wheel(s) into {dest}")
    subprocess.run(cmd, check=True, env=env)
    wheels = {}
    for f in os.listdir(dest):
        if f.endswith(".whl"):
            wheels[canon(f.split("-")[0])] = os.path.join(dest, f)
    missing = [p for p in pins if canon(p.split("==")[0]) not in wheels]
    if missing:
        raise SystemExit(f"pip saved no wheel for {missing}")
    return [wheels[canon(p.split("==")[0])] for p in pins]


def h200_packages(path: str) -> set[str]:
    """The package names KINDS.md lists under 'Python packages already there' (nvidia-h200's image)."""
    text = open(path, encoding="utf-8").read()
    part = text.split("## Python packages already there", 1)[1]
    names = part.split("Packages:", 1)[1].split("\n", 1)[0]
    return {canon(n.strip().rstrip(".")) for n in names.split(",") if n.strip()}


def resolve(vllm_wheel: str, kinds_md: str, work: str) -> list[str]:
    """vLLM's requirements the H200 lacks, with theirs, as pip's resolver picks them for CPython 3.12."""
    from email.parser import Parser

    with zipfile.ZipFile(vllm_wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    have = h200_packages(kinds_md)
    skip = {canon(n) for n in EXCLUDED}
    reqs = []
    for r in msg.get_all("Requires-Dist") or []:
        if "extra ==" in r:
            continue
        base = r.split(";")[0].split("[")[0]
        for op in "<>=!~":
            base = base.split(op)[0]
        name = canon(base.strip())
        if name in skip:
            continue
        if name in have:  # the H200's version serves: keep only the name, for its own requirements
            marker = r.split(";", 1)[1] if ";" in r else ""
            r = base.strip() + (f"; {marker.strip()}" if marker else "")
        reqs.append(r)
    os.makedirs(work, exist_ok=True)
    req_file, pin_file, report = (os.path.join(work, n) for n in ("requirements.txt", "pins.txt", "report.json"))
    open(req_file, "w").write("\n".join(reqs) + "\n")
    open(pin_file, "w").write("\n".join(H200_PINS) + "\n")
    cmd = pip_base() + ["install", "--dry-run", "--ignore-installed", "--disable-pip-version-check", "-q",
                        "--target", os.path.join(work, "target"), "--report", report, "-c", pin_file,
                        "-r", req_file] + platform_args()
    log("resolving vLLM's requirements for CPython 3.12 (pip install --dry-run --report)")
    subprocess.run(cmd, check=True, env=dict(os.environ, PIP_CONSTRAINT=""))
    picked = json.load(open(report))["install"]
    drop = {canon(n) for n in DROPPED} | skip
    out = sorted(f"{canon(i['metadata']['name'])}=={i['metadata']['version']}" for i in picked
                 if canon(i["metadata"]["name"]) not in have and canon(i["metadata"]["name"]) not in drop)
    return out


# ---------------------------------------------------------------------------------------------- trees
def unpack(wheel: str, trees: str, trim: list[str]) -> tuple[str, list[tuple[str, int]]]:
    """The wheel's files under ``trees/<wheel name>/``, less ``trim``; returns (tree dir, removed paths)."""
    name = os.path.basename(wheel)[:-len(".whl")]
    root = os.path.join(trees, name)
    if os.path.isdir(root):
        shutil.rmtree(root)
    removed = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            if any(fnmatch.fnmatch(info.filename, pat) for pat in trim):
                removed.append((info.filename, info.file_size))
                continue
            z.extract(info, root)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(os.path.join(root, info.filename), mode)
    if removed:  # RECORD lists what the wheel installs: drop what was trimmed
        record = next(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs
                      if f == "RECORD" and dp.endswith(".dist-info"))
        gone = {p for p, _ in removed}
        lines = [ln for ln in open(record, encoding="utf-8").read().splitlines() if ln.split(",")[0] not in gone]
        open(record, "w", encoding="utf-8").write("\n".join(lines) + "\n")
    return root, removed


@dataclass
class FileEntry:
    tree: str  # wheel name (no .whl)
    rel: str  # path inside the wheel
    path: str  # on this machine
    size: int
    mode: int
    blocks: list[int] = field(default_factory=list)  # estimated compressed bytes per BLOCK

    @property
    def arc(self) -> str:
        return f"{self.tree}/{self.rel}"


def _estimate(path: str) -> list[int]:
    out = []
    with open(path, "rb") as f:
        while True:
            b = f.read(BLOCK)
            if not b:
                break
            out.append(len(lzma.compress(b, preset=6)))
    return out or [64]


def list_files(trees: list[str], jobs: int) -> list[FileEntry]:
    entries = []
    for root in trees:
        tree = os.path.basename(root)
        for dp, _, fs in os.walk(root):
            for f in sorted(fs):
                p = os.path.join(dp, f)
                st = os.stat(p)
                entries.append(FileEntry(tree, os.path.relpath(p, root), p, st.st_size, st.st_mode & 0o777))
    entries.sort(key=lambda e: (e.tree, e.rel))
    log(f"estimating the compressed size of {len(entries)} files ({sum(e.size for e in entries) / MIB:.1f} MiB)")
    with ProcessPoolExecutor(jobs) as ex:
        for e, blocks in zip(entries, ex.map(_estimate, [e.path for e in entries], chunksize=16), strict=True):
            e.blocks = blocks
    return entries


# ---------------------------------------------------------------------------------------------- packing
@dataclass
class Member:
    entry: FileEntry
    start: int  # byte range of the file
    stop: int
    piece: int | None = None  # k of n, when the file is split over parts
    of: int | None = None

    @property
    def arc(self) -> str:
        return self.entry.arc if self.piece is None else f"{self.entry.arc}.__piece.{self.piece}.{self.of}"


def plan(entries: list[FileEntry], budget: int) -> list[list[Member]]:
    """Files in order into parts whose estimated compressed size stays under ``budget``; a file that does not
    fit where it comes is split at BLOCK boundaries when it is bigger than one block."""
    parts: list[list[Member]] = [[]]
    room = budget
    for e in entries:
        est = sum(e.blocks)
        if est <= room:
            parts[-1].append(Member(e, 0, e.size))
            room -= est + 512
            continue
        if len(e.blocks) == 1:  # small: to the next part
            parts.append([Member(e, 0, e.size)])
            room = budget - est - 512
            continue
        b = 0
        while b < len(e.blocks):  # big: as many blocks as fit, part after part
            n, acc = 0, 0
            while b + n < len(e.blocks) and acc + e.blocks[b + n] <= room:
                acc += e.blocks[b + n]
                n += 1
            if n == 0:
                parts.append([])
                room = budget
                continue
            parts[-1].append(Member(e, b * BLOCK, min(e.size, (b + n) * BLOCK)))
            room -= acc + 512
            b += n
    parts = [p for p in parts if p]
    pieces: dict[str, list[Member]] = {}
    for p in parts:
        for m in p:
            if m.start or m.stop != m.entry.size:
                pieces.setdefault(m.entry.arc, []).append(m)
    for ms in pieces.values():
        for k, m in enumerate(ms):
            m.piece, m.of = k, len(ms)
    return parts


def calibrate(layout: list[list[Member]], sizes: list[int]) -> None:
    """Scale each file's block estimates by what its part came to (solid xz of many small files comes out far
    smaller than their one-by-one estimates; a binary's pieces about as estimated)."""
    for members, size in zip(layout, sizes, strict=True):
        blocks = [(m.entry, b) for m in members for b in range(m.start // BLOCK, -(-m.stop // BLOCK) or 1)]
        est = sum(e.blocks[b] for e, b in blocks)
        for e, b in blocks:
            e.blocks[b] = max(1, int(e.blocks[b] * size / est))


def _tarinfo(name: str, size: int, mode: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, mode or 0o644, 0, 0, 0, "", ""
    return ti


def write_part(args: tuple[str, list[tuple[str, str, int, int, int]]]) -> tuple[str, int, str]:
    """One part's tar.xz from (arc name, path, start, stop, mode); returns (path, bytes, sha256)."""
    out, members = args
    tmp = out + ".tmp"
    with tarfile.open(tmp, "w:xz", preset=PRESET, format=tarfile.PAX_FORMAT) as tar:
        for arc, path, start, stop, mode in members:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(stop - start)
            tar.addfile(_tarinfo(arc, len(data), mode), io.BytesIO(data))
    os.replace(tmp, out)
    return out, os.path.getsize(out), sha256_file(out)


# ---------------------------------------------------------------------------------------------- the repo
TREE_GROWTH_MIB = 8  # what results committed after a build may add to the tree that travels with each part


def default_part_mib(tree_bytes: int | None) -> float:
    """The largest part that fits one call beside a working tree of ``tree_bytes`` grown by
    :data:`TREE_GROWTH_MIB` (at least 8 MiB: a tree too big for that is warned of)."""
    tree_mib = 24.0 if tree_bytes is None else tree_bytes / MIB
    return float(max(8, int(DEVICE_LIMIT // MIB - 1 - tree_mib - TREE_GROWTH_MIB)))


def working_tree_bytes() -> int | None:
    """What travels with every device call besides the carried paths: tracked and untracked-not-ignored
    files."""
    try:
        files = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                               check=True, capture_output=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for f in files:
        p = os.path.join(REPO, f.decode())
        if f and os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
    shared = os.path.join(REPO, "shared")
    if os.path.isdir(shared):
        total += sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(shared) for f in fs)
    return total


def exclude_in_git(out: str) -> None:
    """``out`` (inside the repository) is added to ``.git/info/exclude`` once: nothing of it is tracked."""
    git_dir = os.path.join(REPO, ".git")
    rel = os.path.relpath(out, REPO)
    if not os.path.isdir(git_dir) or rel.startswith(".."):
        return
    path = os.path.join(git_dir, "info", "exclude")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    line = f"/{rel.strip('/')}/"
    have = open(path).read().splitlines() if os.path.exists(path) else []
    if line not in have:
        with open(path, "a") as f:
            f.write(("" if not have or have[-1] == "" else "\n") + line + "\n")
        log(f"added {line} to .git/info/exclude")


def calls_text(parts_rel: list[str]) -> str:
    n = len(parts_rel)
    lines = ["Device calls, kind nvidia-h200, back to back (a machine stays warm 30 s after a call; a fresh one has",
             "lost every earlier part: assemble.sh then names the missing ones and the sequence starts again):", ""]
    for i, p in enumerate(parts_rel, 1):
        cmd = f"bash perf/vllm_carry/assemble.sh {p}"
        if i == n:
            cmd += " && bash perf/gpu_check.sh vllm_engine"
        lines.append(f"{i}. run(kind='nvidia-h200', timeout_s={600 if i == n else 240}, carry=['{p}'],")
        lines.append(f"       command=\"{cmd}\")")
    lines += ["",
              f"Call {n} installs (pip --no-deps --target /tmp/vllm_site) and runs engine_check.py for ~470 s; each",
              "later call in the same lease (within 30 s of the last) continues where it stopped, nothing carried:",
              f"{n + 1}. run(kind='nvidia-h200', timeout_s=600, carry=[],",
              "       command=\"bash perf/gpu_check.sh vllm_engine\")",
              f"{n + 2}. the same, while engine_check.log says runs were skipped for time",
              "The decode benchmark runs the same way (`bash perf/gpu_check.sh vllm_decode`, ~9 min for three",
              "configurations a call: run it again until decode_bench.log names none left).",
              "A call that failed in transfer is repeated as it was; a part that arrives twice is checked again and",
              "skipped. Results: $OUT/results.tar.gz (r/vllm_engine/engine_check.json, engine_check.log, run logs;",
              "r/vllm_decode/decode_bench.md, .json, .log)."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, ".vllm-carry"), help="work folder (ignored by git)")
    p.add_argument("--part-mib", type=float, default=None,
                   help="largest part, MiB (a call carries 64 MiB with the working tree; default: what fits beside "
                        f"today's working tree with {TREE_GROWTH_MIB} MiB left for it to grow)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="processes for compression")
    p.add_argument("--resolve", action="store_true", help="resolve the extras again with pip, and use them")
    p.add_argument("--kinds-md", default=KINDS_MD, help="the device doc listing the H200's packages (--resolve)")
    p.add_argument("--clean", action="store_true", help="remove the unpacked trees when done")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    exclude_in_git(out)
    tree_bytes = working_tree_bytes()
    if a.part_mib is None:
        a.part_mib = default_part_mib(tree_bytes)
        log(f"parts of at most {a.part_mib:g} MiB: the working tree is "
            f"{'unknown' if tree_bytes is None else f'{tree_bytes / MIB:.1f} MiB'}, and results committed later "
            f"may add {TREE_GROWTH_MIB} MiB to it")
    cap = int(a.part_mib * MIB)
    if tree_bytes is not None and tree_bytes + cap > DEVICE_LIMIT - MIB:
        log(f"warning: the working tree is {tree_bytes / MIB:.1f} MiB: with a {a.part_mib} MiB part a call carries "
            f"more than {DEVICE_LIMIT // MIB - 1} MiB; lower --part-mib")

    wheels_dir = os.path.join(out, "wheels")
    vllm_wheel = download([VLLM], wheels_dir)[0]
    extras = EXTRAS
    if a.resolve:
        extras = resolve(vllm_wheel, a.kinds_md, os.path.join(out, "resolve"))
        added, gone = sorted(set(extras) - set(EXTRAS)), sorted(set(EXTRAS) - set(extras))
        log(f"resolved {len(extras)} extras; new or changed: {added or 'none'}; no longer: {gone or 'none'}")
    extra_wheels = download(extras, wheels_dir)

    trees_dir = os.path.join(out, "tree")
    os.makedirs(trees_dir, exist_ok=True)
    trees, removed = [], []
    for w in [vllm_wheel] + extra_wheels:
        root, rm = unpack(w, trees_dir, TRIM if w == vllm_wheel else [])
        trees.append(root)
        removed += rm
    log(f"trimmed {len(removed)} files ({sum(s for _, s in removed) / MIB:.1f} MiB) from "
        f"{os.path.basename(vllm_wheel)}")

    entries = list_files(trees, a.jobs)
    parts_dir = os.path.join(out, "parts")
    if os.path.isdir(parts_dir):
        shutil.rmtree(parts_dir)
    os.makedirs(parts_dir)
    fill, calibrated = 0.985, False
    for _attempt in range(5):
        layout = plan(entries, int(cap * fill))
        # as many parts, evenly full: each call carries less than the limit by as much as it can
        even = int(sum(sum(e.blocks) + 512 for e in entries) / len(layout) * 1.02)
        balanced = plan(entries, even)
        if len(balanced) == len(layout):
            layout = balanced
        jobs = []
        for i, members in enumerate(layout, 1):
            d = os.path.join(parts_dir, f"p{i:02d}")
            os.makedirs(d, exist_ok=True)
            jobs.append((os.path.join(d, f"p{i:02d}.tar.xz"),
                         [(m.arc, m.entry.path, m.start, m.stop, m.entry.mode) for m in members]))
        log(f"compressing {len(layout)} parts (xz -9e, estimated fill {fill:.3f} of {a.part_mib} MiB)")
        with ProcessPoolExecutor(min(a.jobs, len(jobs))) as ex:
            written = list(ex.map(write_part, jobs))
        worst = max(size for _, size, _ in written)
        mean = sum(size for _, size, _ in written) / len(written)
        if worst <= cap and (worst <= mean * 1.08 or calibrated):
            break
        if worst <= cap:  # under the limit but uneven: scale the estimates by what each part came to, once
            calibrate(layout, [size for _, size, _ in written])
            calibrated = True
            log(f"parts of {', '.join(f'{sz / MIB:.1f}' for _, sz, _ in written)} MiB: evening them out")
            shutil.rmtree(parts_dir)
            os.makedirs(parts_dir)
            continue
        fill *= cap / worst * 0.99
        log(f"a part came out at {worst / MIB:.2f} MiB, over {a.part_mib} MiB: packing again at fill {fill:.3f}")
        shutil.rmtree(parts_dir)
        os.makedirs(parts_dir)
    else:
        raise SystemExit("could not pack the parts under --part-mib; lower it")

    # manifest: every part, every split file (its pieces and the whole), every tree
    pieces: dict[str, dict] = {}
    parts_meta = []
    for i, (members, (path, size, digest)) in enumerate(zip(layout, written, strict=True), 1):
        meta = {"name": f"p{i:02d}", "file": os.path.basename(path), "bytes": size, "sha256": digest,
                "members": len(members), "raw_bytes": sum(m.stop - m.start for m in members),
                "pieces": [m.arc for m in members if m.piece is not None]}
        parts_meta.append(meta)
        for m in members:
            if m.piece is not None:
                with open(m.entry.path, "rb") as f:
                    f.seek(m.start)
                    piece_sha = hashlib.sha256(f.read(m.stop - m.start)).hexdigest()
                if m.entry.arc not in pieces:
                    pieces[m.entry.arc] = {"path": m.entry.arc, "bytes": m.entry.size, "mode": m.entry.mode,
                                           "sha256": sha256_file(m.entry.path), "pieces": []}
                d = pieces[m.entry.arc]
                d["pieces"].append({"arc": m.arc, "part": meta["name"], "start": m.start, "stop": m.stop,
                                    "sha256": piece_sha})
    tree_meta = []
    for root in trees:
        name = os.path.basename(root)
        fs = [e for e in entries if e.tree == name]
        tree_meta.append({"wheel": name + ".whl", "files": len(fs), "raw_bytes": sum(e.size for e in fs)})
    build_id = hashlib.sha256(json.dumps([(m["name"], m["sha256"]) for m in parts_meta]).encode()).hexdigest()[:16]
    manifest = {
        "build_id": build_id, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "vllm": VLLM, "python": PYTHON, "platforms": "manylinux x86_64", "stage": STAGE,
        "part_mib": a.part_mib, "working_tree_bytes": tree_bytes,
        "parts": parts_meta, "split_files": sorted(pieces.values(), key=lambda d: d["path"]), "trees": tree_meta,
        "trimmed": [{"path": p_, "bytes": s} for p_, s in removed], "extras": extras, "excluded": EXCLUDED,
        "dropped": DROPPED, "h200_assumed": "torch 2.11.0, triton 3.6.0, transformers 5.17.0, torchvision 0.26.0 "
                                            "and the packages KINDS.md lists for nvidia-h200",
        "total_bytes": sum(m["bytes"] for m in parts_meta),
    }
    text = json.dumps(manifest, indent=1)
    open(os.path.join(parts_dir, "manifest.json"), "w").write(text)
    for i, meta in enumerate(parts_meta, 1):
        d = os.path.join(parts_dir, meta["name"])
        open(os.path.join(d, "manifest.json"), "w").write(text)
        open(os.path.join(d, "part.json"), "w").write(json.dumps(dict(meta, build_id=build_id, index=i,
                                                                      of=len(parts_meta)), indent=1))
    rel = [os.path.relpath(os.path.join(parts_dir, m["name"]), REPO) for m in parts_meta]
    calls = calls_text(rel)
    open(os.path.join(parts_dir, "CALLS.txt"), "w").write(calls + "\n")

    print()
    print(f"build {build_id}: {len(parts_meta)} parts, {manifest['total_bytes'] / MIB:.1f} MiB in all "
          f"({sum(t['raw_bytes'] for t in tree_meta) / MIB:.0f} MiB unpacked, {len(tree_meta)} wheels)")
    for m in parts_meta:
        folder = os.path.join(parts_dir, m["name"])
        carried = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        total = carried + (tree_bytes or 0)
        print(f"  {m['name']}: {m['bytes'] / MIB:6.2f} MiB ({m['members']} members, {m['raw_bytes'] / MIB:.1f} MiB "
              f"unpacked{', pieces ' + ', '.join(x.rsplit('/', 1)[1] for x in m['pieces']) if m['pieces'] else ''})"
              f"; a call carries {total / MIB:.1f} MiB with the working tree")
    if tree_bytes is not None:
        print(f"  working tree: {tree_bytes / MIB:.1f} MiB (tracked and untracked-not-ignored files)")
    print()
    print(calls)
    if a.clean:
        shutil.rmtree(trees_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
