"""Held-out evaluation of a model in training: WER/CER per voice group, at 16 kHz and over a phone line.

Scores with the package's own greedy CTC decoder and edit distance (``cosystream.decoding.greedy``,
``cosystream.app.evaluate``), so a run's numbers are the ones ``cosystream eval`` would report.
"""

from __future__ import annotations

import numpy as np
import torch

from cosystream.app.evaluate import edit_distance
from cosystream.decoding.greedy import CtcDecoder
from cosystream.models.conv_ctc import ConvCtcModel
from training.augment import telephone
from training.corpus import HELD_OUT
from training.data import HOP


@torch.no_grad()
def evaluate(
    model: ConvCtcModel,
    groups,
    device,
    telephone_too: bool = True,
    batch_seconds: float = 120.0,
    examples: int = 0,
    decoders=None,
) -> dict:
    """WER/CER per group (``<group>`` at 16 kHz, ``<group>@8k-mulaw`` after a phone round trip).

    Greedy decoding, or ``decoders()`` (a ``cosystream.decoding.config.DecoderFactory``) fed the top-k
    log-probabilities of each frame, as the server does."""
    model.eval()
    greedy = CtcDecoder(list(model.vocabulary))
    results = {}
    conditions = [("", None)] + ([("@8k-mulaw", "mulaw")] if telephone_too else [])
    for name, (audios, texts) in groups.items():
        for suffix, codec in conditions:
            pcms = [a if codec is None else telephone(a * 0.9, codec) for a in audios]
            # Trailing 0.3 s of silence so the causal model can emit the last characters.
            pcms = [np.concatenate([p, np.zeros(4800, np.float32)]) for p in pcms]
            order = sorted(range(len(pcms)), key=lambda i: pcms[i].size)
            hyps: dict[int, str] = {}
            i = 0
            while i < len(order):
                j = i
                while j < len(order) and pcms[order[j]].size * (j - i + 1) <= batch_seconds * 16000:
                    j += 1
                j = max(j, i + 1)
                idx = order[i:j]
                longest = max(pcms[k].size for k in idx)
                batch = torch.zeros(len(idx), longest)
                for row, k in enumerate(idx):
                    batch[row, : pcms[k].size] = torch.from_numpy(pcms[k])
                logits = model(batch.to(device)).cpu()
                for row, k in enumerate(idx):
                    frames = pcms[k].size // HOP
                    if decoders is None:
                        # The argmax of the logits themselves; the decoder reads log-probabilities only
                        # for word confidences, which are not scored here.
                        ids = logits[row, :frames].argmax(-1).numpy()
                        greedy.reset()
                        greedy.push(ids, np.zeros(ids.shape, np.float32), 0)
                        hyps[k] = greedy.text
                        continue
                    best = torch.log_softmax(logits[row, :frames].float(), -1).topk(decoders.config.top_k, -1)
                    decoder = decoders()
                    decoder.push(best.indices.numpy(), best.values.numpy(), 0)
                    decoder.finalize()
                    hyps[k] = decoder.text
                i = j
            words = chars = werr = cerr = 0
            for k, ref in enumerate(texts):
                werr += edit_distance(ref.split(), hyps[k].split())
                cerr += edit_distance(list(ref), list(hyps[k]))
                words += len(ref.split())
                chars += len(ref)
            entry = {"wer": werr / max(1, words), "cer": cerr / max(1, chars), "n": len(texts)}
            if examples:
                entry["examples"] = [[texts[k], hyps[k]] for k in range(min(examples, len(texts)))]
            results[name + suffix] = entry
    held = [v for k, v in results.items() if k.split("@")[0] in HELD_OUT] or list(results.values())
    if held:
        results["held_out_mean"] = {
            "wer": float(np.mean([v["wer"] for v in held])),
            "cer": float(np.mean([v["cer"] for v in held])),
        }
    model.train()
    return results
