"""Write a random-init torchtune-format checkpoint (FullModelTorchTuneCheckpointer) of the tiny Llama-3."""

import os
import sys

import torch
from torchtune.models.llama3 import llama3

out_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ttbench/ckpt"
os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(0)
model = llama3(
    vocab_size=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=4,
    embed_dim=256,
    max_seq_len=256,
    intermediate_dim=768,
    rope_base=500000,
)
sd = {k: v.contiguous() for k, v in model.state_dict().items()}
torch.save(sd, os.path.join(out_dir, "model.pt"))
n = sum(v.numel() for v in sd.values())
print(f"saved {len(sd)} tensors, {n} params -> {out_dir}/model.pt")
