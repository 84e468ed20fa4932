"""scripts/device.py's own logic, on the CPU and without a device: which steps run with which parameters, how the
call's time is shared out and what is skipped, that a step past its limit is stopped with its children, the
extension's source id, and the A/B table read from bench_fused_moe.py's output."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def device():
    spec = importlib.util.spec_from_file_location("device_runner", ROOT / "scripts" / "device.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def names(chosen):
    return [(st.name, params) for st, params in chosen]


def test_steps_take_a_bare_first_value_and_named_parameters(device):
    st, params = device.parse_step("tests:forced:workers=2")
    assert st.name == "tests" and params == {"list": "forced", "workers": "2"}
    st, params = device.parse_step("ab:qwen3:base=4bb12ca")
    assert params["shapes"] == "qwen3" and params["base"] == "4bb12ca" and params["rounds"] == "1"
    assert device.parse_step("bench")[1] == device.STEPS["bench"].params  # defaults
    assert device.parse_step("bench:qwen3:cpu_experts=5")[1]["cpu_experts"] == "5"  # a split's CPU share
    for bad, message in [("tset", "unknown step"), ("tests:nope=1", "no parameter 'nope'"),
                         ("ab:base=x:qwen3", "bare value only comes first"), ("build:x", "bare value")]:
        with pytest.raises(SystemExit, match=message):
            device.parse_step(bad)


def test_every_step_runs_a_function_of_the_runner_and_its_parameters(device):
    """Each registered step's function takes (runner, parameters): a helper written between a ``@step`` decorator
    and its function (session 55's lcpp_export) would be registered in its place."""
    import inspect

    for name, st in device.STEPS.items():
        assert list(inspect.signature(st.run).parameters) == ["r", "p"], (name, st.run.__name__)


def test_build_is_inserted_before_the_first_step_that_needs_it(device):
    assert [n for n, _ in names(device.select_steps(["tests:gpu", "bench"]))] == ["build", "tests", "bench"]
    # the llama.cpp build starts first, so that it runs beside ktorch's build and tests
    assert [n for n, _ in names(device.select_steps(["llamacpp:start", "tests"]))] == ["llamacpp", "build", "tests"]
    assert [n for n, _ in names(device.select_steps(["llamacpp"]))] == ["llamacpp"]
    assert [n for n, _ in names(device.select_steps(["build", "bench"]))] == ["build", "bench"]
    with pytest.raises(SystemExit, match="must come before"):
        device.select_steps(["bench", "build"])
    with pytest.raises(SystemExit, match="no step"):
        device.select_steps([])


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_budget_gives_each_step_its_limit_or_what_is_left(device):
    clock = FakeClock()
    budget = device.Budget(570, clock)
    step = device.Step("s", "", limit_s=300, min_s=100, params={}, run=None)
    assert budget.limit_for(step) == 300
    clock.now += 300  # 270 left, less the reserve: under the step's limit
    assert budget.limit_for(step) == 270 - device.RESERVE_S
    clock.now += 270 - device.RESERVE_S - 100  # exactly the minimum left
    assert budget.limit_for(step) == 100
    clock.now += 1
    assert budget.limit_for(step) is None


def test_runner_skips_steps_it_has_no_time_for_and_says_so(device, tmp_path, monkeypatch, capsys):
    clock = FakeClock()
    monkeypatch.setattr(device, "OUT", tmp_path / "out")
    ran = []

    def fake(seconds, rc=0):
        def run(runner, params):
            ran.append((params["tag"], runner.limit))
            clock.now += seconds
            return rc

        return run

    steps = [device.Step("long", "", 400, 200, {"tag": "a"}, fake(350), needs_build=False),
             device.Step("big", "", 300, 250, {"tag": "b"}, fake(10), needs_build=False),  # 220 left: skipped
             device.Step("small", "", 120, 60, {"tag": "c"}, fake(100, rc=3), needs_build=False),
             device.Step("tiny", "", 120, 60, {"tag": "d"}, fake(5), needs_build=False)]  # 110 left: 100 < 60? no
    runner = device.Runner(tmp_path, device.Budget(570, clock))
    rc = runner.run([(s, dict(s.params)) for s in steps])
    assert [tag for tag, _ in ran] == ["a", "c", "d"]
    assert ran[0][1] == 400 and ran[1][1] == 120 and ran[2][1] == 570 - 450 - device.RESERVE_S
    assert rc == 3  # the first failure's status
    out = capsys.readouterr().out
    assert "SKIPPED big: 220 s left (10 s kept back), it needs at least 250 s" in out
    assert "rc 3 small" in out and "ok tiny" in out


def test_build_starts_with_less_time_left_where_a_matching_prebuilt_is_carried(device, tmp_path, monkeypatch, capsys):
    """The build step needs its min_s (a compile) unless .device-out/prebuilt holds the extension of these sources
    (an install), then PREBUILT_MIN_S: a 60 s budget installs ktorch instead of skipping the build."""
    monkeypatch.setattr(device, "OUT", tmp_path / "out")
    monkeypatch.setattr(device, "versions", lambda: ("2.11.0+cu130", "3.12"))
    (tmp_path / "ktorch" / "csrc").mkdir(parents=True)
    (tmp_path / "setup.py").write_text("setup()")
    (tmp_path / "pyproject.toml").write_text("")
    ran = []
    build = device.Step("build", "", 300, 60, {}, lambda r, p: ran.append(r.limit) or 0, needs_build=False)
    assert device.Runner(tmp_path, device.Budget(60)).run([(build, {})]) == 0
    assert ran == [] and "SKIPPED build: 60 s left (10 s kept back), it needs at least 60 s" in capsys.readouterr().out
    src = device.source_id(tmp_path, *device.versions())
    (tmp_path / ".device-out" / "prebuilt" / src).mkdir(parents=True)
    (tmp_path / ".device-out" / "prebuilt" / src / "_C.so").write_bytes(b"")
    assert device.Runner(tmp_path, device.Budget(60)).run([(build, {})]) == 0
    assert len(ran) == 1 and 45 <= ran[0] <= 50 and device.PREBUILT_MIN_S <= 50


def test_runner_stops_after_a_failed_build(device, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(device, "OUT", tmp_path / "out")
    build = device.Step("build", "", 300, 60, {}, lambda r, p: 1, needs_build=False)
    after = device.Step("bench", "", 300, 60, {}, lambda r, p: pytest.fail("ran after a failed build"))
    assert device.Runner(tmp_path, device.Budget(570)).run([(build, {}), (after, {})]) == 1
    assert "the build failed" in capsys.readouterr().out


def test_a_command_past_its_limit_is_stopped_with_its_children(device, tmp_path):
    pid_file = tmp_path / "child.pid"
    log = tmp_path / "log"
    start = time.monotonic()
    rc = device.run_logged(f"sleep 60 & echo $! > {pid_file}; echo started; wait", log, timeout=2)
    assert rc == 124 and time.monotonic() - start < 20
    assert "started" in log.read_text()
    child = int(pid_file.read_text())
    for _ in range(50):  # the killed child may linger a moment as a zombie of an exited parent
        try:
            state = pathlib.Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the step's background child survived the stop")
    assert device.run_logged(["bash", "-c", "printf 'a\\rb\\nc'; exit 7"], log, timeout=10) == 7
    assert log.read_text().endswith("a\nb\nc\n")  # carriage-return progress lines become lines


def test_source_id_follows_the_sources_but_not_test_folders(device, tmp_path):
    (tmp_path / "ktorch" / "csrc" / "kernels" / "amx" / "test").mkdir(parents=True)
    (tmp_path / "setup.py").write_text("setup()")
    (tmp_path / "pyproject.toml").write_text("[project]")
    kernel = tmp_path / "ktorch" / "csrc" / "kernels" / "amx" / "kernels.cpp"
    kernel.write_text("int a;")
    ids = [device.source_id(tmp_path, "2.11.0", "3.12")]
    (tmp_path / "ktorch" / "csrc" / "kernels" / "amx" / "test" / "t.cpp").write_text("int t;")
    ids.append(device.source_id(tmp_path, "2.11.0", "3.12"))
    kernel.write_text("int b;")
    ids.append(device.source_id(tmp_path, "2.11.0", "3.12"))
    ids.append(device.source_id(tmp_path, "2.12.0", "3.12"))
    assert ids[0] == ids[1] and len(set(ids[1:])) == 3 and ids[0].endswith("-2.11.0-py3.12")


BENCH_OUTPUT = """machine: Intel Xeon, 16 cores
qwen3     ktorch-int8  T=1         0.400 ms       2500 tok/s   0.100 TFLOPS    90.0 GB/s ( 80.0% BW,   1.0% peak)
qwen3     ktorch-int8  T=512       7.000 ms      73000 tok/s   5.000 TFLOPS    90.0 GB/s ( 80.0% BW,  20.0% peak)

| shape | impl | T | ms | tok/s | eff. TFLOPS | GB/s | % read BW | % dot peak | vs eager |
|---|---|---|---|---|---|---|---|---|---|
| qwen3 | ktorch-int8 | 1 | 0.400 | 2500 | 0.100 | 90.0 | 80% | 1% | - |
| qwen3 | ktorch-int8 | 512 | 7.000 | 73000 | 5.000 | 90.0 | 80% | 20% | - |
"""


def test_bench_rows_are_read_from_live_lines_and_the_closing_table(device):
    assert device.parse_bench_table(BENCH_OUTPUT) == {("qwen3", "ktorch-int8", 1): 0.4,
                                                      ("qwen3", "ktorch-int8", 512): 7.0}
    cut = BENCH_OUTPUT.split("\n\n")[0]  # a run stopped before its table keeps the rows it printed
    assert device.parse_bench_table(cut) == device.parse_bench_table(BENCH_OUTPUT)
    assert device.parse_bench_table("deepseek  ktorch-int4  T=32  failed: out of memory\n") == {}


def test_ab_table_has_medians_ranges_ratios_verdicts_and_gaps(device):
    base = [{("qwen3", "ktorch-int8", 1): 0.5, ("qwen3", "ktorch-int8", 512): 8.0, ("qwen3", "ktorch-int4", 1): 0.30},
            {("qwen3", "ktorch-int8", 1): 0.7, ("qwen3", "ktorch-int8", 512): 9.0, ("qwen3", "ktorch-int4", 1): 0.20},
            {("qwen3", "ktorch-int8", 1): 0.6, ("qwen3", "ktorch-int4", 32): 2.0}]
    head = [{("qwen3", "ktorch-int8", 1): 0.4, ("deepseek", "ktorch-int4", 32): 2.0, ("qwen3", "ktorch-int4", 1): 0.25,
             ("qwen3", "ktorch-int4", 32): 2.5},
            {("qwen3", "ktorch-int8", 1): 0.45, ("qwen3", "ktorch-int4", 1): 0.28, ("qwen3", "ktorch-int4", 32): 2.2}]
    table = device.ab_table({"abc": base, "HEAD": head}, "abc", "HEAD").splitlines()
    assert table[0] == "| shape | impl | T | abc ms (range) | HEAD ms (range) | abc / HEAD | verdict |"
    assert table[2] == "| deepseek | ktorch-int4 | 32 | - | 2.000 | - | - |"
    # overlapping ranges: within the run's noise, whatever the medians say
    assert table[3] == "| qwen3 | ktorch-int4 | 1 | 0.250 (0.200-0.300) | 0.265 (0.250-0.280) | 0.94x | within noise |"
    assert table[4] == "| qwen3 | ktorch-int4 | 32 | 2.000 | 2.350 (2.200-2.500) | 0.85x | 1 sample |"
    assert table[5] == "| qwen3 | ktorch-int8 | 1 | 0.600 (0.500-0.700) | 0.425 (0.400-0.450) | 1.41x | HEAD faster |"
    assert table[6] == "| qwen3 | ktorch-int8 | 512 | 8.500 (8.000-9.000) | - | - | - |"
    slower = device.ab_table({"abc": [{("q", "i", 1): 1.0}, {("q", "i", 1): 1.1}],
                              "HEAD": [{("q", "i", 1): 1.2}, {("q", "i", 1): 1.3}]}, "abc", "HEAD").splitlines()
    assert slower[2] == "| q | i | 1 | 1.050 (1.000-1.100) | 1.250 (1.200-1.300) | 0.84x | HEAD slower |"


def test_ab_builds_take_turns_abba(device):
    assert device.ab_order(1) == [0, 1]
    assert device.ab_order(2) == [0, 1, 1, 0]
    assert device.ab_order(3) == [0, 1, 1, 0, 0, 1]


def test_scripts_folder_holds_at_most_five_files():
    files = [p for p in (ROOT / "scripts").iterdir() if p.is_file()]
    assert len(files) <= 5, sorted(p.name for p in files)


def test_every_step_the_docs_name_exists(device):
    """The docs cite runner steps as `scripts/device.py STEP...`: each must parse."""
    import re

    cited = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "benchmarks" / "RESULTS.md"]:
        for m in re.finditer(r"scripts/device\.py((?: [\w:=,./+-]+)+)", doc.read_text()):
            args = m.group(1).split()
            if args[0] != "snapshot":
                cited.update(a for a in args if not a.startswith("-"))
    assert cited, "no doc cites the runner"
    for text in cited:
        if not re.fullmatch(r"\d+|[A-Z.]+", text):  # (a number of --budget; a placeholder such as STEP...)
            device.parse_step(text)


def test_log_names_are_plain(device):
    assert device.log_name("tests:list=tests/test_x.py,tests/test_y.py") == "tests_list_tests_test_x.py_tests_test_y.py"
    assert device.log_name("bench:kernel=avx512") == "bench_kernel_avx512"


@pytest.mark.parametrize("text, script", [
    ("e2e", "bench_e2e"), ("e2e:layers=12:variants=ktorch", "bench_e2e"), ("deferral", "bench_deferral"),
    ("deferral:deferred=0,3:gpu=0", "bench_deferral"), ("vs-llamacpp", "bench_vs_llamacpp"),
    ("vs-llamacpp:Q4_0:deferred=3:stream=off:only=ktorch", "bench_vs_llamacpp"), ("prefill", "bench_generate"),
    ("prefill:0:variants=default/sync-per-layer:placements=--gpu-memory+off", "bench_generate"),
    ("decode", "bench_generate"), ("decode:1.5:variants=default/sdpa+attention:deferred=0/2:gpu=off", "bench_generate")])
def test_end_to_end_steps_run_their_benchmark_with_options_it_takes(device, tmp_path, monkeypatch, text, script):
    """The end-to-end steps' commands (captured, not run) parse with their benchmark's own parser: the steps name
    only options the scripts have (their ktorch side is `ktorch generate`, no harness variants)."""
    from conftest import load_benchmark

    monkeypatch.setattr(device, "OUT", tmp_path)
    monkeypatch.setattr(device, "lcpp_restore", lambda root: None)
    commands = []
    runner = device.Runner(ROOT, device.Budget(570))
    monkeypatch.setattr(runner, "sh", lambda cmd, **kw: commands.append(cmd) or 0)
    monkeypatch.setattr(runner, "busy_warning", lambda: None)
    st, params = device.parse_step(text)
    assert st.run(runner, params) == 0
    cmd = commands[0]
    assert cmd[1] == f"benchmarks/{script}.py"
    args = load_benchmark(script).build_parser().parse_args(cmd[2:])
    if st.name == "vs-llamacpp":
        assert args.ktorch_args == device.vs_llamacpp_settings(params["deferred"], params["stream"])
        assert args.skip_llamacpp == (params["only"] == "ktorch")
    if st.name == "deferral":
        assert args.what == "speed" and args.deferred == params["deferred"]
    if st.name == "prefill":  # the file written, then the breakdown and the profile of each placement
        assert args.write_layers == 12 and args.skip_ktorch and len(commands) == 3
        breakdown, profile = (load_benchmark(script).build_parser().parse_args(c[2:]) for c in commands[1:])
        assert breakdown.breakdown == 2 and profile.prefill_profile == 3 and breakdown.gguf == args.gguf
        assert profile.prefill_variants == params["variants"].split("/")
        assert profile.ktorch_args == breakdown.ktorch_args == [s.replace("+", " ") for s in params["placements"].split("/")]
    if st.name == "decode":  # the file written (unless there), then one A/B process with its profiles
        ab = load_benchmark(script).build_parser().parse_args(commands[-1][2:])
        if len(commands) == 2:
            assert args.write_layers == 12 and args.write_router_skew == float(params["skew"]) and args.skip_ktorch
        assert ab.ab_compile == int(params["rounds"]) and ab.profile_steps == 10 and ab.gen == 64
        assert ab.ab_variants == params["variants"].replace("+", " ").split("/")
        assert ab.deferred == [int(d) for d in params["deferred"].split("/")] and ab.ab_gpu_memory == params["gpu"]


def _run_recorded(device, monkeypatch, parser, st, params) -> list:
    """Runs a step with its commands recorded, not run: each parsed by ``parser`` (bench_generate's), a file it
    writes (--write-layers) made empty; returns them."""
    commands = []

    def sh(cmd, **kw):
        commands.append(parser.parse_args(cmd[2:]))
        if commands[-1].write_layers:
            open(commands[-1].gguf, "w").close()
        return 0

    runner = device.Runner(ROOT, device.Budget(570))
    monkeypatch.setattr(runner, "sh", sh)
    monkeypatch.setattr(runner, "busy_warning", lambda: None)
    assert st.run(runner, params) == 0
    return commands


@pytest.mark.parametrize("text", ["table", "table:1.5:same=3", "table:0:part=llama:llama=exps/14/0"])
def test_table_step_writes_once_then_runs_generate_llama_bench_and_the_same_process_prompts(device, tmp_path,
                                                                                            monkeypatch, text):
    """The table step (RESULTS section 2): the file written (with its skew) unless there, other skews' files deleted
    first; `ktorch generate` per placement; llama-bench per llama setting (-ot exps=CPU, or --n-cpu-moe N); with
    same=N the same-process prompts; every command parses with bench_generate's own parser."""
    from conftest import load_benchmark

    parser = load_benchmark("bench_generate").build_parser()
    monkeypatch.setattr(device, "OUT", tmp_path)
    monkeypatch.setattr(device, "TABLE_DIR", tmp_path)
    monkeypatch.setattr(device, "LCPP_BUILD", tmp_path / "lcpp")
    monkeypatch.setattr(device, "lcpp_restore", lambda root: None)
    (tmp_path / "lcpp" / "bin").mkdir(parents=True)
    (tmp_path / "lcpp" / "bin" / "llama-bench").touch()
    st, params = device.parse_step(text)
    other = tmp_path / f"q8-48l-skew{'7' if params['skew'] != '7' else '8'}.gguf"
    other.touch()
    if params["part"] != "all":
        (tmp_path / f"q8-48l-skew{params['skew']}.gguf").touch()
    commands = _run_recorded(device, monkeypatch, parser, st, params)
    placements = [s.replace("+", " ") for s in params["placements"].split("/")]
    llama = params["llama"].split("/")
    if params["part"] == "all":
        write, generate, *rest = commands
        assert write.write_layers == 48 and write.write_seed == 11 and write.skip_ktorch
        assert write.write_router_skew == float(params["skew"]) and not other.exists()
        assert generate.ktorch_args == placements and generate.runs == 1 and generate.prompt_kind == "random"
    else:
        rest = commands
        assert other.exists()  # nothing written: nothing deleted
    benches, same = rest[:len(llama)], rest[len(llama):]
    assert [b.llama_n_cpu_moe for b in benches] == [None if s == "exps" else int(s) for s in llama]
    assert all(b.skip_ktorch and b.llama_bench.endswith("llama-bench") and b.threads == "16" for b in benches)
    assert [c.same_process for c in same] == ([int(params["same"])] if int(params["same"]) else [])
    assert all(c.gguf == str(tmp_path / f"q8-48l-skew{params['skew']}.gguf") for c in commands)


def test_vs_llamacpp_settings(device):
    assert device.vs_llamacpp_settings("0", "auto") == [""]
    assert device.vs_llamacpp_settings("3", "auto") == ["", "--deferred-experts 3"]
    assert device.vs_llamacpp_settings("2", "512:0.4") == ["--stream-experts 512:0.4",
                                                           "--deferred-experts 2 --stream-experts 512:0.4"]


def test_test_files_are_found_as_given_or_under_tests(device):
    """The tests step's file list: a path as given, a bare name under tests/; an unknown name is a clear error."""
    assert device.named_test_files(ROOT, "tests/test_generation.py,test_serve.py") == ["tests/test_generation.py",
                                                                               "tests/test_serve.py"]
    with pytest.raises(device.StepError, match="no such test list or file: test_nope.py"):
        device.named_test_files(ROOT, "test_generation.py,test_nope.py")


@pytest.mark.parametrize("text,there", [("coldstart", False), ("coldstart:runs=3:placements=/--gpu-memory+24GiB", True)])
def test_coldstart_step_writes_the_table_file_once_then_runs_cold_start(device, tmp_path, monkeypatch, text, there):
    """The coldstart step (issue 31's start-up): the table's file written unless there (other skews' deleted first),
    then one bench_generate --cold-start RUNS over the placements, random prompts of the given length; every command
    parses with bench_generate's own parser."""
    from conftest import load_benchmark

    parser = load_benchmark("bench_generate").build_parser()
    monkeypatch.setattr(device, "OUT", tmp_path)
    monkeypatch.setattr(device, "TABLE_DIR", tmp_path)
    st, params = device.parse_step(text)
    gguf = tmp_path / "q8-48l-skew0.gguf"
    other = tmp_path / "q8-48l-skew1.5.gguf"
    other.touch()
    if there:
        gguf.touch()
    commands = _run_recorded(device, monkeypatch, parser, st, params)
    *write, cold = commands
    assert [w.write_layers for w in write] == ([] if there else [48]) and other.exists() == there
    assert cold.cold_start == int(params["runs"]) and cold.prompts == [512] and cold.gen == 16
    assert cold.ktorch_args == [s.replace("+", " ") for s in params["placements"].split("/")]
    assert cold.prompt_kind == "random" and all(c.gguf == str(gguf) for c in commands)
