"""WideResNet-16-4 with GroupNorm for 32×32 images, the standard model of the DP image-classification
literature (De et al. 2022, "Unlocking high-accuracy differentially private image classification through
scale"), built from its definition (Zagoruyko & Komodakis 2016) with torch only, so the GPU check can
import it without the recipes' dependencies."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class WideBlock(nn.Module):
    """Pre-activation wide residual block with ``GroupNorm(groups, ·)`` in place of BatchNorm: norm → ReLU →
    3×3 conv → norm → ReLU → 3×3 conv, plus the input, or plus a 1×1 convolution of the activated input
    where the width or the stride changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int = 16) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(groups, c_in), nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.n2, self.c2 = nn.GroupNorm(groups, c_out), nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.short = None if c_in == c_out and stride == 1 else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        o = F.relu(self.n1(x))
        y = self.c2(F.relu(self.n2(self.c1(o))))
        return y + (x if self.short is None else self.short(o))


def wide_resnet(depth: int = 16, width: int = 4, classes: int = 10, groups: int = 16) -> nn.Sequential:
    """WideResNet-depth-width: a 3×3 stem (3→16), three stages of (depth − 4)/6 :class:`WideBlock` s at
    widths 16·width, 32·width and 64·width (strides 1, 2, 2), then norm → ReLU → global average pool →
    Linear. WRN-16-4 with 10 classes has 2,748,890 parameters. De et al. also standardise the convolutions'
    weights; that is left out: a plain ``nn.Conv2d`` is what PyTorch users of the model train."""
    n = (depth - 4) // 6
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False)]
    c = 16
    for stage, c_out in enumerate((16 * width, 32 * width, 64 * width)):
        for i in range(n):
            layers.append(WideBlock(c, c_out, 2 if stage and not i else 1, groups))
            c = c_out
    layers += [
        nn.GroupNorm(groups, c),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, classes),
    ]
    return nn.Sequential(*layers)
