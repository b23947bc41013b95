"""DP training of a model sharded by FSDP2 over several processes, with Opacus's PrivacyEngine
and dpgrad's ghost clipping, one backward pass per step.

Run with torchrun, one process per GPU, or on a CPU (gloo):

    .venv/bin/torchrun --nproc-per-node 2 examples/fsdp_privacy_engine.py [--steps N] [--bf16]

Each block of dpgrad's built-in transformer is sharded, then the root (which keeps the
embeddings, the final norm and the output layer; a tied embedding and output layer belong
there too); then privacy_engine.py's training runs on the sharded model. Each process draws
its share of the Poisson batches and clips its own samples; FSDP reduce-scatters the clipped
gradients and Opacus's FSDP optimizer adds the noise. Rank 0 prints the loss and epsilon at
delta = 1e-5.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dpgrad.tools.cli_common import number_in
from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig
from privacy_engine import train  # the example beside this one


def main(steps: int = 10, bf16: bool = False) -> float:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)  # the same weights on every rank before sharding
    cfg = TinyTransformerConfig()
    model = TinyTransformer(cfg).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # after the blocks: shard first, then wrap
    # privacy_engine.py's training, on the sharded model: make_private wraps it, and each
    # backward pass ends with every FSDP group's clipped gradient reduce-scattered.
    epsilon = train(model, cfg, steps, device, verbose=dist.get_rank() == 0)
    dist.destroy_process_group()
    return epsilon


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=number_in(int, 1), default=10, help="training steps (default 10)")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction (MixedPrecisionPolicy)")
    args = parser.parse_args()
    main(args.steps, args.bf16)
