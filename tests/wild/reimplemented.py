"""Faithful re-implementations, for the two wild models whose package has no importable torch class.

Each copies its package's architecture line for line, with the package's own module names, so the real
checkpoint loads into it with ``strict=True``; the docstring says where the original is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VoiceEncoder(nn.Module):
    """resemblyzer 0.1.4's speaker encoder (``resemblyzer/voice_encoder.py``), without its ``__init__``'s
    own ``torch.load`` and device handling: a 3-layer LSTM over 40 mel channels, a linear layer, ReLU,
    L2 norm. The package's module imports ``webrtcvad`` and ``librosa`` (not installed), and its
    constructor loads the weights itself, so it cannot be built on the meta device anyway.

    Its checkpoint also holds ``similarity_weight`` / ``similarity_bias``, training-only scalars of the
    GE2E loss that the class does not have (resemblyzer loads with ``strict=False`` for them).

    Example:
        >>> VoiceEncoder()(torch.randn(2, 160, 40)).shape
        torch.Size([2, 256])
    """

    def __init__(self, mel_n_channels: int = 40, hidden: int = 256, layers: int = 3, embedding: int = 256):
        super().__init__()
        self.lstm = nn.LSTM(mel_n_channels, hidden, layers, batch_first=True)
        self.linear = nn.Linear(hidden, embedding)
        self.relu = nn.ReLU()

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.lstm(mels)
        embeds_raw = self.relu(self.linear(hidden[-1]))
        return embeds_raw / torch.norm(embeds_raw, dim=1, keepdim=True)


class SileroVAD(nn.Module):
    """silero-vad 6.2.3's 16 kHz network as torch modules: ``silero_vad/tinygrad_model.py``'s
    ``TinySileroVAD`` (the package's only Python class for ``silero_vad_16k.safetensors``, written for
    tinygrad) translated op for op. The TorchScript archive ``silero_vad.jit`` holds the same network as
    ``_model`` (tests check the two agree), under its own names: see ``JIT_RENAME``.

    Input: 576 samples, the 64 last samples of the previous chunk then a 512-sample chunk; output: the
    speech probability of the chunk and the LSTM state for the next one.

    Example:
        >>> probability, state = SileroVAD()(torch.randn(3, 576))
        >>> probability.shape, state.shape
        (torch.Size([3, 1]), torch.Size([2, 3, 128]))
    """

    def __init__(self) -> None:
        super().__init__()
        self.n_fft, self.stride, self.pad = 256, 128, 64
        self.cutoff = self.n_fft // 2 + 1
        self.stft_conv = nn.Conv1d(1, 258, kernel_size=256, stride=self.stride, padding=0, bias=False)
        self.conv1 = nn.Conv1d(129, 128, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv1d(128, 64, kernel_size=3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(64, 64, kernel_size=3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(64, 128, kernel_size=3, stride=1, padding=1)
        self.lstm_cell = nn.LSTMCell(128, 128)
        self.final_conv = nn.Conv1d(128, 1, 1)

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = None if state is None else (state[0], state[1])
        x = F.pad(x, (0, self.pad), "reflect").unsqueeze(1)
        x = self.stft_conv(x)
        x = (x[:, : self.cutoff, :] ** 2 + x[:, self.cutoff :, :] ** 2).sqrt()
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        x = F.relu(self.conv4(x)).squeeze(-1)
        h, c = self.lstm_cell(x, hidden)
        x = F.relu(h.unsqueeze(-1))
        x = torch.sigmoid(self.final_conv(x))
        return x.squeeze(1).mean(dim=1).unsqueeze(1), torch.stack([h, c])


# The archive's 16 kHz network (under ``_model.``) in SileroVAD's names.
JIT_RENAME = {
    "stft.forward_basis_buffer": "stft_conv.weight",
    "encoder.0.reparam_conv.": "conv1.",
    "encoder.1.reparam_conv.": "conv2.",
    "encoder.2.reparam_conv.": "conv3.",
    "encoder.3.reparam_conv.": "conv4.",
    "decoder.rnn.": "lstm_cell.",
    "decoder.decoder.2.": "final_conv.",
}
