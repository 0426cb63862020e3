"""Continue training a moeify output (an upcycle or merge) in Hugging Face Trainer, as the stock transformers class
it is saved as, with the load-balancing loss (output_router_logits), and save it back:

    torchrun --nproc-per-node 2 scripts/check_trainer_fsdp.py OUT TEXT SAVE [--fsdp] [--steps N]
    accelerate launch --num_processes 2 --cpu scripts/check_trainer_fsdp.py OUT TEXT SAVE

--fsdp asks Trainer for FSDP2 (TrainingArguments fsdp="full_shard", fsdp_config version 2, each decoder layer a
unit). Prints one JSON line on rank 0: the processes, the distributed type accelerate chose, whether the model was
sharded (its parameters DTensors), the loss of each step. tests/test_trainer_fsdp.py runs it on the CPU."""

from __future__ import annotations

import argparse
import json
import os

import torch


def windows(tok, text: str, seq: int) -> list[dict]:
    ids = tok(open(text).read())["input_ids"]
    return [{"input_ids": torch.tensor(ids[s:s + seq]), "labels": torch.tensor(ids[s:s + seq])}
            for s in range(0, len(ids) - seq + 1, seq)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("text")
    ap.add_argument("save")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    model.config.output_router_logits = True  # the loss includes router_aux_loss_coef x the balance loss
    layer = type(model.model.layers[0]).__name__
    fsdp = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer],
                                                "state_dict_type": "FULL_STATE_DICT"}) if args.fsdp else {}
    targs = TrainingArguments(output_dir=args.save, per_device_train_batch_size=2, max_steps=args.steps,
                              learning_rate=1e-4, use_cpu=not torch.cuda.is_available(), save_strategy="no",
                              report_to=[], logging_steps=1, seed=0, dataloader_drop_last=True, **fsdp)
    trainer = Trainer(model=model, args=targs, train_dataset=windows(tok, args.text, args.seq))
    trainer.train()
    sharded = any(isinstance(p, DTensor) for p in trainer.model_wrapped.parameters())
    trainer.save_model(args.save)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(json.dumps({"processes": int(os.environ.get("WORLD_SIZE", "1")), "sharded": sharded,
                          "distributed_type": str(trainer.accelerator.distributed_type), "losses": losses}))


if __name__ == "__main__":
    main()
