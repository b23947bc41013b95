"""Private training of a small GPT-2 with the Hugging Face Trainer (``dpgrad.hf.DPTrainer``).

Run (from the repository root, after `make test` or `make report` has made .venv):

    .venv/bin/python examples/hf_trainer.py                  # DP, epsilon 8
    .venv/bin/python examples/hf_trainer.py --non-private    # the same steps without DP

The text is English that ships with Python itself: the reference pages of ``help()``
(``pydoc_data.topics``, about 450 KB), read as bytes (a vocabulary of 256: no tokenizer to
download) and cut into rows of 64 bytes; the last tenth is held out. The model is a four-layer
GPT-2 built from a config with random weights. Each row is one privacy unit. The script prints
the held-out perplexity per byte before and after, and the epsilon spent (delta = rows^-1.1,
DPTrainer's default).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch
import transformers

SEQ = 64


def text_rows(seq_len: int = SEQ):
    """The help pages' text as rows of ``seq_len`` bytes: (training rows, held-out rows)."""
    import pydoc_data.topics

    data = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)).encode("utf-8")
    ids = torch.tensor(list(data), dtype=torch.long)
    ids = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    rows = [{"input_ids": r, "attention_mask": torch.ones(seq_len, dtype=torch.long), "labels": r.clone()} for r in ids]
    held_out = len(rows) // 10
    return rows[:-held_out], rows[-held_out:]


def main(non_private: bool = False, epsilon: float = 8.0, steps: int = 100, batch_size: int = 64,
         lr: float = 2e-3, max_grad_norm: float = 1.0, quiet: bool = False) -> dict:
    from dpgrad.hf import DPTrainer, PrivacyArguments

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    train, held_out = text_rows()
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=SEQ,
                                  bos_token_id=10, eos_token_id=10, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch_size, max_steps=steps, learning_rate=lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=max(steps // 5, 1),
            save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0,
            per_device_eval_batch_size=256)
        common = dict(model=model, args=args, train_dataset=train, eval_dataset=held_out)
        if non_private:
            trainer = transformers.Trainer(**common)
        else:
            privacy = PrivacyArguments(target_epsilon=epsilon, max_grad_norm=max_grad_norm)
            trainer = DPTrainer(**common, privacy_args=privacy)
        before = math.exp(trainer.evaluate()["eval_loss"])
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        after = math.exp(trainer.evaluate()["eval_loss"])
    result = {"perplexity_before": before, "perplexity_after": after, "steps": steps, "seconds": seconds,
              "rows": len(train)}
    if not non_private:
        result["epsilon"], result["delta"] = trainer.privacy_spent()
        result["noise_multiplier"] = trainer.noise_multiplier
    if not quiet and trainer.is_world_process_zero():
        what = "non-private" if non_private else (f"DP: epsilon {result['epsilon']:.2f} (delta {result['delta']:.1e}), "
                                                  f"noise multiplier {result['noise_multiplier']:.3f}")
        print(f"{what}; {len(train)} rows of {SEQ} bytes, {steps} steps of {batch_size * args.world_size} rows "
              f"({'expected, Poisson-sampled' if not non_private else 'shuffled'}) in {seconds:.0f} s")
        print(f"held-out perplexity per byte: {before:.2f} before, {after:.2f} after")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--non-private", action="store_true", help="train the same steps without DP")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    a = parser.parse_args()
    main(a.non_private, a.epsilon, a.steps, a.batch_size, a.lr, a.max_grad_norm)
