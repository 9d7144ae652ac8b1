"""The core correctness property: streaming ``step`` over any chunking reproduces the offline ``forward``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from cosystream.models import FRAME_SAMPLES, load_model, save_model
from cosystream.models.conv_ctc import ConvCtcConfig, ConvCtcModel
from tests.conftest import speech_like


def stream(model, pcm: torch.Tensor, chunk_frames: list[int]) -> torch.Tensor:
    """Step ``pcm [B, N]`` through ``model`` in chunks of the given frame counts (cycled)."""
    caches = model.init_caches(pcm.shape[0])
    outputs, start, i = [], 0, 0
    total = pcm.shape[1] // FRAME_SAMPLES
    while start < total:
        frames = min(chunk_frames[i % len(chunk_frames)], total - start)
        chunk = pcm[:, start * FRAME_SAMPLES : (start + frames) * FRAME_SAMPLES]
        logits, caches = model.step(chunk, caches)
        outputs.append(logits)
        start += frames
        i += 1
    return torch.cat(outputs, dim=1)


def assert_close(streamed: torch.Tensor, offline: torch.Tensor, rel: float) -> None:
    assert streamed.shape == offline.shape
    bound = rel * max(1.0, offline.abs().max().item())
    diff = (streamed - offline).abs().max().item()
    assert diff <= bound, f"max |streaming - offline| = {diff:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def pcm() -> torch.Tensor:
    return torch.from_numpy(np.stack([speech_like(3.0, seed=1), speech_like(3.0, seed=2)]))


@pytest.mark.parametrize(
    "chunks",
    [[1], [4], [16], [1, 4, 2, 16, 3, 1, 7], [33, 1, 1, 5], [300]],
    ids=["T1", "T4", "T16", "uneven", "uneven-large-first", "one-chunk"],
)
def test_streaming_equals_offline_float32(model, pcm, chunks):
    with torch.no_grad():
        offline = model(pcm)
        streamed = stream(model, pcm, chunks)
    assert offline.shape == (2, 300, len(model.vocabulary))
    assert_close(streamed, offline, 1e-4)


@pytest.mark.parametrize("chunks", [[1], [1, 4, 2, 16, 3]], ids=["T1", "uneven"])
def test_streaming_equals_offline_float64(model, pcm, chunks):
    double = copy.deepcopy(model).double()
    with torch.no_grad():
        offline = double(pcm.double())
        streamed = stream(double, pcm.double(), chunks)
    assert_close(streamed, offline, 1e-9)


@pytest.fixture(scope="module")
def lookahead_model():
    """Random weights with two centred blocks: 2 + 4 frames of right context."""
    torch.manual_seed(1)
    config = ConvCtcConfig(
        vocabulary=("<blank>", " ", "a", "b"), channels=32, dilations=(1, 2, 4, 2, 4), lookahead_blocks=2
    )
    model = ConvCtcModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))  # biases and norms off their neutral start
    return model


@pytest.mark.parametrize("chunks", [[1], [1, 4, 2, 16, 3, 1, 7], [300]], ids=["T1", "uneven", "one-chunk"])
def test_lookahead_blocks_stream_like_offline(lookahead_model, pcm, chunks):
    with torch.no_grad():
        offline = lookahead_model(pcm)
        streamed = stream(lookahead_model, pcm, chunks)
    assert_close(streamed, offline, 1e-4)


def test_lookahead_blocks_delay_the_output_by_their_right_context(lookahead_model, pcm):
    """Centred blocks whose convolutions add nothing pass the frame ``output_delay_frames`` back through
    their skip connections: the output is the causal blocks' output, that many frames later."""
    model = copy.deepcopy(lookahead_model)
    assert model.output_delay_frames == model.config.output_delay_frames == 2 + 4
    causal = copy.deepcopy(model)
    causal.blocks = causal.blocks[:3]
    with torch.no_grad():
        for block in model.blocks[3:]:
            block.conv.weight.zero_()
            block.conv.bias.zero_()
        delayed, reference = model(pcm), causal(pcm)
    assert_close(delayed[:, 6:], reference[:, :-6], 1e-5)
    assert not torch.allclose(delayed[:, 6:], reference[:, 6:], atol=1e-3)


def test_first_frames_match_from_frame_zero(model, pcm):
    """No warm-up frames are excluded: frame 0 of a stream already matches."""
    with torch.no_grad():
        offline = model(pcm[:, : 5 * FRAME_SAMPLES])
        first, _ = model.step(pcm[:, :FRAME_SAMPLES], model.init_caches(2))
    assert_close(first, offline[:, :1], 1e-5)


def test_streaming_detects_a_wrong_cache(model, pcm):
    """The comparison can fail: a cache that is not carried over breaks equality after frame 0."""
    with torch.no_grad():
        offline = model(pcm)
        outputs = [model.step(pcm[:, i : i + 1600], model.init_caches(2))[0] for i in range(0, 48000, 1600)]
    diff = (torch.cat(outputs, dim=1) - offline).abs().max().item()
    assert diff > 1e-2


def test_contract_names(model):
    assert model.vocabulary[0] == "<blank>" and model.vocabulary[1] == " "  # blank, then the word separator
    assert len(set(model.vocabulary)) == len(model.vocabulary)
    assert all(len(token) == 1 for token in model.vocabulary[1:])  # letters or phonemes, one character each
    specs = model.cache_specs()
    caches = model.init_caches(3)
    assert [tuple(c.shape) for c in caches] == [(3, *s.shape) for s in specs]
    assert all(c.dtype == s.dtype and not c.any() for c, s in zip(caches, specs, strict=True))


def test_receptive_field_is_half_to_one_second(model):
    frames = model.config.receptive_field_frames
    assert 50 <= frames <= 100
    # Audio older than the receptive field cannot change the current frame's output.
    x = torch.from_numpy(speech_like(2.0, seed=3))[None]
    y = x.clone()
    y[:, : 2 * 16000 - (frames + 3) * FRAME_SAMPLES] = 0  # keep the window's tail of samples too
    with torch.no_grad():
        assert torch.allclose(model(x)[:, -1], model(y)[:, -1], atol=1e-5)
        y[:, : 2 * 16000 - (frames - 5) * FRAME_SAMPLES] = 0
        assert not torch.equal(model(x)[:, -1], model(y)[:, -1])


def test_save_and_load_round_trip(model, tmp_path, pcm):
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.vocabulary == model.vocabulary
    with torch.no_grad():
        assert torch.equal(loaded(pcm), model(pcm))


def test_config_validation():
    with pytest.raises(ValueError, match="blank"):
        ConvCtcConfig(vocabulary=("<blank>",))
    with pytest.raises(ValueError, match="dilations"):
        ConvCtcConfig(vocabulary=("<blank>", "a"), dilations=(1, 0))
    with pytest.raises(ValueError, match="odd kernel_size"):
        ConvCtcConfig(vocabulary=("<blank>", "a"), kernel_size=2, lookahead_blocks=1)
    with pytest.raises(ValueError, match="lookahead_blocks"):
        ConvCtcConfig(vocabulary=("<blank>", "a"), dilations=(1, 2), lookahead_blocks=3)
    assert (
        ConvCtcConfig(vocabulary=("<blank>", "a"), dilations=(1, 2, 4, 8), lookahead_blocks=2).output_delay_frames
        == 12
    )


def test_unknown_architecture_is_refused(tmp_path, model):
    save_model(model, tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"conv_ctc"', '"transformer"'))
    with pytest.raises(ValueError, match="unknown architecture"):
        load_model(tmp_path)


@pytest.mark.parametrize("chunks", [[1], [1, 4, 2, 16, 3, 1, 7]], ids=["T1", "uneven"])
def test_the_light_model_streams_like_offline(pcm, chunks):
    """The packaged light model (``--model embedded:light``) keeps the contract too."""
    from cosystream.model_files import EMBEDDED_MODELS

    light = load_model(EMBEDDED_MODELS["light"]).eval()
    assert len(light.blocks) == 5 and light.vocabulary == load_model().vocabulary
    with torch.no_grad():
        assert_close(stream(light, pcm, chunks), light(pcm), rel=1e-4)
