"""moeify.evaluation.loglik (the scoring under `eval --tasks`): each context run once with its continuations beside it gives
lm-eval's own numbers (HFLM, a row per request) for a dense model and Mixtral / Qwen2-MoE carves; the rows, mask
and truncation as documented; the whole-experts product equal to transformers' own; the retention statistics
against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import build_dense, corpus_text
from moeify.evaluation import loglik
from moeify.formats.config import build_config
from moeify.carving.conversion import plan_conversion, run_conversion
from moeify.maths.stats import kept_share, mean_and_se, pooled

WORDS = corpus_text(4000).split()


@pytest.fixture(scope="module")
def three(tmp_path_factory, tokenizer_dir):
    """A dense llama, its top-2-of-4 Mixtral carve and a Qwen2-MoE carve with a shared expert."""
    root = tmp_path_factory.mktemp("loglik")
    dense = build_dense(root / "dense", tokenizer_dir)
    run_conversion(plan_conversion(dense, build_config(experts=4, top_k=2)), root / "mixtral")
    run_conversion(plan_conversion(dense, build_config(experts=6, top_k=2, shared=2, format="qwen2_moe")),
                   root / "qwen")
    return dense, root / "mixtral", root / "qwen"


def requests() -> list[tuple[str, str]]:
    """Multiple-choice-like requests: contexts with 1-4 continuations of 1-12 words (one-token ones among them), a
    continuation given twice, and a context of its own."""
    out = []
    for i in range(9):
        ctx = " ".join(WORDS[i * 30:i * 30 + 5 + 3 * i])
        for c in range(1 + i % 4):
            out.append((ctx, " " + " ".join(WORDS[i * 30 + 20 + c:i * 30 + 21 + c + (c * 3 + i) % 12])))
    out.append(out[1])  # the same request twice
    out.append((WORDS[0], " " + WORDS[1]))
    return out


@pytest.mark.parametrize("which", [0, 1, 2], ids=["llama", "mixtral", "qwen2_moe"])
def test_packed_scoring_equals_lm_evals_own_rows(three, which):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = three[which]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(path), batch_size=4)
    encoded = [((c, k), *lm._encode_pair(c, k)) for c, k in requests()]
    assert any(len(k) == 1 for _, _, k in encoded) and any(len(k) > 4 for _, _, k in encoded)
    stock = lm._loglikelihood_tokens(encoded, disable_tqdm=True)
    seen = []
    packed = loglik.score(model, [(c, k) for _, c, k in encoded], lm.max_length, max_rows=3, max_tokens=200,
                          done=lambda idx, answers: seen.extend(idx))
    assert sorted(seen) == list(range(len(encoded)))  # every request answered once, batch by batch
    assert [g for _, g in packed] == [g for _, g in stock]
    assert max(abs(a - b) for (a, _), (b, _) in zip(packed, stock)) < 1e-4
    assert len({round(a, 3) for a, _ in stock}) > len(stock) // 2  # distinct numbers: the comparison has teeth
    assert model.config._experts_implementation in (None, "grouped_mm", "eager")  # restored after scoring


def test_rows_share_each_context_and_keep_each_choice_to_itself():
    pairs = [([5, 6, 7], [8]), ([5, 6, 7], [9, 10, 11]), ([1, 2], [3, 4]), ([5, 6, 7], [9, 10, 11])]
    rows = loglik.pack(pairs, max_length=64)
    assert len(rows) == 2
    a = rows[0]
    assert a.tokens == [5, 6, 7, 9, 10] and a.positions == [0, 1, 2, 3, 4] and a.segments == [0, 0, 0, 2, 2]
    # [8] is predicted at the context's last token alone; [9, 10, 11] there and at its own first two tokens
    assert a.targets == [(0, [2], [8]), (1, [2, 3, 4], [9, 10, 11]), (3, [2, 3, 4], [9, 10, 11])]
    assert rows[1].tokens == [1, 2, 3] and rows[1].positions == [0, 1, 2]
    # two continuations after one context restart their positions after it
    two = loglik.pack([([1, 2], [3, 4, 5]), ([1, 2], [6, 7])], 64)[0]
    assert two.positions == [0, 1, 2, 3, 2] and two.segments == [0, 0, 1, 1, 2]
    # too long for the window: the context cut from the left, the longest continuation still fits
    cut = loglik.pack([(list(range(10)), [20, 21, 22])], max_length=6)[0]
    assert cut.tokens == [6, 7, 8, 9, 20, 21] and max(cut.positions) < 6
    with pytest.raises(ValueError, match="longer than the model's window"):
        loglik.pack([([1], list(range(8)))], max_length=6)
    with pytest.raises(ValueError, match="empty"):
        loglik.pack([([], [1])], 6)


def test_tree_mask():
    seg = torch.tensor([[0, 0, 1, 1, 2, -1]])
    m = loglik.tree_mask(seg)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0],
                 [1, 1, 1, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0],  # segment 2 sees the context and itself, not segment 1
                 [0, 0, 0, 0, 0, 1]]  # padding: itself alone


def test_batches_follow_the_row_and_token_limits():
    rows = loglik.pack([([i] * n, [1]) for i, n in enumerate([3, 9, 5, 7, 2], 1)], 64)
    got = loglik.batches(rows, max_rows=2, max_tokens=13)
    assert [[len(r.tokens) for r in b] for b in got] == [[9], [7], [5, 3], [2]]


def test_whole_experts_product_equals_transformers_own(three):
    from transformers import AutoModelForCausalLM

    _, _, qwen = three
    model = AutoModelForCausalLM.from_pretrained(qwen, dtype=torch.float32).eval()
    ids = torch.randint(0, 384, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        with loglik.experts_for_scoring(model):
            assert model.config._experts_implementation == loglik.ALL_EXPERTS
            whole = model(ids).logits
        after = model(ids).logits
    assert (whole - before).abs().max() < 1e-4 and torch.equal(before, after)
    assert (before - before.mean()).abs().max() > 0.1  # not a constant output


def test_kept_share_and_pooling_equal_a_hand_computation():
    a = [1, 1, 0, 1, 0, 1, 1, 0, 1, 1.0]  # reference: 0.7
    b = [1, 0, 0, 1, 1, 1, 0, 0, 1, 0.0]  # other: 0.5
    r, se = kept_share(a, b)
    assert r == pytest.approx(0.5 / 0.7)
    # delta method by hand: var(B/A) ≈ (var_B - 2 r cov_AB + r² var_A) / A², the (co)variances of the means
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    cov = lambda x, y, mx, my: sum((u - mx) * (v - my) for u, v in zip(x, y)) / (n - 1) / n  # noqa: E731
    hand = math.sqrt(cov(b, b, mb, mb) - 2 * r * cov(a, b, ma, mb) + r * r * cov(a, a, ma, ma)) / ma
    assert se == pytest.approx(hand)
    c = [0.25] * n  # four choices: the margin above chance kept
    k, k_se = kept_share(a, b, c)
    assert k == pytest.approx((0.5 - 0.25) / (0.7 - 0.25)) and k_se > se
    assert kept_share(a, a) == (1.0, 0.0)
    with pytest.raises(ValueError, match="no better than chance"):
        kept_share([0.0, 0.0], [1.0, 0.0])
    assert pooled([(0.8, 0.03), (0.6, 0.04)]) == pytest.approx((0.7, 0.025))
    assert mean_and_se(a)[0] == pytest.approx(0.7)


def test_chance_by_item():
    from moeify.evaluation.tasks import chance_by_item

    mc = [{"doc_id": i, "arguments": [("q", f" a{i}{j}") for j in range(2 + i)], "target": 0} for i in range(3)]
    assert chance_by_item(mc, "multiple_choice") == {0: 1 / 2, 1: 1 / 3, 2: 1 / 4}
    yes_no = [{"doc_id": i, "arguments": [("p", " no"), ("p", " yes")], "target": t} for i, t in enumerate([1, 1, 0, 1])]
    assert chance_by_item(yes_no, "multiple_choice") == dict.fromkeys(range(4), 0.75)  # always 'yes' scores 3 of 4
    assert chance_by_item([{"doc_id": 7, "arguments": [("x", " y")], "target": " y"}], "loglikelihood") == {7: 0.0}


def test_retention_pools_the_informative_tasks():
    from types import SimpleNamespace

    from moeify.evaluation.tasks import ModelTasks, retention

    ids = range(400)
    good = {i: float(i % 10 < 8) for i in ids}  # 0.8 on four-choice items: informative
    near = {i: float(i % 2 == 0) for i in ids}  # 0.5 on two-choice items: chance, left out
    ref = ModelTasks("dense", items={"t1": {"acc": good, "acc_norm": good}, "t2": {"acc": near}},
                     chance={"t1": dict.fromkeys(ids, 0.25), "t2": dict.fromkeys(ids, 0.5)})
    moe_t1 = {i: float(i % 10 < 6) for i in ids}  # 0.6
    moe = ModelTasks("moe", items={"t1": {"acc": good, "acc_norm": moe_t1}, "t2": {"acc": near}}, chance=ref.chance)
    r = retention(SimpleNamespace(names=["t1", "t2"]), [ref, moe])
    assert r["informative"] == ["t1"] and r["tasks"]["t1"]["metric"] == "acc_norm"
    assert r["tasks"]["t2"] == {"metric": "acc", "chance": 0.5, "informative": False}
    m = r["models"][0]
    assert m["retention"] == pytest.approx(0.75) and m["margin_kept"] == pytest.approx(0.35 / 0.55)
    assert (m["retention"], m["retention_se"]) == pytest.approx(kept_share(list(good.values()),
                                                                           list(moe_t1.values())))
    assert "vs_first" not in m
    twin = ModelTasks("twin", items={"t1": {"acc": good, "acc_norm": good}, "t2": {"acc": near}}, chance=ref.chance)
    r = retention(SimpleNamespace(names=["t1", "t2"]), [ref, moe, twin])
    assert r["models"][1]["retention"] == pytest.approx(1.0)
    assert r["models"][1]["vs_first"] == pytest.approx(0.25)  # keeps all of 0.8, the first model 0.6 of it


def test_kept_share_difference_against_a_hand_computation():
    from moeify.maths.stats import kept_share_difference

    a = [1, 1, 0, 1, 0, 1, 1, 0, 1, 1.0]
    f = [1, 0, 0, 1, 1, 1, 0, 0, 1, 0.0]
    o = [1, 1, 0, 1, 1, 0, 0, 0, 1, 0.0]
    d, se = kept_share_difference(a, f, o)
    assert d == pytest.approx(kept_share(a, o)[0] - kept_share(a, f)[0])  # 0.5/0.7 - 0.5/0.7 = 0
    n, ma = len(a), sum(a) / len(a)
    infl = [(oi - fi - d * ai) / ma for ai, fi, oi in zip(a, f, o)]
    m = sum(infl) / n
    assert se == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in infl) / (n - 1) / n)) and se > 0
    assert kept_share_difference(a, f, f) == (0.0, 0.0)


def test_a_sliding_window_bounds_the_rows(tmp_path, tokenizer_dir):
    """A given 4D mask has no window: a Mistral's rows are cut to its window, so the packed scoring keeps to it."""
    from transformers import AutoModelForCausalLM

    src = build_dense(tmp_path / "mistral", tokenizer_dir, family="mistral", sliding_window=8)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ctx, cont = list(range(3, 23)), [30, 31]
    (got,) = loglik.score(model, [(ctx, cont)], max_length=64)
    with torch.no_grad():  # the model itself over the last 8 - 2 + 1 context tokens and the continuation
        ids = torch.tensor([ctx[-7:] + cont[:-1]])
        logp = torch.log_softmax(model(ids).logits[0, -2:].float(), -1)
    assert got[0] == pytest.approx(float(logp[0, 30] + logp[1, 31]), abs=1e-4)
