"""What a tuning run is asked to do: `moeify tune`'s flags as TuneOptions (and what `convert --tune-*` asks), checked
before any work; and the interruption a signal turns into."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..formats.config import ConvertConfig
from ..errors import MoeifyError

SCHEDULES = ("continue", "restart")
Progress = Callable[..., None]  # progress(stage, done, total): the CLI's bars


@dataclass(frozen=True)
class TuneOptions:
    """What a tuning run is asked to do (`moeify tune` flags; `convert` derives them from its --tune-* flags)."""

    tokens: int  # training tokens of this run (its warm-up and cosine: see schedule)
    lr: float = 0.003  # Adam step relative to each expert tensor's RMS (moeify.training.distill.DistillSettings.lr)
    generated: float = 0.5  # share of the tokens the dense model samples itself
    calib: tuple[str, ...] = ()  # real tuning text; () = the output's own calibration text (its moeify.toml)
    tune_text: tuple[str, ...] = ()  # more real text; () with calib () = the output's own --tune-text
    train_router: bool = True
    train_experts: bool = True  # False: --router-only (the routers alone learn; the experts stay as carved)
    train_attention: bool = False
    seed: int | None = None  # None: the output's seed, moved on by the number of earlier runs (fresh text each run)
    schedule: str = "continue"  # continue: the step size follows one cosine over the output's earlier tuning tokens
    # and these (a doubling starts at half the peak and decays to 0); restart: a whole cosine from the peak
    step_tokens: int | None = None  # tokens an optimizer step; None: the device's (moeify.tuning.sizing.step_size),
    # resolved when the run starts and recorded, so a resumed run steps alike
    hidden_weight: float = 0.0  # > 0: the loss adds this times each decoder layer's output error relative to the
    # dense model's (moeify.training.hidden); the teacher then runs in the loop, in one process

    def validate(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 1:
            raise MoeifyError(f"--tokens must be a positive integer (tuning tokens), got {self.tokens!r}")
        if not 0.0 < self.lr < 1.0:
            raise MoeifyError(f"--lr must be in (0, 1) (a step size relative to each weight's RMS), got {self.lr}")
        if not 0.0 <= self.generated < 1.0:
            raise MoeifyError(f"--tune-generated must be in [0, 1) (the share of tuning windows the dense model "
                              f"samples itself), got {self.generated}")
        if self.step_tokens is not None and (not isinstance(self.step_tokens, int) or isinstance(self.step_tokens, bool)
                                             or self.step_tokens < 1):
            raise MoeifyError(f"--step-tokens must be a positive integer (tokens an optimizer step), got "
                              f"{self.step_tokens!r}")
        if not (isinstance(self.hidden_weight, (int, float)) and not isinstance(self.hidden_weight, bool)
                and 0.0 <= self.hidden_weight < float("inf")):
            raise MoeifyError(f"--hidden-weight must be a number >= 0 (the weight of the layer-output term; 0: the "
                              f"logit KL alone), got {self.hidden_weight!r}")
        if not (self.train_router or self.train_experts or self.train_attention):
            raise MoeifyError("--router-only with --freeze-router leaves nothing to train", "drop one of them")
        if self.schedule not in SCHEDULES:
            raise MoeifyError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for f in (*self.calib, *self.tune_text):
            if not Path(f).is_file():
                raise MoeifyError(f"tuning text {f} not found", "pass existing .txt/.jsonl files to --calib / --tune-text")

    @classmethod
    def from_record(cls, options: dict) -> TuneOptions:
        """The options a run recorded in its run.json (dataclasses.asdict of them; states saved before --schedule
        ran whole cosines). ValueError for a record that is not such options."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {"schedule": "restart", "step_tokens": 1024, **options}  # (and steps of 1,024 tokens)
        if set(values) - names or "tokens" not in values:
            raise ValueError(f"options {sorted(set(values) - names) or ['tokens']} unknown or missing")
        opts = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        if (not isinstance(opts.tokens, int) or opts.tokens < 1 or opts.schedule not in SCHEDULES
                or not isinstance(opts.step_tokens, int) or opts.step_tokens < 1):
            raise ValueError("tokens, schedule or step_tokens invalid")
        return opts

    def schedule_from(self, prior_tokens: int) -> float:
        """Where in one cosine schedule over prior_tokens + tokens this run starts (DistillSettings.schedule_from):
        prior / (prior + tokens) when continuing a tuned output, 0 for a fresh output or a restarted schedule."""
        return prior_tokens / (prior_tokens + self.tokens) if self.schedule == "continue" and prior_tokens > 0 else 0.0


def options_from_config(cfg: ConvertConfig) -> TuneOptions:
    """The tuning run `convert --tune-tokens` asks for."""
    return TuneOptions(tokens=cfg.tune_tokens, lr=cfg.tune_model_lr, generated=cfg.tune_generated,
                       train_router=cfg.tune_router, train_attention=cfg.tune_attention)


class TuningInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT / SIGTERM after saving its state."""

    def __init__(self, step: int, total: int):
        super().__init__(f"tuning stopped at step {step} of {total}; its state is saved")
        self.step, self.total = step, total
