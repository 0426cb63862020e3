"""Layer-sequential calibration: calibration tokens through the dense model, one decoder layer resident.

Each decoder layer is a real transformers LlamaDecoderLayer/MistralDecoderLayer (rotary embeddings,
causal or sliding-window mask and GQA exactly as the model computes them), built on the meta device and
loaded with only that layer's weights. The FFN input of every calibration token (post-attention RMSNorm
output) is what the carving statistics, router fitting and down-projection refit are computed from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import CheckpointReader
from .errors import MoeifyError
from .families import SourceModel

# ------------------------------------------------------------------------------------------ calibration text


def read_texts(files: list[str | Path]) -> str:
    """Concatenate .txt files and the `text` fields of .jsonl files."""
    parts = []
    for f in files:
        path = Path(f)
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise MoeifyError(f"calibration file {path} not found", "pass existing .txt or .jsonl files to --calib") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise MoeifyError(f"calibration file {path} cannot be read ({exc.__class__.__name__})",
                              "pass readable UTF-8 .txt or .jsonl files to --calib") from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    parts.append(str(json.loads(line)["text"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise MoeifyError(f"{path}:{n} is not a JSON object with a 'text' field") from None
        else:
            parts.append(raw)
    text = "\n\n".join(parts)
    if not text.strip():
        raise MoeifyError(f"calibration data in {', '.join(map(str, files))} is empty", "pass files with English text")
    return text


def calibration_tokens(src_path: Path, files: list[str | Path], n_tokens: int, seq_len: int) -> torch.Tensor:
    """Tokenize with the checkpoint's own tokenizer; return (n_seq, seq_len) windows covering n_tokens."""
    from transformers import AutoTokenizer

    text = read_texts(files)
    try:
        tok = AutoTokenizer.from_pretrained(str(src_path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a missing tokenizer
        raise MoeifyError(f"{src_path} has no usable tokenizer ({exc.__class__.__name__})",
                          "calibration needs the checkpoint's tokenizer files (tokenizer.json)") from None
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n_seq = n_tokens // seq_len
    if n_seq < 1:
        raise MoeifyError(f"--calib-tokens {n_tokens} is less than one window of --calib-seq-len {seq_len}")
    if len(ids) < n_seq * seq_len:
        raise MoeifyError(
            f"calibration text has {len(ids)} tokens, fewer than --calib-tokens {n_tokens}",
            f"add text to --calib or lower --calib-tokens (to at most {len(ids) // seq_len * seq_len})",
        )
    return torch.tensor(ids[: n_seq * seq_len]).view(n_seq, seq_len)


# ------------------------------------------------------------------------------------- layer-by-layer forward


class LayerwiseModel:
    """The dense model, one decoder layer at a time, on calibration tokens (hidden states kept resident)."""

    def __init__(self, src: SourceModel, reader: CheckpointReader, tokens: torch.Tensor, device: str = "cpu",
                 batch_size: int = 8):
        from transformers import LlamaConfig, MistralConfig

        cls = LlamaConfig if src.model_type == "llama" else MistralConfig
        self.config = cls.from_dict({k: v for k, v in src.raw.items() if k != "auto_map"})
        self.config._attn_implementation = "sdpa"
        self.src, self.reader, self.device, self.batch_size = src, reader, torch.device(device), batch_size
        self.tokens = tokens
        embed = reader.get("model.embed_tokens.weight")
        self.hidden = F.embedding(tokens, embed).float().to(self.device)  # (n_seq, seq, d_model)
        if src.model_type == "llama":
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
        else:
            from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding as Rotary
        self.rotary = Rotary(self.config).to(self.device)
        self.position_ids = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0)

    def load_layer(self, layer_idx: int) -> torch.nn.Module:
        if self.src.model_type == "llama":
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer
        else:
            from transformers.models.mistral.modeling_mistral import MistralDecoderLayer as Layer
        with torch.device("meta"):
            layer = Layer(self.config, layer_idx)
        prefix = f"model.layers.{layer_idx}."
        state = {k: self.reader.get(prefix + k).float().to(self.device) for k in layer.state_dict()}
        layer.load_state_dict(state, assign=True)
        return layer.eval()

    def _mask(self, h: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        fn = create_sliding_window_causal_mask if getattr(self.config, "sliding_window", None) else create_causal_mask
        return fn(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                  position_ids=self.position_ids)

    @torch.no_grad()
    def attention(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the attention half of a layer on all hidden states.
        Returns (h_mid, x): the residual stream after attention and the FFN input, both (n_seq, seq, d)."""
        mids = []
        for start in range(0, self.hidden.shape[0], self.batch_size):
            h = self.hidden[start:start + self.batch_size]
            pos = self.rotary(h, position_ids=self.position_ids)
            attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=self._mask(h),
                                      position_ids=self.position_ids, position_embeddings=pos)
            mids.append(h + attn)
        h_mid = torch.cat(mids)
        return h_mid, layer.post_attention_layernorm(h_mid)

    def advance(self, h_mid: torch.Tensor, ffn_out: torch.Tensor) -> None:
        """Next layer's input = residual after attention + this layer's FFN output (dense or carved)."""
        self.hidden = h_mid + ffn_out.view_as(h_mid)


# ---------------------------------------------------------------------------------------- neuron statistics


def ffn_activations(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Intermediate activations act(gate x) * (up x). x: (n, d_model) -> (n, d_ff)."""
    return F.silu(x @ gate.T) * (x @ up.T)


@dataclass
class NeuronStats:
    """Per-layer calibration statistics of the FFN neurons."""

    rate: torch.Tensor  # (d_ff,) share of tokens where the neuron is among the top-K_a by |activation| (CMoE)
    mean_abs: torch.Tensor  # (d_ff,) mean |activation|
    pattern: torch.Tensor  # (d_ff, n_sample) binary top-K_a indicators on a token sample (for clustering)
    profile: torch.Tensor  # (d_ff, n_sample) |activation| on the same sample (co-activation signal)

    def to_dict(self, layer_idx: int) -> dict[str, torch.Tensor]:
        return {f"{layer_idx}.{k}": v.contiguous() for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict[str, torch.Tensor], layer_idx: int) -> "NeuronStats":
        return cls(**{k: d[f"{layer_idx}.{k}"] for k in ("rate", "mean_abs", "pattern", "profile")})


def neuron_stats(act: torch.Tensor, active_frac: float = 0.1, n_sample: int = 2048, seed: int = 0) -> NeuronStats:
    """act: (n_tokens, d_ff). K_a = active_frac * d_ff neurons count as active in a token."""
    n, d_ff = act.shape
    k_a = max(1, int(round(active_frac * d_ff)))
    mag = act.abs()
    top = mag.topk(k_a, dim=1).indices
    active = torch.zeros_like(mag, dtype=torch.bool).scatter_(1, top, True)
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randperm(n, generator=gen)[: min(n, n_sample)].sort().values.to(act.device)
    return NeuronStats(rate=active.float().mean(0).cpu(), mean_abs=mag.mean(0).cpu(),
                       pattern=active[sample].T.float().cpu(), profile=mag[sample].T.cpu())
