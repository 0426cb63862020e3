"""`moeify eval`: perplexity against a plain HF computation, routing statistics, oracle, errors, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from conftest import build_dense, corpus_text
from moeify.cli.app import app
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.errors import MoeifyError
from moeify.evaluation.perplexity import EvalSettings, evaluate, expert_output_norms, oracle_topk, routing_stats
from moeify.formats.text import SAMPLE, make_windows, read_text

REL = 1e-4
SEQ, MAX_TOKENS = 32, 400


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    """A dense llama, its top-2-of-4 Mixtral carve and a qwen2_moe carve (shared expert, dense layer 1)."""
    root = tmp_path_factory.mktemp("eval")
    dense = build_dense(root / "dense", tokenizer_dir)
    out = {"dense": dense}
    for name, flags in (("mixtral", dict(experts=4, top_k=2)),
                        ("qwen2_moe", dict(experts=4, top_k=2, shared=2, format="qwen2_moe", dense_layers="1"))):
        run_conversion(plan_conversion(dense, build_config(**flags)), root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(corpus_text(6000))
    return path


def reference_perplexity(path, text_path, seq_len, stride, max_tokens):
    """The transformers perplexity guide, verbatim in spirit: full-model forward with labels, -100 on the context."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(AutoTokenizer.from_pretrained(path)(text_path.read_text())["input_ids"][:max_tokens])[None]
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, ids.size(1), stride):
        end = min(begin + seq_len, ids.size(1))
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            logits = model(input_ids).logits.float()
        labels = target_ids[:, 1:]
        n = int((labels != -100).sum())
        if n:
            nll_sum += F.cross_entropy(logits[0, :-1], labels[0], ignore_index=-100, reduction="sum").item()
            n_tokens += n
        prev_end = end
        if end == ids.size(1):
            break
    return math.exp(nll_sum / n_tokens), n_tokens


@pytest.mark.parametrize("stride", [SEQ, 20])
def test_perplexity_equals_plain_hf_forward(models, text_file, stride):
    settings = EvalSettings(seq_len=SEQ, stride=stride, max_tokens=MAX_TOKENS, batch_size=3, device="cpu")
    result = evaluate(list(models.values()), text_file, settings)
    for name, m in zip(models, result.models):
        ppl, n = reference_perplexity(models[name], text_file, SEQ, stride, MAX_TOKENS)
        assert m.scored_tokens == n == MAX_TOKENS - (1 if stride < SEQ else math.ceil(MAX_TOKENS / SEQ))
        assert abs(m.perplexity / ppl - 1) < REL, (name, m.perplexity, ppl)
        assert (m.routing is None) == (name == "dense")
    dense, mixtral, qwen = result.models
    assert dense.ratio == 1.0 and mixtral.ratio == pytest.approx(mixtral.perplexity / dense.perplexity)
    assert [r.layer for r in qwen.routing] == [0, 2]  # mlp_only_layers are dense
    for m in (mixtral, qwen):  # every token routed exactly once, top-2 of 4
        for r in m.routing:
            assert r.tokens == MAX_TOKENS and sum(r.load) == pytest.approx(2.0)
    assert dense.active_params == dense.total_params and mixtral.active_params < mixtral.total_params


def test_windows_score_every_token_but_the_first_once():
    for n, seq, stride in ((100, 32, 32), (100, 32, 12), (33, 32, 32), (7, 32, 5), (64, 32, 1)):
        ws = make_windows(n, seq, stride)
        scored = [p for w in ws for p in range(w.begin + max(w.new_from, 1), w.end)]
        routed = [p for w in ws for p in range(w.begin + w.new_from, w.end)]
        if stride < seq:
            assert scored == list(range(1, n)) and routed == list(range(n))
        assert all(w.length <= seq for w in ws) and ws[-1].end >= n - 1  # a 1-token last window scores nothing


def test_routing_stats_router_forced_to_one_expert():
    t, n = 50, 4
    logits = torch.zeros(t, n)
    logits[:, 2] = 30.0  # every token: expert 2 first, then (ties) the lowest index
    logits[:, 0] = 1.0
    top1 = routing_stats(logits, logits.topk(1).indices)
    assert top1.load == [0.0, 0.0, 1.0, 0.0] and top1.collapsed == 3 and top1.tokens == t
    assert top1.mean_prob[2] == pytest.approx(1.0, abs=1e-9)
    assert top1.aux_loss == pytest.approx(n * 1.0, rel=1e-6)  # N · f_2 · P_2
    assert top1.load_cv == pytest.approx(math.sqrt(3))  # counts (0, 0, T, 0)
    top2 = routing_stats(logits, logits.topk(2).indices)
    assert top2.load == [1.0, 0.0, 1.0, 0.0] and top2.collapsed == 2 and top2.load_cv == pytest.approx(1.0)
    # even load: f = k/N for every expert, aux = k whatever the probabilities
    even = torch.tensor([[0, 1], [2, 3]]).repeat(10, 1)
    r = routing_stats(torch.randn(20, 4), even)
    assert r.load == [0.5] * 4 and r.aux_loss == pytest.approx(2.0) and r.load_cv == 0 and r.collapsed == 0
    # one expert under 1% of tokens: collapsed
    idx = torch.zeros(200, 1, dtype=torch.long)
    idx[0] = 1
    assert routing_stats(torch.randn(200, 2), idx).collapsed == 1


def test_aux_loss_equals_mixtral_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(300, 8, generator=torch.Generator().manual_seed(0)) * 2
    r = routing_stats(logits, torch.softmax(logits, -1).topk(2).indices)
    assert r.aux_loss == pytest.approx(load_balancing_loss_func((logits,), 8, 2).item(), rel=1e-5)


def test_oracle_norms_and_known_topk():
    g = torch.Generator().manual_seed(0)
    e, h, i = 4, 16, 8
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(10, h, generator=g)
    norms = expert_output_norms(x, gate_up, down, F.silu, chunk=3)
    for t in range(10):  # straightforward per-token, per-expert SwiGLU
        for j in range(e):
            y = down[j] @ (F.silu(gate_up[j, :i] @ x[t]) * (gate_up[j, i:] @ x[t]))
            assert norms[t, j] == pytest.approx(y.norm().item(), rel=1e-4)
    down[1] *= 1e3  # experts 1 and 3 dominate every token's output
    down[3] *= 1e4
    assert (oracle_topk(x, gate_up, down, F.silu, 2).sort(-1).values == torch.tensor([1, 3])).all()
    logits = torch.randn(10, e, generator=g)
    routed = torch.tensor([[3, 1]] * 5 + [[0, 1]] * 5)
    oracle = oracle_topk(x, gate_up, down, F.silu, 2)
    assert routing_stats(logits, routed, oracle_indices=oracle).oracle_agreement == 0.5


def test_hooks_see_what_the_router_returns_in_a_plain_forward(models, text_file):
    """Routing statistics via hooks == statistics of output_router_logits from a plain full forward per window."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = evaluate([models["mixtral"]], text_file, EvalSettings(seq_len=SEQ, max_tokens=MAX_TOKENS, batch_size=4,
                                                                   device="cpu", oracle=False))
    model = AutoModelForCausalLM.from_pretrained(models["mixtral"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(models["mixtral"])
    ids = torch.tensor(tokenizer(text_file.read_text())["input_ids"][:MAX_TOKENS])
    per_layer = [[] for _ in range(3)]
    with torch.no_grad():
        for w in make_windows(len(ids), SEQ, SEQ):
            out = model(ids[None, w.begin:w.end], output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                per_layer[layer].append(logits)
    for r, chunks in zip(result.models[0].routing, per_layer):
        logits = torch.cat(chunks)
        ref = routing_stats(logits, torch.softmax(logits.float(), -1).topk(2).indices)
        assert r.load == pytest.approx(ref.load, abs=1e-9) and r.aux_loss == pytest.approx(ref.aux_loss, rel=1e-6)
        assert r.oracle_agreement is None


def test_oracle_not_applicable_when_every_expert_is_active(tmp_path, tokenizer_dir, text_file):
    dense = build_dense(tmp_path / "dense", tokenizer_dir)
    run_conversion(plan_conversion(dense, build_config(experts=2, top_k=2)), tmp_path / "moe")
    r = evaluate([tmp_path / "moe"], text_file, EvalSettings(seq_len=SEQ, max_tokens=100, device="cpu"))
    assert all(layer.oracle_agreement is None for layer in r.models[0].routing)


def test_data_formats_and_bundled_sample(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "first doc"}\n\n{"text": "second doc", "id": 2}\n')
    assert read_text(tmp_path / "d.jsonl")[0] == "first doc\n\nsecond doc"
    text, label = read_text(None)
    assert SAMPLE.is_file() and 100_000 < len(text) < 250_000 and "bundled" in label
    assert (SAMPLE.parent / "README.md").read_text().count("CC BY-SA 3.0")
    assert read_text("sample")[0] == text


# ------------------------------------------------------------------------------------------- errors


def other_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Completely different text, zebra zebra zebra quartz. " * 40],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = tmp_path / "other_tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


def run_cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def error_line(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), output
    return lines[0]


def test_mismatched_tokenizers(tmp_path, models, text_file):
    other = build_dense(tmp_path / "other", other_tokenizer(tmp_path))
    with pytest.raises(MoeifyError, match="different tokenizer"):
        evaluate([models["dense"], other], text_file, EvalSettings(seq_len=SEQ))
    code, out = run_cli("eval", models["dense"], other, "--data", text_file, "--seq-len", SEQ)
    assert code == 2 and str(other) in error_line(out) and "tokenizer" in out


def test_empty_data(tmp_path, models):
    for name, content in (("empty.txt", " \n\n "), ("empty.jsonl", '{"text": ""}\n\n')):
        (tmp_path / name).write_text(content)
        with pytest.raises(MoeifyError, match="empty"):
            evaluate([models["dense"]], tmp_path / name)
        code, out = run_cli("eval", models["dense"], "--data", tmp_path / name)
        line = error_line(out)
        assert code == 2 and "--data" in line and name in line
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    code, out = run_cli("eval", models["dense"], "--data", tmp_path / "bad.jsonl")
    assert code == 2 and "bad.jsonl:1" in error_line(out) and "'text'" in out
    code, out = run_cli("eval", models["dense"], "--data", tmp_path / "missing.txt")
    assert code == 2 and "missing.txt" in error_line(out)


def test_seq_len_and_stride_checks(models, text_file):
    with pytest.raises(MoeifyError, match="--seq-len 256 is larger than the context"):
        evaluate([models["dense"], models["mixtral"]], text_file, EvalSettings(seq_len=256))
    code, out = run_cli("eval", models["dense"], "--seq-len", 4096)
    line = error_line(out)
    assert code == 2 and "--seq-len 4096" in line and "128" in line
    code, out = run_cli("eval", models["dense"], "--seq-len", 16, "--stride", 32)
    assert code == 2 and "--stride 32" in error_line(out)
    code, out = run_cli("eval", models["dense"], "--device", "tpu")
    assert code == 2 and "--device tpu" in error_line(out)
    code, out = run_cli("eval", models["dense"].parent / "nope")
    assert code == 2 and "config.json" in error_line(out)


def test_plot_without_matplotlib_is_a_clear_error(models, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, out = run_cli("eval", models["dense"], models["mixtral"], "--plot", tmp_path / "p.png")
    line = error_line(out)
    assert code == 2 and "--plot" in line and "moeify[plot]" in line and not (tmp_path / "p.png").exists()


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_eval_table_json_and_plot(models, text_file, tmp_path):
    args = ["eval", models["dense"], models["mixtral"], "--data", text_file, "--seq-len", SEQ, "--stride", 16,
            "--max-tokens", 200, "--json", tmp_path / "eval.json"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", tmp_path / "load.png"]
    except ImportError:
        pass
    code, out = run_cli(*args)
    assert code == 0, out
    assert "PPL" in out and "ref" in out and "oracle" in out
    data = json.loads((tmp_path / "eval.json").read_text())
    assert data["settings"]["stride"] == 16 and data["data"]["tokens"] == 200
    dense, moe = data["models"]
    assert dense["routing"] is None and len(moe["routing"]) == 3
    assert set(moe["routing"][0]) >= {"load", "mean_prob", "aux_loss", "load_cv", "collapsed", "oracle_agreement"}
    if "--plot" in args:
        assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"


def test_convert_with_eval(tmp_path, tokenizer_dir, text_file):
    src = build_dense(tmp_path / "dense", tokenizer_dir)
    code, out = run_cli("convert", src, tmp_path / "moe", "--experts", 4, "--top-k", 2, "--weight-only",
                        "--eval", text_file)
    assert code == 0, out
    assert "PPL" in out and "mixtral" in out and "routing of" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_close_to_cpu_fp32(models, text_file):
    settings = dict(seq_len=SEQ, max_tokens=MAX_TOKENS)
    gpu = evaluate([models["dense"], models["mixtral"]], text_file, EvalSettings(device="cuda", **settings))
    cpu = evaluate([models["dense"], models["mixtral"]], text_file, EvalSettings(device="cpu", **settings))
    assert gpu.settings["dtype"] == "bfloat16" and gpu.models[0].device.startswith("cuda")
    for g, c in zip(gpu.models, cpu.models):
        assert g.perplexity == pytest.approx(c.perplexity, rel=0.03)
    assert gpu.models[1].routing and gpu.models[1].routing[0].tokens == MAX_TOKENS


BUNDLED = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"


@pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason="bundled model not present")
def test_bundled_model_perplexity_on_bundled_sample():
    """Expected number for the bundled tiny Llama (first 2048 tokens of the bundled sample, 256-token windows).

    Cross-check: on the first 100,000 tokens of valid.txt this code gives 131.16, the training script's 131.12
    (it drops the final partial window)."""
    r = evaluate([BUNDLED], None, EvalSettings(seq_len=256, max_tokens=2048, device="cpu"))
    assert r.models[0].scored_tokens == 2040
    assert r.models[0].perplexity == pytest.approx(185.7586, rel=1e-3)


# ------------------------------------------------------------------------------------ 80-column output


def render(result, width: int = 80) -> list[str]:
    import io

    from rich.console import Console

    from moeify.cli.report import print_eval

    buf = io.StringIO()
    print_eval(Console(file=buf, width=width, color_system=None), result)
    return buf.getvalue().splitlines()


def test_eval_table_rows_fit_80_columns(models, text_file):
    """A plain terminal or CI log (80 columns): every table row on one line, short labels, full paths in a legend."""
    result = evaluate(list(models.values()), text_file, EvalSettings(seq_len=SEQ, max_tokens=200, device="cpu"))
    lines = render(result)
    legend = [ln for ln in lines if ln.startswith("  ") and " (" in ln]
    assert [ln.split()[:2] for ln in legend] == [["A", str(models["dense"])], ["B", str(models["mixtral"])],
                                                ["C", str(models["qwen2_moe"])]]
    assert "(llama, reference)" in legend[0]
    assert all(len(ln) <= 80 for ln in lines if ln not in legend), "\n".join(ln for ln in lines if len(ln) > 80)
    dense, mixtral, qwen = result.models
    rows = {ln.split()[0]: ln.split() for ln in lines if ln[:2] in ("A ", "B ", "C ")}
    assert rows["A"][1:3] == [f"{dense.perplexity:.3f}", "ref"]
    assert rows["B"][1:3] == [f"{mixtral.perplexity:.3f}", f"{mixtral.ratio:.4f}"] and "E4 k2 ×3" in " ".join(rows["B"])
    assert rows["C"][1:3] == [f"{qwen.perplexity:.3f}", f"{qwen.ratio:.4f}"] and "E4 k2 ×2" in " ".join(rows["C"])
    titles = [ln.strip() for ln in lines if ln.startswith("routing of")]
    assert titles == ["routing of B: 4 experts, top-2", "routing of C: 4 experts, top-2"]
    for r in mixtral.routing:  # one per-layer row each, on one line
        assert sum(ln.startswith(f"{r.layer} ") and f"{r.load_cv:.2f}" in ln for ln in lines) >= 1


def test_routing_table_with_many_experts_fits_80_columns():
    """64 experts do not fit one bar character each next to the numbers: experts are grouped per character."""
    from moeify.evaluation.perplexity import EvalResult, LayerRouting, ModelResult

    load = [2 / 64 * (1 + 0.5 * (e % 2)) for e in range(64)]
    routing = [LayerRouting(i, 64, 2, 1000, load, [1 / 64] * 64, 2.0, 0.33, 0, 0.5) for i in range(3)]
    path = "out/a/rather/long/path/to/a/converted/model-with-64-experts-and-a-long-name"
    result = EvalResult({"source": "text.txt", "tokens": 1000, "windows": 4}, {"seq_len": 256, "stride": 256,
                        "device": "cpu", "dtype": "float32"},
                        [ModelResult("dense", "llama", "float32", "cpu", 12.3456, 2.5, 1.0, 999, 10**9, 10**9, 2.5e6, 1),
                         ModelResult(path, "mixtral", "float32", "cpu", 13.5, 2.6, 1.0935, 999, 10**9, 4 * 10**8, 1234.5,
                                     1, 64, 2, routing)])
    lines = render(result)
    assert all(len(ln) <= 80 for ln in lines if not ln.startswith("  ")), "\n".join(lines)
    head = next(ln for ln in lines if ln.startswith("layer"))
    assert "experts/char" in head
    assert any(ln.split()[:3] == ["B", "13.500", "1.0935"] for ln in lines)
    assert any(ln.split()[:3] == ["A", "12.346", "ref"] and "2.50M" in ln for ln in lines)  # tok/s ≥ 100k: 2.50M


def test_json_dash_prints_only_json_on_stdout(models, text_file, tmp_path):
    """--json -: stdout is the JSON alone (pipe it to jq), the table goes to stderr; --json PATH writes a file."""
    code, _ = run_cli("eval", models["dense"], "--data", text_file, "--seq-len", SEQ, "--max-tokens", 100,
                      "--json", tmp_path / "e.json")
    assert code == 0 and json.loads((tmp_path / "e.json").read_text())["data"]["tokens"] == 100
    result = CliRunner().invoke(app, [str(a) for a in ("eval", models["dense"], "--data", text_file, "--seq-len", SEQ,
                                                       "--max-tokens", 100, "--json", "-")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["tokens"] == 100
    assert "PPL" in result.stderr and "PPL" not in result.stdout


def test_kl_to_the_reference_equals_a_direct_computation(models, text_file):
    """eval's KL column: the mean over scored tokens of KL(reference || model), computed from the reference's kept
    final hidden states, equals KL of the two models' own logits on the same windows; it is 0 for the reference
    itself and positive for a carved model."""
    settings = EvalSettings(seq_len=SEQ, max_tokens=MAX_TOKENS, batch_size=3, device="cpu")
    dense_path, moe_path = models["dense"], models["mixtral"]
    result = evaluate([dense_path, moe_path, dense_path], text_file, settings)
    dense, moe, again = result.models
    assert dense.kl is None and again.kl == pytest.approx(0.0, abs=1e-6) and moe.kl > 1e-4
    from conftest import load
    from moeify.formats.text import load_tokenizer, make_windows, read_text, tokenize

    ids = tokenize(load_tokenizer(dense_path), read_text(str(text_file))[0], MAX_TOKENS)
    a, b = load(dense_path)[0], load(moe_path)[0]
    total, n = 0.0, 0
    with torch.no_grad():
        for w in make_windows(len(ids), SEQ, SEQ):
            x = ids[w.begin:w.end].unsqueeze(0)
            t, s = (F.log_softmax(m(x).logits[0, :-1].float(), -1) for m in (a, b))
            total += (t.exp() * (t - s)).sum().item()
            n += t.shape[0]
    assert moe.kl == pytest.approx(total / n, rel=1e-3)
    off = evaluate([dense_path, moe_path], text_file, EvalSettings(seq_len=SEQ, max_tokens=MAX_TOKENS, kl=False))
    assert off.models[1].kl is None


@pytest.mark.parametrize("content,needle", [
    (b'{"text": "a"}\n{"txt": "b"}\n', ":2 is not a JSON object with a string 'text' field"),
    (b'{"text": "a"}\nnot json\n', ":2 is not valid JSON"),
    (b"\xff\xfe text", "cannot be read: not UTF-8 text"),
])
def test_evaluation_and_calibration_text_is_read_by_one_reader(tmp_path, content, needle):
    """--data and --calib files go through formats.text.read_documents: the same refusals, each naming its flag."""
    from moeify.errors import MoeifyError
    from moeify.formats.text import read_text, read_texts

    f = tmp_path / ("data.jsonl" if content.startswith(b"{") else "data.txt")
    f.write_bytes(content)
    with pytest.raises(MoeifyError, match=f"^--data {f}"):
        read_text(f)
    with pytest.raises(MoeifyError, match=f"^calibration file {f}") as raised:
        read_texts([f])
    assert needle in str(raised.value)
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert read_text(good)[0] == read_texts([good]) == "one\n\ntwo"


def test_bf16_on_a_cpu_without_it_warns(monkeypatch):
    """--dtype bfloat16 on a CPU without AVX512-BF16 / AMX (emulated: ~100x slower than float32 on an AVX2 EPYC)
    says so and what to use; a CPU with it, float32 and auto say nothing."""
    import warnings

    from moeify.evaluation import perplexity

    monkeypatch.setattr(perplexity, "bf16_fast", lambda device: False)
    with pytest.warns(UserWarning, match=r"--dtype bfloat16 on a CPU without AVX512-BF16.*use --dtype float32"):
        assert perplexity.resolve_device("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert perplexity.resolve_device("cpu", "float32")[1] is torch.float32
        assert perplexity.resolve_device("cpu", "auto")[1] is torch.float32
        monkeypatch.setattr(perplexity, "bf16_fast", lambda device: True)
        assert perplexity.resolve_device("cpu", "bfloat16")[1] is torch.bfloat16
