#!/usr/bin/env python3
"""Writes the objectives' fixtures: DPO's and GRPO's losses, metrics and gradients as TRL computes
them (its DPOTrainer's and GRPOTrainer's formulas, written out in PyTorch here: TRL itself is not
installed where this runs), on the llama parity fixture's model with its PEFT adapter.

    python3 tests/parity/make_objective_fixtures.py [tests/fixtures/parity/llama] [tests/fixtures/objectives]

The policy is the model with the adapter; the reference is the same model with the adapter
disabled (PEFT's disable_adapter, as TRL does for a PEFT model). Rows are right-padded, fp32, CPU.
Writes OUT/dpo.safetensors + dpo.json and OUT/grpo.safetensors + grpo.json:
    input_ids, attention_mask, labels      the rows (-100: not a completion token)
    policy_logps, reference_logps          [rows, T]: each labelled token's log-probability (0 elsewhere)
    grad.<PEFT key>                        the gradient of the first case's loss
    *.json                                 each case's options, loss and metrics
Deterministic; never touches the network.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

src = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/parity/llama")
out = Path(sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/objectives")
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(11)
base = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32, attn_implementation="eager")
model = PeftModel.from_pretrained(base, src / "adapter", is_trainable=True)
model.eval()
vocab = base.config.vocab_size


def rows_of(prompts, completions):
    """Right-padded rows of prompt + completion, labelled on the completion."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, : len(p) + len(c)] = 1
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
    return ids, mask, labels


def token_logps(ids, mask, labels):
    """[rows, T]: log p(label t | tokens before t), 0 at t = 0 and where not labelled."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, labels[:, 1:].clamp(min=0).unsqueeze(2)).squeeze(2)
    logp = logp * (labels[:, 1:] != -100)
    return torch.cat([torch.zeros(ids.size(0), 1), logp], 1)


def lora_grads(loss):
    model.zero_grad()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            key = name.replace(".default", "")  # PEFT's saved key drops the adapter's name
            grads["grad." + key] = p.grad.detach().clone()
    return grads


def draw(n, low=4):
    return torch.randint(low, vocab, (n,)).tolist()


# ---- DPO: 3 pairs ----------------------------------------------------------------------------
prompts = [draw(4), draw(5), draw(3)]
chosen = [draw(3), draw(2), draw(4)]
rejected = [draw(2), draw(4), draw(3)]
ids, mask, labels = rows_of(prompts + prompts, chosen + rejected)
with torch.no_grad(), model.disable_adapter():
    reference = token_logps(ids, mask, labels)


def dpo(policy, case):
    """TRL DPOTrainer.dpo_loss for one batch of pairs (chosen rows first), with its metrics."""
    beta, loss_type, smoothing = case["beta"], case["loss_type"], case.get("label_smoothing", 0.0)
    n = policy.size(0) // 2
    tokens = (labels != -100).sum(1).clamp(min=1)
    pol, ref = policy.sum(1), reference.sum(1)
    if loss_type == "ipo":  # TRL averages IPO's log-probabilities over the completion's tokens
        pol, ref = pol / tokens, ref / tokens
    logits = (pol[:n] - pol[n:]) - (ref[:n] - ref[n:])
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * (pol[:n] - ref[:n]).detach()
    rejected_rewards = beta * (pol[n:] - ref[n:]).detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": pol[:n].detach().mean().item(),
        "logps/rejected": pol[n:].detach().mean().item(),
    }
    return losses.mean(), metrics


cases = [
    {"beta": 0.3, "loss_type": "sigmoid"},
    {"beta": 0.3, "loss_type": "sigmoid", "label_smoothing": 0.1},
    {"beta": 0.5, "loss_type": "ipo"},
    {"beta": 2.0, "loss_type": "hinge"},
]
tensors = {"input_ids": ids, "attention_mask": mask, "labels": labels, "reference_logps": reference}
for k, case in enumerate(cases):
    policy = token_logps(ids, mask, labels)
    loss, metrics = dpo(policy, case)
    case.update(loss=loss.item(), metrics=metrics)
    if k == 0:
        tensors["policy_logps"] = policy.detach()
        tensors.update(lora_grads(loss))
save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "dpo.safetensors"))
(out / "dpo.json").write_text(json.dumps({"pairs": 3, "cases": cases}, indent=1) + "\n")

# ---- GRPO: 2 prompts x 3 completions ------------------------------------------------------------
group, max_completion = 3, 5
prompts = [draw(4), draw(3)]
completions = [draw(k) for k in (2, 5, 3, 4, 1, 5)]
rewards = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.2, 0.9]], dtype=torch.float64)
ids, mask, labels = rows_of([p for p in prompts for _ in range(group)], completions)
with torch.no_grad(), model.disable_adapter():
    reference = token_logps(ids, mask, labels)


def advantages_of(scale):
    centred = rewards - rewards.mean(1, keepdim=True)
    if scale == "none":
        return centred
    spread = rewards.std(1, keepdim=True) if scale == "group" else rewards.std().expand(rewards.size(0), 1)
    return centred / (spread + 1e-4)


def grpo(policy, case):
    """TRL GRPOTrainer._compute_loss with one update per generation (old log-probabilities = the policy's, detached)."""
    adv = advantages_of(case["scale_rewards"]).reshape(-1).float().unsqueeze(1)
    completion_mask = (labels != -100).float()
    ratio = torch.exp(policy - policy.detach())
    clipped = torch.clamp(ratio, 1 - case["epsilon"], 1 + case["epsilon_high"])
    per_token = -torch.min(ratio * adv, clipped * adv)
    gap = reference - policy
    kl = torch.exp(gap) - gap - 1
    per_token = per_token + case["beta"] * kl
    if case["loss_type"] == "grpo":
        loss = ((per_token * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
    elif case["loss_type"] == "dr_grpo":
        loss = (per_token * completion_mask).sum() / (per_token.size(0) * max_completion)
    else:
        loss = (per_token * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
    metrics = {"kl": ((kl * completion_mask).sum() / completion_mask.sum()).item()}
    return loss, metrics


cases = [
    {"loss_type": "dapo", "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group"},
    {"loss_type": "grpo", "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.2, "scale_rewards": "batch"},
    {"loss_type": "dr_grpo", "beta": 0.1, "epsilon": 0.2, "epsilon_high": 0.2, "scale_rewards": "none"},
]
tensors = {"input_ids": ids, "attention_mask": mask, "labels": labels, "reference_logps": reference, "rewards": rewards}
for k, case in enumerate(cases):
    policy = token_logps(ids, mask, labels)
    loss, metrics = grpo(policy, case)
    case.update(loss=loss.item(), metrics=metrics, advantages=advantages_of(case["scale_rewards"]).reshape(-1).tolist())
    if k == 0:
        tensors["policy_logps"] = policy.detach()
        tensors.update(lora_grads(loss))
save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "grpo.safetensors"))
(out / "grpo.json").write_text(
    json.dumps({"group": group, "max_completion_length": max_completion, "cases": cases}, indent=1) + "\n")
print("wrote", out / "dpo.safetensors", out / "grpo.safetensors")
