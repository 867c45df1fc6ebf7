"""The command line as a user meets it: exit codes, one-line errors, JSON, streaming."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers as T

from helpers_checkpoints import make_hf_checkpoint
from hf_oracle import hf_kv_rounded_to_bf16
from metrale_cli.errors import MetraleError

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def metrale(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``args`` and ``stdin`` may hold bytes that are not UTF-8 as surrogates (os.fsdecode's);
    ``env``: more environment variables."""
    return subprocess.run([sys.executable, "-m", "metrale_cli", *args], capture_output=True, text=True,
                          errors="surrogateescape", input=stdin, env=ENV | (env or {}), timeout=300)


def assert_one_line_error(result, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("cli"), "qwen3")


def test_unknown_kv_dtype_lists_valid_values():
    result = metrale("generate", "--kv-cache-dtype", "int3", "hi")
    assert_one_line_error(result, "Unsupported --kv-cache-dtype 'int3'", "fp8k_turbo2v", "turbo4k3v")


def test_missing_model_path():
    assert_one_line_error(metrale("generate", "-m", "/no/such/model", "hi"), "/no/such/model")


@pytest.fixture
def truncated(tiny, tmp_path):
    """A copy of the tiny checkpoint whose safetensors files are cut in half."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    return broken


def test_corrupt_safetensors(truncated):
    assert_one_line_error(metrale("generate", "-m", str(truncated), "hi"), "truncated")


def _stacked_beside_per_expert(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj"] = torch.zeros(6, 64, 32, dtype=torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _dense_layer_past_the_last(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [2]}))


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("edit, needle", [
    (_stacked_beside_per_expert, "error: checkpoint holds model.layers.1.mlp.experts.* both stacked"),
    (_dense_layer_past_the_last, "error: config.json mlp_only_layers lists layer(s) [2] outside num_hidden_layers (2)"),
])
def test_a_broken_moe_checkpoint_is_one_error_line(tmp_path, command, edit, needle):
    folder = make_hf_checkpoint(tmp_path, "qwen3_moe")
    edit(folder)
    args = ["-n", "4", "hi"] if command == "generate" else ["-p", "8", "-n", "4"]
    assert_one_line_error(metrale(command, "-m", str(folder), *args), needle)


@pytest.mark.parametrize("file, key, value, needle", [
    ("config.json", "eos_token_id", "x",
     "error: config.json eos_token_id must be a token id or a list of token ids, got 'x'"),
    ("config.json", "eos_token_id", [1, None],
     "error: config.json eos_token_id must be a token id or a list of token ids"),
    ("generation_config.json", "eos_token_id", -1,
     "error: generation_config.json eos_token_id must be a token id or a list"),
    ("config.json", "bos_token_id", "y", "error: config.json bos_token_id must be a token id, got 'y'"),
    # ids past the vocabulary (320 tokens) were accepted: an eos id there never ends an answer
    ("config.json", "eos_token_id", 100000,
     "error: config.json eos_token_id 100000 is past the model's vocabulary: vocab_size is 320, so token ids are "
     "0 to 319"),
    ("generation_config.json", "eos_token_id", [2, 320],
     "error: generation_config.json eos_token_id 320 is past the model's vocabulary: vocab_size is 320"),
    ("config.json", "bos_token_id", 100000, "error: config.json bos_token_id 100000 is past the model's vocabulary"),
])
def test_a_token_id_that_is_not_one_is_one_error_line(tmp_path, file, key, value, needle):
    folder = make_hf_checkpoint(tmp_path, "qwen3")
    path = folder / file
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(config | {key: value}))
    assert_one_line_error(metrale("generate", "-m", str(folder), "-n", "2", "hi"), needle)


def test_prompt_longer_than_context(tiny):
    result = metrale("generate", "-m", str(tiny), "--no-chat-template", "--max-seq-len", "16",
                     "word " * 40)
    assert_one_line_error(result, "--max-seq-len")


def test_a_prompt_that_cannot_fit_is_refused_before_the_weights_load(truncated):
    """The weights of this copy are truncated: reaching them would fail on them instead."""
    result = metrale("generate", "-m", str(truncated), "--no-chat-template", "--max-seq-len", "16",
                     "word " * 40)
    assert_one_line_error(result, "prompt 1 has", "the context is 16 tokens (--max-seq-len)")
    assert "truncated" not in result.stderr


def test_a_tokenizer_past_the_model_vocabulary_is_refused_before_the_weights_load(truncated):
    """Two tokens added to the tokenizer take ids the model's embedding has no row for."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(truncated / "tokenizer.json"))
    tokenizer.add_special_tokens(["<extra_a>", "<extra_b>"])
    tokenizer.save(str(truncated / "tokenizer.json"))
    vocab = json.loads((truncated / "config.json").read_text())["vocab_size"]
    result = metrale("generate", "-m", str(truncated), "--no-chat-template", "<extra_b> hi")
    assert_one_line_error(result, f"prompt 1: token id {vocab + 1} is past the model's vocabulary of {vocab} tokens: "
                                  "the tokenizer does not match the checkpoint")
    assert "truncated" not in result.stderr


def test_cuda_backend_without_gpu(tiny):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_one_line_error(metrale("generate", "-m", str(tiny), "--backend", "cuda", "hi"), "GPU")


def test_hub_id_offline():
    assert_one_line_error(metrale("generate", "-m", "someone/some-model", "hi"), "HF_HUB_OFFLINE")


def test_turbo_dtype_refuses_a_head_dim_the_rotation_does_not_serve(tiny):
    result = metrale("generate", "-m", str(tiny), "--kv-cache-dtype", "turbo3", "hi")  # head_dim 16
    assert_one_line_error(result, "turbo KV sides need head_dim in (64, 128, 256, 512), not 16")


def test_generate_verbose_reports_kv_memory(tiny):
    result = metrale("generate", "-m", str(tiny), "--kv-cache-dtype", "nvfp4", "--no-chat-template", "-n", "3",
                     "--ignore-eos", "--verbose", "--kv-high-precision-layers", "1", "hello")
    assert result.returncode == 0, result.stderr
    # 2 layers, 2 KV heads, head_dim 16: bf16 layer 2·2·16·2 = 128 B, nvfp4 layer 2·2·(8 + 1) = 36 B
    assert "KV cache: nvfp4, 164 bytes/token over 2 layers" in result.stderr, result.stderr
    assert "KV layer dtypes: bf16 layer 0, nvfp4 layer 1 (per layer and token: bf16 128 B, nvfp4 36 B)" \
        in result.stderr


@pytest.mark.parametrize("spec, lines", [
    ("some", ("error: invalid --kv-high-precision-layers 'some'",)),
    ("100", ("error: --kv-high-precision-layers 100: the model has only 2 layers with a KV cache",
             "hint: max or all keeps every layer's KV in bf16")),  # it was capped at 2 without a word
])
def test_bad_high_precision_layers_is_one_line(tiny, spec, lines):
    result = metrale("generate", "-m", str(tiny), "--kv-high-precision-layers", spec, "hi")
    assert_one_line_error(result, *lines)


def test_bench_kv_quality_json(tiny, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat and looked at the rain. " * 6)
    result = metrale("bench", "--kv-quality", "-m", str(tiny), "--backend", "torch", "--corpus", str(corpus),
                     "--window", "32", "--kv-cache-dtype", "bf16", "--kv-cache-dtype", "nvfp4", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    bf16, nvfp4 = report["rows"]
    assert bf16["kv_cache_dtype"] == "bf16" and bf16["mean_kl"] == 0 and bf16["top1_agreement"] == 1
    assert bf16["ppl"] == pytest.approx(report["reference_ppl"])
    assert nvfp4["mean_kl"] > 0 and 0 < nvfp4["top1_agreement"] <= 1
    assert nvfp4["kv_bytes_per_token"] == 2 * 36 and nvfp4["all_layers"]["mean_kl"] == pytest.approx(nvfp4["mean_kl"])
    assert report["windows"] >= 2 and report["corpus"] == str(corpus)


@pytest.mark.parametrize("args, line", [
    (["--kv-quality", "--preset", "qwen3-30b-a3b"], "error: --preset does not apply here: --kv-quality measures"),
    (["--kv-quality", "-tp", "2", "-p", "8"], "error: --n-prompt, --tensor-parallel-size do not apply here"),
    (["--preset", "smollm2", "--window", "64"], "error: --window does not apply here: bench times the model"),
    (["--kv-quality", "--window", "1"], "error: --window must be at least 2 tokens, got 1"),
    (["--kv-quality", "--window", "100000"], "error: --window 100000 is past the model's context of 8192 tokens"),
    (["--kv-quality", "--corpus", "/no/such/corpus.txt"], "error: cannot read --corpus /no/such/corpus.txt"),
])
def test_bench_refuses_an_option_its_mode_would_not_read(args, line):
    """Checked before a weight is read: the timing's options under --kv-quality, its own without."""
    assert_one_line_error(metrale("bench", *args), line, "hint: ")


def _hf_greedy_ids(folder, prompt: str, n: int) -> list[int]:
    tok = T.AutoTokenizer.from_pretrained(folder)
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tok(prompt).input_ids])
    with hf_kv_rounded_to_bf16(), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_generate_json_equals_hf_greedy(tiny):
    """fp32 weights with a bf16 KV cache on our side, HF fp32 with K/V rounded to bf16: equal."""
    prompt = "The quick brown fox"
    result = metrale("generate", "-m", str(tiny), "--dtype", "fp32", "--no-chat-template", "-n", "24",
                     "--ignore-eos", "--json", prompt)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    (only,) = payload["results"]
    assert only["completion_tokens"] == 24 and only["finish_reason"] == "length"
    assert only["token_ids"] == _hf_greedy_ids(tiny, prompt, 24)


def test_several_prompts_batch_equals_each_alone(tiny):
    prompts = ["Hello world", "Numbers like 12345 and", "Café"]
    args = ["generate", "-m", str(tiny), "--no-chat-template", "-n", "12", "--ignore-eos", "--json"]
    batch = json.loads(metrale(*args, *prompts).stdout)["results"]
    alone = [json.loads(metrale(*args, p).stdout)["results"][0] for p in prompts]
    assert [r["token_ids"] for r in batch] == [r["token_ids"] for r in alone]


def test_stdin_prompt_streams_and_reports_speed(tiny):
    result = metrale("generate", "-m", str(tiny), "--no-chat-template", "-n", "6", "--ignore-eos",
                     stdin="Hello world")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout.strip()) > 0
    assert "tok/s" in result.stderr and "finish: length" in result.stderr


def test_stop_string_truncates(tiny):
    args = ["generate", "-m", str(tiny), "--no-chat-template", "-n", "30", "--ignore-eos", "--json", "Hello"]
    full = json.loads(metrale(*args).stdout)["results"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    stopped = json.loads(metrale(*args, "--stop", stop).stdout)["results"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == full[: full.index(stop)]


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny):
    base = ["generate", "-m", str(tiny), "--no-chat-template", "-n", "16", "--ignore-eos", "--json", "Hello"]
    greedy = json.loads(metrale(*base).stdout)["results"][0]["token_ids"]
    sampled = [json.loads(metrale(*base, "-t", "1.5", "--seed", "7").stdout)["results"][0]["token_ids"]
               for _ in range(2)]
    top1 = json.loads(metrale(*base, "-t", "1.5", "--top-k", "1", "--seed", "3").stdout)["results"][0]
    assert sampled[0] == sampled[1]
    assert sampled[0] != greedy  # at temperature 1.5 over ~300 tokens, 16 draws never all agree
    assert top1["token_ids"] == greedy


def test_a_seeded_answer_does_not_depend_on_the_other_prompts(tiny):
    base = ["generate", "-m", str(tiny), "--no-chat-template", "-n", "16", "--ignore-eos", "--json", "-t", "1.5",
            "--seed", "7"]
    alone = json.loads(metrale(*base, "Hello").stdout)["results"]
    batched = json.loads(metrale(*base, "--n", "2", "Once upon", "Hello").stdout)["results"]
    assert [r["prompt"] for r in batched] == ["Once upon", "Once upon", "Hello", "Hello"]
    assert batched[2]["token_ids"] == alone[0]["token_ids"]
    assert batched[3]["token_ids"] != batched[2]["token_ids"]  # the second answer: a stream of its own
    assert batched[0]["token_ids"] != batched[1]["token_ids"]


def test_embedded_default_answers_paris():
    result = metrale("generate", "-n", "24", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_validate_kernels_cli():
    ok = metrale("validate-kernels", "--kv-cache-dtype", "fp8", "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] and report["missing"] == []
    assert "paged_decode_fp8::paged_decode_attn_fp8" in [k["kernel"] for k in report["kernels"]]
    bad = metrale("validate-kernels", "--kv-cache-dtype", "turbo2", "--head-dim", "96")
    assert_one_line_error(bad, "head_dim", "hint: pass the head_dim of the model's attention")
    assert "--backend" not in bad.stderr  # validate-kernels has no --backend to point to
    auto = metrale("validate-kernels", "--kv-cache-dtype", "auto")
    assert_one_line_error(auto, "not 'auto'", "hint: e.g. --kv-cache-dtype fp8")


def test_the_prefill_split_counts_every_kernel_of_the_trace():
    """bench's prefill split over a chrome trace: a kernel launched by CuPy (a driver call, no torch
    op above it) inside the GDN range counts as the mixer's, one launched outside it by name; a
    copy and a memset count too, and nothing is left out of the total."""
    from metrale_cli.commands.bench import split_device_time
    from metrale_cli.layers.gdn import GDN_RANGE

    def launch(cat, ts, corr):
        return {"cat": cat, "name": "cuLaunchKernel", "ts": ts, "dur": 1.0, "args": {"correlation": corr}}

    def kernel(cat, name, dur, corr):
        return {"cat": cat, "name": name, "ts": 1e6 + corr, "dur": dur, "args": {"correlation": corr}}

    events = [
        {"cat": "user_annotation", "name": GDN_RANGE, "ts": 100.0, "dur": 50.0},
        launch("cuda_driver", 110.0, 1), kernel("kernel", "gdn_chunk_walk_f32", 3000.0, 1),
        launch("cuda_runtime", 120.0, 2), kernel("kernel", "sm80_xmma_gemm_f32f32", 2000.0, 2),
        launch("cuda_driver", 200.0, 3), kernel("kernel", "rms_norm_bf16", 500.0, 3),
        launch("cuda_runtime", 210.0, 4), kernel("kernel", "nvjet_sm90_tst_256x128", 4000.0, 4),
        launch("cuda_runtime", 220.0, 5), kernel("gpu_memcpy", "Memcpy DtoD", 250.0, 5),
        kernel("gpu_memset", "Memset (Device)", 250.0, 6),  # its launch call not in the trace
        {"cat": "cpu_op", "name": "aten::mm", "ts": 105.0, "dur": 10.0, "args": {}},
    ]
    split = split_device_time(events)
    assert split == pytest.approx({"gdn_mixer_s": 5e-3, "gemm_s": 4e-3, "other_s": 1e-3})


def test_the_prefill_split_is_a_line_of_the_table_and_of_md():
    """The split's line, from a row that carries it (a hybrid's cuda prefill): its total and shares;
    a row without it gives no line."""
    from metrale_cli.commands.bench import split_lines

    result = {"rows": [{"engine": "metrale cuda graphs kv=bf16", "test": "pp4096", "gdn_mixer_s": 0.2,
                        "gemm_s": 0.15, "other_s": 0.05}, {"engine": "HF transformers (eager)", "test": "pp4096"}]}
    assert split_lines(result) == ["metrale cuda graphs kv=bf16 pp4096: device time of one prefill 400.0 ms = Gated "
                                   "DeltaNet mixers 200.0 ms (50%), GEMMs 150.0 ms (38%), other 50.0 ms"]


def test_bench_cpu_json():
    result = metrale("bench", "--preset", "smollm2", "-p", "8", "-n", "2", "-r", "1", "--backend", "torch",
                     "--kv-cache-dtype", "bf16", "--kv-cache-dtype", "fp8", "--compare-hf", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [(r["engine"], r["test"]) for r in rows] == [
        ("metrale torch eager kv=bf16", "pp8"), ("metrale torch eager kv=bf16", "tg2 b1 @8"),
        ("metrale torch eager kv=fp8", "pp8"), ("metrale torch eager kv=fp8", "tg2 b1 @8"),
        ("HF transformers (eager)", "pp8"), ("HF transformers (eager)", "tg2 b1 @8"),
    ]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # SmolLM2 shapes: 30 layers, 3 KV heads, head_dim 64 -> bf16 768 B and fp8 384 B per layer
    assert [r["kv_bytes_per_token"] for r in rows[:4]] == [23040, 23040, 11520, 11520]
    assert rows[0]["pool_tokens"] == 16 * 1  # one 11-token sequence: one block


def test_hub_id_served_from_the_hf_cache_offline(tiny, tmp_path):
    """A model already in the HF cache loads by hub id with HF_HUB_OFFLINE=1, equal to its folder."""
    import shutil

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-qwen3"
    shutil.copytree(tiny, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    args = ["generate", "--no-chat-template", "-n", "8", "--ignore-eos", "--json", "Hello world"]
    env = {**ENV, "HF_HUB_CACHE": str(tmp_path / "hub")}
    by_id = subprocess.run([sys.executable, "-m", "metrale_cli", *args, "-m", "someone/tiny-qwen3"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert by_id.returncode == 0, by_id.stderr
    by_folder = json.loads(metrale(*args, "-m", str(tiny)).stdout)["results"][0]["token_ids"]
    assert json.loads(by_id.stdout)["results"][0]["token_ids"] == by_folder


def test_validate_kernels_all_dtypes_in_one_run():
    result = metrale("validate-kernels", "--kv-cache-dtype", "all", "--json")
    assert result.returncode == 0, result.stderr
    reports = json.loads(result.stdout)
    assert [r["kv_cache_dtype"] for r in reports] == [
        "bf16", "fp8", "nvfp4", "turbo4", "turbo3", "turbo2", "turbo8", "turbo4k_turbo3v", "turbo4k_turbo8v",
        "turbo3k_turbo8v", "bf16k_turbo4v", "bf16k_turbo3v", "bf16k_turbo2v", "fp8k_turbo4v", "fp8k_turbo3v",
        "fp8k_turbo2v"]
    assert all(r["ok"] and r["missing"] == [] for r in reports)
    wide = metrale("validate-kernels", "--kv-cache-dtype", "all", "--head-dim", "512", "--json")
    assert wide.returncode == 0, wide.stderr  # every dtype is built for Gemma-4's / DeepSeek-V4's 512
    assert all(r["ok"] and r["missing"] == [] and r["head_dim"] == 512 for r in json.loads(wide.stdout))


def test_bench_counts_the_experts_a_moe_decode_step_reads(tmp_path):
    """Batch 1 reads top-k distinct experts in every MoE layer a step: the roofline's routed bytes,
    metrale's and HF's (counted by a hook on its routers), are exactly that many experts' weights."""
    folder = make_hf_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    result = metrale("bench", "-m", str(folder), "-p", "8", "-n", "3", "-r", "1", "--backend", "torch",
                     "--compare-hf", "--peak-bandwidth", "100", "--json")
    assert result.returncode == 0, result.stderr
    cfg = json.loads((folder / "config.json").read_text())
    expert = 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"] * 2  # gate, up, down in bf16
    want = 2 * cfg["num_experts_per_tok"] * expert  # layers 0 and 2 are MoE
    tg = [r for r in json.loads(result.stdout)["rows"] if r["test"].startswith("tg")]
    assert [r["engine"] for r in tg] == ["metrale torch eager kv=bf16", "HF transformers (eager)"]
    assert [r["routed_bytes_per_step"] for r in tg] == [want, want]
    assert all(r["roofline_pct"] > 0 for r in tg)


def test_the_hf_roofline_counts_its_kv_cache_in_the_models_dtype(tiny, monkeypatch):
    """HF caches K and V in the model's dtype: under --dtype float32, 4 bytes an element. A step
    of 0.5 s makes the row's GB/s the step's bytes: every weight but the untied input embedding,
    and the KV of the middle of the run, derived here from the config."""
    from metrale_cli.commands import bench_hf
    from metrale_cli.commands.bench import BenchOptions, bench_source

    opts = BenchOptions(model=str(tiny), n_prompt=8, n_gen=4, repetitions=1, backend="torch", dtype="float32")
    source, dtype = bench_source(opts, torch.device("cpu"))
    tensors = source.load(torch.device("cpu"), torch.float32, None).tensors
    monkeypatch.setattr(bench_hf, "_time_hf", lambda *args: (1.0, 0.5, 0.0))
    tg = bench_hf.bench_hf(source.config, tensors, opts, torch.device("cpu"), None)[1]
    cfg = json.loads((tiny / "config.json").read_text())
    weights = 4 * (sum(t.numel() for t in tensors.values()) - tensors["model.embed_tokens.weight"].numel())
    kv = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V in fp32
    assert dtype == "fp32" and not cfg["tie_word_embeddings"]
    assert tg["achieved_gbs"] * 0.5 * 1e9 == pytest.approx(weights + (8 + 4 // 2) * kv)


def test_a_rows_gbs_is_its_tokens_per_s_times_the_bytes_a_token_reads():
    """GB/s and % of the roofline follow the row's t/s (the mean of the samples' rates), not
    another statistic of the same samples: uneven samples would make the two disagree."""
    from metrale_cli.commands.timing import timing_row

    row = timing_row("e", "tg8 b2 @8", [0.1, 0.2, 0.4], tokens=2, step_bytes=6e9, peak=1000.0)
    assert row["tokens_per_s"] == pytest.approx((20 + 10 + 5) / 3)
    assert row["achieved_gbs"] == pytest.approx(row["tokens_per_s"] * 3e9 / 1e9)  # 3 GB a token: 6 GB a step of 2
    assert row["roofline_pct"] == pytest.approx(100 * row["achieved_gbs"] / 1000.0)


# --- bad input: one line each, before any weight is read -------------------------------------
def _json_error(result) -> dict:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("prompt, raw", [("", True), ("  \n", False)])
def test_an_empty_prompt_is_refused(tiny, prompt, raw):
    args = ["generate", "-m", str(tiny), *(["--no-chat-template"] if raw else []), prompt]
    assert_one_line_error(metrale(*args), "prompt 1 is empty")


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("source", ["argv", "stdin", "stdin decoded strictly"])
def test_a_prompt_that_is_not_utf8_is_refused(tiny, source, raw):
    """Not the tokenizers library's "TextInputSequence must be str" (argv and stdin reach Python
    as surrogates where their bytes are not UTF-8), nor a UnicodeDecodeError where the locale
    has stdin decode strictly."""
    prompt = os.fsdecode(b"caf\xe9")
    args = ["generate", "-m", str(tiny), "-n", "2", *(["--no-chat-template"] if raw else [])]
    strict = {"PYTHONIOENCODING": "utf-8:strict"} if source.endswith("strictly") else {}
    result = metrale(*args, prompt) if source == "argv" else metrale(*args, stdin=prompt, env=strict)
    before = "'caf'" if raw else "'<|im_start|>user\\ncaf'"
    assert_one_line_error(result, f"error: the prompt is not valid UTF-8: byte 0xe9 after {before}\n",
                          "hint: give the prompt as UTF-8 text")


def test_errors_under_json_are_one_json_object_on_stderr(tiny):
    payload = _json_error(metrale("generate", "-m", str(tiny), "--json", "--no-chat-template", ""))
    assert payload == {"error": "prompt 1 is empty", "hint": "give the model some text to answer or continue"}


def test_a_value_that_is_not_a_number_is_one_line_not_a_usage_box():
    result = metrale("generate", "-n", "abc", "hi")
    assert_one_line_error(result, "Invalid value for '--max-new-tokens'", "hint: see ")
    assert "╭" not in result.stderr
    assert "'--max-new-tokens'" in _json_error(metrale("generate", "--json", "-n", "abc", "hi"))["error"]


def test_an_unknown_option_and_an_unknown_command_are_one_line():
    assert_one_line_error(metrale("generate", "--no-such-option", "hi"), "No such option: --no-such-option")
    assert_one_line_error(metrale("no-such-command"), "No such command 'no-such-command'")


def test_a_system_message_without_the_chat_template_is_refused(tiny):
    result = metrale("generate", "-m", str(tiny), "--no-chat-template", "--system", "be brief", "hi")
    assert_one_line_error(result, "--system needs the chat template")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_an_empty_system_message_is_refused(command):
    """Not dropped for the chat template's default system message."""
    assert_one_line_error(metrale(command, "--system", " ", *(["hi"] if command == "generate" else []), stdin="hi\n"),
                          "error: --system is empty", "hint: ")


def test_a_context_past_the_models_is_refused(tiny):
    result = metrale("generate", "-m", str(tiny), "--max-seq-len", "100000", "hi")
    assert_one_line_error(result, "--max-seq-len 100000 is past the model's context of 256 tokens",
                          "use --max-seq-len 256 or less")


def test_a_negative_innerq_calibration_count_is_refused(tiny):
    result = metrale("generate", "-m", str(tiny), "--innerq-calibration-tokens", "-2", "hi")
    assert_one_line_error(result, "--innerq-calibration-tokens must not be negative")


def test_bench_refuses_a_bandwidth_that_is_not_positive_and_a_model_beside_a_preset(tiny):
    for bandwidth in ("-1", "inf"):  # inf made every % of the roofline 0.0%
        assert_one_line_error(metrale("bench", "-m", str(tiny), "--peak-bandwidth", bandwidth),
                              f"--peak-bandwidth must be a finite positive GB/s figure, got {bandwidth}")
    assert_one_line_error(metrale("bench", "-m", str(tiny), "--preset", "qwen3-0.6b"),
                          "give -m (a checkpoint) or --preset")
    for fraction in ("0", "1.5"):  # refused before a weight is read, as generate refuses it
        result = metrale("bench", "-m", str(tiny), "--backend", "torch", "--gpu-memory-utilization", fraction)
        assert_one_line_error(result, "--gpu-memory-utilization must be in (0, 1]")


def test_bench_gives_the_pool_generate_would_build_at_the_memory_fraction(monkeypatch):
    """On a GPU the KV tokens column is the pool `generate` would size at --gpu-memory-utilization
    beside the same weights: the fraction of the card less what is in use, with the run's own
    (small) pool counted back, in whole blocks."""
    from types import SimpleNamespace
    from metrale_cli.commands import bench

    gb = 10**9
    layout = SimpleNamespace(bytes_per_token=lambda: 1000, bytes_per_block=lambda: 16000)
    cache = SimpleNamespace(layout=layout, num_blocks=100, capacity_tokens=1600)
    runner = SimpleNamespace(model=SimpleNamespace(kv_cache=cache, device=torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gb, 100 * gb))
    memory = bench.kv_memory(runner, 0.9)
    assert memory == {"kv_bytes_per_token": 1000, "pool_tokens": 1600, "gpu_memory_utilization": 0.9,
                      "utilization_pool_tokens": (50 * gb + 1_600_000) // 16000 * 16}
    assert bench._tokens(memory) == f"{(50 * gb + 1_600_000) // 16000 * 16:,} (at 0.9 of memory)"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * gb, 100 * gb))
    assert bench.kv_memory(runner, 0.9)["utilization_pool_tokens"] == 0  # in use past the fraction


def test_version():
    from metrale_cli import __version__

    result = metrale("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"metrale {__version__}"


def test_a_tokenizer_json_the_library_cannot_read_is_one_line(tiny, tmp_path):
    broken = tmp_path / "bad-tokenizer"
    broken.mkdir()
    for f in tiny.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text('{"valid": "json", "but": "no tokenizer"}')
    result = metrale("generate", "-m", str(broken), "hi")
    assert_one_line_error(result, "tokenizer.json is not a tokenizer the tokenizers library reads")


def test_the_speed_line_counts_the_tokens_json_counts(tiny):
    args = ["generate", "-m", str(tiny), "--no-chat-template", "--ignore-eos", "-n", "7", "hello"]
    text, payload = metrale(*args), json.loads(metrale(*args, "--json").stdout)
    assert text.returncode == 0, text.stderr
    (result,) = payload["results"]
    assert result["completion_tokens"] == 7 and payload["decode_tokens"] == 6
    assert "completion: 7 tokens (1 from the prefill, 6 decoded at " in text.stderr


def test_no_decode_speed_is_given_where_no_decode_step_ran(tiny):
    """-n 1: the one token comes from the prefill and no decode step runs, so there is no decode
    speed to give (it said 0.0 tok/s)."""
    args = ["generate", "-m", str(tiny), "--no-chat-template", "--ignore-eos", "-n", "1", "hello"]
    text, payload = metrale(*args), json.loads(metrale(*args, "--json").stdout)
    assert text.returncode == 0, text.stderr
    assert (payload["decode_tokens"], payload["decode_tokens_per_s"]) == (0, None)
    assert "completion: 1 tokens (1 from the prefill, 0 decoded) · finish: length" in text.stderr


def test_an_unwritable_cache_folder_only_costs_the_next_check_a_compile(monkeypatch):
    """compile.check_module with METRALE_CACHE_DIR under /proc: the compile's outcome, nothing
    cached, no error (the verdict store does the same)."""
    from metrale_cli.kernels import compile as kc
    from metrale_cli.kernels.registry import MODULES

    if kc.compiler_id() is None:
        pytest.skip("no CUDA compiler here")
    monkeypatch.setenv("METRALE_CACHE_DIR", "/proc/metrale-cannot-write-here")
    result = kc.check_module(MODULES["activation"])
    assert result.ok and not result.cached and "silu_and_mul_bf16" in result.symbols


# --- the spellings of vLLM and of torch -------------------------------------------------------
def _tokens(*args: str) -> list[int]:
    result = metrale(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["results"][0]["token_ids"]


def test_the_dtype_spellings_of_torch_and_vllm_are_metrales(tiny):
    base = ["generate", "-m", str(tiny), "--no-chat-template", "--ignore-eos", "-n", "6", "hello there"]
    assert _tokens(*base, "--dtype", "float32") == _tokens(*base, "--dtype", "fp32")
    assert _tokens(*base, "--dtype", "bfloat16") == _tokens(*base, "--dtype", "bf16")
    assert_one_line_error(metrale(*base, "--dtype", "int4"), "unknown --dtype 'int4'", "half")


def test_dtype_auto_says_what_it_chose(tiny):
    result = metrale("generate", "-m", str(tiny), "--no-chat-template", "-n", "2", "--dtype", "auto", "hello")
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("dtype auto:")]
    assert json.loads((tiny / "config.json").read_text())["dtype"] == "bfloat16"
    assert line == "dtype auto: bf16 (the checkpoint's bfloat16)"


def test_max_model_len_enforce_eager_and_fp8_e4m3_are_accepted(tiny):
    assert_one_line_error(metrale("generate", "-m", str(tiny), "--max-model-len", "100000", "hi"),
                          "past the model's context of 256 tokens")
    base = ["generate", "-m", str(tiny), "--no-chat-template", "--ignore-eos", "-n", "5", "hello there"]
    assert _tokens(*base, "--enforce-eager", "--kv-cache-dtype", "fp8_e4m3") == _tokens(*base, "--kv-cache-dtype",
                                                                                          "fp8")


def test_a_prompt_from_a_file(tiny, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("hello there", encoding="utf-8")
    base = ["generate", "-m", str(tiny), "--no-chat-template", "--ignore-eos", "-n", "4"]
    assert _tokens(*base, "-f", str(path)) == _tokens(*base, "hello there")
    assert_one_line_error(metrale(*base, "-f", str(tmp_path / "none.txt")), "prompt file not found")
    assert_one_line_error(metrale(*base, "-f", str(path), "hi"), "not both")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    assert_one_line_error(metrale(*base, "-f", str(tmp_path / "binary.txt")), "cannot read the prompt file")


# --- bench output users can paste ---------------------------------------------------------------
def test_bench_sweeps_and_llama_bench_outputs(tiny):
    """-p 4,8 -n 2 sweeps two cases on one load; md / csv / jsonl carry the model's size and
    parameters in every row and the build (version, commit) beside them; json has it too."""
    import csv
    import io

    from metrale_cli import __version__

    base = ["bench", "-m", str(tiny), "--backend", "torch", "-p", "4,8", "-n", "2", "-r", "1"]
    tests = ["pp4", "tg2 b1 @4", "pp8", "tg2 b1 @8"]
    payload = json.loads(metrale(*base, "--json").stdout)
    assert [r["test"] for r in payload["rows"]] == tests
    assert payload["build"]["version"] == __version__ and payload["params"] > 0
    params = f"{payload['params'] / 1e9:.2f} B"
    md = metrale(*base, "-o", "md")
    assert md.returncode == 0, md.stderr
    lines = md.stdout.strip().splitlines()
    assert lines[0].startswith("| model | size | params | engine | test | t/s |")
    assert [line.split(" | ")[4] for line in lines[2:6]] == tests and all(params in line for line in lines[2:6])
    assert lines[-1].startswith("cpu; build: metrale ")
    rows = list(csv.DictReader(io.StringIO(metrale(*base, "-o", "csv").stdout)))
    assert [r["test"] for r in rows] == tests and {r["params"] for r in rows} == {params}
    assert all(r["build"].startswith(f"metrale {__version__} (") for r in rows)
    jsonl = [json.loads(line) for line in metrale(*base, "-o", "jsonl").stdout.splitlines()]
    assert [r["test"] for r in jsonl] == tests and all(r["version"] == __version__ for r in jsonl)


def test_bench_shows_the_rows_measured_before_a_later_case_fails(tiny, monkeypatch, capsys):
    """An error in a later KV dtype's run (here the second's, as a pool that does not fit would
    raise it) leaves the rows measured before it on the screen, in the table marked as stopped
    and in -o md; the error itself is raised for the CLI's error line. A -p past the model's
    context is refused before anything runs."""
    from metrale_cli.commands import bench
    from metrale_cli.output import Output

    real, runs = bench.bench_metrale, []

    def second_fails(runner, opts, peak):
        runs.append(runner.kv_dtype.value)
        if len(runs) == 2:
            raise MetraleError("the KV pool does not fit", hint="a shorter context")
        return real(runner, opts, peak)

    monkeypatch.setattr(bench, "bench_metrale", second_fails)
    opts = bench.BenchOptions(model=str(tiny), backend="torch", n_prompt=4, n_gen=2, repetitions=1,
                              kv_cache_dtypes=("bf16", "fp8"))
    for fmt in ("table", "md"):
        runs.clear()
        with pytest.raises(MetraleError, match="the KV pool does not fit"):
            bench.run_bench_cmd(Output(), opts, fmt=fmt)
        shown = capsys.readouterr().out
        assert runs == ["bf16", "fp8"]
        assert "kv=bf16" in shown and "pp4" in shown and "tg2 b1 @4" in shown and "kv=fp8" not in shown, shown
        assert ("stopped by the error below" in shown) == (fmt == "table")
    with pytest.raises(MetraleError, match="-p 300 -n 2 needs 303 positions, past the model's context of 256"):
        bench.run_bench(dataclasses.replace(opts, n_prompt=300))
    assert runs == ["bf16", "fp8"]  # nothing ran


def test_bench_prints_a_small_bandwidth_in_significant_digits():
    """A CPU's decode reads a fraction of a GB/s: printed as 0.32, not rounded to 0."""
    from metrale_cli.commands import bench

    result = {"model": "m", "weight_bytes": 2**30, "params": 1e9}
    row = {"engine": "e", "test": "tg8", "tokens_per_s": 1.2, "std": 0.0}
    gbs = [bench._cells(result, row | {"achieved_gbs": g})[6] for g in (0.3187, 3.46, 12.4, 2382.4)]
    assert gbs == ["0.32", "3.5", "12", "2382"]
    assert bench._cells(result, row)[6] == ""


def test_bench_counts_a_tied_models_parameters_once(tmp_path):
    """A tied model's checkpoint may hold its embedding a second time as lm_head.weight (the build
    leaves it unread): the model's parameters and size are HF's count of the tied model, in bf16."""
    from safetensors.torch import load_file, save_file

    folder = make_hf_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    result = metrale("bench", "-m", str(folder), "-p", "4", "-n", "1", "-r", "1", "--backend", "torch", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    params = T.AutoModelForCausalLM.from_pretrained(folder).num_parameters()
    assert (payload["params"], payload["weight_bytes"]) == (params, 2 * params)


@pytest.mark.parametrize("fmt", ["md", "csv", "jsonl"])
def test_a_tensor_parallel_bench_says_its_rows_are_one_ranks(fmt, capsys):
    """With -tp 2 the size, parameters, KV bytes and GB/s of a row are one rank's shard (half the
    model's): md says so under the rows, csv and jsonl give the ranks in every row; with one
    process none of it."""
    import csv
    import io

    from metrale_cli.commands import bench
    from metrale_cli.output import Output

    row = {"engine": "e", "test": "tg8 b1 @8", "tokens_per_s": 1.2, "std": 0.0, "achieved_gbs": 0.5,
           "kv_bytes_per_token": 128}
    for size in (2, 1):
        result = {"model": "m", "weight_bytes": 2**30, "params": 10**9, "device": "cpu",
                  "build": {"version": "0", "commit": None}, "tensor_parallel_size": size, "rows": [row]}
        bench._render(Output(), result, fmt)
        shown = capsys.readouterr().out
        if fmt == "md":
            per_rank = "cpu; size, params, GB/s and KV B/token per rank of 2 (tensor parallel); build:" in shown
            assert per_rank == (size == 2) and ("per rank" in shown) == (size == 2)
        else:
            (got,) = list(csv.DictReader(io.StringIO(shown))) if fmt == "csv" else [json.loads(shown)]
            assert int(got["tensor_parallel_size"]) == size


def test_bench_refuses_a_bad_sweep_or_format(tiny):
    assert_one_line_error(metrale("bench", "-m", str(tiny), "-p", "8,x"), "-p takes a count or a comma list")
    assert_one_line_error(metrale("bench", "-m", str(tiny), "-n", "4,0"), "-n counts must all be at least 1",
                          "e.g. -n 32,128")
    assert_one_line_error(metrale("bench", "-m", str(tiny), "--batch", "0"), "--batch counts must all be at least 1",
                          "e.g. --batch 1,16")
    assert_one_line_error(metrale("bench", "-m", str(tiny), "-o", "xml"), "unknown -o 'xml'")
    assert_one_line_error(metrale("bench", "-m", str(tiny), "-r", "0"), "error: --repetitions must be at least 1, "
                          "got 0", "e.g. -r 3")


# --- metrale chat ---------------------------------------------------------------------------------
def _turns(result) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_chat_carries_the_conversation_and_reset_forgets_it(tiny):
    """Three turns from stdin (not a terminal): the first equals generate's answer to the same
    message, the second is read after the first exchange, and after /reset the same message gets
    the first answer again."""
    args = ["chat", "-m", str(tiny), "-n", "5", "--json"]
    first, second, again = _turns(metrale(*args, stdin="hello\nand again?\n/reset\nhello\n"))
    alone = json.loads(metrale("generate", "-m", str(tiny), "-n", "5", "--json", "hello").stdout)["results"][0]
    assert (first["text"], first["prompt_tokens"]) == (alone["text"], alone["prompt_tokens"])
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    speed = "decode_tokens_per_s"
    assert {k: v for k, v in again.items() if k != speed} == {k: v for k, v in first.items() if k != speed}
    assert first["decode_tokens"] == first["completion_tokens"] - 1 == 4 and first[speed] > 0


def test_chat_gives_a_decode_speed_only_where_decode_steps_ran(tiny):
    """-n 1: the answer's one token comes from the prefill, so no decode rate is measured."""
    (turn,) = _turns(metrale("chat", "-m", str(tiny), "-n", "1", "--json", stdin="hi\n"))
    assert (turn["completion_tokens"], turn["decode_tokens"], turn["decode_tokens_per_s"]) == (1, 0, None)
    plain = metrale("chat", "-m", str(tiny), "-n", "1", stdin="hi\n")
    assert plain.returncode == 0 and "1 tokens · conversation" in plain.stderr and "tok/s" not in plain.stderr
    several = metrale("chat", "-m", str(tiny), "-n", "3", stdin="hi\n")
    assert "3 tokens, 2 decoded at " in several.stderr, several.stderr


def test_chat_with_no_input_ends_at_once_and_a_system_message_changes_the_prompt(tiny):
    result = metrale("chat", "-m", str(tiny), "-n", "2", stdin="")
    assert result.returncode == 0 and result.stdout == "", result.stderr
    plain, = _turns(metrale("chat", "-m", str(tiny), "-n", "2", "--json", stdin="hi\n"))
    system, = _turns(metrale("chat", "-m", str(tiny), "-n", "2", "--json", "--system", "be brief", stdin="hi\n"))
    assert system["prompt_tokens"] > plain["prompt_tokens"]


def test_chat_turns_that_fail_are_one_line_and_the_session_goes_on(tiny):
    """A message past the context and an unknown command: an error line each, the next turn
    answered, exit 1 at the end (stdin is not a terminal: a script should see it)."""
    result = metrale("chat", "-m", str(tiny), "-n", "2", "--max-seq-len", "24", "--json",
                     stdin="word " * 40 + "\n/nope\nhi\n")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [json.loads(line)["error"] for line in result.stderr.splitlines() if line.startswith('{"error"')]
    assert len(errors) == 2 and errors[1] == "unknown command /nope"
    assert errors[0].startswith("the conversation with this message has ") and "the context is 24 tokens" in errors[0]
    (turn,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert turn["user"] == "hi" and turn["completion_tokens"] == 2


def test_a_chat_turn_that_is_not_utf8_fails_as_a_turn_and_the_session_goes_on(tiny):
    result = metrale("chat", "-m", str(tiny), "-n", "2", "--json", stdin=os.fsdecode(b"caf\xe9\nhi\n"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [json.loads(line) for line in result.stderr.splitlines() if line.startswith('{"error"')]
    assert errors == [{"error": "the prompt is not valid UTF-8: byte 0xe9 after '<|im_start|>user\\ncaf'",
                       "hint": "give the prompt as UTF-8 text (iconv -t UTF-8 converts it)"}]
    (turn,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert turn["user"] == "hi" and turn["completion_tokens"] == 2


def test_chat_system_without_text_says_what_it_needs(tiny):
    result = metrale("chat", "-m", str(tiny), "-n", "2", stdin="/system\n/system   \nhi\n")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: /system needs the message's text"] * 2, result.stderr


@pytest.mark.parametrize("args", [["-tp", "2"], ["--tensor-parallel-size", "2"]])
def test_chat_refuses_tensor_parallelism_by_name(args):
    """-tp is not read as -t with the value "p" (a temperature that is not a number)."""
    assert_one_line_error(metrale("chat", *args, stdin="hi\n"), "error: metrale chat runs in one process, "
                          "not --tensor-parallel-size 2", "hint: ")


def test_chat_needs_a_chat_template(tiny, tmp_path):
    bare = tmp_path / "no-template"
    bare.mkdir()
    for f in tiny.iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).write_bytes(f.read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert_one_line_error(metrale("chat", "-m", str(bare), stdin="hi\n"), "has no chat template",
                          "--no-chat-template")


def test_ctrl_c_stops_the_answer_not_the_session(tiny):
    """ChatSession.answer with the stream interrupted after its first piece: the answer is cut,
    kept in the history as written, every block goes back, and the next answer runs."""
    from metrale_cli.commands.chat import STOPPED, ChatSession
    from metrale_cli.engine.llm import LLM
    from metrale_cli.engine.runner import RunnerOptions, open_runner
    from metrale_cli.engine.sampler import SamplingParams
    from metrale_cli.engine.source import ModelSource

    llm = LLM(open_runner(RunnerOptions(backend="torch"), ModelSource.checkpoint(str(tiny))))
    session = ChatSession(llm, SamplingParams(max_new_tokens=6, ignore_eos=True))
    free = llm.runner.model.kv_cache.allocator.free_blocks
    pieces = []

    def interrupt(delta):
        pieces.append(delta)
        raise KeyboardInterrupt

    cut = session.answer("hello", interrupt)
    assert cut["finish_reason"] == STOPPED and cut["text"] == pieces[0] != ""
    assert session.history[-1] == {"role": "assistant", "content": pieces[0]}
    assert llm.runner.model.kv_cache.allocator.free_blocks == free
    whole = session.answer("go on", lambda d: None)
    assert whole["finish_reason"] == "length" and whole["completion_tokens"] == 6


# --- sampling knobs on the command line --------------------------------------------------------
def test_generate_n_samples_per_prompt_and_the_penalties(tiny):
    base = ["generate", "-m", str(tiny), "--no-chat-template", "--ignore-eos", "-n", "8", "--json"]
    sampled = json.loads(metrale(*base, "--n", "3", "-t", "1.0", "--seed", "2", "hello").stdout)["results"]
    assert [r["prompt"] for r in sampled] == ["hello"] * 3
    assert len({tuple(r["token_ids"]) for r in sampled}) > 1  # one generator, three rows: not one answer
    greedy = json.loads(metrale(*base, "--n", "2", "hello").stdout)["results"]
    assert greedy[0]["token_ids"] == greedy[1]["token_ids"]
    penalized = _tokens(*base[:-1], "--repetition-penalty", "1.8", "--frequency-penalty", "1.0", "hello")
    assert penalized != greedy[0]["token_ids"]
    assert_one_line_error(metrale(*base[:-1], "--min-p", "2", "hello"), "--min-p must be in [0, 1]")
    assert_one_line_error(metrale(*base[:-1], "--n", "0", "hello"), "--n must be at least 1")


def test_a_chat_template_file_replaces_the_models(tiny, tmp_path):
    import tokenizers

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}"
                        "=>{% endif %}", encoding="utf-8")
    base = ["-m", str(tiny), "-n", "3", "--json", "--chat-template", str(template)]
    (result,) = json.loads(metrale("generate", *base, "hello").stdout)["results"]
    want = tokenizers.Tokenizer.from_file(str(tiny / "tokenizer.json")).encode("<<hello>>=>", add_special_tokens=False)
    assert result["prompt_tokens"] == len(want.ids)
    (turn,) = _turns(metrale("chat", *base, stdin="hello\n"))
    assert (turn["text"], turn["prompt_tokens"]) == (result["text"], result["prompt_tokens"])
    assert_one_line_error(metrale("generate", "-m", str(tiny), "--chat-template", str(tmp_path / "none"), "hi"),
                          "chat template file not found")
    assert_one_line_error(metrale("generate", "-m", str(tiny), "--no-chat-template", "--chat-template", str(template),
                                  "hi"), "contradict")


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("template, failure", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ('{{ "x" * 5000000 }}', "OverflowError: the result of * would hold 5000000 characters, items or digits"),
])
def test_a_chat_template_file_that_fails_while_rendering_is_one_error_line(tiny, tmp_path, command, template,
                                                                            failure):
    """generate renders before the weights load; chat at the turn, which fails as a turn does."""
    path = tmp_path / "t.jinja"
    path.write_text(template, encoding="utf-8")
    args = [command, "-m", str(tiny), "-n", "2", "--chat-template", str(path)]
    result = metrale(*args, "hi") if command == "generate" else metrale(*args, stdin="hi\n")
    assert_one_line_error(result, f"error: the chat template failed: {failure}",
                          "hint: fix the chat template (--chat-template), or pass another with --chat-template FILE")


def test_chat_template_kwargs_reach_the_template(tiny, tmp_path):
    template = tmp_path / "thinking.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if enable_thinking is "
                        "defined and enable_thinking is false %}[no thinking]{% endif %}=>", encoding="utf-8")
    base = ["-m", str(tiny), "-n", "2", "--json", "--chat-template", str(template)]
    tokens = {}
    for name, extra in (("plain", []), ("off", ["--chat-template-kwargs", '{"enable_thinking": false}'])):
        result = metrale("generate", *base, *extra, "hello")
        tokens[name] = json.loads(result.stdout)["results"][0]["prompt_tokens"]
        (turn,) = _turns(metrale("chat", *base, *extra, stdin="hello\n"))
        assert turn["prompt_tokens"] == tokens[name]
    assert tokens["off"] > tokens["plain"]
    unread = metrale("generate", *base, "--chat-template-kwargs", '{"reasoning_effort": "low"}', "hello")
    assert "the chat template reads no reasoning_effort: --chat-template-kwargs changes nothing there" in unread.stderr
    for bad, needle in (('{"enable_thinking": false', "is not JSON"), ("[1]", "is not a JSON object"),
                        ("[" * 5000 + "]" * 5000, "is not JSON (nested too deeply)"),
                        ('{"messages": []}', "may not set messages")):
        assert_one_line_error(metrale("generate", "-m", str(tiny), "--chat-template", str(template),
                                      "--chat-template-kwargs", bad, "hi"), needle)
    assert_one_line_error(metrale("generate", "-m", str(tiny), "--no-chat-template", "--chat-template-kwargs", "{}",
                                  "hi"), "contradict")


def test_a_revision_of_a_hub_id_from_the_hf_cache(tiny, tmp_path):
    """--revision (and -m owner/name@revision): a branch in the HF cache, offline; a revision the
    cache lacks is one line, and so is --revision beside a local folder."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-qwen3"
    shutil.copytree(tiny, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**ENV, "HF_HUB_CACHE": str(tmp_path / "hub")}
    args = ["generate", "--no-chat-template", "-n", "5", "--ignore-eos", "--json", "Hello world"]

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "metrale_cli", *args, *extra], capture_output=True, text=True,
                              env=env, timeout=300)

    want = json.loads(metrale(*args, "-m", str(tiny)).stdout)["results"][0]["token_ids"]
    for extra in (["-m", "someone/tiny-qwen3", "--revision", "main"], ["-m", "someone/tiny-qwen3@main"]):
        got = run(*extra)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["results"][0]["token_ids"] == want
    missing = _json_error(run("-m", "someone/tiny-qwen3", "--revision", "v9"))
    assert "cannot load 'someone/tiny-qwen3@v9'" in missing["error"]
    assert_one_line_error(metrale("generate", "-m", str(tiny), "--revision", "main", "hi"),
                          "--revision applies to a hub id")


def test_generate_logprobs_in_json(tiny):
    base = ["generate", "-m", str(tiny), "--no-chat-template", "--ignore-eos", "-n", "4", "--json", "hello"]
    (result,) = json.loads(metrale(*base, "--logprobs", "2").stdout)["results"]
    assert len(result["logprobs"]) == result["completion_tokens"] == 4
    for token, lp in zip(result["token_ids"], result["logprobs"]):
        assert len(lp["top"]) == 2 and lp["top"][0] == [token, lp["logprob"]] and lp["logprob"] <= 0
    assert "logprobs" not in json.loads(metrale(*base).stdout)["results"][0]
    assert_one_line_error(metrale(*base[:-2], "--logprobs", "21", "hello"), "--logprobs must be in [0, 20]")


@pytest.mark.parametrize("args", [
    ["generate", "--prefill-chunk", "0", "hi"], ["generate", "--max-seq-len", "1", "hi"],
    ["generate", "--gpu-memory-utilization", "2", "hi"], ["generate", "--fp8-kv-calibration-tokens", "-1", "hi"],
    ["generate", "-n", "0", "hi"], ["generate", "-t", "-1", "hi"], ["generate", "--top-p", "0", "hi"],
    ["generate", "--top-k", "-2", "hi"], ["generate", "--repetition-penalty", "0", "hi"],
    ["generate", "--n", "0", "hi"], ["generate", "-f", "/no/such/prompt.txt"], ["bench", "-r", "0"],
    ["bench", "--batch", "1,0"], ["generate", "--revision", "main", "hi"], ["generate", "--dtype", "int4", "hi"],
    ["generate", "-n", "abc", "hi"], ["generate", "--stop", "", "hi"], ["generate", "--logprobs", "3", "hi"],
])
def test_every_bad_option_is_one_error_line_with_a_hint(args):
    result = metrale(*args)
    assert_one_line_error(result)
    assert len([line for line in result.stderr.splitlines() if line.startswith("hint: ")]) == 1, result.stderr


@pytest.mark.parametrize("args, line", [
    (["-t", "nan"], "error: --temperature must be a finite number >= 0, got nan"),
    (["-t", "inf"], "error: --temperature must be a finite number >= 0, got inf"),
    (["--repetition-penalty", "inf"], "error: --repetition-penalty must be a finite number > 0, got inf"),
])
def test_a_sampling_value_that_is_not_a_finite_number_is_refused(args, line):
    result = metrale("generate", *args, "hi")
    assert_one_line_error(result, line)


def test_the_critical_path_counts_an_overlap_once():
    """bench --profile's critical path: a programmatic launch that starts while the kernel before it
    runs is charged only past that kernel's end, a kernel inside another's span adds nothing, the
    gaps are idle, and the shares and the idle time add up to the range."""
    from metrale_cli.commands.bench import critical_path, critical_path_table

    kernels = [("gemm", 0.0, 10.0), ("norm", 8.0, 12.0), ("tiny", 9.0, 9.5), ("gemm", 15.0, 25.0), ("norm", 26.0, 27.0)]
    shares, idle = critical_path(list(reversed(kernels)))
    assert shares == {"gemm": (2, 20.0), "norm": (2, 3.0), "tiny": (1, 0.0)} and idle == 4.0
    assert sum(t for _, t in shares.values()) + idle == 27.0
    table = critical_path_table(kernels, steps=2, rows=2).splitlines()
    assert table[0].startswith("critical path of a decode step (13.5 µs;")
    assert table[2].split() == ["10.0", "74.1%", "1.0", "gemm"] and table[3].split() == ["1.5", "11.1%", "1.0", "norm"]
    assert table[4].split()[:3] == ["2.0", "14.8%", "0.0"] and table[4].endswith("(no kernel running)")
    assert critical_path_table([], 2, 2) == "critical path of a decode step: no device work recorded"


def test_a_preset_past_the_devices_memory_is_refused_before_a_weight_is_drawn(monkeypatch):
    """bench --preset checks the preset's weight bytes against what the device can hold first: on
    the host an allocation past it is not an exception but the kernel's out-of-memory kill."""
    from metrale_cli.commands import bench
    from metrale_cli.commands.bench_presets import PRESETS
    from metrale_cli.engine import room
    from metrale_cli.models import model_config

    need = room.weight_bytes(model_config(PRESETS["qwen3-0.6b"]), torch.bfloat16)
    assert 1.1e9 < need < 1.3e9  # the 0.6B's 0.60 B parameters in bf16 (the bench's "weights 1.19 GB")
    drawn = []
    monkeypatch.setattr(bench, "random_weights", lambda *a, **k: drawn.append(1) or {})
    monkeypatch.setattr(room, "free_bytes", lambda device: need - 1)
    with pytest.raises(MetraleError) as info:
        bench.bench_source(bench.BenchOptions(preset="qwen3-0.6b"), torch.device("cpu"))
    assert info.value.message == f"--preset qwen3-0.6b's weights take {need / 1e9:.1f} GB; the host has " \
                                 f"{(need - 1) / 1e9:.1f} GB free, of which 0.5 GB is kept for activations"
    assert not drawn
    monkeypatch.setattr(room, "free_bytes", lambda device: need + room.HOST_RESERVE - 1)
    with pytest.raises(MetraleError):
        bench.bench_source(bench.BenchOptions(preset="qwen3-0.6b"), torch.device("cpu"))
    monkeypatch.setattr(room, "free_bytes", lambda device: need + room.HOST_RESERVE)
    bench.bench_source(bench.BenchOptions(preset="qwen3-0.6b"), torch.device("cpu"))
    assert drawn


def test_a_checkpoint_past_the_devices_memory_is_refused_before_it_is_read(tiny, monkeypatch):
    """generate's runner checks the checkpoint's weight bytes (its config's tensors in --dtype)
    against the device's room before reading a tensor; weights already in memory (a bench preset's)
    are not counted again."""
    from metrale_cli.checkpoint import read_config
    from metrale_cli.engine import room, runner
    from metrale_cli.engine.source import ModelSource
    from metrale_cli.models import model_config

    checkpoint = ModelSource.checkpoint(str(tiny))
    source = ModelSource(checkpoint.config, checkpoint.tokenizer, lambda *a, **k: pytest.fail("a tensor was read"))
    need = room.weight_bytes(model_config(read_config(str(tiny))), torch.float32)
    monkeypatch.setattr(room, "free_bytes", lambda device: need - 1)
    with pytest.raises(MetraleError) as info:
        runner.open_runner(runner.RunnerOptions(backend="torch", dtype="fp32"), source)
    assert info.value.message.startswith(f"the model's weights take {need / 1e9:.1f} GB and its KV pool ")
    resident = ModelSource.loaded(source.config, {"x": torch.zeros(1)})
    assert resident.resident and not source.resident


def test_on_the_host_the_kv_pool_a_run_needs_is_counted_beside_its_weights(tiny, monkeypatch):
    """On the CPU the pool is what the run needs (its context times its sequences), known before a
    weight is read: weights that fit with no room for it are refused, naming both and the shorter
    context that would fit."""
    from metrale_cli.checkpoint import read_config
    from metrale_cli.engine import room, runner
    from metrale_cli.engine.source import ModelSource
    from metrale_cli.kv.paged import blocks_for
    from metrale_cli.models import kv_layout, model_config

    checkpoint = ModelSource.checkpoint(str(tiny))
    cfg = model_config(read_config(str(tiny)))
    need, per_block = room.weight_bytes(cfg, torch.float32), kv_layout(cfg).bytes_per_block()
    opts = runner.RunnerOptions(backend="torch", dtype="fp32", max_seq_len=256, max_num_seqs=2)
    pool = per_block * blocks_for(256) * 2
    read = []
    source = ModelSource(checkpoint.config, checkpoint.tokenizer, lambda *a, **k: read.append(1) or pytest.fail("read"))
    monkeypatch.setattr(room, "free_bytes", lambda device: need + pool + room.HOST_RESERVE - 1)
    with pytest.raises(MetraleError) as info:
        runner.open_runner(opts, source)
    assert f"and its KV pool {pool / 1e9:.1f} GB" in info.value.message and "--max-seq-len" in info.value.hint
    assert not read
    monkeypatch.setattr(room, "free_bytes", lambda device: need + pool + room.HOST_RESERVE)
    with pytest.raises(pytest.fail.Exception):
        runner.open_runner(opts, source)  # past the check, the first read
    assert read


def test_a_checkpoints_tensors_are_freed_as_the_build_fuses_them(tiny, monkeypatch):
    """The build holds the only reference to a loaded checkpoint's tensors: the q/k/v and gate/up
    parts it has fused are gone before it fuses the next layer's, so a build's peak is the weights
    and one layer's fused copy, not the weights twice over (on a GPU, beside a pool sized before)."""
    import gc
    import weakref

    from metrale_cli.engine import runner
    from metrale_cli.engine.source import ModelSource
    from metrale_cli.models import decoder

    fused, alive = decoder.fused_rows, []

    def watched(parts):
        gc.collect()
        alive.append(sum(ref() is not None for ref in watched.refs))
        out = fused(parts)
        watched.refs += [weakref.ref(p) for p in parts]
        return out

    watched.refs = []
    monkeypatch.setattr(decoder, "fused_rows", watched)
    runner.open_runner(runner.RunnerOptions(backend="torch", dtype="fp32"), ModelSource.checkpoint(str(tiny)))
    assert len(alive) >= 4 and not any(alive)


def test_on_the_host_weights_already_in_memory_leave_room_for_the_pool_or_are_refused(monkeypatch):
    """A bench's weights are in memory before its runner opens: on the CPU the pool the run needs
    must fit beside them (with the activations' reserve), or the run is one error line, not the
    kernel's out-of-memory kill mid-build."""
    from metrale_cli.commands.bench_presets import PRESETS, random_weights
    from metrale_cli.engine import room, runner
    from metrale_cli.engine.source import ModelSource
    from metrale_cli.kv.paged import blocks_for
    from metrale_cli.models import kv_layout, model_config

    raw = PRESETS["smollm2"] | {"num_hidden_layers": 2}
    source = ModelSource.loaded(raw, random_weights(raw, torch.device("cpu"), torch.float32))
    opts = runner.RunnerOptions(backend="torch", dtype="fp32", max_seq_len=512, max_num_seqs=3)
    pool = kv_layout(model_config(raw)).bytes_per_block() * blocks_for(512) * 3
    monkeypatch.setattr(room, "free_bytes", lambda device: pool + room.HOST_RESERVE - 1)
    with pytest.raises(MetraleError) as info:
        runner.open_runner(opts, source)
    assert info.value.message.startswith(f"the KV pool takes {pool / 1e9:.1f} GB beside the weights in memory")
    assert "--max-seq-len" in info.value.hint
    monkeypatch.setattr(room, "free_bytes", lambda device: pool + room.HOST_RESERVE)
    assert runner.open_runner(opts, source).model.kv_cache.num_blocks == blocks_for(512) * 3


@pytest.mark.parametrize("error, line", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 "
                            "GiB of which 1.06 GiB is free."), "error: out of GPU memory: Tried to allocate 2.00 GiB"),
    (MemoryError(), "error: out of host memory"),
])
def test_running_out_of_memory_is_one_error_line(capsys, error, line):
    """An allocation that fails anywhere under a command (a checkpoint past the GPU's memory, a
    pool that cannot be made) is one error line with a hint and exit code 1; other runtime errors
    are not taken for it."""
    import typer

    from metrale_cli.cli import _run
    from metrale_cli.output import Output

    def fail():
        raise error

    with pytest.raises(typer.Exit) as info:
        _run(Output(), False, fail)
    assert info.value.exit_code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == line and err.count("error:") == 1 and "hint:" in err
    with pytest.raises(RuntimeError, match="not memory"):
        _run(Output(), False, lambda: (_ for _ in ()).throw(RuntimeError("not memory")))
