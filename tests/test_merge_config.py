"""`moeify merge --config`: a mergekit-moe YAML read as mergekit reads it. Router rows by gate mode equal mergekit's
formulas computed independently here with transformers (hidden states of the whole model, output_hidden_states);
the keys honoured (experts_per_token, dtype, architecture, residual_scale); every other key refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_dense, load, max_logit_diff
from safetensors.torch import load_file
from typer.testing import CliRunner

import moeify
from moeify.cli.app import app
from moeify.errors import MoeifyError
from moeify.merging.spec import output_format, read_merge_spec

PROMPTS = [(["The history of the city", "In the year 1820 the king"], ["def main():"]),
           (["x = [i * i for i in range(10)]", "import torch\n"], []),
           (["THE QUICK BROWN FOX 42", "SHOUTING LOUDLY 7"], ["the quiet fox"])]


def yaml_config(path: Path, base: Path, sources: list[Path], mode: str = "random", prompts=None, **keys) -> Path:
    lines = [f"base_model: {base}", f"gate_mode: {mode}"] + [f"{k}: {v}" for k, v in keys.items()] + ["experts:"]
    for i, s in enumerate(sources):
        lines.append(f"  - source_model: {s}")
        if prompts:
            pos, neg = prompts[i]
            lines += ["    positive_prompts:"] + [f"      - {json.dumps(p)}" for p in pos]
            if neg:
                lines += ["    negative_prompts:"] + [f"      - {json.dumps(p)}" for p in neg]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def three(tmp_path_factory, tokenizer_dir):
    """A base and two fine-tunes of it (other seeds: the same shapes and tokenizer)."""
    root = tmp_path_factory.mktemp("sources")
    return [build_dense(root / n, tokenizer_dir, seed=s) for n, s in (("base", 0), ("ft1", 1), ("ft2", 2))]


def routers(out: Path) -> list[torch.Tensor]:
    weights = {}
    for f in out.glob("*.safetensors"):
        weights.update(load_file(str(f)))
    names = sorted((n for n in weights if n.endswith("block_sparse_moe.gate.weight") or n.endswith("mlp.gate.weight")),
                   key=lambda n: int(n.split(".")[2]))
    return [weights[n].float() for n in names]


def mergekit_rows(base: Path, mode: str) -> torch.Tensor:
    """mergekit.moe.router.get_gate_params's formulas, written out here: (n_layers, E, d)."""
    from transformers import AutoTokenizer

    model, _ = load(base)
    tok = AutoTokenizer.from_pretrained(base)

    def state(prompts):
        if mode == "cheap_embed":
            ids = [tok(tok.bos_token + p, add_special_tokens=False)["input_ids"] for p in prompts]
            e = model.model.embed_tokens.weight[torch.tensor(sum(ids, []))].sum(0)
            v = e / e.norm().clamp(min=1e-8)
            return v.expand(model.config.num_hidden_layers, -1)
        per = []
        for p in prompts:  # one prompt at a time: mergekit's left padding changes no real token's state
            ids = tok(tok.bos_token + p, add_special_tokens=False, return_tensors="pt")
            with torch.no_grad():
                hs = torch.stack(model(**ids, output_hidden_states=True).hidden_states[:-1])[:, 0]  # (L, seq, d)
            per.append(hs[:, -1] if mode == "hidden" else hs.mean(1))
        return torch.stack(per).mean(0)

    rows = []
    for pos, neg in PROMPTS:
        v = state(pos)
        if neg:
            v = v - state(neg)
        rows.append(v / v.norm(dim=-1, keepdim=True).clamp(min=1e-8))
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("mode", ["hidden", "hidden_avg", "cheap_embed"])
def test_prompted_gate_modes_give_mergekits_router_rows(tmp_path, three, mode):
    base, ft1, ft2 = three
    cfg = yaml_config(tmp_path / "moe.yml", base, [base, ft1, ft2], mode, PROMPTS, dtype="float32")
    report = moeify.merge(None, tmp_path / "moe", config=cfg)
    assert report["router"] == mode and report["experts"] == 3 and report["top_k"] == 2
    want = mergekit_rows(base, mode)
    for i, got in enumerate(routers(tmp_path / "moe")):
        torch.testing.assert_close(got, want[i], atol=2e-5, rtol=1e-4)


def test_router_input_rows_are_the_routers_own_input_centred(tmp_path, three):
    base, ft1, ft2 = three
    cfg = yaml_config(tmp_path / "moe.yml", base, [base, ft1, ft2], "router_input", PROMPTS, dtype="float32")
    moeify.merge(None, tmp_path / "moe", config=cfg)
    model, _ = load(base)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    seen: dict[int, list] = {}
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda _m, _i, out, i=i: seen.setdefault(i, []).append(out[0])) for i, layer in enumerate(model.model.layers)]

    def mean_input(prompts):  # every token of every prompt, the router's input
        for v in seen.values():
            v.clear()
        for p in prompts:
            with torch.no_grad():
                model(**tok(tok.bos_token + p, add_special_tokens=False, return_tensors="pt"))
        return torch.stack([torch.cat(seen[i]).mean(0) for i in range(len(model.model.layers))])

    rows = torch.stack([mean_input(pos) - (mean_input(neg) if neg else 0) for pos, neg in PROMPTS], dim=1)
    rows = rows - rows.mean(1, keepdim=True)
    rows = rows / rows.norm(dim=-1, keepdim=True)
    for h in hooks:
        h.remove()
    for i, got in enumerate(routers(tmp_path / "moe")):
        torch.testing.assert_close(got, rows[i], atol=2e-5, rtol=1e-4)


def test_random_gate_with_the_base_as_every_expert_reproduces_it_and_keys_are_honoured(tmp_path, three):
    base = three[0]
    cfg = yaml_config(tmp_path / "moe.yml", base, [base] * 4, "uniform_random", experts_per_token=3,
                      dtype="bfloat16", architecture="qwen")
    report = moeify.merge(None, tmp_path / "moe", config=cfg)
    assert (report["format"], report["top_k"], report["output_dtype"]) == ("qwen2_moe", 3, "bfloat16")
    rows = routers(tmp_path / "moe")[0]
    assert rows.abs().max() <= 1 / 64 ** 0.5 and rows.std() > 0  # U(±1/√d), d = 64
    cfg = yaml_config(tmp_path / "exact.yml", base, [base] * 4, "random", dtype="float32")
    report = moeify.merge(None, tmp_path / "exact", config=cfg)
    assert report["format"] == "mixtral" and report["check"]["kl_to_source"] < 1e-6
    assert max_logit_diff(base, tmp_path / "exact") <= 1e-4


def test_residual_scale_multiplies_an_experts_down_projection(tmp_path, three):
    base, ft1, _ = three
    cfg = tmp_path / "moe.yml"
    cfg.write_text(f"base_model: {base}\ngate_mode: random\ndtype: float32\nexperts:\n  - source_model: {base}\n"
                   f"  - source_model: {ft1}\n    residual_scale: 0.25\n")
    report = moeify.merge(None, tmp_path / "moe", config=cfg)
    assert report["residual_scales"] == [1.0, 0.25]
    assert report["check"]["exact_model"] == "every expert the base's FFN"  # checked without the scales
    got = load_file(str(tmp_path / "moe" / "model.safetensors"))
    src = load_file(str(ft1 / "model.safetensors"))
    torch.testing.assert_close(got["model.layers.0.block_sparse_moe.experts.1.w2.weight"],
                               src["model.layers.0.mlp.down_proj.weight"] * 0.25)
    torch.testing.assert_close(got["model.layers.0.block_sparse_moe.experts.1.w1.weight"],
                               src["model.layers.0.mlp.gate_proj.weight"])


def test_architecture_names_match_by_prefix_as_mergekit_matches_them(tmp_path):
    cfg = tmp_path / "a.yml"
    for value, want in (("Mixtral", ("mixtral",)), ("qwen", ("qwen2_moe", "qwen3_moe")), ("Qwen3", ("qwen3_moe",)),
                        ("qwen moe", ("qwen2_moe",))):
        cfg.write_text(f"base_model: b\narchitecture: {value}\ngate_mode: random\nexperts:\n"
                       "  - source_model: a\n  - source_model: c\n")
        assert read_merge_spec(cfg).formats == want
    assert output_format(("qwen2_moe", "qwen3_moe"), "qwen3", False) == "qwen3_moe"
    assert output_format(("qwen2_moe", "qwen3_moe"), "llama", False) == "qwen2_moe"
    assert output_format((), "llama", False) == "auto"


@pytest.mark.parametrize("text,message", [
    ("base_model: b\nexperts: [{source_model: a}, {source_model: c}]\nmerge_method: ties\n",
     "merge_method is not a mergekit-moe key"),
    ("base_model: b\ngate_mode: random\nexperts: [{source_model: a, noise_scale: 0.1}, {source_model: c}]\n",
     "experts[0].noise_scale is not supported"),
    ("base_model: b\narchitecture: deepseek\ngate_mode: random\nexperts: [{source_model: a}, {source_model: c}]\n",
     "no stock transformers class holds mergekit's DeepSeek"),
    ("base_model: b\nexperts: [{source_model: a, positive_prompts: [x]}, {source_model: c}]\n",
     "experts[1] has no positive_prompts, which gate_mode hidden needs"),
    ("base_model: b\nexperts: [{source_model: a, positive_prompts: [x]}, {source_model: c, positive_prompts: [x]}]\n",
     "every expert has the same prompts"),
    ("base_model: b\ngate_mode: random\nexperts: [{source_model: a}, {source_model: c}]\n"
     "shared_experts: [{source_model: a}, {source_model: c}]\n", "shared_experts must list at most one entry"),
    ("base_model: b\ngate_mode: random\nexperts_per_token: 3\nexperts: [{source_model: a}, {source_model: c}]\n",
     "experts_per_token 3 must be an integer from 1 to the 2 experts"),
    ("base_model: b\ngate_mode: learned\nexperts: [{source_model: a}, {source_model: c}]\n",
     "gate_mode 'learned' is not one of hidden"),
    ("base_model: b\ngate_mode: random\ndtype: int8\nexperts: [{source_model: a}, {source_model: c}]\n",
     "dtype 'int8' is not one of float32"),
    ("base_model: b\ngate_mode: random\nexperts: [{source_model: a+lora}, {source_model: c}]\n",
     "a model+LoRA reference is not supported"),
    ("base_model: [b\n", "not valid YAML at line"),
    ("- just\n- a list\n", "is not a mergekit-moe config"),
])
def test_keys_moeify_does_not_honour_are_refused_in_one_line_naming_them(tmp_path, text, message):
    cfg = tmp_path / "moe.yml"
    cfg.write_text(text)
    with pytest.raises(MoeifyError, match=None) as err:
        read_merge_spec(cfg)
    assert message in str(err.value) and str(cfg) in str(err.value) and "\n" not in str(err.value)


def test_the_cli_reads_a_config_and_refuses_sources_given_twice(tmp_path, three):
    base, ft1, _ = three
    cfg = yaml_config(tmp_path / "moe.yml", base, [base, ft1], "random", dtype="float32")
    runner = CliRunner()
    res = runner.invoke(app, ["merge", str(tmp_path / "moe"), str(base), str(ft1), "--config", str(cfg)])
    assert res.exit_code == 2 and "sources named both on the command line and in --config" in res.output
    assert not (tmp_path / "moe").exists()
    res = runner.invoke(app, ["merge", str(tmp_path / "moe"), "--config", str(cfg), "--top-k", "1"])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and "nats" in res.output
    assert json.loads((tmp_path / "moe" / "report.json").read_text())["top_k"] == 1
    res = runner.invoke(app, ["merge", str(tmp_path / "m2"), str(base), str(ft1), "--gate-mode", "hidden"])
    assert res.exit_code == 2 and "--gate-mode hidden needs each expert's prompts or text" in res.output


def test_a_source_that_does_not_exist_is_named(tmp_path, three):
    cfg = yaml_config(tmp_path / "moe.yml", three[0], [three[0], tmp_path / "nowhere"], "random")
    with pytest.raises(MoeifyError, match="nowhere"):
        moeify.merge(None, tmp_path / "moe", config=cfg)
    assert not (tmp_path / "moe").exists()


def test_identical_sources_merge_and_copy_of_config_unchanged(tmp_path, three):
    base = three[0]
    other = shutil.copytree(base, tmp_path / "copy")
    cfg = yaml_config(tmp_path / "moe.yml", base, [base, other], "hidden", PROMPTS[:2])
    before = cfg.read_bytes()
    report = moeify.merge(None, tmp_path / "moe", config=cfg)
    assert cfg.read_bytes() == before and report["check"]["max_logit_diff"] <= 1e-4


def shared_yaml(path: Path, base: Path, experts: list[Path], shared: Path, mode: str = "random", extra: str = "",
                prompts: bool = False) -> Path:
    lines = [f"base_model: {base}", f"gate_mode: {mode}", "dtype: float32", "experts:"]
    for i, e in enumerate(experts):
        lines.append(f"  - source_model: {e}")
        if prompts:
            lines += ["    positive_prompts:"] + [f"      - {json.dumps(p)}" for p in PROMPTS[i][0]]
    lines += ["shared_experts:", f"  - source_model: {shared}"] + ([f"    {extra}"] if extra else [])
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_shared_expert_of_the_base_beside_copies_of_it_reproduces_the_base(tmp_path, three, monkeypatch):
    """... and its writing reads each layer's FFN once (the base named 5 times: 4 experts and the shared one)."""
    from moeify.formats.checkpoint import CheckpointReader

    reads = []
    real = CheckpointReader.get
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: reads.append(name) or real(self, name))
    base = three[0]
    cfg = shared_yaml(tmp_path / "moe.yml", base, [base] * 4, base)
    report = moeify.merge(None, tmp_path / "moe", config=cfg)
    ffn = [n for n in reads if n.endswith("mlp.down_proj.weight") and n.startswith("model.layers.0.")]
    assert len(ffn) == 2  # once writing, once by the check's dense stack (the output's names are experts.N / shared)
    assert report["format"] == "qwen2_moe" and report["shared_width"] == 96 and report["expert_width"] == 96
    assert report["check"]["exact_model"] == "as written: every expert the base's FFN"  # one stack, one pass
    model, info = load(tmp_path / "moe")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert max_logit_diff(base, tmp_path / "moe") <= 1e-4


def test_the_cli_says_what_each_engine_makes_of_the_output(tmp_path, three):
    """A Qwen MoE merge (top-2 of 2 routed experts beside the shared one) is computed as written by transformers
    and vLLM, not by llama.cpp, whose qwen2moe never renormalises the top-k weights: the command says so before it
    writes; a Mixtral merge of the same sources draws no note."""
    base, ft1, _ = three
    runner = CliRunner()
    res = runner.invoke(app, ["merge", str(tmp_path / "qwen"), "--config",
                              str(shared_yaml(tmp_path / "qwen.yml", base, [base, ft1], base))])
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("llama.cpp:")]
    assert len(notes) == 1 and "never renormalises the top-k weights" in notes[0], res.output
    assert "serve it with transformers or vLLM" in notes[0]
    res = runner.invoke(app, ["merge", str(tmp_path / "mixtral"), str(base), str(ft1)])
    assert res.exit_code == 0, res.output
    assert not [ln for ln in res.output.splitlines() if ln.startswith(("llama.cpp:", "vllm:"))], res.output


def test_a_shared_expert_from_another_source_is_its_whole_ffn_scaled(tmp_path, three):
    base, ft1, ft2 = three
    cfg = shared_yaml(tmp_path / "moe.yml", base, [base, ft1], ft2, extra="residual_scale: 0.5")
    report = moeify.merge(None, tmp_path / "moe", config=cfg)
    assert report["shared_source"] == str(ft2) and report["shared_scale"] == 0.5
    assert report["check"]["exact_model"] is None  # no setting of this merge computes the base
    got = load_file(str(tmp_path / "moe" / "model.safetensors"))
    src = load_file(str(ft2 / "model.safetensors"))
    torch.testing.assert_close(got["model.layers.1.mlp.shared_expert.down_proj.weight"],
                               src["model.layers.1.mlp.down_proj.weight"] * 0.5)
    own = load_file(str(ft1 / "model.safetensors"))
    torch.testing.assert_close(got["model.layers.1.mlp.experts.1.down_proj.weight"],
                               own["model.layers.1.mlp.down_proj.weight"] / 2)  # the routed half


def test_a_shared_expert_with_prompts_gets_its_gate_row_from_them(tmp_path, three):
    base, ft1, ft2 = three
    cfg = shared_yaml(tmp_path / "moe.yml", base, [base, ft1], ft2, "hidden",
                      'positive_prompts: ["The history of the world"]', prompts=True)
    report = moeify.merge(None, tmp_path / "moe", config=cfg)
    assert report["shared_gate"] == "prompts"
    gate = load_file(str(tmp_path / "moe" / "model.safetensors"))["model.layers.0.mlp.shared_expert_gate.weight"]
    assert gate.shape == (1, 64) and abs(float(gate.norm()) - 1) < 1e-5


def test_a_shared_expert_in_a_qwen3_or_mixtral_output_is_refused(tmp_path, three, tokenizer_dir):
    q3 = build_dense(tmp_path / "q3", tokenizer_dir, family="qwen3")
    cfg = shared_yaml(tmp_path / "q3.yml", q3, [q3, q3], q3)
    with pytest.raises(MoeifyError, match="Qwen3-MoE, the one stock class with its q/k norms, has no shared expert"):
        moeify.merge(None, tmp_path / "out", config=cfg)
    cfg = shared_yaml(tmp_path / "mx.yml", three[0], [three[0]] * 2, three[0])
    with pytest.raises(MoeifyError, match="--format mixtral has no shared expert"):
        moeify.merge(None, tmp_path / "out", config=cfg, format="mixtral")
    assert not (tmp_path / "out").exists()


# mergekit-moe's documentation (docs/moe.md, "Example Configurations"), verbatim
DOC_UPCYCLE = """\
base_model: BEE-spoke-data/smol_llama-220M-GQA
gate_mode: random
dtype: bfloat16
experts:
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
  - source_model: BEE-spoke-data/smol_llama-220M-GQA
# and then train the sucker!
"""
DOC_CLOWN_CAR = """\
base_model: NousResearch/Hermes-2-Pro-Mistral-7B
gate_mode: hidden
dtype: bfloat16
experts:
  - source_model: NousResearch/Hermes-2-Pro-Mistral-7B
    positive_prompts:
      - "<|im_start|>user\\nHello, who are you?<|im_end|>"
      - "<|im_start|>user\\nI need help with"
  - source_model: BioMistral/BioMistral-7B-DARE
    positive_prompts:
      - "As a doctor of medicine,"
  - source_model: PocketDoc/Dans-AdventurousWinds-7b
    positive_prompts:
      - "[Genres: Science Fiction]\\n[Tags: humor, old school, sci fi]"
      - "> get ye flask"
      - "[Mode: Interactive Storyteller]"
  - source_model: VAGOsolutions/SauerkrautLM-7b-HerO
    positive_prompts:
      - "<|im_start|>user\\nWie geht es dir?<|im_end|>"
      - "Das ist ein Satz auf Deutsch."
"""


def test_mergekits_documented_example_configs_run_unchanged(tmp_path, tokenizer_dir, monkeypatch):
    """Both of mergekit-moe's documented examples, their Hub ids served by a Hub cache laid out here (tiny models
    of the same families; the network refused)."""
    import socket

    import huggingface_hub.constants as constants
    from conftest import lay_out_hub

    monkeypatch.setattr(socket.socket, "connect", lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))
    cache = tmp_path / "hub"
    repos = {"BEE-spoke-data/smol_llama-220M-GQA": "llama", "NousResearch/Hermes-2-Pro-Mistral-7B": "mistral",
             "BioMistral/BioMistral-7B-DARE": "mistral", "PocketDoc/Dans-AdventurousWinds-7b": "mistral",
             "VAGOsolutions/SauerkrautLM-7b-HerO": "mistral"}
    for seed, (repo, family) in enumerate(repos.items()):
        model = build_dense(tmp_path / "src" / repo, tokenizer_dir, family=family, seed=seed)
        lay_out_hub(cache, repo, model, {"main": f"{seed:040x}"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name, text, experts in (("upcycle", DOC_UPCYCLE, 8), ("clown-car", DOC_CLOWN_CAR, 4)):
        cfg = tmp_path / f"{name}.yml"
        cfg.write_text(text)
        report = moeify.merge(None, tmp_path / name, config=cfg)
        assert (report["format"], report["experts"], report["top_k"]) == ("mixtral", experts, 2)
        assert report["output_dtype"] == "bfloat16" and report["router"] == ("random" if experts == 8 else "hidden")
        model, info = load(tmp_path / name)
        assert not info["missing_keys"] and not info["unexpected_keys"]
    rows = routers(tmp_path / "clown-car")[1].float()
    assert torch.allclose(rows.norm(dim=-1), torch.ones(4), atol=1e-2)  # unit rows (bfloat16)
