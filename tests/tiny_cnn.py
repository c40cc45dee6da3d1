"""The tiny CNN ``slimtorch slim`` runs on in tests (digits, 8x8): its source, written into a test's folder
as ``tiny.py`` and named on the command line as ``tiny.py:Tiny``."""

import textwrap

TINY = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            )
            self.classifier = nn.Linear(32, 10)

        def forward(self, x):
            return self.classifier(torch.flatten(self.features(x), 1))
    """
)
