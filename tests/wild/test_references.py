"""What the suite compares against is right: the re-implemented silero-vad is the shipped TorchScript
network, and the generated inputs are realistic enough that the real models hear what is in them."""

from __future__ import annotations

import numpy as np
import torch

from tests.wild import inputs, package_code
from tests.wild.classes import silero_jit
from tests.wild.matrix import reference
from tests.wild.models import BY_NAME


def test_the_silero_reimplementation_is_the_shipped_torchscript_network_bit_for_bit() -> None:
    chunks = inputs.vad_chunks()
    with torch.no_grad():
        shipped, _ = silero_jit()._model(chunks)
        ours, _ = BY_NAME["silero-vad"].original()(chunks)
    assert torch.equal(ours, shipped)


def test_silero_hears_the_synthetic_voice_and_not_the_silence_before_it() -> None:
    _, rows = reference(BY_NAME["silero-vad"])
    probabilities = rows.flatten()
    silence, voice = probabilities[:4], probabilities[5:]  # vad_chunks starts with four silent chunks
    assert silence.max() < 0.05 and voice.mean() > 0.25


def test_crepe_hears_the_pitch_of_the_synthetic_voice_within_a_third_of_a_semitone() -> None:
    seconds, hop, half = 1.0, 160, 512  # inputs.crepe_frames
    _, rows = reference(BY_NAME["crepe-tiny"])
    per_bin = package_code.definitions("torchcrepe", "core.py", ["CENTS_PER_BIN"], {})["CENTS_PER_BIN"]
    cents = per_bin * rows.argmax(dim=1).double() + 1997.3794084376191  # convert.bins_to_cents, no dither
    heard = 10 * 2 ** (cents / 1200)
    centres = np.arange(len(heard)) * hop  # torchcrepe pads half a window: frame i is centred on i * hop
    voiced = np.pad(inputs.voiced(seconds), half)  # False beyond the ends too
    inside = np.array([voiced[c : c + 2 * half].all() for c in centres])  # the whole window sounds
    played = torch.from_numpy(inputs.pitch(seconds)[centres[inside]])
    error = 1200 * torch.log2(heard[torch.from_numpy(inside)] / played).abs()
    assert error.median() < 33


def test_minilm_finds_the_paraphrase_closest_among_the_sentences() -> None:
    _, embeddings = reference(BY_NAME["minilm"])
    question = inputs.SENTENCES.index("How far is the train station from here?")
    paraphrase = inputs.SENTENCES.index("Is the railway station a long way from here?")
    similarity = embeddings @ embeddings[question]  # unit vectors: cosine
    similarity[question] = -1
    assert int(similarity.argmax()) == paraphrase and similarity[paraphrase] > 0.7
