"""A video-diffusion + action-head shape trained with accelerate: a diffusers transformer (a tiny Flux) and a head
trained on its output, one optimizer over both, written as for one GPU; launched with and without
``parallelism_config_sp_size`` (tests/test_sequence_parallel.py, tests/test_sequence_parallel_fsdp2.py).

Under sequence parallelism the transformer's output is gathered (its ``_cp_plan``) and the head and the loss run on
the whole output on every rank of the sequence-parallel group. With ``--together`` (FSDP2 prepares one model) both
are one module, the head run in its forward, as a robot model holds its video model and its action head. One step
of AdamW with ``eps`` far above every gradient: its update is ``lr * g / (|g| + eps)``, linear in the gradient to
1e-6, so each parameter's change is its gradient, scaled. Prints ``RESULT {json}`` per rank: the loss and each
parameter's change, summed per module.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from tiny_sd3_flux import flux_transformer

EPS = 1e6
LR = 1e4  # a step of ~1e-2 * gradient


class WithHead(torch.nn.Module):
    """The transformer and its action head as one model: (the transformer's output, the actions)."""

    def __init__(self, transformer, head):
        super().__init__()
        self.transformer, self.head = transformer, head
        self._no_split_modules = transformer._no_split_modules  # FSDP's TRANSFORMER_BASED_WRAP: a group per block

    def forward(self, **inputs):
        output = self.transformer(**inputs, return_dict=False)[0]
        return output, self.head(output).mean(dim=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--together", action="store_true", help="one model holding both (FSDP2 takes one)")
    together = parser.parse_args().together
    accelerator = Accelerator()
    torch.manual_seed(0)
    transformer = flux_transformer()  # the tiny Flux of the official scripts' tests (tests/scripts/tiny_sd3_flux.py)
    head = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    before = {f"transformer.{n}": p.detach().clone() for n, p in transformer.named_parameters()}
    before.update({f"head.{n}": p.detach().clone() for n, p in head.named_parameters()})
    optimizer = torch.optim.AdamW(
        [*transformer.parameters(), *head.parameters()], lr=LR, eps=EPS, weight_decay=0.0, betas=(0.9, 0.999)
    )
    generator = torch.Generator().manual_seed(1)
    sample = {
        "hidden_states": torch.randn(64, 4, generator=generator),  # 8x8 latent tokens
        "encoder_hidden_states": torch.randn(16, 32, generator=generator),
        "pooled_projections": torch.randn(32, generator=generator),
        "target": torch.randn(64, 4, generator=generator),
        "actions": torch.randn(3, generator=generator),
    }
    loader = torch.utils.data.DataLoader([sample], batch_size=1)
    if together:
        model, optimizer, loader = accelerator.prepare(WithHead(transformer, head), optimizer, loader)
    else:
        transformer, head, optimizer, loader = accelerator.prepare(transformer, head, optimizer, loader)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1)
    img_ids = img_ids.reshape(64, 3)
    for batch in loader:
        inputs = {
            "hidden_states": batch["hidden_states"],
            "encoder_hidden_states": batch["encoder_hidden_states"],
            "pooled_projections": batch["pooled_projections"],
            "timestep": torch.tensor([0.5]),
            "img_ids": img_ids,
            "txt_ids": torch.zeros(16, 3),
        }
        # the diffusion loss on the transformer's output, and an action head reading the same output
        if together:
            output, actions = model(**inputs)
        else:
            output = transformer(**inputs, return_dict=False)[0]
            actions = head(output).mean(dim=1)
        loss = torch.nn.functional.mse_loss(output, batch["target"]) + torch.nn.functional.mse_loss(
            actions, batch["actions"]
        )
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if together:
        after = dict(accelerator.unwrap_model(model).named_parameters())
    else:
        after = {f"transformer.{n}": p for n, p in accelerator.unwrap_model(transformer).named_parameters()}
        after.update({f"head.{n}": p for n, p in accelerator.unwrap_model(head).named_parameters()})
    # FSDP2's parameters are DTensors, each rank holding a shard
    after = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in after.items()}
    change = {n: (after[n].detach().double() - before[n].double()).abs().sum().item() for n in before}
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": accelerator.process_index,
                "loss": loss.item(),
                "transformer": sum(v for n, v in change.items() if n.startswith("transformer.")),
                "head": sum(v for n, v in change.items() if n.startswith("head.")),
                "changes": change,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
