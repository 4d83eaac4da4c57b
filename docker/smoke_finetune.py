"""One fine-tuning step inside the image: Fashion-MNIST IDX files in /data, a checkpoint in /runs out.

Used by build_local.sh until `edgetl finetune` lands; it drives the same library pieces
(build_network in repnet mode, Adam on the trainable parameters) for one step.
"""

import gzip
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import build_network

data, runs = Path(sys.argv[1]), Path(sys.argv[2])
with gzip.open(data / "train-images-idx3-ubyte.gz", "rb") as f:
    f.read(16)
    images = np.frombuffer(f.read(8 * 784), np.uint8).reshape(8, 1, 28, 28)
with gzip.open(data / "train-labels-idx1-ubyte.gz", "rb") as f:
    f.read(8)
    labels = torch.from_numpy(np.frombuffer(f.read(8), np.uint8).astype(np.int64))
x = torch.from_numpy(images.astype(np.float32) / 255.0).repeat(1, 3, 1, 1)
x = nn.functional.interpolate(x, size=(64, 64), mode="bilinear", align_corners=False)
torch.manual_seed(0)
net = build_network(BackboneSpec(width=0.35, num_classes=10), mode="repnet")
opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)
net.train()
loss = nn.functional.cross_entropy(net(x), labels)
loss.backward()
opt.step()
runs.mkdir(parents=True, exist_ok=True)
torch.save({"model": net.state_dict(), "step": 1}, runs / "last.pt")
print(f"one fine-tuning step: loss {loss.item():.4f}, saved {runs / 'last.pt'}")
