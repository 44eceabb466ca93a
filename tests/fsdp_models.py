"""Models of the FSDP2 tests: each shards itself in ``configure_model`` when a process group exists
(``dp_fsdp``) and is an ordinary module otherwise (the single-process reference runs)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import TinyModule
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import checking, per_example_token_loss


def sharding() -> bool:
    return dist.is_available() and dist.is_initialized()


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full on every rank (all-gathered from the shards), or the module's own state."""
    if not sharding():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


class ShardedTiny(TinyModule):
    """TinyModule whose two Linear layers and their container are each an FSDP2 unit; optionally in fp64,
    with bf16 parameters and fp32 reduction, with the first layer frozen (a LoRA-like frozen base), or with
    activation checkpointing (the whole network recomputed in backward)."""

    def __init__(
        self,
        *args,
        dtype: torch.dtype = torch.float32,
        mixed_precision: bool = False,
        frozen_first: bool = False,
        checkpointed: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.checkpointed = checkpointed
        self.net.to(dtype)
        self.x = self.x.to(dtype)
        self.mixed_precision = mixed_precision
        if frozen_first:
            self.net[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checkpointed:
            return self.net(x)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(
            self.net, x, use_reentrant=False
        )  # activation checkpointing: recomputed in backward

    def configure_model(self) -> None:
        if not sharding():
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if self.mixed_precision else None
        extra = {"mp_policy": policy} if policy is not None else {}
        for layer in (self.net[0], self.net[2], self.net):
            fully_shard(layer, **extra)


class ShardedDeep(TinyModule):
    """TinyModule with ``depth`` hidden layers between its first and last: every Linear its own FSDP2 unit,
    then the container (a model of several units, for the memory a step holds in full)."""

    def __init__(self, *args, depth: int = 6, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        first, act, last = self.net
        hidden = [
            m for _ in range(depth) for m in (nn.Linear(first.out_features, first.out_features), nn.Tanh())
        ]
        self.net = nn.Sequential(first, act, *hidden, last)

    def configure_model(self) -> None:
        if not sharding():
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(self.net)


class GPTModule(LightningModule):
    """A 2-block GPT-2 built from a transformers config (tied input and output embeddings), fp64, trained
    on a per-example token loss; ``configure_model`` shards each block and then the whole model."""

    def __init__(self, n: int = 16, length: int = 8, vocab: int = 17) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab, n_embd=16, n_layer=2, n_head=2, n_positions=length)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        self.net = GPT2LMHeadModel(config).double()
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.steps: list[int] = []

    def configure_model(self) -> None:
        if not sharding():
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.net.transformer.h:
            fully_shard(block)
        fully_shard(self.net)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if not checking():
            self.steps.append(len(ids))
        logits = self.net(input_ids=ids).logits
        return per_example_token_loss(logits, ids, shift=True).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.ids), batch_size=len(self.ids))
