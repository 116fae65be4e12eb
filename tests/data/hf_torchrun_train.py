"""A ``target=cmd`` Hugging Face Trainer script for the two-rank end-to-end search, run as users run
the Trainer on several processes: ``torchrun --nproc_per_node 2 hf_torchrun_train.py`` (torchrun sets
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in each rank; the Trainer joins a gloo process group on the
CPU and wraps the model in DDP) with oomtune's one line, ``callbacks=[OomtuneCallback()]``.

The model is GPT-2-shaped and tiny (``GPT2Config``: 2 layers, width 32, 2 heads, a vocabulary of 128,
sequences of 32 tokens; no weights downloaded), trained on random token sequences.

Test knob: ``--rank1-hold-per-sample BYTES`` makes rank 1 allocate a float32 tensor of BYTES x its
micro-batch at its first optimizer step and keep it to the end (an uneven rank: rank 1's peak is
above rank 0's by that tensor's segment, and grows with the micro-batch).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from oomtune.integrations.huggingface import OomtuneCallback

SEQ_LEN, VOCAB = 32, 128


class RandomTokens(torch.utils.data.Dataset):
    """``n`` sequences of ``SEQ_LEN`` random token ids, their own labels (language modelling)."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Rank1Holds(TrainerCallback):
    """Rank 1 keeps ``per_sample`` bytes per sample of its micro-batch from its first step on."""

    def __init__(self, per_sample: int) -> None:
        self.per_sample = per_sample
        self.held: torch.Tensor | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.per_sample and self.held is None and args.process_index == 1:
            self.held = torch.ones(self.per_sample * args.per_device_train_batch_size // 4)
        return control


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank1-hold-per-sample", type=int, default=0)
    hold = parser.parse_args().rank1_hold_per_sample
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ_LEN))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=4, learning_rate=1e-4,
                                 report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                 dataloader_num_workers=0, use_cpu=True, ddp_find_unused_parameters=False)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(256),
                          callbacks=[Rank1Holds(hold), OomtuneCallback()])
        result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"trained {result.global_step} optimizer steps on {args.world_size} ranks")


if __name__ == "__main__":
    main()
