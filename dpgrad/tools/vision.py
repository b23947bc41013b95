"""Vision models of the benchmarks and the vision tests, with random weights: the WideResNet
with GroupNorm of DP image classification (De et al. 2022, "Unlocking High-Accuracy
Differentially Private Image Classification through Scale": WRN-16-4 on CIFAR-10), and Hugging
Face's ViT built from a config (transformers is an extra dependency).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def group_norm(channels: int, groups: int = 16) -> nn.GroupNorm:
    """GroupNorm in place of BatchNorm (which mixes the samples of a batch)."""
    return nn.GroupNorm(min(groups, channels), channels)


class WideBlock(nn.Module):
    """Pre-activation residual block: GroupNorm, ReLU, 3x3 convolution, twice; a 1x1 convolution
    on the shortcut where the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.norm1 = group_norm(c_in, groups)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm2 = group_norm(c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.shortcut = (nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
                         if stride != 1 or c_in != c_out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(h)
        h = self.conv1(h)
        h = self.conv2(torch.relu(self.norm2(h)))
        return h + skip


class WideResNet(nn.Module):
    """WRN-depth-width with GroupNorm: a 3x3 stem of 16 channels, three stages of (depth - 4) / 6
    blocks of 16w, 32w and 64w channels (strides 1, 2, 2), GroupNorm, ReLU, global average
    pooling and a Linear classifier. WRN-16-4: 2.7M parameters."""

    def __init__(self, depth: int = 16, width: int = 4, classes: int = 10, in_channels: int = 3,
                 groups: int = 16):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WideResNet depth {depth}: use 6n + 4 (10, 16, 22, 28, ...)")
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.stem = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        blocks = []
        for stage in range(3):
            for i in range(n):
                c_in = widths[stage] if i == 0 else widths[stage + 1]
                blocks.append(WideBlock(c_in, widths[stage + 1], 2 if stage and i == 0 else 1, groups))
        self.blocks = nn.Sequential(*blocks)
        self.norm = group_norm(widths[3], groups)
        self.head = nn.Linear(widths[3], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.blocks(self.stem(x))))
        return self.head(h.mean(dim=(2, 3)))


def vit(image_size: int = 224, patch_size: int = 16, hidden: int = 768, layers: int = 12, heads: int = 12,
        mlp: int = 3072, classes: int = 10, channels: int = 3) -> nn.Module:
    """Hugging Face's ``ViTForImageClassification`` from a config (ViT-B/16 by default), random
    weights, no dropout; its forward takes ``pixel_values`` and returns ``.logits``."""
    import transformers

    cfg = transformers.ViTConfig(image_size=image_size, patch_size=patch_size, hidden_size=hidden,
                                 num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=mlp,
                                 num_channels=channels, num_labels=classes, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg)


__all__ = ["WideBlock", "WideResNet", "group_norm", "vit"]
