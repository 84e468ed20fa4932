#!/usr/bin/env python3
"""The device runner: one call of the device tool runs named steps, in order, inside the call's time.

On the device, from the repo root (its working-tree copy; carry what the steps need, see each step):

    python3 scripts/device.py [--budget 570] [--snapshot] STEP [STEP ...]
    python3 scripts/device.py --list                       # the steps, their parameters, limits and carries

Here, before a call (git-ignored files under .device-out/, to carry):

    python3 scripts/device.py snapshot [--base COMMIT]     # .device-out/src.tar = HEAD (what --snapshot runs), and
                                                           # base-<sha>.tar for `ab` (also llama_cpp.tar when
                                                           # .peers/llama_cpp is there and it is not)

A step is ``NAME`` or ``NAME:VALUE[:KEY=VALUE...]`` (VALUE sets the step's first parameter), e.g. ``tests:gpu``,
``bench:kernel=avx512:shapes=qwen3``, ``vs-llamacpp:Q4_0:layers=48``, ``ab:qwen3:base=1234abc``. Steps that need
the extension get ``build`` before them when it is not listed. Each step has its own time limit; before starting one
the runner compares what is left of ``--budget`` (the call's own end, inside the tool's 600 s) with the least the
step needs, and skips it, saying so, when that is short. A step that runs past its limit is stopped with its whole
process group (pytest's xdist workers included). Logs go to $OUT/<step>.log, the lines that matter to stdout.

The extension: ``build`` installs ktorch in editable mode. A build costs about a minute of device time, so each
fresh build leaves its extension (stripped) in $OUT/prebuilt/<id>/, id = a hash of setup.py, pyproject.toml and
ktorch/csrc plus the torch and Python versions. Copied back here into .device-out/prebuilt/ and carried, a later
call with the same sources installs it in seconds (setup.py's KT_PREBUILT_EXTENSION). ``ab`` uses the same store
for the older commit's build.

llama.cpp (for vs-llamacpp): ``llamacpp:start`` starts its CUDA build (~5.5 min on 16 cores) detached (its own
session, so it outlives the call while the machine stays warm; the next call must follow within 30 s) and returns
at once; ``llamacpp`` waits for it (or builds, or restores binaries from .device-out/lcpp/) and returns the binaries
in $OUT as stripped lcpp_bin.txz.* chunks, once a machine (copy them to .device-out/lcpp/ to skip the build on a fresh
machine). Measuring steps warn while the build runs: their timings are then not results.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import hashlib
import os
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", "/tmp/out"))
LCPP_BUILD = Path("/tmp/lcpp")
SITE = Path("/tmp/site")  # carried wheels (.whl/: gguf, accelerate, pytest-xdist, ...) are installed here
TABLE_DIR = Path("/tmp")  # the table step's 48-layer files (~34 GB each: the device's disk holds one)
RESERVE_S = 10  # kept back from every step's limit: the summary, and the tool's copy of $OUT

# the GPU/compile test files (the device's reason to be), and the op tests run again with AMX forced
GPU_TESTS = ["tests/test_compile_backend.py", "tests/test_compile_deferral.py", "tests/test_gpu_experts.py",
             "tests/test_host_tasks.py", "tests/test_integrations_transformers.py", "tests/test_streamed_experts.py",
             "tests/test_cli.py", "tests/test_generation.py", "tests/test_routed_experts.py",
             "tests/test_serve_cuda.py", "tests/test_resident_rows.py", "tests/test_resident_swaps.py",
             "tests/test_triton_prefill.py", "tests/test_triton_train.py", "tests/test_train_experts.py"]
AMX_OP_TESTS = ["tests/test_ops_fused_moe.py", "tests/test_ops_pack.py"]
NOISE = re.compile(r"^W\d{4} |Warning|warn\(")


# ---------------------------------------------------------------- steps and their parameters


@dataclasses.dataclass
class Step:
    name: str
    doc: str
    limit_s: int  # stopped after this long
    min_s: int  # not started with less than this left
    params: dict  # name -> default (str); the first is set by a bare value
    run: Callable[["Runner", dict], int]
    needs_build: bool = True
    carry: str = ""


STEPS: dict[str, Step] = {}


def step(name: str, doc: str, limit_s: int, min_s: int, params: Optional[dict] = None, needs_build: bool = True,
         carry: str = ""):
    def register(fn):
        STEPS[name] = Step(name, doc, limit_s, min_s, dict(params or {}), fn, needs_build, carry)
        return fn

    return register


def parse_step(text: str) -> tuple[Step, dict]:
    """``NAME[:VALUE][:KEY=VALUE...]`` -> (the step, its parameters with defaults filled in); a clear error for
    an unknown step or parameter."""
    name, *parts = text.split(":")
    if name not in STEPS:
        raise SystemExit(f"device.py: unknown step {name!r} (steps: {', '.join(STEPS)})")
    st = STEPS[name]
    params = dict(st.params)
    for i, part in enumerate(parts):
        key, eq, value = part.partition("=")
        if not eq:
            if i > 0 or not st.params:
                raise SystemExit(f"device.py: {text!r}: a bare value only comes first, for a step with parameters")
            key, value = next(iter(st.params)), part
        if key not in st.params:
            raise SystemExit(f"device.py: {text!r}: step {name} has no parameter {key!r} "
                             f"(it has: {', '.join(st.params) or 'none'})")
        params[key] = value
    return st, params


def select_steps(texts: list[str]) -> list[tuple[Step, dict]]:
    """The steps to run, in order, with ``build`` inserted before the first step that needs it when it is not
    listed (steps before it, e.g. ``llamacpp:start``, run first)."""
    if not texts:
        raise SystemExit("device.py: no step given (--list shows them)")
    chosen = [parse_step(t) for t in texts]
    names = [st.name for st, _ in chosen]
    needing = [i for i, (st, _) in enumerate(chosen) if st.needs_build]
    if needing and "build" not in names:
        chosen.insert(needing[0], parse_step("build"))
    elif needing and needing[0] < names.index("build"):
        raise SystemExit("device.py: 'build' must come before the steps that need it")
    return chosen


# ---------------------------------------------------------------- time


class Budget:
    """What is left of the call's time, and the limit of each step started inside it."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic):
        self.total_s, self.clock, self.start = total_s, clock, clock()

    def left(self) -> float:
        return self.total_s - (self.clock() - self.start)

    def limit_for(self, st: Step) -> Optional[float]:
        """Seconds the step may run, or None when too little is left to start it."""
        left = self.left() - RESERVE_S
        if left < st.min_s:
            return None
        return min(st.limit_s, left)


# ---------------------------------------------------------------- processes


def run_logged(cmd, log: Path, timeout: float, env: Optional[dict] = None, cwd: Optional[Path] = None,
               show: Callable[[str], bool] = lambda line: not NOISE.search(line)) -> int:
    """Runs ``cmd`` (a list, or a string for bash) in its own process group: every line to ``log``, the lines
    ``show`` keeps to stdout. Past ``timeout`` the whole group is stopped; returns 124 then."""
    if isinstance(cmd, str):
        cmd = ["bash", "-c", cmd]
    print(f"$ {shlex.join(cmd) if cmd[0] != 'bash' else cmd[2]}", flush=True)
    deadline = time.monotonic() + timeout
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        fd, pending, timed_out = proc.stdout.fileno(), b"", False

        def emit(raw: bytes) -> None:
            line = raw.decode(errors="replace")
            f.write(line)
            if show(line):
                sys.stdout.write(line)
                sys.stdout.flush()

        while True:
            if time.monotonic() > deadline:
                timed_out = True
                break
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk.replace(b"\r", b"\n")).split(b"\n")
            for raw in lines:
                emit(raw + b"\n")
        if pending:
            emit(pending + b"\n")
        if timed_out:
            stop_group(proc)
        proc.wait()
    if timed_out:
        print(f"(stopped after {timeout:.0f} s)", flush=True)
        return 124
    return proc.returncode


def stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- the runner


class Runner:
    def __init__(self, root: Path, budget: Budget):
        self.root, self.budget = root, budget
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), self.env.get("PYTHONPATH", "")) if p)
        self.limit = 0.0  # the running step's
        self.step_name = ""

    def sh(self, cmd, timeout: Optional[float] = None, env: Optional[dict] = None, cwd: Optional[Path] = None,
           show=None) -> int:
        left = self.limit - (time.monotonic() - self.step_start)
        kw = {"show": show} if show else {}
        return run_logged(cmd, OUT / f"{self.step_name}.log", min(timeout or left, left), env=env or self.env,
                          cwd=cwd or self.root, **kw)

    def run(self, chosen: list[tuple[Step, dict]]) -> int:
        OUT.mkdir(parents=True, exist_ok=True)
        self.install_wheels()
        summary, worst = [], 0
        for st, params in chosen:
            if st.name == "build" and prebuilt_matches(self.root):
                st = dataclasses.replace(st, min_s=min(st.min_s, PREBUILT_MIN_S))
            limit = self.budget.limit_for(st)
            label = st.name + "".join(f":{k}={v}" for k, v in params.items() if v != st.params[k])
            if limit is None:
                summary.append(f"SKIPPED {label}: {self.budget.left():.0f} s left ({RESERVE_S} s kept back), "
                               f"it needs at least {st.min_s} s")
                print(f"== {summary[-1]}", flush=True)
                continue
            print(f"== {time.strftime('%H:%M:%S')} {label} (limit {limit:.0f} s, {self.budget.left():.0f} s left)",
                  flush=True)
            self.limit, self.step_start, self.step_name = limit, time.monotonic(), log_name(label)
            try:
                rc = st.run(self, params)
            except StepError as e:
                print(f"{st.name}: {e}", flush=True)
                rc = 1
            took = time.monotonic() - self.step_start
            summary.append(f"{'ok' if rc == 0 else f'rc {rc}'} {label} ({took:.0f} s)")
            worst = worst or rc
            if st.name == "build" and rc != 0:
                summary.append("the build failed: the other steps were not run")
                break
        print("== summary\n" + "\n".join(summary), flush=True)
        return worst

    def install_wheels(self) -> None:
        wheels = sorted(glob.glob(str(self.root / ".whl" / "*.whl")))
        if wheels and not SITE.exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--target", str(SITE), *wheels], check=False)
        if SITE.exists():
            self.env["PYTHONPATH"] = f"{SITE}{os.pathsep}{self.env['PYTHONPATH']}"
            sys.path.insert(0, str(SITE))

    def busy_warning(self) -> None:
        """Measurements on a busy machine are not results: say what else runs."""
        if lcpp_running():
            print("WARNING: the llama.cpp build is running; timings are not results", flush=True)
        ps = subprocess.run(["ps", "-eo", "pcpu=,args=", "--sort=-pcpu"], capture_output=True, text=True).stdout
        for line in ps.splitlines()[:5]:
            if float(line.split()[0]) > 5 and "device.py" not in line:
                print(f"busy: {line.strip()[:160]}", flush=True)


def log_name(label: str) -> str:
    """A file name for a step's log: the device tool leaves out files with odd characters in their names."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)[:100]


class StepError(Exception):
    pass


# ---------------------------------------------------------------- the extension


def source_id(root: Path, torch_version: str, python_version: str) -> str:
    """What a built extension depends on: setup.py, pyproject.toml, ktorch/csrc (not its test folders), the torch
    and Python versions."""
    h = hashlib.sha256()
    files = [root / "setup.py", root / "pyproject.toml"]
    files += sorted(p for p in (root / "ktorch" / "csrc").rglob("*") if p.is_file() and "test" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    # the tool brings back names of letters, digits, '.', '_' and '-' only: torch's "2.11.0+cu130" becomes 2.11.0_cu130
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{h.hexdigest()[:16]}-{torch_version}-py{python_version}")


@functools.lru_cache(maxsize=None)  # one interpreter's torch and Python: asked by the build's check and the build
def versions() -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", "import sys, torch; print(torch.__version__, "
                          "'%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, check=True).stdout
    torch_version, python_version = out.split()
    return torch_version, python_version


def prebuilt_for(root: Path, src: str) -> Optional[Path]:
    found = sorted((root / ".device-out" / "prebuilt" / src).glob("_C*.so"))
    return found[0] if found else None


def prebuilt_matches(root: Path) -> bool:
    """Whether .device-out/prebuilt holds the extension of ``root``'s sources for this torch and Python."""
    if not (root / ".device-out" / "prebuilt").is_dir():
        return False
    try:
        return prebuilt_for(root, source_id(root, *versions())) is not None
    except (OSError, subprocess.CalledProcessError):
        return False


def keep_build(tree: Path, src: str) -> None:
    """The fresh build's extension, stripped, to $OUT/prebuilt/<id>/ (the tool brings it back)."""
    so = sorted((tree / "ktorch").glob("_C*.so"))[0]
    dest = OUT / "prebuilt" / src
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["strip", "--strip-debug", "-o", str(dest / so.name), str(so)], check=True)
    print(f"built extension kept: $OUT/prebuilt/{src}/{so.name} (copy $OUT/prebuilt/* into .device-out/prebuilt/)")


def build_tree(r: Runner, tree: Path, editable: bool) -> int:
    src = source_id(tree, *versions())
    pre = prebuilt_for(r.root, src)
    print(f"build {tree} ({'prebuilt extension, ' if pre else ''}{src})", flush=True)
    env = dict(r.env, KT_PREBUILT_EXTENSION=str(pre or ""), MAX_JOBS=str(os.cpu_count() or 16))
    if editable:
        cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."]
    elif pre:
        shutil.copy(pre, tree / "ktorch" / pre.name)
        return 0
    else:
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    log = OUT / f"{r.step_name}.log"
    start = log.stat().st_size if log.exists() else 0
    rc = r.sh(cmd, env=env, cwd=tree, show=lambda line: bool(re.search(r"\berror:|^ERROR", line)))
    if rc != 0:
        with open(log, errors="replace") as f:
            f.seek(start)
            print("the build failed; the end of its log:\n" + "".join(f.readlines()[-40:]), flush=True)
    elif not pre:
        keep_build(tree, src)
    return rc


# The least the build step needs when the carried prebuilt extension matches the sources (an editable install: 21-32
# s on the device in session 52) instead of its min_s for a compile: a call whose budget was set for an install was
# otherwise left without ktorch (sessions 51 and 52, --budget 60)
PREBUILT_MIN_S = 40


@step("build", "machine, then ktorch installed in editable mode (compiled, or the carried prebuilt extension; with "
      f"a matching prebuilt it starts with >= {PREBUILT_MIN_S} s left)",
      limit_s=300, min_s=60, needs_build=False, carry=".device-out/prebuilt (optional), .whl")
def step_build(r: Runner, p: dict) -> int:
    r.sh("lscpu | grep -E 'Model name|^CPU\\(s\\)|Thread|NUMA node\\(s\\)|L3|Flags' | cut -c1-300; nvidia-smi -L; "
         "python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'",
         show=lambda line: True)
    rc = build_tree(r, r.root, editable=True)
    if rc == 0:
        rc = r.sh([sys.executable, "-c", "import ktorch; print(ktorch.cpu_features())"], show=lambda line: True)
    return rc


# ---------------------------------------------------------------- tests


def importable(r: Runner, module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=r.env, capture_output=True).returncode == 0


def pytest(r: Runner, files: list[str], env_extra: dict, workers: int, name: str) -> int:
    env = dict(r.env, **env_extra, KT_FAILURES_LOG=str(OUT / f"failures_{name}.log"))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", "--tb=short", "-rfE"]
    if importable(r, "pytest_timeout"):
        args.append("--timeout=240")
    if workers > 1 and importable(r, "xdist"):
        args += ["-n", str(workers)]
        threads = str(max(1, (os.cpu_count() or 16) // workers))
        env.update(OMP_NUM_THREADS=threads, KT_NUM_THREADS=threads)
    return r.sh(args + files, env=env, show=lambda line: bool(re.search(r"passed|failed|^FAILED|^ERROR", line)))


@step("tests", "a test list: all, gpu (the GPU/compile files, in one process whatever workers says: their CUDA graph "
      "captures and compiles collide under xdist; ~15 min, so name files to fit a call), amx (the AMX kernel test "
      "binary, then the op tests with KT_CPU_KERNEL=amx), amx-emulated (the kernel test binary's emulated build "
      "under ASan/UBSan, ~160 s), forced (the suite with KT_CPU_KERNEL=amx KT_NUMA_SPLIT=2), or test files "
      "joined by ','", limit_s=570, min_s=120, params={"list": "gpu", "workers": "4"}, carry=".whl (pytest-xdist)")
def step_tests(r: Runner, p: dict) -> int:
    which, workers = p["list"], int(p["workers"])
    if which == "all":
        return pytest(r, ["tests"], {}, workers, which)
    if which == "gpu":
        return pytest(r, GPU_TESTS, {}, 1, which)
    if which == "amx":
        rc = r.sh("bash ktorch/csrc/kernels/amx/test/run.sh native 2>&1 | tail -8", timeout=150, show=lambda l: True)
        # one worker took > 217 s for these 789 tests (session 51 call 1, cut at its summary)
        return pytest(r, AMX_OP_TESTS, {"KT_CPU_KERNEL": "amx"}, workers, which) or rc
    if which == "amx-emulated":  # the tile model under ASan/UBSan: 160 s on the device (session 51 call 3)
        return r.sh("bash ktorch/csrc/kernels/amx/test/run.sh emulated 2>&1 | tail -8", timeout=400,
                    show=lambda l: True)
    if which == "forced":
        return pytest(r, ["tests"], {"KT_CPU_KERNEL": "amx", "KT_NUMA_SPLIT": "2"}, workers, which)
    files = named_test_files(r.root, which)
    # the GPU files' captures and compiles collide under xdist, as for the gpu list
    together = len(files) > 1 and not any(f in GPU_TESTS for f in files)
    return pytest(r, files, {}, workers if together else 1, "files")


def named_test_files(root: Path, which: str) -> list[str]:
    """The test files a ','-joined list names, each as given or under tests/ (session 53 lost a call to bare names)."""
    files, missing = [], []
    for name in which.split(","):
        found = next((f for f in (name, f"tests/{name}") if (root / f).is_file()), None)
        (files if found else missing).append(found or name)
    if missing:
        raise StepError(f"no such test list or file: {', '.join(missing)} (lists: all, gpu, amx, amx-emulated, forced)")
    return files


# ---------------------------------------------------------------- benchmarks


def kernel_env(r: Runner, kernel: str) -> dict:
    return dict(r.env, **({} if kernel == "auto" else {"KT_CPU_KERNEL": kernel}))


@step("bench", "the op benchmark (benchmarks/bench_fused_moe.py: ktorch's formats vs transformers' eager and "
      "grouped_mm), cold caches; cpu_experts=N: only N experts' pairs routed (a prefill split's CPU share)",
      limit_s=420, min_s=90,
      params={"shapes": "qwen3,deepseek", "tokens": "1,32,512,2048", "impls": "all", "kernel": "auto",
              "seconds": "0.5", "cpu_experts": ""})
def step_bench(r: Runner, p: dict) -> int:
    r.busy_warning()
    impls = [] if p["impls"] == "all" else ["--impls", *p["impls"].split(",")]
    share = ["--cpu-experts", p["cpu_experts"]] if p["cpu_experts"] else []
    return r.sh([sys.executable, "benchmarks/bench_fused_moe.py", "--shapes", *p["shapes"].split(","), "--tokens",
                 *p["tokens"].split(","), *impls, *share, "--min-seconds", p["seconds"]], env=kernel_env(r, p["kernel"]),
                show=lambda line: line.startswith(("|", "machine", "L3", "skip")) or "failed" in line)


@step("kernels", "ktorch against KTransformers' kt-kernel 0.7.2, side by side (benchmarks/bench_vs_kt_kernel.py), "
      "cold caches; variants: ktorch's, joined by ',', '/' for ':' (e.g. auto,amx/16: the script's amx:16)",
      limit_s=480, min_s=180,
      params={"shapes": "qwen3", "formats": "bf16,int8,int4", "tokens": "1,32,512,2048", "cold": "16",
              "variants": "auto,avx512"},
      carry=".peers/kt_kernel (bash /work/shared/tools/fetch_kt_kernel.sh .peers/kt_kernel)")
def step_kernels(r: Runner, p: dict) -> int:
    if not (r.root / ".peers" / "kt_kernel").is_dir():
        raise StepError("no .peers/kt_kernel: fetch it with /work/shared/tools/fetch_kt_kernel.sh and carry it")
    r.busy_warning()
    return r.sh([sys.executable, "benchmarks/bench_vs_kt_kernel.py", "--shapes", *p["shapes"].split(","),
                 "--formats", *p["formats"].split(","), "--tokens", *p["tokens"].split(","),
                 "--ktorch-variants", *p["variants"].replace("/", ":").split(","), "--kt-threads", "15",
                 "--cold-factor", p["cold"], "--min-seconds", "0.3"])


@step("e2e", "end to end, Qwen3-30B-A3B shape: `ktorch generate` (fresh processes, defaults, on a random Q8_0 GGUF "
      "of the shape) vs transformers + accelerate offload (benchmarks/bench_e2e.py)", limit_s=540, min_s=300,
      params={"shape": "qwen3-30b-a3b", "variants": "ktorch,hf_offload", "layers": "48"},
      carry=".whl (gguf, accelerate, psutil)")
def step_e2e(r: Runner, p: dict) -> int:
    r.busy_warning()
    return r.sh([sys.executable, "benchmarks/bench_e2e.py", "--shape", p["shape"], "--variants", p["variants"],
                 "--layers", p["layers"], "--prompts", "512", "--decode-tokens", "64", "--json",
                 str(OUT / "e2e.jsonl")])


@step("deferral", "expert deferral and hot experts on the GPU: the model loaded by `ktorch generate`'s loader from a "
      "random Qwen3-30B-A3B-shaped GGUF, Zipf-skewed routers, decode by its generate call per "
      "--deferred-experts d and GPU share (benchmarks/bench_deferral.py speed)", limit_s=480, min_s=240,
      params={"shape": "qwen3-30b-a3b", "deferred": "0,2", "gpu": "0.25", "layers": "12"}, carry=".whl (gguf)")
def step_deferral(r: Runner, p: dict) -> int:
    r.busy_warning()
    return r.sh([sys.executable, "benchmarks/bench_deferral.py", "speed", "--shape", p["shape"], "--deferred",
                 p["deferred"], "--gpu-experts", p["gpu"], "--zipf", "1", "--layers", p["layers"],
                 "--decode-tokens", "256", "--profile-steps", "20", "--json", str(OUT / "deferral.jsonl")])


def placement_args(text: str) -> list[str]:
    """A ``placements=`` parameter -> one `ktorch generate` option string per placement ('/' between them, '+' for
    their spaces; an empty string is the defaults)."""
    return [s.replace("+", " ") for s in text.split("/")]


def small_file(r: Runner, p: dict) -> tuple[list[str], int]:
    """The prefill and decode steps' file, a random Q8_0 /tmp/q8-<layers>l-skew<skew>.gguf, written (bench_generate.py's
    seed) unless there: (bench_generate.py's command on it, the write's exit status)."""
    gguf = f"/tmp/q8-{p['layers']}l-skew{p['skew']}.gguf"
    common = [sys.executable, "benchmarks/bench_generate.py", "--gguf", gguf]
    rc = 0
    if not Path(gguf).exists():
        rc = r.sh(common + ["--write-layers", p["layers"], "--write-router-skew", p["skew"], "--skip-ktorch"],
                  timeout=240)
    return common, rc


@step("prefill", "the eager prefill as generate runs it, on a random 12-layer (layers=) Qwen3-30B-A3B-shaped Q8_0 "
      "file (skew=: the routers' Zipf bias, 0 near-uniform): bench_generate.py --breakdown N (the first prompts by "
      "part, the Triton kernels each compiles) and --prefill-profile R over variants= ('/' between names), one process "
      "per placement ('/' between generate option strings, '+' for their spaces); cprofile=N: the breakdown's first "
      "prompts and one warm prefill per variant under cProfile, N functions. The budget placement's default, 9GiB, "
      "holds ~55% of each of 12 layers' experts, as 24GiB does of 48 (6GiB did before the budget counted the CUDA "
      "context and the captured prefills' pool, session 56; ~14% now)", limit_s=540,
      min_s=200, params={"skew": "1.5", "layers": "12", "placements": "--deferred-experts+2+--gpu-memory+off/"
                         "--gpu-memory+9GiB", "prompts": "512,2048", "variants": "default", "rounds": "3",
                         "breakdown": "2", "cprofile": "0"}, carry=".whl (gguf)")
def step_prefill(r: Runner, p: dict) -> int:
    r.busy_warning()
    common, rc = small_file(r, p)
    placements = placement_args(p["placements"])
    prompts = ["--prompts", *p["prompts"].split(","), "--prompt-kind", "random"]
    if rc == 0 and int(p["breakdown"]) > 0:
        rc = r.sh(common + ["--breakdown", p["breakdown"], "--breakdown-cprofile", p["cprofile"], *prompts,
                            "--ktorch-args", *placements])
    if rc == 0 and int(p["rounds"]) > 0:
        rc = r.sh(common + ["--prefill-profile", p["rounds"], "--prefill-cprofile", p["cprofile"], *prompts,
                            "--prefill-variants",
                            *p["variants"].split("/"), "--profile-trace", str(OUT / f"ptrace-skew{p['skew']}"),
                            "--ktorch-args", *placements])
    return rc


@step("decode", "the captured decode step's A/B and profile: a random 12-layer (layers=) Qwen3-30B-A3B-shaped Q8_0 "
      "file (skew=), one process (bench_generate.py --ab-compile ROUNDS): the variants= ('/' between names: "
      "bench_generate.py's AB_VARIANTS) taking turns per deferral (deferred=, '/'), then --profile-steps 10 of each "
      "profiled variant (kernels by time a step) and of the default after each longer prompt; gpu=: the model's GPU "
      "memory option (auto: every expert resident; off: the CPU op and its handoffs). ~150 s at the defaults "
      "(session 51 call 5: the file 26 s, the A/B and profiles ~90 s); '+' for a space in a variant's name",
      limit_s=400, min_s=150,
      params={"skew": "0", "layers": "12", "variants": "default", "rounds": "2", "deferred": "0", "gpu": "auto",
              "prompts": "512,2048"}, carry=".whl (gguf)")
def step_decode(r: Runner, p: dict) -> int:
    r.busy_warning()
    common, rc = small_file(r, p)
    if rc == 0:
        variants = p["variants"].replace("+", " ").split("/")
        rc = r.sh(common + ["--prompts", *p["prompts"].split(","), "--gen", "64", "--ab-compile", p["rounds"],
                            "--ab-variants", *variants, "--deferred", *p["deferred"].split("/"),
                            "--ab-gpu-memory", p["gpu"], "--profile-steps", "10"])
    return rc


@step("gguf", "loading: a random Qwen3-30B-A3B-shaped GGUF (benchmarks/make_gguf.py), then `ktorch generate` on it "
      "as typed: load time, peak RSS, tok/s", limit_s=540, min_s=300,
      params={"type": "Q4_K", "layers": "48", "tokens": "64"}, carry=".whl (gguf)")
def step_gguf(r: Runner, p: dict) -> int:
    r.busy_warning()
    env = dict(r.env, GGUF_DIR="/tmp", GGUF_LOG=str(OUT / "gguf_stderr.log"),
               GGUF_GENERATE_ARGS=f"--max-new-tokens {p['tokens']}")
    return r.sh(["bash", "benchmarks/gguf_device_run.sh", p["type"], p["layers"]], env=env)


# ---------------------------------------------------------------- llama.cpp


def lcpp_pid_alive() -> bool:
    try:
        pid = int((LCPP_BUILD / "build.pid").read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return False
    return state != "Z"


def lcpp_running() -> bool:
    return (LCPP_BUILD / "build.running").exists() and lcpp_pid_alive()


def lcpp_source(root: Path) -> Optional[Path]:
    """The llama.cpp source: .peers/llama_cpp, or .device-out/llama_cpp.tar (or .tgz) unpacked to /tmp/lcpp_src."""
    if (root / ".peers" / "llama_cpp" / "CMakeLists.txt").exists():
        return root / ".peers" / "llama_cpp"
    dest = Path("/tmp/lcpp_src")
    for tar in (root / ".device-out" / "llama_cpp.tar", root / ".device-out" / "llama_cpp.tgz"):
        if tar.exists() and not (dest / "CMakeLists.txt").exists():
            dest.mkdir(parents=True, exist_ok=True)
            subprocess.run(["tar", "xf", str(tar), "-C", str(dest)], check=True)
    return dest if (dest / "CMakeLists.txt").exists() else None


def lcpp_restore(root: Path) -> None:
    """Binaries an earlier call returned (lcpp_bin.tgz.* or .txz.* chunks in .device-out/lcpp/), on a fresh machine."""
    if (LCPP_BUILD / "bin" / "llama-bench").exists():
        return
    for ext, flag in (("txz", "xJf"), ("tgz", "xzf")):
        chunks = sorted(glob.glob(str(root / ".device-out" / "lcpp" / f"lcpp_bin.{ext}.*")))
        if chunks:
            LCPP_BUILD.mkdir(parents=True, exist_ok=True)
            subprocess.run(f"cat {' '.join(map(shlex.quote, chunks))} | tar {flag} - -C {LCPP_BUILD}", shell=True,
                           check=True)
            print("llama.cpp binaries restored from .device-out/lcpp/", flush=True)
            (LCPP_BUILD / "exported").touch()  # nothing new to return
            return


def lcpp_start(root: Path, jobs: int) -> None:
    """Starts the CUDA build of llama-bench in its own session (it outlives this call); ninja resumes a cut one."""
    src = lcpp_source(root)
    if src is None:
        raise StepError("no llama.cpp source: carry .peers/llama_cpp or .device-out/llama_cpp.tar "
                        "(bash /work/shared/tools/fetch_llama_cpp.sh .peers/llama_cpp; device.py snapshot tars it)")
    LCPP_BUILD.mkdir(parents=True, exist_ok=True)
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        raise StepError("nvcc not found (PATH, /usr/local/cuda/bin)")
    cap = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.split("\n")[0].replace(".", "").strip() or "90"
    # the configuration of /work/shared/tools/fetch_llama_cpp.sh's header (and issue 7)
    configure = ["cmake", "-S", str(src), "-B", str(LCPP_BUILD), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DGGML_CUDA=ON",
                 f"-DCMAKE_CUDA_ARCHITECTURES={cap}", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    b = shlex.quote(str(LCPP_BUILD))
    # the fetched source lists llama-bench alone among the tools: add llama-perplexity's folder (issue 32's quality
    # comparison; its failure leaves llama-bench's result alone)
    tools = shlex.quote(str(Path(src) / "tools" / "CMakeLists.txt"))
    script = (f"echo $$ > {b}/build.pid; grep -q 'add_subdirectory(perplexity)' {tools} || "
              f"echo 'add_subdirectory(perplexity)' >> {tools}; "
              f"{{ [ -f {b}/build.ninja ] || {shlex.join(configure)}; }} && "
              f"cmake --build {b} -j{jobs} --target llama-bench; rc=$?; "
              f"cmake --build {b} -j{jobs} --target llama-perplexity >/dev/null 2>&1; echo $rc > {b}/build.rc")
    for name in ("build.rc", "build.pid"):
        (LCPP_BUILD / name).unlink(missing_ok=True)
    (LCPP_BUILD / "build.running").touch()
    if not (LCPP_BUILD / "build.started").exists():
        (LCPP_BUILD / "build.started").write_text(str(int(time.time())))
    with open(LCPP_BUILD / "build.log", "a") as log:
        log.write(f"== build started {time.strftime('%FT%TZ', time.gmtime())}\n")
        log.flush()
        subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    # the detached script writes its pid first thing: until then lcpp_running() would read "not running"
    deadline = time.monotonic() + 20
    while not (LCPP_BUILD / "build.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"llama.cpp build started, detached, {jobs} jobs (log {LCPP_BUILD}/build.log)", flush=True)


def lcpp_export() -> None:
    """The binaries this machine built to $OUT as stripped, xz-compressed lcpp_bin.txz.* chunks (unstripped gzip,
    245 MB of files, did not come back, session 55), once per machine: copied to .device-out/lcpp/ they are restored
    on a fresh machine instead of building again."""
    marker = LCPP_BUILD / "exported"
    if marker.exists():
        return
    subprocess.run(f"rm -rf /tmp/lcpp_export && cp -a {LCPP_BUILD}/bin /tmp/lcpp_export && "
                   "(find /tmp/lcpp_export -type f -exec strip --strip-unneeded {} + 2>/dev/null; true) && "
                   f"tar -I 'xz -T0 -6' -cf - -C /tmp --transform s,^lcpp_export,bin, lcpp_export | "
                   f"split -b 15M - {OUT}/lcpp_bin.txz.", shell=True, check=False)
    marker.touch()
    print("llama.cpp binaries in $OUT/lcpp_bin.txz.* (copy them to .device-out/lcpp/)", flush=True)


@step("llamacpp", "llama.cpp's llama-bench with CUDA into /tmp/lcpp: 'start' starts the build detached and "
      "returns; 'wait' (default) waits for it (starting it if need be), then returns the binaries in $OUT",
      limit_s=540, min_s=20, params={"mode": "wait", "jobs": "16"}, needs_build=False,
      carry=".peers/llama_cpp or .device-out/llama_cpp.tar; or .device-out/lcpp/ (binaries)")
def step_llamacpp(r: Runner, p: dict) -> int:
    lcpp_restore(r.root)
    bench = LCPP_BUILD / "bin" / "llama-bench"
    if bench.exists() and not lcpp_running():
        print(f"llama-bench: {bench} (already built)", flush=True)
        lcpp_export()
        return 0
    if not lcpp_running():
        lcpp_start(r.root, int(p["jobs"]))
    if p["mode"] == "start":
        return 0
    while lcpp_running() and not (LCPP_BUILD / "build.rc").exists():
        if time.monotonic() - r.step_start > r.limit - 5:
            print("llama.cpp still building: run the step again (it waits on the same build)", flush=True)
            return 75
        time.sleep(5)
    rc_file = LCPP_BUILD / "build.rc"
    rc = int(rc_file.read_text()) if rc_file.exists() else 1
    (LCPP_BUILD / "build.running").unlink(missing_ok=True)
    if rc != 0 or not bench.exists():
        print("llama.cpp build failed; the end of its log:\n" + "".join(open(LCPP_BUILD / "build.log").readlines()[-30:]))
        return 1
    print(f"llama-bench built, {int(time.time()) - int((LCPP_BUILD / 'build.started').read_text())} s since the "
          "first start", flush=True)
    lcpp_export()
    return 0


@step("vs-llamacpp", "`ktorch generate` (fresh processes, as typed) against llama.cpp (-ot exps=CPU) on one random "
      "Qwen3-30B-A3B-shaped GGUF per type (benchmarks/bench_vs_llamacpp.py; needs the llamacpp step on this warm "
      "machine first); deferred=D adds a `--deferred-experts D` setting, stream=PLAN gives every setting "
      "`--stream-experts PLAN` (auto: the default, not passed); results accumulate over calls in "
      "/tmp/vs_llamacpp.jsonl", limit_s=540, min_s=200,
      params={"types": "Q8_0", "layers": "12", "only": "both", "deferred": "0", "stream": "auto"},
      carry=".whl (gguf)")
def step_vs_llamacpp(r: Runner, p: dict) -> int:
    lcpp_restore(r.root)
    if not (LCPP_BUILD / "bin" / "llama-bench").exists() and p["only"] != "ktorch":
        print("no /tmp/lcpp/bin/llama-bench (run the llamacpp step first): the llama.cpp columns stay empty")
    r.busy_warning()
    jsonl = Path("/tmp/vs_llamacpp.jsonl")
    args = [sys.executable, "benchmarks/bench_vs_llamacpp.py", "--types", p["types"], "--layers", p["layers"],
            "--llama-reps", "3", "--json", str(jsonl), "--out", str(OUT), "--ktorch-args",
            *vs_llamacpp_settings(p["deferred"], p["stream"])]
    if p["only"] in ("ktorch", "llamacpp"):
        args += ["--skip-llamacpp" if p["only"] == "ktorch" else "--skip-ktorch", "--keep"]
    rc = r.sh(args, timeout=r.limit - 30)
    r.sh([sys.executable, "benchmarks/bench_vs_llamacpp.py", "--report", str(jsonl)], timeout=20,
         show=lambda line: True)
    if jsonl.exists():
        shutil.copy(jsonl, OUT / jsonl.name)
    return rc


def write_table_file(r: Runner, p: dict, gguf: Path, common: list) -> int:
    """The table's random file (layers=, skew=, seed 11) written by ``common`` (bench_generate.py on ``gguf``) unless
    there, the other skews' files deleted first (the disk holds one); the write's exit status (0 when there)."""
    if gguf.exists():
        return 0
    for other in glob.glob(str(TABLE_DIR / f"q8-{p['layers']}l-skew*.gguf")):
        os.unlink(other)
    return r.sh(common + ["--write-layers", p["layers"], "--write-seed", "11", "--write-router-skew", p["skew"],
                          "--skip-ktorch"], timeout=300)


@step("coldstart", "issue 31's start-up: bench_generate.py --cold-start RUNS on the table's random 48-layer Q8_0 file "
      "(layers=, skew=; written first unless there, the disk holds one): fresh `ktorch generate` processes per "
      "placement (placements=, '/' between option strings, '+' for their spaces; empty: the defaults), Triton's and "
      "Inductor's caches empty for the first (a fresh machine's, whatever this one cached) and kept for the next "
      "(second runs): load, warm-up prefill, decode capture, first token; then the first again with ktorch's Triton "
      "compiles and Dynamo/Inductor's compile_times listed. ~70 s a 48-layer process, the file ~60 s",
      limit_s=560, min_s=200, params={"runs": "2", "placements": "", "prompt": "512", "gen": "16", "skew": "0",
                                      "layers": "48"}, carry=".whl (gguf)")
def step_coldstart(r: Runner, p: dict) -> int:
    gguf = TABLE_DIR / f"q8-{p['layers']}l-skew{p['skew']}.gguf"
    common = [sys.executable, "benchmarks/bench_generate.py", "--gguf", str(gguf)]
    rc = write_table_file(r, p, gguf, common)
    r.busy_warning()
    if rc == 0:
        rc = r.sh(common + ["--cold-start", p["runs"], "--prompts", p["prompt"], "--gen", p["gen"], "--prompt-kind",
                            "random", "--ktorch-args", *placement_args(p["placements"])])
    return rc


@step("table", "RESULTS section 2's end-to-end table: a random 48-layer (layers=) Qwen3-30B-A3B-shaped Q8_0 file "
      "(seed 11, skew= the routers' Zipf bias, 0 near-uniform; other such files in /tmp are deleted first: the disk "
      "holds one), fresh `ktorch generate` processes per placement (placements=, '/' between option strings, '+' "
      "for their spaces) and prompt length, then llama-bench at its best settings per matching placement (llama=, "
      "'/'-joined: 'exps' = -ot exps=CPU, N = --n-cpu-moe N); same=N > 0: then N prompts of each length in one "
      "process per placement (bench_generate --same-process: the third on replays the captured prefill); "
      "part=write|ktorch|llama|all. At the defaults it takes ~480 s (session 51: the file 54-65 s, four generate "
      "processes 63-74 s each, llama-bench 88 s with exps and ~45 s with 14): run it alone after build, --budget 570",
      limit_s=560, min_s=100,
      params={"skew": "0", "layers": "48", "placements": "--deferred-experts+2+--gpu-memory+off/--gpu-memory+24GiB",
              "llama": "exps/14", "prompts": "512,2048", "same": "0", "part": "all"},
      carry=".whl (gguf); .device-out/lcpp")
def step_table(r: Runner, p: dict) -> int:
    gguf = TABLE_DIR / f"q8-{p['layers']}l-skew{p['skew']}.gguf"
    common = [sys.executable, "benchmarks/bench_generate.py", "--gguf", str(gguf), "--json", str(OUT / "table.jsonl")]
    prompts = ["--prompts", *p["prompts"].split(",")]
    rc = write_table_file(r, p, gguf, common) if p["part"] in ("write", "all") else 0
    if not gguf.exists():
        raise StepError(f"no {gguf}: run the step with part=write (or all) first")
    r.busy_warning()
    if rc == 0 and p["part"] in ("ktorch", "all"):
        rc = r.sh(common + [*prompts, "--gen", "64", "--runs", "1", "--prompt-kind", "random", "--ktorch-args",
                            *placement_args(p["placements"])])
    if rc == 0 and p["part"] in ("llama", "all"):
        lcpp_restore(r.root)
        bench = LCPP_BUILD / "bin" / "llama-bench"
        if not bench.exists():
            raise StepError("no llama-bench: run the llamacpp step first (or carry .device-out/lcpp)")
        for setting in p["llama"].split("/"):
            cpu_moe = [] if setting == "exps" else ["--llama-n-cpu-moe", setting]
            rc = rc or r.sh(common + [*prompts, "--gen", "64", "--skip-ktorch", "--llama-bench", str(bench),
                                      "--threads", "16", "--flash-attn", "1", "--llama-reps", "2", *cpu_moe])
    if rc == 0 and int(p["same"]) > 0 and p["part"] in ("ktorch", "all"):
        rc = r.sh(common + [*prompts, "--gen", "64", "--same-process", p["same"], "--ktorch-args",
                            *placement_args(p["placements"])])
    return rc


def vs_llamacpp_settings(deferred: str, stream: str) -> list[str]:
    """The vs-llamacpp step's ``ktorch generate`` option strings: the defaults (""), and ``--deferred-experts D``
    when D is not 0; ``--stream-experts PLAN`` in each unless PLAN is auto (the default)."""
    extra = "" if stream == "auto" else f" --stream-experts {stream}"
    settings = [extra.strip()]
    if deferred != "0":
        settings.append(f"--deferred-experts {int(deferred)}{extra}")
    return settings


# ---------------------------------------------------------------- A/B of the op against an older commit

AB_SHAPES = {"qwen3": "Qwen3-30B-A3B layer (E=128, H=2048, I=768, K=8)",
             "deepseek": "DeepSeek-V3 layer (E=256, H=7168, I=2048, K=8)"}
TABLE_ROW = re.compile(r"^\|\s*(\w+)\s*\|\s*([\w/.-]+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|")
# the line each row prints as it is measured (so a run cut short keeps what it measured)
LIVE_ROW = re.compile(r"^(\w+)\s+([\w/.-]+)\s+T=(\d+)\s+([\d.]+) ms ")


def parse_bench_table(text: str) -> dict[tuple[str, str, int], float]:
    """bench_fused_moe.py's output -> {(shape, impl, T): ms per call}, from its rows as they print and from its
    closing table."""
    rows = {}
    for line in text.splitlines():
        m = LIVE_ROW.match(line.strip()) or TABLE_ROW.match(line.strip())
        if m and m.group(1) != "shape":
            rows[(m.group(1), m.group(2), int(m.group(3)))] = float(m.group(4))
    return rows


def ab_table(runs: dict[str, list[dict]], base: str, head: str) -> str:
    """One markdown table from the runs of both builds: the median ms of each (shape, impl, T) per build with the
    range over its processes, base / HEAD (> 1: HEAD is faster) and a verdict against the run's own noise: "slower"
    or "faster" only where the two builds' ranges do not overlap (every HEAD process slower than every base process,
    or the reverse), else "within noise"; one process a side decides nothing ("1 sample"). A row one build lacks
    shows '-'."""
    keys = sorted({k for results in runs.values() for r in results for k in r}, key=lambda k: (k[0], k[1], k[2]))
    lines = [f"| shape | impl | T | {base} ms (range) | {head} ms (range) | {base} / {head} | verdict |",
             "|---|---|---|---|---|---|---|"]
    for key in keys:
        vals = {b: [r[key] for r in runs.get(b, []) if key in r] for b in (base, head)}
        cells = [f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" if len(v) > 1
                 else f"{v[0]:.3f}" if v else "-" for v in vals.values()]
        b, h = vals[base], vals[head]
        ratio = f"{statistics.median(b) / statistics.median(h):.2f}x" if b and h else "-"
        if not b or not h:
            verdict = "-"
        elif len(b) < 2 or len(h) < 2:
            verdict = "1 sample"
        elif min(h) > max(b):
            verdict = "HEAD slower"
        elif max(h) < min(b):
            verdict = "HEAD faster"
        else:
            verdict = "within noise"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cells[0]} | {cells[1]} | {ratio} | {verdict} |")
    return "\n".join(lines)


def ab_order(rounds: int) -> list[int]:
    """Which build runs each turn, 0 = base, 1 = HEAD: ABBA... so neither always goes first."""
    return [i % 2 if (i // 2) % 2 == 0 else 1 - i % 2 for i in range(2 * rounds)]


def base_tree(root: Path, commit: str) -> Path:
    """The older commit's source in /tmp/ab-<commit>: from .device-out/base-<commit>.tar (device.py snapshot), or a
    git worktree when the copy has its git metadata."""
    tree = Path(f"/tmp/ab-{commit}")
    if (tree / "setup.py").exists():
        return tree
    tars = sorted(glob.glob(str(root / ".device-out" / f"base-{commit}*.tar")))
    if tars:
        tree.mkdir(parents=True)
        subprocess.run(["tar", "xf", tars[0], "-C", str(tree)], check=True)
    elif (root / ".git").exists():
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), commit], check=True)
    else:
        raise StepError(f"no source of {commit}: run `python3 scripts/device.py snapshot --base {commit}` here and "
                        "carry .device-out")
    return tree


@step("ab", "the op at HEAD against an older commit (base=COMMIT): both extensions built, then "
      "benchmarks/bench_fused_moe.py (HEAD's) for each shape at each T (tokens=), cold caches, the builds taking "
      "turns in alternating processes (ABBA), one table with base / HEAD and a verdict against the run's noise "
      "(the two builds' ranges over their processes; rounds=2 or more to decide)", limit_s=560, min_s=240,
      params={"shapes": "qwen3,deepseek", "base": "", "tokens": "1,32,512,2048", "impls": "ktorch-bf16,ktorch-int8,ktorch-int4",
              "rounds": "1", "seconds": "0.3"}, carry=".device-out (base-<commit>.tar; prebuilt/ optional)")
def step_ab(r: Runner, p: dict) -> int:
    if not p["base"]:
        raise StepError("ab needs base=COMMIT (e.g. ab:base=4bb12ca)")
    unknown = [s for s in p["shapes"].split(",") if s not in AB_SHAPES]
    if unknown:
        raise StepError(f"unknown shape {unknown} (shapes: {', '.join(AB_SHAPES)})")
    tree = base_tree(r.root, p["base"])
    if build_tree(r, tree, editable=False) != 0:
        raise StepError(f"the build of {p['base']} failed")
    builds = [(p["base"], tree), ("HEAD", r.root)]
    for name, path in builds:  # each process must import its own build (not the editable install's)
        env = dict(r.env, PYTHONPATH=f"{path}{os.pathsep}{r.env['PYTHONPATH']}")
        where = subprocess.run([sys.executable, "-c", "import ktorch; print(ktorch.__file__)"], env=env, cwd="/",
                               capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(path)):
            raise StepError(f"{name}: ktorch imports from {where or '(nothing)'}, not {path}")
    r.busy_warning()
    runs: dict[str, list[dict]] = {p["base"]: [], "HEAD": []}
    failed: list[str] = []
    for shape in p["shapes"].split(","):
        print(f"-- {AB_SHAPES[shape]}", flush=True)
        for turn in ab_order(int(p["rounds"])):
            name, path = builds[turn]
            log = OUT / f"{log_name(f'ab_{shape}_{name}')}.log"
            env = dict(r.env, PYTHONPATH=f"{path}{os.pathsep}{r.env['PYTHONPATH']}")
            before = log.read_text() if log.exists() else ""
            rc = run_logged([sys.executable, str(r.root / "benchmarks" / "bench_fused_moe.py"), "--shapes", shape,
                             "--tokens", *p["tokens"].split(","), "--impls", *p["impls"].split(","),
                             "--min-seconds", p["seconds"]], log,
                            timeout=r.limit - (time.monotonic() - r.step_start) - 5, env=env, cwd=Path("/"),
                            show=lambda line: line.split(" ")[0] in AB_SHAPES or line.startswith("machine"))
            text = log.read_text()[len(before):]
            runs[name].append(parse_bench_table(text))
            if rc != 0:
                failed.append(f"{shape} {name}: rc {rc}, {(text.strip().splitlines() or ['no output'])[-1]}")
                print(f"failed: {failed[-1]}", flush=True)
            if rc == 124:
                break
    table = ab_table(runs, p["base"], "HEAD")
    print(table, flush=True)
    (OUT / "ab.md").write_text(table + "\n")
    return 1 if failed else 0


# ---------------------------------------------------------------- here: what a call carries


def snapshot(root: Path, base: Optional[str]) -> None:
    out = root / ".device-out"
    out.mkdir(exist_ok=True)
    # without the built-in model's 16 MB of weights (tracked, never changed; the device's copy of the working tree
    # has them and --snapshot copies them in): a call carries at most 64 MiB
    exclude = ":(exclude)ktorch/builtin/model.safetensors"
    subprocess.run(["git", "-C", str(root), "archive", "HEAD", "-o", str(out / "src.tar"), "--", ".", exclude],
                   check=True)
    print(f"{git_short(root, 'HEAD')}: .device-out/src.tar")
    if base:
        sha = git_short(root, base)
        subprocess.run(["git", "-C", str(root), "archive", sha, "-o", str(out / f"base-{sha}.tar"), "--", ".",
                        exclude], check=True)
        print(f"{sha}: .device-out/base-{sha}.tar (step ab:base={sha})")
    peers = root / ".peers" / "llama_cpp"
    if peers.is_dir() and not (out / "llama_cpp.tar").exists():
        subprocess.run(["tar", "czf", str(out / "llama_cpp.tar"), "-C", str(peers), "."], check=True)
        print(".device-out/llama_cpp.tar (the llama.cpp source, for the llamacpp step)")
    print("carry: .device-out (and .whl, .peers/kt_kernel for the kernels step); 64 MiB in all")


def git_short(root: Path, rev: str) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", rev], capture_output=True, text=True,
                          check=True).stdout.strip()


def from_snapshot(root: Path, steps: list[str], budget: Budget) -> None:
    """Re-runs these steps in /tmp/src, unpacked from .device-out/src.tar (HEAD, without uncommitted work)."""
    src = Path("/tmp/src")
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    subprocess.run(["tar", "xf", str(root / ".device-out" / "src.tar"), "-C", str(src)], check=True)
    shutil.copy(root / "ktorch" / "builtin" / "model.safetensors", src / "ktorch" / "builtin")
    for name in (".whl", ".peers", ".device-out"):
        if (root / name).exists():
            (src / name).symlink_to(root / name)
    os.chdir(src)
    os.execv(sys.executable, [sys.executable, str(src / "scripts" / "device.py"), f"--budget={budget.left():.0f}",
                              *steps])


def describe() -> str:
    lines = []
    for st in STEPS.values():
        params = " ".join(f"{k}={v!r}" for k, v in st.params.items())
        lines.append(f"{st.name}: {st.doc}\n    limit {st.limit_s} s, starts with >= {st.min_s} s left"
                     + (f"; parameters: {params}" if params else "") + (f"; carry: {st.carry}" if st.carry else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["snapshot"]:
        ap = argparse.ArgumentParser(prog="device.py snapshot")
        ap.add_argument("--base", default=None, help="also the source of this commit, for the ab step")
        snapshot(ROOT, ap.parse_args(argv[1:]).base)
        return 0
    ap = argparse.ArgumentParser(prog="device.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="*", help="STEP or STEP:VALUE[:KEY=VALUE...] (--list)")
    ap.add_argument("--budget", type=float, default=570, help="seconds this call may take (default 570)")
    ap.add_argument("--snapshot", action="store_true", help="run from .device-out/src.tar (device.py snapshot)")
    ap.add_argument("--list", action="store_true", help="print the steps and exit")
    args = ap.parse_args(argv)
    if args.list:
        print(describe())
        return 0
    chosen = select_steps(args.steps)  # errors before any time is spent
    budget = Budget(args.budget)
    if args.snapshot:
        from_snapshot(ROOT, args.steps, budget)
    return Runner(ROOT, budget).run(chosen)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
