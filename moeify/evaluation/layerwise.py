"""Models run one decoder layer at a time: transformers' own decoder-layer classes (dense Llama / Mistral / Qwen2 /
Qwen3, or the Mixtral / Qwen2-MoE / Qwen3-MoE an output holds) built on the meta device and loaded with one layer's
tensors from the shards, so a 70B source and its upcycled 400B MoE can be compared on a few tokens with one layer of
each resident. The MoE side runs the stock block: its router, top-k and (non-)renormalisation as the class computes
them, each expert's tensors read from the files (or made) when tokens first reach it and joined as transformers fuses
them on load, so that a layer holds one expert at a time.

`stream_hidden` gives each model's final hidden states (after the final norm); `logits` and `kl_to_reference` turn
them into what the upcycle check and `verify --against` compare, a chunk of tokens at a time. `ResidentRun` runs a
stack with every window's hidden states resident and a layer's attention and MLP apart, so that a layer's MLP input
can be taken and its MLP replaced: the calibrated carve (moeify.carving.calibrate) and merge's router rows from text.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..formats.checkpoint import CheckpointReader
from ..formats.families import SourceModel, family_classes

MOE_CLASSES = {"mixtral": ("MixtralConfig", "MixtralDecoderLayer", "MixtralRotaryEmbedding"),
               "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeDecoderLayer", "Qwen2MoeRotaryEmbedding"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeDecoderLayer", "Qwen3MoeRotaryEmbedding")}
PREFETCH_EXPERT_BYTES = 512 << 20  # a layer's experts read ahead only up to this size (LayerStack.prefetch)
ExpertOverride = Callable[[int], "Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None"]  # by index


@dataclass
class LayerStack:
    """One checkpoint as decoder layers: its transformers config, classes, reader and tensor names."""

    config: object
    layer_cls: type
    rotary_cls: type
    reader: CheckpointReader
    tied: bool
    fmt: str | None = None  # the MoE format; None for a dense source
    n_experts: int = 0
    expert_override: ExpertOverride | None = field(default=None, repr=False)  # layer -> [(gate, up, down)] or None
    rounded_to: torch.dtype | None = None  # every weight rounded through this dtype first (a source held to its output)
    device: torch.device = torch.device("cpu")  # where layer() puts a layer's (non-expert) weights

    def get(self, name: str) -> torch.Tensor:
        t = self.reader.get(name)
        return (t.to(self.rounded_to) if self.rounded_to is not None else t).float()

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    def layer(self, i: int) -> torch.nn.Module:
        with torch.device("meta"):
            layer = self.layer_cls(self.config, i)
        keys = list(layer.state_dict())
        fused = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} if self.fmt is not None else set()
        fused &= set(keys)
        state = {k: self._tensor(i, k).float().to(self.device) for k in keys if k not in fused}
        missing = layer.load_state_dict(state, assign=True, strict=False).missing_keys
        if set(missing) != fused:
            raise RuntimeError(f"layer {i} of {self.layer_cls.__name__}: no weights for {sorted(set(missing) - fused)}")
        if fused:  # left unmaterialised: STORED_DTYPE_EXPERTS fetches each expert as the tokens reach it
            layer.mlp.experts.moeify_experts = self._experts(i)
        return layer.eval()

    def prefetch(self, i: int) -> None:
        """Start reading layer i's tensors in the background (nothing past the last layer): one more layer resident,
        read while the current one computes; its experts too when they come from the files and weigh at most
        PREFETCH_EXPERT_BYTES (a small model's: Qwen2.5-0.5B × 4, 0.1 GB; not Llama-3-8B × 8's 2.8 GB, which
        would more than double the check's memory)."""
        if 0 <= i < self.n_layers:
            names = self.reader.layer_tensors(i)
            experts = [n for n in names if ".experts." in n]
            if self.expert_override or sum(self.reader.tensors[n].nbytes for n in experts) > PREFETCH_EXPERT_BYTES:
                names = [n for n in names if ".experts." not in n]
            self.reader.prefetch(names)

    def release(self, i: int) -> None:
        """Drop what was prefetched of layer i and not used (experts no token reached)."""
        self.reader.forget(self.reader.layer_tensors(i))

    def rotary(self) -> torch.nn.Module:
        """The config's rotary embedding, on the stack's device."""
        return self.rotary_cls(self.config).to(self.device)

    def _experts(self, i: int):
        """Layer i's routed experts, (gate, up, down) by index as the checkpoint stores them: read from the files
        when asked for (or made by expert_override), so that a layer holds the expert in use, not all of them (an
        upcycle of Llama-3-8B into E8 would hold 2.8 GB a layer)."""
        block = f"model.layers.{i}." + ("block_sparse_moe." if self.fmt == "mixtral" else "mlp.")
        override = self.expert_override(i) if self.expert_override else None
        if override is not None:
            return override
        names = ("w1", "w3", "w2") if self.fmt == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        return _ReadExperts(self.reader, [tuple(f"{block}experts.{e}.{n}.weight" for n in names)
                                          for e in range(self.n_experts)])

    def _tensor(self, i: int, key: str) -> torch.Tensor:
        p = f"model.layers.{i}."
        if self.fmt is None or not key.startswith("mlp."):
            return self.get(p + key)
        block = p + ("block_sparse_moe." if self.fmt == "mixtral" else "mlp.")
        sub = key.removeprefix("mlp.")
        if block + sub in self.reader.tensors:  # router, shared expert, shared gate
            return self.reader.get(block + sub)
        return self.reader.get(p + key)  # a dense layer of a Qwen2-MoE / Qwen3-MoE (mlp_only_layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ids, float32 (the matrix is read as stored, never whole in float32)."""
        w = self.reader.get("model.embed_tokens.weight")
        rows = w[ids]
        return (rows.to(self.rounded_to) if self.rounded_to is not None else rows).float()

    def head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm weight float32, output matrix as stored (rounded through rounded_to): `head_logits` upcasts
        it a block of rows at a time, so a 128k-vocabulary head is never held whole in float32)."""
        name = "model.embed_tokens.weight" if self.tied or "lm_head.weight" not in self.reader.tensors else "lm_head.weight"
        w = self.reader.get(name)
        return self.get("model.norm.weight"), w.to(self.rounded_to) if self.rounded_to is not None else w


class _ReadExperts:
    """A layer's experts as (gate, up, down) by index, each read from the files when it is asked for."""

    def __init__(self, reader: CheckpointReader, names: list[tuple[str, str, str]]):
        self.reader, self.names = reader, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.reader.get(n) for n in self.names[e])


def source_stack(src: SourceModel, reader: CheckpointReader, rounded_to: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> LayerStack:
    """The dense source; rounded_to: its weights rounded through the output's dtype, as the output holds them;
    device: where its layers are built."""
    cls, layer_cls, rotary = family_classes(src.model_type)
    config = cls.from_dict({k: v for k, v in src.raw.items() if k != "auto_map"})
    config._attn_implementation = "sdpa"
    return LayerStack(config, layer_cls, rotary, reader, src.tied, rounded_to=rounded_to, device=torch.device(device))


def moe_stack(out: Path, reader: CheckpointReader, expert_override: ExpertOverride | None = None) -> LayerStack:
    """The MoE checkpoint in `out` (config.json as written), experts from the files or from `expert_override`."""
    import importlib

    raw = json.loads((Path(out) / "config.json").read_text())
    fmt = raw["model_type"]
    config_name, layer_name, rotary_name = MOE_CLASSES[fmt]
    modeling = importlib.import_module(f"transformers.models.{fmt}.modeling_{fmt}")
    config = getattr(importlib.import_module("transformers"), config_name).from_dict(
        {k: v for k, v in raw.items() if k != "auto_map"})
    config._attn_implementation = "sdpa"
    config._experts_implementation = _stored_dtype_experts()  # float32 products, experts kept as stored
    n = raw.get("num_local_experts") or raw.get("num_experts")
    return LayerStack(config, getattr(modeling, layer_name), getattr(modeling, rotary_name), reader,
                      bool(config.tie_word_embeddings), fmt, int(n), expert_override)


STORED_DTYPE_EXPERTS = "moeify_stored_dtype"


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop (the same products, in the same order), each expert's weights upcast to the
    hidden states' dtype as it is used. A layer that LayerStack built holds no experts (`moeify_experts`: each fetched
    as stored when a token first reaches it, freed after the next one's is fetched), so the streamed check of an E8
    upcycle of Llama-3-8B holds two experts, not a layer's 2.8 GB (bf16) or 5.6 GB (float32); an expert equal to the
    one before it (copies of one FFN: an exact construction) uses its upcast weights instead of making them again."""
    fetch = getattr(self, "moeify_experts", None)
    final = torch.zeros_like(hidden_states)
    mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
    last = None  # the previous fetched expert as stored, and upcast: an equal one (copies of one FFN) reuses it
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(e[0])
        if e == self.num_experts:
            continue
        pos, tok = torch.where(mask[e])
        x = hidden_states[tok]
        if fetch is None:
            gate_up, down = self.gate_up_proj[e].to(x.dtype), self.down_proj[e].to(x.dtype)
        else:
            stored = fetch[e]
            if last is None or not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(stored, last[0])):
                last = None  # freed before the next upcast
                last = stored, _fused(stored, x.dtype)
            gate_up, down = last[1]
            del stored
        h = self._apply_gate(F.linear(x, gate_up))
        y = F.linear(h, down) * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, y.to(final.dtype))
        del gate_up, down
    return final


def _fused(stored, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up, down) as stored -> (gate_up, down) in `dtype`, gate_up in transformers' fused layout (the gate rows,
    then the up rows), each upcast in one pass (no concatenated copy in the stored dtype first)."""
    gate, up, down = stored
    gate_up = torch.empty((gate.shape[0] + up.shape[0], gate.shape[1]), dtype=dtype)
    gate_up[:gate.shape[0]].copy_(gate)
    gate_up[gate.shape[0]:].copy_(up)
    return gate_up, down.to(dtype)


def _stored_dtype_experts() -> str:
    """The name of _experts_forward in transformers' experts interface (registered on first use)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(STORED_DTYPE_EXPERTS, _experts_forward)
    return STORED_DTYPE_EXPERTS


def causal_mask(config, h: torch.Tensor, position_ids: torch.Tensor):
    """The config's causal (or sliding-window) mask for hidden states h, as its model builds it without a cache."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    fn = create_sliding_window_causal_mask if getattr(config, "sliding_window", None) else create_causal_mask
    no_cache = {"cache" if "cache" in inspect.signature(fn).parameters else "past_key_values": None}  # 5.24 renamed it
    return fn(config=config, inputs_embeds=h, attention_mask=None, position_ids=position_ids, **no_cache)


def position_ids(seq_len: int, device: str | torch.device | None = None) -> torch.Tensor:
    """(1, seq_len): every window's positions from 0 (no cache, no padding on the left)."""
    return torch.arange(seq_len, device=device).unsqueeze(0)


class ResidentRun:
    """A stack on token windows (n, seq), every window's hidden states resident on the stack's device, a decoder
    layer's attention half and its MLP run apart: `attention` gives the residual stream after attention and the MLP
    input, `advance` adds the MLP's output (the layer's own, or one made in its place). Attention runs batch_size
    windows at a time, each batch with its own mask; the caller builds each layer (`load_layer`) and frees it."""

    def __init__(self, stack: LayerStack, tokens: torch.Tensor, batch_size: int = 8):
        self.stack, self.tokens, self.batch_size, self.device = stack, tokens, batch_size, stack.device
        self.hidden = stack.embed(tokens).to(self.device)  # (n, seq, d_model) float32
        self.rotary = stack.rotary()
        self.position_ids = position_ids(tokens.shape[1], self.device)

    @property
    def config(self):
        return self.stack.config

    def load_layer(self, layer_idx: int) -> torch.nn.Module:
        return self.stack.layer(layer_idx)

    @torch.no_grad()
    def attention(self, layer: torch.nn.Module, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the attention half of a layer on all hidden states (default: self.hidden).
        Returns (h_mid, x): the residual stream after attention and the FFN input, both (n_seq, seq, d)."""
        hidden = self.hidden if hidden is None else hidden
        mids = []
        for start in range(0, hidden.shape[0], self.batch_size):
            h = hidden[start:start + self.batch_size]
            pos = self.rotary(h, position_ids=self.position_ids)
            attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(h),
                                      attention_mask=causal_mask(self.config, h, self.position_ids),
                                      position_ids=self.position_ids, position_embeddings=pos)
            mids.append(h + attn)
        h_mid = torch.cat(mids)
        return h_mid, layer.post_attention_layernorm(h_mid)

    def advance(self, h_mid: torch.Tensor, ffn_out: torch.Tensor) -> None:
        """Next layer's input = residual after attention + this layer's FFN output (dense or carved)."""
        self.hidden = h_mid + ffn_out.view_as(h_mid)


@torch.no_grad()
def stream_hidden(stacks: list[LayerStack], ids: torch.Tensor,
                  progress: Callable[[str, int, int], None] | None = None) -> list[torch.Tensor]:
    """Final hidden states (after the final norm), float32, of each stack on ids (batch, seq): layer i of every stack
    is built, run and freed before layer i + 1 (whose tensors are read meanwhile); each stack uses its own config's
    rotary embedding and mask (so a config that lost a rope or window setting shows)."""
    pos_ids = position_ids(ids.shape[1])
    hidden = [s.embed(ids) for s in stacks]
    rotary = [s.rotary() for s in stacks]
    masks = [causal_mask(s.config, h, pos_ids) for s, h in zip(stacks, hidden)]
    n_layers = stacks[0].n_layers
    for s in stacks:
        s.prefetch(0)
    for i in range(n_layers):
        for j, s in enumerate(stacks):
            s.prefetch(i + 1)  # read while this layer computes
            layer = s.layer(i)
            pos = rotary[j](hidden[j], position_ids=pos_ids)
            out = layer(hidden_states=hidden[j], position_embeddings=pos, attention_mask=masks[j],
                        position_ids=pos_ids)
            hidden[j] = out[0] if isinstance(out, tuple) else out
            del layer
            s.release(i)
        if progress:
            progress("checking", i + 1, n_layers)
    finals = []
    for s, h in zip(stacks, hidden):
        norm = s.get("model.norm.weight")
        eps = getattr(s.config, "rms_norm_eps", 1e-6)
        finals.append(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm)
    return finals


HEAD_ROWS = 16384  # output-matrix rows upcast to float32 at a time


def head_logits(final: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """final (tokens, d) float32 @ w.T, w upcast HEAD_ROWS rows at a time (the same products as w.float())."""
    if w.dtype == torch.float32:
        return final @ w.T
    return torch.cat([final @ w[r:r + HEAD_ROWS].float().T for r in range(0, w.shape[0], HEAD_ROWS)], dim=-1)


def logits(stack: LayerStack, final: torch.Tensor) -> torch.Tensor:
    return head_logits(final, stack.head()[1])


@torch.no_grad()
def compare_to_reference(ref: LayerStack, ref_final: torch.Tensor, others: list[tuple[LayerStack, torch.Tensor]],
                         chunk: int = 256, kl: bool = True) -> list[dict]:
    """Each other model's logits against the reference's on the same tokens, every model's head product made once a
    chunk of tokens: per other {"max_logit_diff": max |logit difference|, "logit_scale": max |reference logit|, and
    with `kl` "kl": mean KL(reference ‖ other) of the next-token distributions over every position, nats}."""
    a = ref_final.reshape(-1, ref_final.shape[-1])
    w_ref = ref.head()[1]
    heads = [(final.reshape(-1, final.shape[-1]), other.head()[1]) for other, final in others]
    # an output matrix equal to the reference's (an upcycle's, a merge's copy of the base's) is upcast once for both
    same = [w.dtype == w_ref.dtype and w.shape == w_ref.shape and torch.equal(w, w_ref) for _, w in heads]
    found = [{"max_logit_diff": 0.0, "logit_scale": 0.0, **({"kl": 0.0} if kl else {})} for _ in others]
    for s in range(0, a.shape[0], chunk):
        rows = [a[s:s + chunk]] + [b[s:s + chunk] for (b, _), eq in zip(heads, same) if eq]
        joint = iter(head_logits(torch.cat(rows), w_ref).split([r.shape[0] for r in rows]))
        la = next(joint)
        lp = F.log_softmax(la, -1) if kl else None
        for (b, w), eq, f in zip(heads, same, found):
            lb = next(joint) if eq else head_logits(b[s:s + chunk], w)
            f["max_logit_diff"] = max(f["max_logit_diff"], (la - lb).abs().max().item())
            f["logit_scale"] = max(f["logit_scale"], la.abs().max().item())
            if kl:
                f["kl"] += (lp.exp() * (lp - F.log_softmax(lb, -1))).sum().item()
    for f in found:
        if kl:
            f["kl"] /= a.shape[0]
    return found


def max_logit_diff(ref: LayerStack, ref_final: torch.Tensor, other: LayerStack, final: torch.Tensor,
                   chunk: int = 256) -> tuple[float, float]:
    """(max |logit difference|, max |reference logit|), a chunk of tokens at a time."""
    c = compare_to_reference(ref, ref_final, [(other, final)], chunk, kl=False)[0]
    return c["max_logit_diff"], c["logit_scale"]


def kl_to_reference(ref: LayerStack, ref_final: torch.Tensor, other: LayerStack, final: torch.Tensor,
                    chunk: int = 256) -> float:
    """Mean KL(reference ‖ other) of the next-token distributions over every position, nats."""
    return compare_to_reference(ref, ref_final, [(other, final)], chunk)[0]["kl"]


__all__ = ["causal_mask", "position_ids", "ResidentRun", "LayerStack", "source_stack", "moe_stack", "stream_hidden",
           "logits", "compare_to_reference", "max_logit_diff", "kl_to_reference", "MOE_CLASSES"]
