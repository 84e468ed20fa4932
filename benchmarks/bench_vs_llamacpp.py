"""ktorch against llama.cpp on the same machine and the same weights (issue 7): prefill and decode tok/s.

For each experts type in --types (Q8_0, Q4_0) this writes ONE random Qwen3-30B-A3B-shaped GGUF
(``write_random_qwen3moe_gguf``, as benchmarks/make_gguf.py: 128 experts top-8, H=2048, I=768, 32 query / 4 KV
heads of 128, vocab 151936, no tokenizer; experts in the type, other matrices F16; --layers of them, default 12),
then on that one file:

llama.cpp  ``llama-bench -m FILE -ngl 99 -ot exps=CPU`` (routed experts in CPU memory, everything else on the GPU,
           what people run for big MoE models on one GPU), -o jsonl. Each test is its own invocation over a sweep
           of settings, and the table takes llama.cpp's BEST setting per test (never a handicapped one), naming it:
             -t      CPU threads (--threads, default 15,16: one thread fewer than the cores often wins decode)
             -fa     flash attention off/on (--flash-attn, default 0,1)
             -lm     load mode (--load-mode, default auto,none): auto mmaps the file, so the CPU experts live in
                     page-cache memory; none reads them into a CUDA host (pinned) buffer, which llama.cpp itself
                     advises with -ot ...=CPU (faster copies when it moves expert weights to the GPU for big batches)
             -ub     micro-batch (--ubatch, default 512,2048; prefill tests only, values above the prompt are skipped):
                     llama.cpp streams the CPU experts to the GPU once per micro-batch on prompts
           Timing is llama-bench's: a warm-up run, then -r (--llama-reps, default 5) repetitions; tok/s is the mean
           over repetitions (avg_ts). ppN = one N-token prompt from an empty cache; tgN = N single-token steps
           from an empty cache. The model is loaded before timing (not timed), the file is in the page cache
           (just written), so both sides are measured warm.
ktorch     ``ktorch generate --model FILE --prompt <P bytes> --max-new-tokens N [OPTIONS]`` on the SAME file, each a
           fresh process exactly as a user types it (benchmarks/bench_generate.py's ``run_generate``: its loader,
           ``prepare``, defaults and generation loop; the file has no tokenizer, so P bytes are P token ids), for
           each string of options in --ktorch-args ('' = the defaults, e.g. '--deferred-experts 3'), --runs times.
           The figures are the ones the command prints: ppP = its prefill rate (the prompt of the process's first
           and only call, so it includes the first call's one-time costs); tgN = its decode rate (the replayed
           decode steps after the first token and the capture's one eager step) in the run with the shortest
           prompt. Q8_0 experts load as int8 per output channel, Q4_0 as int4 group 32 (``--experts-dtype auto``).

The table: rows (experts type, test), columns llama.cpp best tok/s and its setting, ktorch's best option set
(the median over its processes) and its options, and ktorch / llama.cpp. --json appends one line per llama-bench
record, per ktorch process and per table row (``kind``: machine, llama.cpp, ktorch, comparison); ``--report FILE`` prints the table again from such lines
(e.g. after one device call per experts type). The machine (CPU model, cores, kernel level, GPU, versions,
llama.cpp build) is printed first. Benchmarks never assert.

Degrades: no llama-bench (--llama-bench, else /tmp/lcpp/bin/llama-bench, else PATH) -> llama.cpp columns skipped
with a message; no GPU -> ktorch generate runs on the CPU (a smoke run, not a result).

Memory and disk on the device (128 GiB, 64 GiB disk): 12 layers are ~8 GB (Q8_0) / ~4.5 GB (Q4_0), 48 layers
~32 / ~18 GB. Types run one after the other; each file is deleted after its type unless --keep (an existing file
of the same name, e.g. kept by an earlier call, is reused instead of written again).

    python benchmarks/bench_vs_llamacpp.py --types Q8_0 --llama-bench /tmp/lcpp/bin/llama-bench --json $OUT/vs.jsonl \\
        --ktorch-args "" "--deferred-experts 3"
    python benchmarks/bench_vs_llamacpp.py --report $OUT/vs.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_use import GpuUse  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LLAMA_BENCH = "/tmp/lcpp/bin/llama-bench"  # where scripts/device.py's llamacpp step builds it
EXPERTS_TYPES = ("Q8_0", "Q4_0")


# ---------------------------------------------------------------- llama-bench output


def _load_json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # llama-bench prints doubles with std::to_string: a failed test can give "nan"/"inf", which JSON lacks
        return json.loads(re.sub(r"(?<=[:\[,\s])-?(nan|inf)\b", "null", text))


def parse_llama_bench(text: str) -> list[dict]:
    """The test records in llama-bench's ``-o json`` (one array) or ``-o jsonl`` (one object per line) output.

    Each record has llama-bench's fields (``n_prompt``, ``n_gen``, ``n_threads``, ``flash_attn``, ``n_ubatch``,
    ``load_mode``, ``avg_ts``, ``stddev_ts``, ``samples_ts``, ``build_commit``, ``cpu_info``, ``gpu_info``, ...).
    Lines that are not JSON objects are skipped (a run cut off midway leaves its finished tests readable).
    """
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            return [r for r in _load_json_value(text) if isinstance(r, dict)]
        except json.JSONDecodeError:
            pass  # an array cut off midway: read it object by object below
    records = []
    for chunk in re.split(r"\n(?=\s*\{)", text.lstrip("[")):
        chunk = chunk.strip().rstrip(",]").strip()
        if not chunk.startswith("{"):
            continue
        try:
            value = _load_json_value(chunk)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records


def llama_test_name(record: dict) -> str:
    """llama-bench's name of a test: ``pp512``, ``tg64`` or ``pp512+tg64``."""
    p, g = int(record.get("n_prompt", 0)), int(record.get("n_gen", 0))
    if p and g:
        return f"pp{p}+tg{g}"
    return f"pp{p}" if p else f"tg{g}"


FLASH_ATTN = {-1: "auto", 0: "0", 1: "1"}  # llama_flash_attn_type as llama-bench's JSON writes it (an int)


def setting_label(record: dict) -> str:
    """The llama-bench options that the sweep varies, as they would be written: ``-t 16 -fa 1 -lm none -ub 512``."""
    fa = record.get("flash_attn")
    fa = FLASH_ATTN.get(fa, str(fa)) if not isinstance(fa, bool) else str(int(fa))
    parts = [f"-t {record.get('n_threads')}", f"-fa {fa}"]
    if "load_mode" in record:
        parts.append(f"-lm {record['load_mode']}")
    if int(record.get("n_prompt", 0)):
        parts.append(f"-ub {record.get('n_ubatch')}")
    return " ".join(parts)


def best_per_test(records: Iterable[dict]) -> dict[str, dict]:
    """For each test name, the record with the highest mean tok/s (``avg_ts``); records without a number are
    ignored."""
    best: dict[str, dict] = {}
    for r in records:
        ts = r.get("avg_ts")
        if not isinstance(ts, (int, float)) or not math.isfinite(ts):
            continue
        name = llama_test_name(r)
        if name not in best or ts > best[name]["avg_ts"]:
            best[name] = r
    return best


def llama_bench_commands(binary: str, gguf: str, prompts: list[int], gen: int, threads: str, flash_attn: str,
                         load_mode: str, ubatch: str, reps: int, extra: list[str]) -> list[list[str]]:
    """One llama-bench command per test (ppN for each prompt length, then tgN): each sweeps the settings that can
    matter for it (the micro-batch only for prompts, and only sizes up to the prompt length)."""
    common = [binary, "-m", gguf, "-ngl", "99", "-ot", "exps=CPU", "-t", threads, "-fa", flash_attn,
              "-lm", load_mode, "-r", str(reps), "-o", "jsonl", "--progress", *extra]
    commands = []
    ubatches = [int(u) for u in ubatch.split(",") if u]
    for p in prompts:
        ub = sorted({u for u in ubatches if u <= p}) or [min(ubatches + [p])]
        commands.append(common + ["-p", str(p), "-n", "0", "-b", str(max(p, 2048)), "-ub", ",".join(map(str, ub))])
    if gen:
        commands.append(common + ["-p", "0", "-n", str(gen)])
    return commands


def run_llama_bench(commands: list[list[str]], log_path: Path, timeout_s: float) -> list[dict]:
    """Runs the commands one after another; stdout (jsonl) is parsed, stderr appended to ``log_path``. A command
    that fails or runs past ``timeout_s`` contributes the tests it finished."""
    records = []
    for cmd in commands:
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        with open(log_path, "a") as log, GpuUse() as use:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout_s)
                out, rc = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                rc = "timeout"
        found = parse_llama_bench(out)
        if use.peak_gib is not None:
            for r in found:  # the command's peak (every setting it swept): what the card showed in use
                r["gpu_smi_peak_gib"] = use.peak_gib
        failed = f" (exit {rc}; see {log_path})" if rc else ""
        used = f", GPU in use (nvidia-smi) peak {use.peak_gib:.2f} GiB" if use.peak_gib is not None else ""
        print(f"  {len(found)} results in {time.perf_counter() - t0:.0f} s{used}{failed}", flush=True)
        records += found
    return records


def find_llama_bench(path: Optional[str]) -> Optional[str]:
    """The llama-bench to run: ``path`` if given (None if it is not an executable), else the build script's
    output, else llama-bench on PATH."""
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    if os.access(DEFAULT_LLAMA_BENCH, os.X_OK):
        return DEFAULT_LLAMA_BENCH
    return shutil.which("llama-bench")


# ---------------------------------------------------------------- ktorch on the same file


def run_ktorch(gguf: Path, prompts: list[int], gen: int, ktorch_args: Sequence[str], runs: int,
               timeout_s: float) -> Iterator[dict]:
    """``ktorch generate`` on ``gguf`` as a user types it (bench_generate.run_generate: a fresh process each time,
    the options in each string of ``ktorch_args``, "" = the defaults), ``runs`` times per prompt length; yields one
    dict per process, as soon as it is done, with ``tests``: {"ppP": the prefill rate it printed} and, for the
    shortest prompt, {"tgN": the decode rate it printed} (N = ``gen``; llama-bench's tgN starts from an empty
    cache, so the decode figure is taken next to the shortest context), plus what it printed (load, capture) or
    ``error``."""
    from bench_generate import run_generate

    for extra in ktorch_args:
        for run in range(runs):
            for p in prompts:
                # (--gen 0: prefill only, but generate a few tokens anyway: a run that prints no decode rate counts as failed)
                r = run_generate(str(gguf), p, max(gen, 4), shlex.split(extra), timeout_s)
                tests = {f"pp{p}": r["prefill_tok_s"]} if "prefill_tok_s" in r else {}
                if gen and p == min(prompts) and "decode_tok_s" in r:
                    tests[f"tg{gen}"] = r["decode_tok_s"]
                yield dict(r, variant=extra.strip() or "defaults", run=run, prompt=p, tests=tests)


# ---------------------------------------------------------------- the table


def comparison_rows(lines: list[dict]) -> list[dict]:
    """Table rows from the JSON lines of one or more runs (kinds "llama.cpp" and "ktorch"): for each (experts
    type, layers, test), llama.cpp's best record and ktorch's best option set (the median of its processes), and
    their ratio. A later llama.cpp line of the same (type, layers, test, setting) replaces an earlier one."""
    llama: dict[tuple, dict] = {}
    kt: dict[tuple, dict] = {}
    order: list[tuple] = []

    def seen(key):
        if key not in order:
            order.append(key)

    for line in lines:
        if line.get("kind") == "llama.cpp":
            key = (line["experts_type"], line["layers"], line["test"])
            seen(key)
            llama.setdefault(key, {})[line["setting"]] = line
        elif line.get("kind") == "ktorch":
            for test, ts in line.get("tests", {}).items():
                key = (line["experts_type"], line["layers"], test)
                seen(key)
                kt.setdefault(key, {}).setdefault(line["variant"], []).append(ts)
    rows = []
    groups = list(dict.fromkeys(k[:2] for k in order))  # (type, layers) in the order they were run
    for key in sorted(order, key=lambda k: (groups.index(k[:2]), _test_order(k[2]))):
        type_name, layers, test = key
        row = dict(kind="comparison", experts_type=type_name, layers=layers, test=test)
        if key in llama:
            best = max(llama[key].values(), key=lambda r: r["tok_s"])
            row.update(llama_tok_s=best["tok_s"], llama_setting=best["setting"],
                       llama_settings_tried=len(llama[key]))
        if key in kt:
            medians = {variant: statistics.median(ts) for variant, ts in kt[key].items()}
            variant = max(medians, key=medians.get)
            row.update(ktorch_tok_s=medians[variant], ktorch_variant=variant, ktorch_runs=len(kt[key][variant]))
        if row.get("llama_tok_s") and row.get("ktorch_tok_s"):
            row["ratio"] = row["ktorch_tok_s"] / row["llama_tok_s"]
        rows.append(row)
    return rows


def _test_order(test: str) -> tuple:
    m = re.match(r"(pp|tg)(\d+)", test)
    return (0 if m and m.group(1) == "pp" else 1, int(m.group(2)) if m else 0, test)


def format_table(rows: list[dict]) -> str:
    out = ["| experts | test | llama.cpp tok/s (best setting) | ktorch generate tok/s (options) | ktorch / llama.cpp |",
           "|---|---|---|---|---|"]
    for r in rows:
        llama = f"{r['llama_tok_s']:.1f} (`{r['llama_setting']}`)" if "llama_tok_s" in r else "-"
        kt = f"{r['ktorch_tok_s']:.1f} (`{r['ktorch_variant']}`)" if "ktorch_tok_s" in r else "-"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        out.append(f"| {r['experts_type']} ({r['layers']} layers) | {r['test']} | {llama} | {kt} | {ratio} |")
    return "\n".join(out)


# ---------------------------------------------------------------- main


def machine_info(device: str, llama_records: list[dict]) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_e2e
    import torch

    info = bench_e2e.machine_info(device)
    info["kt_num_threads"] = os.environ.get("KT_NUM_THREADS")
    if device == "cuda":
        info["cuda"] = torch.version.cuda
    if llama_records:
        r = llama_records[0]
        info["llama_cpp"] = dict(build_commit=r.get("build_commit"), build_number=r.get("build_number"),
                                 backends=r.get("backends"), cpu_info=r.get("cpu_info"), gpu_info=r.get("gpu_info"))
    return info


def gguf_path(directory: str, type_name: str, layers: int, experts: int) -> Path:
    # the name benchmarks/gguf_device_run.sh uses for the same file (make_gguf.py's defaults: 4 distinct experts)
    suffix = "" if experts == 128 else f"-{experts}e"
    return Path(directory) / f"qwen3-30b-a3b-random-{type_name}-{layers}l{suffix}.gguf"


def write_gguf(path: Path, type_name: str, layers: int, experts: int) -> tuple[bool, float]:
    """Writes the file unless it exists: (written now, seconds). Written under a temporary name, renamed when
    complete, so that a cut-off write is never reused."""
    if path.exists():
        print(f"reusing {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
        return False, 0.0
    sys.path.insert(0, str(REPO))
    from ktorch.integrations.gguf_writer import write_random_qwen3moe_gguf

    t0 = time.perf_counter()
    partial = path.with_name(path.name + ".partial")
    write_random_qwen3moe_gguf(partial, experts_type=type_name, num_layers=layers, num_experts=experts,
                               progress=False)
    os.replace(partial, path)
    seconds = time.perf_counter() - t0
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB, {layers} layers, {type_name} experts, "
          f"in {seconds:.1f} s", flush=True)
    return True, seconds


def _append(json_path: Optional[str], line: dict) -> None:
    if json_path:
        with open(json_path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default=",".join(EXPERTS_TYPES), help="experts types, one file each (default: Q8_0,Q4_0)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers of the file (default: 12; the model has 48)")
    p.add_argument("--experts", type=int, default=128, help="routed experts per layer (default: 128)")
    p.add_argument("--prompts", default="512,2048", help="prompt lengths of the prefill tests (default: 512,2048)")
    p.add_argument("--gen", type=int, default=64, help="decode steps of the tg test (default: 64; 0: none)")
    p.add_argument("--gguf-dir", default="/tmp", help="where the GGUF files go (default: /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the GGUF files (default: deleted after each type)")
    p.add_argument("--llama-bench", default=None,
                   help=f"llama-bench binary (default: {DEFAULT_LLAMA_BENCH} if built, else PATH)")
    p.add_argument("--threads", default="15,16", help="llama-bench -t values (default: 15,16)")
    p.add_argument("--flash-attn", default="0,1", help="llama-bench -fa values (default: 0,1)")
    p.add_argument("--load-mode", default="auto,none", help="llama-bench -lm values (default: auto,none)")
    p.add_argument("--ubatch", default="512,2048", help="llama-bench -ub values for prompts (default: 512,2048)")
    p.add_argument("--llama-reps", type=int, default=5, help="llama-bench -r (default: 5)")
    p.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. '--poll 100'")
    p.add_argument("--llama-timeout", type=float, default=480, help="seconds per llama-bench command (default: 480)")
    p.add_argument("--skip-llamacpp", action="store_true", help="run ktorch only")
    p.add_argument("--skip-ktorch", action="store_true", help="run llama.cpp only")
    p.add_argument("--ktorch-args", nargs="*", default=[""], metavar="OPTIONS",
                   help="one string of `ktorch generate` options per setting, each run as typed, e.g. '' "
                        "'--deferred-experts 3' '--stream-experts off' (default: '' = the defaults)")
    p.add_argument("--runs", type=int, default=1,
                   help="`ktorch generate` processes per setting and prompt; the table takes their median "
                        "(default: 1)")
    p.add_argument("--ktorch-timeout", type=float, default=400, help="seconds per ktorch process (default: 400)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"),
                   help="folder for llama-bench's log (default: $OUT or /tmp)")
    p.add_argument("--json", default=None, help="append JSON lines to this file")
    p.add_argument("--report", default=None, metavar="JSONL", help="only print the table from these JSON lines")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.report:
        with open(args.report) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        machine_lines = [line for line in lines if line.get("kind") == "machine"]
        for m in dict.fromkeys(json.dumps({k: v for k, v in line.items() if k not in ("kind", "llama_cpp")})
                               for line in machine_lines):
            print("machine:", m)
        for b in dict.fromkeys(json.dumps(line["llama_cpp"]) for line in machine_lines if "llama_cpp" in line):
            print("llama.cpp:", b)
        print(format_table(comparison_rows(lines)))
        return
    # `timeout` sends SIGTERM: exit through Python, so that files are deleted and a running llama-bench killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    types = _csv(args.types)
    prompts = [int(p) for p in _csv(args.prompts)]
    if device != "cuda" and not args.skip_ktorch:
        print("no GPU: ktorch generate runs on the CPU (a smoke run, not a result)", flush=True)
    llama_bench = None
    if not args.skip_llamacpp:
        llama_bench = find_llama_bench(args.llama_bench)
        if llama_bench is None:
            print(f"llama-bench not found ({args.llama_bench or DEFAULT_LLAMA_BENCH + ' or PATH'}): llama.cpp columns "
                  "skipped (build it with the llamacpp step of scripts/device.py)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    log_path = Path(args.out) / "llama_bench.log"

    info = machine_info(device, [])
    print("machine:", json.dumps(info), flush=True)
    _append(args.json, dict(kind="machine", **info))
    lines: list[dict] = []
    all_llama: list[dict] = []
    for type_name in types:
        path = gguf_path(args.gguf_dir, type_name, args.layers, args.experts)
        try:
            _, write_s = write_gguf(path, type_name, args.layers, args.experts)
            if llama_bench:
                commands = llama_bench_commands(llama_bench, str(path), prompts, args.gen, args.threads,
                                                args.flash_attn, args.load_mode, args.ubatch, args.llama_reps,
                                                args.llama_args.split())
                records = []
                for command in commands:  # each test's lines are written as soon as it is done
                    found = run_llama_bench([command], log_path, args.llama_timeout)
                    for r in found:
                        line = dict(kind="llama.cpp", experts_type=type_name, layers=args.layers,
                                    test=llama_test_name(r), setting=setting_label(r), tok_s=r.get("avg_ts"),
                                    stddev_tok_s=r.get("stddev_ts"), record=r)
                        lines.append(line)
                        _append(args.json, line)
                    records += found
                all_llama += records
                best = best_per_test(records)
                for test, r in best.items():
                    print(f"llama.cpp {type_name} {test}: best {r['avg_ts']:.1f} tok/s with {setting_label(r)}",
                          flush=True)
            if not args.skip_ktorch:
                for r in run_ktorch(path, prompts, args.gen, args.ktorch_args, args.runs, args.ktorch_timeout):
                    line = dict(kind="ktorch", experts_type=type_name, layers=args.layers, device=device,
                                gguf_write_s=write_s, **r)
                    lines.append(line)
                    _append(args.json, line)
        finally:
            if not args.keep:
                for p in (path, path.with_name(path.name + ".partial")):
                    if p.exists():
                        p.unlink()
                        print(f"deleted {p}", flush=True)

    info = machine_info(device, all_llama)
    if all_llama:
        _append(args.json, dict(kind="machine", **info))
    rows = comparison_rows(lines)
    for row in rows:
        _append(args.json, row)
    print()
    print("machine:", json.dumps(info))
    print(f"model: random Qwen3-30B-A3B shape, {args.layers} layers, {args.experts} experts top-8; "
          f"ktorch generate on {device}, {args.runs} process(es) per setting and prompt")
    print(format_table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
