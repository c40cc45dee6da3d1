"""Realistic inputs for the wild models, generated, deterministic, with no data file and no network.

Audio is synthetic voice: a harmonic tone whose pitch glides and wobbles (vibrato), in syllables with a
pause, over a little noise, at 16 kHz. Each model then gets it through its package's own preprocessing
where that is torch or NumPy code (torchcrepe's framing, resemblyzer's volume normalisation and partial
utterances, torchfcpe's mel extractor, pesto's CQT inside the model); resemblyzer's librosa mel
spectrogram is re-done with transformers' copy of librosa's filterbank. Text is real sentences through the
folder's own tokenizer. Faces are smooth synthetic crops, normalised as MTCNN normalises them.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Union

import numpy as np
import torch
import torch.nn.functional as F

from tests.wild import package_code

SAMPLE_RATE = 16000

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A checkpoint saved by an older library should still load today.",
    "Structured pruning removes whole channels from every tensor that carries them.",
    "How far is the train station from here?",
    "Is the railway station a long way from here?",
    "Quantized weights take a quarter of the memory of float ones.",
    "She sells sea shells by the sea shore.",
    "Rain is expected tomorrow afternoon in the north of the country, with sunny spells later.",
    "Hello!",
)


def pitch(seconds: float, low_hz: float = 110.0, high_hz: float = 220.0) -> np.ndarray:
    """The fundamental frequency of :func:`voiced_audio` at every sample: a glide from ``low_hz`` up to
    ``high_hz`` and back, with a 5.5 Hz vibrato of 2%."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    glide = 0.5 - 0.5 * np.cos(2 * np.pi * t / seconds)
    return low_hz * (high_hz / low_hz) ** glide * (1 + 0.02 * np.sin(2 * np.pi * 5.5 * t))


def voiced(seconds: float) -> np.ndarray:
    """Which samples of :func:`voiced_audio` sound (False in its pause)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return ~((t > 0.6 * seconds) & (t < 0.6 * seconds + 0.2))


def voiced_audio(
    seconds: float = 2.0, seed: int = 0, low_hz: float = 110.0, high_hz: float = 220.0
) -> np.ndarray:
    """Float32 samples in [-1, 1] at 16 kHz: eight harmonics on :func:`pitch`, three syllables a second,
    a 0.2 s pause at 60% of the way (:func:`voiced`), noise 40 dB down.

    Example:
        >>> voiced_audio(0.5).shape
        (8000,)
    """
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    phase = 2 * np.pi * np.cumsum(pitch(seconds, low_hz, high_hz)) / SAMPLE_RATE
    wave = sum(0.6**k * np.sin((k + 1) * phase + rng.uniform(0, 2 * np.pi)) for k in range(8))
    envelope = (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t) ** 2) * voiced(seconds)
    audio = 0.3 * wave / np.abs(wave).max() * envelope + rng.normal(0, 0.003, t.shape)
    return audio.astype(np.float32)


# -- text ----------------------------------------------------------------------------------------------------
def sentence_batch(folder: Path, max_length: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of :data:`SENTENCES`, padded to the longest, by the folder's
    ``tokenizer.json`` (the tokenizer sentence-transformers itself uses)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding()
    encoded = tokenizer.encode_batch(list(SENTENCES))
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded])
    return ids, mask


# -- resemblyzer ---------------------------------------------------------------------------------------------
@functools.cache
def _resemblyzer() -> dict:
    hparams = package_code.module("resemblyzer.hparams")
    audio = package_code.definitions("resemblyzer", "audio.py", ["int16_max", "normalize_volume"], {"np": np})
    names = {k: getattr(hparams, k) for k in dir(hparams) if not k.startswith("_")}
    encoder = package_code.definitions(
        "resemblyzer",
        "voice_encoder.py",
        ["VoiceEncoder"],
        {"np": np, "nn": torch.nn, "torch": torch, "Union": Union, "List": list, "Path": Path, **names},
    )["VoiceEncoder"]
    return {"hparams": hparams, **audio, "partial_slices": encoder.compute_partial_slices}


def speaker_partials(seconds: float = 2.5, seed: int = 1) -> torch.Tensor:
    """What ``VoiceEncoder.embed_utterance`` feeds its network: the utterance normalised to -30 dBFS
    (resemblyzer's ``normalize_volume``), its 40-channel mel spectrogram (25 ms windows, 10 ms hop; as
    librosa computes it), cut into 1.6 s partial utterances by resemblyzer's ``compute_partial_slices``.
    (resemblyzer also trims long silences with webrtcvad, which is not installed: its pause is kept.)

    Example:
        >>> speaker_partials().shape
        torch.Size([2, 160, 40])
    """
    from transformers.audio_utils import mel_filter_bank

    r = _resemblyzer()
    hp = r["hparams"]
    wav = r["normalize_volume"](
        voiced_audio(seconds, seed, 90.0, 180.0), hp.audio_norm_target_dBFS, increase_only=True
    )
    wav_slices, mel_slices = r["partial_slices"](len(wav), 1.3, 0.75)
    wav = np.pad(wav, (0, max(0, wav_slices[-1].stop - len(wav))))
    n_fft = int(hp.sampling_rate * hp.mel_window_length / 1000)
    hop = int(hp.sampling_rate * hp.mel_window_step / 1000)
    spectrum = torch.stft(
        torch.from_numpy(wav.astype(np.float32)),
        n_fft,
        hop,
        window=torch.hann_window(n_fft),
        center=True,
        pad_mode="constant",
        return_complex=True,
    )
    filters = mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=hp.mel_n_channels,
        min_frequency=0.0,
        max_frequency=hp.sampling_rate / 2,
        sampling_rate=hp.sampling_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    mel = (torch.from_numpy(filters.T).float() @ spectrum.abs().pow(2)).T
    return torch.stack([mel[s] for s in mel_slices]).float()


# -- torchcrepe ----------------------------------------------------------------------------------------------
def crepe_frames(seconds: float = 1.0, seed: int = 2, hop: int = 160) -> torch.Tensor:
    """torchcrepe's own ``preprocess``: 1024-sample frames every 10 ms, each mean-centred and scaled to
    unit standard deviation.

    Example:
        >>> crepe_frames().shape
        torch.Size([101, 1024])
    """
    core = package_code.definitions("torchcrepe", "core.py", ["SAMPLE_RATE", "WINDOW_SIZE"], {})
    preprocess = package_code.definitions(
        "torchcrepe", "core.py", ["preprocess"], {"torch": torch, "resample": None, **core}
    )["preprocess"]
    audio = torch.from_numpy(voiced_audio(seconds, seed))[None]
    return torch.cat(list(preprocess(audio, SAMPLE_RATE, hop)))


# -- torchfcpe -----------------------------------------------------------------------------------------------
def fcpe_mels(config: dict, seconds: float = 1.0, seed: int = 3) -> torch.Tensor:
    """torchfcpe's own ``MelModule`` with the checkpoint's mel settings: (2, frames, 128) log-mels."""
    mel_fn = package_code.module("torchfcpe.mel_fn_librosa").mel
    mel_module = package_code.definitions(
        "torchfcpe",
        "mel_extractor.py",
        ["dynamic_range_compression_torch", "HannWindow", "MelModule"],
        {"torch": torch, "np": np, "F": F, "librosa_mel_fn": mel_fn},
    )["MelModule"]
    mel = config["mel"]
    extract = mel_module(
        mel["sr"], mel["num_mels"], mel["n_fft"], mel["win_size"], mel["hop_size"], mel["fmin"], mel["fmax"]
    )
    audio = np.stack([voiced_audio(seconds, seed), voiced_audio(seconds, seed + 1, 220.0, 440.0)])
    return extract(torch.from_numpy(audio)[..., None])


# -- pesto, silero -------------------------------------------------------------------------------------------
def waveforms(seconds: float = 2.5, seed: int = 4) -> torch.Tensor:
    """Two voices, a low and a high one: (2, samples). pesto's lowest CQT filter (27.5 Hz) is 32768
    samples long and its padding reflects the audio, so it takes more than 16384 samples."""
    return torch.from_numpy(
        np.stack([voiced_audio(seconds, seed), voiced_audio(seconds, seed + 1, 220.0, 440.0)])
    )


def vad_chunks(seconds: float = 1.5, seed: int = 5, chunk: int = 512, context: int = 64) -> torch.Tensor:
    """What silero-vad's wrapper hands its 16 kHz network: each 512-sample chunk after the 64 samples
    before it, (chunks, 576); silence, noise and voice among them."""
    audio = np.concatenate([np.zeros(4 * chunk, np.float32), voiced_audio(seconds, seed)])
    audio = np.pad(audio, (context, (-len(audio)) % chunk))
    starts = range(context, len(audio) - chunk + 1, chunk)
    return torch.from_numpy(np.stack([audio[s - context : s + chunk] for s in starts]))


# -- facenet MTCNN -------------------------------------------------------------------------------------------
def face_crops(size: int, count: int = 4, seed: int = 6) -> torch.Tensor:
    """(count, 3, size, size) crops as MTCNN's stages see them, ``(pixel - 127.5) / 128``: a skin-toned
    oval with two eyes, brows and a mouth on a shaded background, smooth edges, some faces shifted and
    scaled as a detector's candidate boxes are.

    Example:
        >>> face_crops(12).shape
        torch.Size([4, 3, 12, 12])
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / (size - 1) * 2 - 1  # [-1, 1]
    crops = []
    for _ in range(count):
        dx, dy, scale = rng.uniform(-0.15, 0.15), rng.uniform(-0.15, 0.15), rng.uniform(0.8, 1.1)
        u, v = (x - dx) / scale, (y - dy) / scale
        background = rng.uniform(40, 200, 3)[:, None, None] * (0.8 + 0.2 * (x + y)[None])
        skin = np.array([rng.uniform(150, 230), rng.uniform(110, 180), rng.uniform(90, 150)])[:, None, None]
        face = _soft(1 - (u / 0.7) ** 2 - (v / 0.9) ** 2, size)
        dark = sum(_soft(1 - ((u - ex) / 0.14) ** 2 - ((v + 0.25) / 0.09) ** 2, size) for ex in (-0.3, 0.3))
        brows = sum(_soft(1 - ((u - ex) / 0.2) ** 2 - ((v + 0.45) / 0.04) ** 2, size) for ex in (-0.3, 0.3))
        mouth = _soft(1 - (u / 0.3) ** 2 - ((v - 0.45) / 0.07) ** 2, size)
        image = background * (1 - face) + skin * face
        image = image * (1 - 0.7 * np.clip(dark + brows, 0, 1)) * (1 - 0.4 * mouth)
        crops.append(image + rng.normal(0, 2.0, image.shape))
    pixels = np.clip(np.stack(crops), 0, 255).astype(np.float32)
    return (torch.from_numpy(pixels) - 127.5) * 0.0078125


def _soft(inside: np.ndarray, size: int) -> np.ndarray:
    """1 inside a shape, 0 outside, with an edge about a pixel wide."""
    return 0.5 * (1 + np.tanh(inside * size / 8))  # the logistic function, without overflow


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """The lowest cosine similarity between matching rows of two (rows, features) tensors.

    Example:
        >>> cosine_rows(torch.ones(2, 3), torch.ones(2, 3))
        1.0
    """
    a, b = a.double().flatten(1), b.double().flatten(1)
    if a.shape != b.shape:
        raise ValueError(f"outputs differ in shape: {list(a.shape)} and {list(b.shape)}")
    cosine = F.cosine_similarity(a, b, dim=1, eps=1e-30)
    return float(cosine.min()) if not math.isnan(float(cosine.min())) else 0.0
