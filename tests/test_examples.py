"""Every script in examples/ runs on the embedded SmolLM2-135M-Instruct (CPU) and prints what it says."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
TEXT = ("The Eiffel Tower stands in Paris, the capital of France. It was built for the world's fair of 1889 "
        "and was the tallest structure in the world for forty years. Rome, the capital of Italy, is older "
        "by far: its Colosseum was finished in the year 80, and its forum was the centre of public life. ") * 2


def run(script: str, *args: str, ok: bool = True) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=600)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def test_every_example_is_tested():
    tested = {"generate.py", "batch.py", "stream.py", "kv_quality.py", "check_kernels.py", "bench_preset.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_generate_answers_the_question():
    out = run("generate.py", "-n", "24")
    answer, stats = out.strip().splitlines()
    assert "Paris" in answer
    assert re.fullmatch(r"\[\d+ tokens, finish: eos, \d+\.\d tok/s decode\]", stats)


def test_batch_answers_each_prompt():
    out = run("batch.py", "-n", "16", "What is the capital of France?", "What is the capital of Italy?")
    lines = out.strip().splitlines()
    assert lines[0] == "[1] What is the capital of France?" and "Paris" in lines[1]
    assert lines[2] == "[2] What is the capital of Italy?" and "Rome" in lines[3]


def test_stream_prints_the_text_generate_prints():
    """Greedy decoding: the streamed pieces join into the very answer generate.py prints."""
    question = "What is the capital of France?"
    streamed = run("stream.py", "-n", "24", question).strip().splitlines()
    generated = run("generate.py", "-n", "24", question).strip().splitlines()
    assert streamed[0] == generated[0] and "Paris" in streamed[0]
    assert re.fullmatch(r"\[decode: \d+ tokens at \d+\.\d tok/s\]", streamed[-1])
    stopped = run("stream.py", "-n", "24", "--stop", "Paris", question).splitlines()
    assert stopped[0] == generated[0].split("Paris")[0]  # cut before the stop string


def test_kv_quality_scores_a_dtype_on_your_text(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = run("kv_quality.py", str(text), "--window", "48", "--kv-cache-dtype", "fp8")
    header, columns, row = out.strip().splitlines()
    assert re.fullmatch(r"\d+ tokens in \d+ windows; bf16 KV perplexity \d+\.\d{3}", header)
    name, nbytes, kl, dppl, top1, kl_all, top1_all = row.split()
    assert name == "fp8" and int(nbytes) == 30 * 2 * 3 * 64  # SmolLM2: 30 layers, 3 KV heads of 64, 1 byte each side
    assert 0 < float(kl) < 0.1 and 80 <= float(top1.rstrip("%")) <= 100
    assert kl_all == kl  # fp8 promotes no boundary layers: deployed = every layer


def test_check_kernels_passes_and_fails_as_a_deploy_script_needs():
    out = run("check_kernels.py", "bf16", "fp8k4v")
    assert out.splitlines() == ["bf16: 22/22 kernels ok (compiled for sm_90)",
                                "fp8k_turbo4v: 22/22 kernels ok (compiled for sm_90)"]
    assert run("check_kernels.py", "turbo2", "--head-dim", "512") == "turbo2: 21/21 kernels ok (compiled for sm_90)\n"
    out = run("check_kernels.py", "bf16", "turbo2", "--head-dim", "96", ok=False)
    assert out.splitlines() == [f"{d}: error: the attention kernels are built for head_dim 64, 128, 256, 512, not 96"
                                for d in ("bf16", "turbo2")]
    assert "int4: error: Unsupported --kv-cache-dtype 'int4'" in run("check_kernels.py", "int4", ok=False)


def test_bench_preset_times_prefill_and_decode():
    out = run("bench_preset.py", "-p", "16", "-n", "4", "-r", "1")
    lines = out.strip().splitlines()
    assert lines[0] == "smollm2 (random weights) on cpu"
    rows = [re.fullmatch(r"metrale torch eager kv=bf16\s+(pp16|tg4 b1 @16)\s+(\d+\.\d) t/s\s*", line) for line in lines[1:]]
    assert all(rows) and [r[1] for r in rows] == ["pp16", "tg4 b1 @16"] and all(float(r[2]) > 0 for r in rows)


@pytest.mark.parametrize("script", ["generate.py", "batch.py", "stream.py", "kv_quality.py", "check_kernels.py",
                                    "bench_preset.py"])
def test_every_example_explains_itself(script):
    out = run(script, "--help")
    assert out.startswith("usage:") and len(out.splitlines()) > 3
