"""The `powerinfer` command as a user runs it: output, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from gguf import GGMLQuantizationType as QT

from tests.processes.children import worker_children

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], capture_output=True, text=True, timeout=300)


def test_one_shot_generation(make_model: Callable[..., Path]) -> None:
    model = make_model(arch="llama")
    proc = run("-m", str(model), "-p", "abc", "-n", "4", "--temp", "0", "-t", "1", "-c", "64")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("abc")
    assert "eval time        =" in proc.stderr and "/     3 runs" in proc.stderr and "tokens per second" in proc.stderr


def test_prompt_from_file_and_sampling_flags(make_model: Callable[..., Path], tmp_path: Path) -> None:
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    args = ["-m", str(make_model(arch="qwen2")), "-f", str(prompt), "-n", "3", "--temp", "0.7", "--top-k", "5",
            "--top-p", "0.9", "--min-p", "0.1", "--repeat-penalty", "1.1", "--repeat-last-n", "16", "--seed", "3", "-b", "2"]
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("hello")


@pytest.mark.parametrize(
    "args,message",
    [
        (["-m", "/nonexistent/model.gguf", "-p", "x"], "no such file"),
        (["-m", "smollm", "-p", "x"], "neither a file nor a known model name"),
        (["-m", "{model}", "-p", "x", "-c", "-5"], "--ctx-size must be >= 0"),
        (["-m", "{model}", "-p", "x", "--log-level", "LOUD"], "invalid choice"),
        (["-m", "{model}", "-p", "x", "-t", "0"], "must be positive"),
        (["-m", "{model}", "-p", "x", "--temp", "-1"], "temperature must be >= 0"),
        (["-m", "{model}", "-p", "x", "-n", "0"], "--n-predict must be positive or -1"),
        (["-m", "{model}"], "no prompt"),
        (["-m", "{model}", "-p", "x" * 300, "-c", "16"], "do not fit the context of 16"),
        (["-m", "{dir}", "-p", "x"], "is a directory"),
        (["-m", "{garbage}", "-p", "x"], "not a GGUF file"),
        (["-m", "{truncated}", "-p", "x"], "past the end of the file"),
        (["-m", "{mamba}", "-p", "x"], "architecture 'mamba' is not supported"),
        (["-m", "{model}", "-f", "/nonexistent/prompt.txt"], "cannot read prompt file"),
        (["-m", "{model}", "-p", "x", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_error(make_model: Callable[..., Path], tmp_path: Path, args: list[str], message: str) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\x00" * 1000)
    model = make_model(arch="llama")
    data = model.read_bytes()
    truncated, mamba = tmp_path / "truncated.gguf", tmp_path / "mamba.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    mamba.write_bytes(data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00mamba", 1))
    subs = {"{model}": str(model), "{dir}": str(tmp_path), "{garbage}": str(garbage), "{truncated}": str(truncated), "{mamba}": str(mamba)}
    proc = run(*[subs.get(a, a) for a in args])
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bench_prints_measured_table(make_model: Callable[..., Path], tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run("bench", "-m", str(make_model(arch="llama")), "--workers", "1,2", "--worker-threads", "1", "--prompt-tokens", "8",
               "--gen-tokens", "4", "--repeat", "1", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert "decode_tps" in proc.stdout and "decode ceiling" in proc.stdout
    import json

    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["threads"] for r in rows] == [1, 2] and [r["workers"] for r in rows] == [1, 2]
    for r in rows:
        assert r["decode_tps"] > 0 and r["prefill_tps"] > 0 and r["total_pss_mib"] > 0 and r["peak_rss_mib"] >= r["total_rss_mib"] * 0.9
        assert r["decode_step_us"] > 0 and r["merge_median_us"] > 0 and r["merge_p99_us"] >= r["merge_median_us"]
        assert 0 <= r["merge_wait_share"] < 1
        assert len(r["merge_wait_share_per_rank"]) == r["workers"] and all(0 <= w < 1 for w in r["merge_wait_share_per_rank"])
        assert 0 <= r["outside_native_share"] < 1
    assert data["ceiling_tps"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sigterm_stops_generation_and_workers(make_model: Callable[..., Path]) -> None:
    import psutil

    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), "-m", str(make_model(arch="llama")), "-p", "abc",
                             "-n", "-1", "-c", "65536", "-t", "2", "--worker-threads", "1", "--temp", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # greedy: this model never samples its end token then (a random draw can, within a second at
    # ~10k tokens/s); the text is read as a terminal would: a full pipe would block the writer
    drain = threading.Thread(target=lambda: proc.stdout.read() if proc.stdout else None, daemon=True)
    drain.start()
    try:
        deadline = time.monotonic() + 60
        workers: list[psutil.Process] = []
        while time.monotonic() < deadline and len(workers) < 2:  # wait until generation runs
            workers = worker_children(proc.pid)  # not the socket folder's reaper shell
            time.sleep(0.1)
        assert len(workers) == 2
        time.sleep(1.0)
        proc.terminate()
        t0 = time.monotonic()
        proc.wait(timeout=5)
        assert time.monotonic() - t0 < 5
        assert proc.returncode != 0 and "Traceback" not in proc.stderr.read()
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, "orphan workers"
    finally:
        proc.kill()
        proc.wait()


def run_input(stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_interactive_chat_turns_commands_and_eof(make_model: Callable[..., Path]) -> None:
    model = str(make_model(arch="llama"))
    proc = run_input("hello\n/help\n/reset\nagain\n", "-m", model, "-i", "--system", "be brief", "-n", "3", "--temp", "0",
                     "-c", "128", "--executor", "inprocess")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 3  # a prompt per turn, then EOF (Ctrl+D) quits
    assert "/exit (or Ctrl+D) quit" in proc.stderr and "[conversation cleared]" in proc.stderr
    proc = run_input("hi\n/exit\nnever sent\n", "-m", model, "-i", "-n", "2", "--temp", "0", "--executor", "inprocess")
    assert proc.returncode == 0 and proc.stdout.count("> ") == 2


def test_interactive_ctrl_c_at_the_prompt_says_how_to_quit(make_model: Callable[..., Path]) -> None:
    import io

    from powerinfer.api import LLM
    from powerinfer.cli.interactive import run_chat
    from powerinfer.sampling import SamplingParams

    class Keys(io.StringIO):
        """Ctrl+C at the first prompt, then a message, then /exit."""

        def __init__(self) -> None:
            super().__init__("hi\n/exit\n")
            self.first = True

        def readline(self, size: int = -1) -> str:  # type: ignore[override]
            if self.first:
                self.first = False
                raise KeyboardInterrupt
            return super().readline(size)

    out, err = io.StringIO(), io.StringIO()
    with LLM(make_model(arch="llama"), n_ctx=64, executor="inprocess") as llm:
        assert run_chat(llm, SamplingParams(temperature=0), None, 2, stdin=Keys(), out=out, err=err) == 0
    assert "[Ctrl+C stops an answer; Ctrl+D or /exit quits]" in out.getvalue()
    assert out.getvalue().count("> ") == 3  # the chat went on after Ctrl+C


def test_interactive_drops_old_turns_when_context_fills(make_model: Callable[..., Path]) -> None:
    model = str(make_model(arch="llama"))
    turns = "".join(f"message number {i} with some words\n" for i in range(6))
    proc = run_input(turns, "-m", model, "-i", "--system", "sys", "-n", "4", "--temp", "0", "-c", "160", "--executor", "inprocess")
    assert proc.returncode == 0, proc.stderr
    assert "context full: dropped" in proc.stderr and "system prompt is kept" in proc.stderr
    long = run_input("hi\n", "-m", model, "-i", "--system", "word " * 300, "-n", "4", "-c", "64", "--executor", "inprocess")
    assert long.returncode == 1 and "the system prompt needs" in long.stderr and "Traceback" not in long.stderr, long.stderr


def test_verbose_prints_summary_timings_and_layer_figures(make_model: Callable[..., Path]) -> None:
    proc = run("-m", str(make_model(arch="llama")), "-p", "abc", "-n", "3", "--temp", "0", "-t", "2", "--verbose",
               "--log-level", "INFO", "--no-sparse", "--worker-threads", "1")
    assert proc.returncode == 0, proc.stderr
    for text in ("placement  2 CPU worker processes", "native rank", "mode       dense", "prompt eval time", "eval time", "round trip",
                 "merges a step", "merge latency per sync"):
        assert text in proc.stderr, text
    zmq = run("-m", str(make_model(arch="llama")), "-p", "abc", "-n", "3", "--temp", "0", "-t", "2", "--verbose", "--transport", "zmq",
              "--worker-threads", "1")
    assert zmq.returncode == 0, zmq.stderr
    for text in ("placement  2 CPU worker processes", "round trip µs", "attention"):
        assert text in zmq.stderr, text


@pytest.mark.parametrize("args,message", [(["-ngl", "10"], "need an NVIDIA GPU"), (["--vram-budget", "8"], "need an NVIDIA GPU"),
                                          (["-ngl", "-2"], "-ngl must be >= 0"), (["--vram-budget", "0"], "--vram-budget must be a positive"),
                                          (["--vram-budget", "inf", "--gpu-backend", "cpu"], "--vram-budget must be a positive, finite")])
def test_gpu_flags_without_gpu(make_model: Callable[..., Path], args: list[str], message: str) -> None:
    proc = run("-m", str(make_model(arch="llama")), "-p", "x", *args)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_offload_on_the_cpu_backend(make_model: Callable[..., Path]) -> None:
    """-ngl/--vram-budget with the GPU worker's numpy stand-in (its numbers are held against the CPU
    path in tests/gpu_worker); here: the flags reach it and the summary says where parts live."""
    model = str(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2))
    texts = {}
    # neuron split: a budget that holds both layers' attention and some of their neurons, not whole layers
    for split, ngl, budget in (("neuron", "2", "0.00054"), ("layer", "1", "0.002")):
        proc = run("-m", model, "-p", "abc", "-n", "6", "--temp", "0", "-ngl", ngl, "--vram-budget", budget, "--gpu-backend", "cpu",
                   "--split", split, "--verbose", *(["--reset-gpu-index"] if split == "neuron" else []))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("abc") and "eval time" in proc.stderr
        assert "placement  GPU worker (pid" in proc.stderr
        # the GPU worker as a rank of the native pool (coordinator/gpu_rank.py)
        if split == "neuron":
            assert "as a rank of the pool: in 2 layers (0-1) the attention of 2 and" in proc.stderr
            assert "hot neurons, the cold ones on the CPU ranks" in proc.stderr
        else:
            assert "as a rank of the pool: 1/2 whole layers (0) handed over as the residual stream" in proc.stderr
        assert "waiting for the GPU rank" in proc.stderr
        texts[split] = proc.stdout
    # --gpu-worker inprocess: the hybrid executor, the same runtime in this process, the same greedy text
    inproc = run("-m", model, "-p", "abc", "-n", "6", "--temp", "0", "-ngl", "1", "--vram-budget", "0.002", "--gpu-backend", "cpu",
                 "--split", "layer", "--gpu-worker", "inprocess", "--verbose")
    assert inproc.returncode == 0, inproc.stderr
    assert "placement  GPU worker (in process), layer split" in inproc.stderr and "hot-neuron ratio" in inproc.stderr
    assert "layers with no GPU part (native decoder)" in inproc.stderr  # layer 1 of 2
    assert inproc.stdout == texts["layer"]


def test_inspect_prints_metadata_and_tensor_types(make_model: Callable[..., Path]) -> None:
    proc = run("inspect", str(make_model(arch="gemma3", qtype=QT.Q8_0)), "--tensors")
    assert proc.returncode == 0, proc.stderr
    for text in ("general.architecture = 'gemma3'", "tensor types:", "Q8_0", "blk.0.attn_q_norm.weight", "architecture: gemma3"):
        assert text in proc.stdout, text
    bad = run("inspect", "/nonexistent.gguf")
    assert bad.returncode != 0 and "no such file" in bad.stderr


def test_inspect_shows_a_gguf_it_cannot_run(make_model: Callable[..., Path], tmp_path: Path) -> None:
    from powerinfer.predictors.predictor_file import write_predictor
    from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate

    pred = tmp_path / "p.predictor"
    write_predictor(pred, calibrate(make_model(arch="llama", n_layers=2), CalibrationSettings(mode="gate", tokens=32, window=32)))
    proc = run("inspect", str(pred))
    assert proc.returncode == 0 and "general.architecture = 'powerinfer-predictor'" in proc.stdout, proc.stderr
    assert "not runnable here" in proc.stdout and "is not supported" in proc.stdout


@pytest.mark.parametrize("sub", ["fetch", "bench", "inspect", "calibrate", "perplexity", "serve", "loadtest"])
def test_subcommand_help(sub: str) -> None:
    proc = run(sub, "--help")
    assert proc.returncode == 0 and "usage: powerinfer" in proc.stdout


def test_predictor_flags(make_model: Callable[..., Path], tmp_path: Path) -> None:
    from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
    from powerinfer.predictors.predictor_file import write_predictor

    model, other = make_model(arch="llama"), make_model(arch="llama", seed=7)
    pred = tmp_path / "m.predictor"
    write_predictor(pred, calibrate(model, CalibrationSettings(mode="gate", sparsity=0.5, tokens=32, window=32, steps=1)))
    ok = run("-m", str(model), "-p", "abc", "-n", "3", "--temp", "0", "--executor", "inprocess", "--predictor", str(pred), "--verbose")
    assert ok.returncode == 0, ok.stderr
    assert "mode       sparse (gate)" in ok.stderr and "FFN computed" in ok.stderr
    dense = run("-m", str(model), "-p", "abc", "-n", "3", "--executor", "inprocess", "--predictor", str(pred), "--no-sparse", "--verbose")
    assert dense.returncode == 0 and "dense (--no-sparse)" in dense.stderr
    wrong = run("-m", str(other), "-p", "abc", "-c", "64", "--predictor", str(pred))
    assert wrong.returncode != 0 and "Traceback" not in wrong.stderr and len(wrong.stderr.strip().splitlines()) == 1
    assert "made for" in wrong.stderr or "another model" in wrong.stderr or "fingerprint" in wrong.stderr, wrong.stderr
    truncated = tmp_path / "t.predictor"
    truncated.write_bytes(pred.read_bytes()[:300])
    bad = run("-m", str(model), "-p", "abc", "-c", "64", "--predictor", str(truncated))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_outputs_are_checked_before_the_work_and_inputs_are_never_overwritten(make_model: Callable[..., Path], tmp_path: Path) -> None:
    model = make_model(arch="llama", n_layers=2)
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 40)
    before = model.read_bytes()
    cal = ("calibrate", "-m", str(model), "--text", str(text), "--sparsity", "0.5", "--mode", "gate", "--tokens", "64")
    # exit 2: the flag's value is refused (a usage error); 1: the file system is not as the command needs
    for out, says, status in ((str(model), "is the input", 2), (str(text), "is the input", 2), (str(tmp_path), "is a directory", 2),
                              (str(tmp_path / "no" / "p.predictor"), "does not exist", 1), ("", "give a file name", 2)):
        proc = run(*cal, "-o", out)
        assert proc.returncode == status and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    other = tmp_path / "notes.predictor"
    other.write_text("my notes")
    proc = run(*cal, "-o", str(other))
    assert proc.returncode == 1 and "not a .predictor file" in proc.stderr and other.read_text() == "my notes"
    assert model.read_bytes() == before and text.read_text().startswith("The cat")
    # a predictor is overwritten in place, through a symlink, with the permissions a new file gets
    good = tmp_path / "p.predictor"
    made = run(*cal, "-o", str(good))
    assert made.returncode == 0 and good.stat().st_mode & 0o044  # not mkstemp's 0600
    assert "every layer will decode dense" in made.stderr  # 0.5 < 0.75: said, not left to an INFO line
    assert "decode dense" not in run(*cal[:5], "--sparsity", "0.8", *cal[7:], "-o", str(good)).stderr
    link = tmp_path / "link.predictor"
    link.symlink_to(good)
    assert run(*cal, "-o", str(link)).returncode == 0 and link.is_symlink()
    assert run(*cal, "-o", str(good), "--seed", "-1").stderr.strip() == "error: --seed must be >= 0, got -1"
    for args, says in ((("bench", "-m", str(model), "--json", str(tmp_path)), "is a directory"),
                       (("bench", "-m", str(model), "--plot", str(tmp_path / "x.txt")), ".png, .svg or .pdf"),
                       (("perplexity", "-m", str(model), "--text", str(text), "-c", "1"), "at least 2 tokens"),
                       (("perplexity", "-m", str(model), "--text", str(text), "--max-tokens", "-3"), "(--max-tokens) must be >= 0"),
                       (("calibrate", "-m", str(model), "-o", str(tmp_path / "r.predictor"), "--mode", "predictor", "--sparsity", "0.5",
                         "--rank", "100000"), "exceeds the model's width"),
                       (("bench", "--merge", "--workers", "1"), "give --workers 2 or more")):
        proc = run(*args)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # the torch tools take -t, so a shared machine can keep them to one core
    proc = run("perplexity", "-m", str(model), "--text", str(text), "-t", "1")
    assert proc.returncode == 0 and "dense perplexity" in proc.stdout, proc.stderr
    proc = run("perplexity", "-m", str(model), "--text", str(text), "-t", "1", "--decode-path", "--max-tokens", "40")
    assert proc.returncode == 0 and "decode path (" in proc.stdout and "dense perplexity" in proc.stdout, proc.stderr
    assert "must be positive" in run("perplexity", "-m", str(model), "--text", str(text), "-t", "0").stderr


def test_a_prompt_too_long_prints_nothing_and_a_full_disk_is_an_error(make_model: Callable[..., Path]) -> None:
    model = make_model(arch="llama", n_layers=2)
    proc = run("-m", str(model), "-p", "abc " * 100, "-n", "2", "-t", "1", "-c", "32")
    assert proc.returncode == 1 and proc.stdout == "" and "do not fit the context of 32" in proc.stderr
    assert run("-m", str(model), "-p", "abc", "-n", "2", "-t", "1", "-c", "32", "-b", "100000000").returncode == 0  # clamped to -c
    ignored = run("-m", str(model), "-p", "abc", "-n", "2", "-t", "1", "-c", "32", "--system", "s", "--executor", "inprocess",
                  "--transport", "zmq")
    assert ignored.returncode == 0 and "without -i it is ignored" in ignored.stderr and "--transport zmq applies" in ignored.stderr
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, str(REPO / "launch.py"), "-m", str(model), "-p", "abc", "-n", "2", "-t", "1", "-c", "32"],
                                  stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        assert done.returncode == 1 and "No space left on device" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_grammar_time_has_help_and_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from powerinfer.devtools.harness.grammar_time import main as grammar_time

    assert grammar_time(["/no/such.gguf"]) == 1 and capsys.readouterr().err.strip() == "error: /no/such.gguf: no such file"
    with pytest.raises(SystemExit) as e:
        grammar_time(["--help"])
    assert e.value.code == 0 and "model" in capsys.readouterr().out


def test_version_on_both_commands() -> None:
    from powerinfer import __version__

    for args in (["launch.py", "--version"], ["-m", "powerinfer.server.main", "--version"], ["launch.py", "convert", "--version"]):
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parents[2])
        assert proc.returncode == 0 and proc.stdout.strip().endswith(__version__), (args, proc.stdout, proc.stderr)


def test_every_flag_of_every_command_has_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command's parser is built by asking for its --help; an option added without help text fails."""
    from powerinfer import flags
    from powerinfer.cli.main import COMMANDS, build_generate_parser

    missing: list[str] = []
    original = flags.Parser.add_argument

    def add_argument(self, *names, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("help") in (None, "") and names and names[0].startswith("-"):
            missing.append(f"{self.prog} {names[0]}")
        return original(self, *names, **kwargs)

    monkeypatch.setattr(flags.Parser, "add_argument", add_argument)
    build_generate_parser()
    for name, run in COMMANDS.items():
        if name == "fetch":
            continue  # its subparser is built by add_fetch_subcommand (checked through `powerinfer fetch --help` below)
        with pytest.raises(SystemExit):
            run(["--help"])
    with pytest.raises(SystemExit):
        COMMANDS["fetch"](["--help"])
    assert not missing, missing
