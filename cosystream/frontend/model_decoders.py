"""What makes each served model's decoders, in one frontend, kept in step with the engine's models.

At start-up every served model gets its decoder setup (the app's decoder config for it). A model the engine
loads while serving is made ready here before it serves (``prepare``, answering the engine's ``Prepare``: its
language model is read in a low-priority thread while the streams go on); when the engine's models change
(``models_changed``) those no longer served are dropped. Models alike (same decoder config, vocabulary, and
language model and lexicon of the same contents) share one setup.

Phrase boosting is made ready the same way: the named vocabularies are built for each setup in a
low-priority thread at start-up and as a new version is prepared, and so are the phrase lists of the streams
live on that model, so that a stream moved to the new version finds its own built (``DecoderFactory.cached``)
instead of building it on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable

from cosystream.decoding.config import DecoderConfig, DecoderFactory
from cosystream.decoding.phrases import Phrase, PhraseError
from cosystream.engine.ipc import EngineInfo, ModelInfo

log = logging.getLogger(__name__)


def fingerprint(path: str | None) -> tuple | None:
    """A file's size and SHA-256 (None: no file)."""
    if path is None:
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return (os.path.getsize(path), digest.hexdigest())


def _lowest_priority() -> None:
    """This thread at the lowest CPU priority (Linux schedules threads on their own): reading a language model
    or building a vocabulary takes seconds of CPU that the frontend's streams and the engine need more."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class ModelDecoders:
    def __init__(
        self,
        engine,
        decoder: DecoderConfig,
        resolved: tuple[tuple[str, DecoderConfig], ...] = (),
        vocabularies: tuple[tuple[str, tuple[Phrase, ...]], ...] = (),
        phrase_lists: Callable[[str], list[tuple[tuple[Phrase, ...], str]]] = lambda model: [],
    ):
        """``engine``: its ``info`` is the truth (``engine_client.Engine``); ``decoder``: the decoder asked for,
        resolved against each model's files; ``resolved``: the app's result for the models served at start-up,
        by name; ``vocabularies``: the named vocabularies (name, phrases); ``phrase_lists``: the (phrases,
        vocabulary name) of the live streams on a model, by its name (called on the event loop)."""
        self.engine = engine
        self.vocabularies = dict(vocabularies)
        self._phrase_lists = phrase_lists
        self.decoder_config = decoder
        by_name = dict(resolved)
        # (for those files only: a version loaded later under one of these names is resolved against its own)
        self._startup = {
            m.name: ((m.path, m.version), by_name[m.name]) for m in engine.info.models if m.name in by_name
        }
        self._factories: dict[tuple, DecoderFactory] = {}
        # Per model id (``ModelInfo.id``) served: its files (path, version) and what makes its decoders.
        self._by_id: dict[int, tuple[tuple, DecoderFactory]] = {}
        for model in engine.info.models:
            self._by_id[model.id] = ((model.path, model.version), self._make(model))
        engine.on_prepare = self.prepare
        engine.on_models = self.models_changed
        if self.vocabularies:
            factories = list({id(f): f for _, f in self._by_id.values()}.values())
            threading.Thread(
                target=lambda: [self._build(f, []) for f in factories], daemon=True, name="vocabularies"
            ).start()

    def _build(self, factory: DecoderFactory, lists: list[tuple[tuple[Phrase, ...], str]]) -> None:
        """Build the named vocabularies and ``lists`` for ``factory`` (at the lowest priority, in this thread)."""
        _lowest_priority()
        if not factory.can_boost:
            return
        for name, phrases in self.vocabularies.items():
            try:
                factory.named(name, phrases)
            except PhraseError as err:
                log.warning("vocabulary %s cannot be boosted: %s", name, err)
        for phrases, name in lists:
            with contextlib.suppress(PhraseError):  # (the stream is told when it moves)
                factory.boosting(phrases, (name, self.vocabularies[name]) if name else None)

    def decoder(self, model: ModelInfo) -> DecoderFactory:
        """What makes decoders for ``model``; raises ``ValueError`` saying why it cannot be decoded."""
        entry = self._by_id.get(model.id)
        if entry is not None and entry[0] == (model.path, model.version):
            return entry[1]
        return self._make(model)

    def _make(self, model: ModelInfo) -> DecoderFactory:
        files, decoder = self._startup.get(model.name, (None, None))
        if decoder is None or files != (model.path, model.version):
            decoder = self.decoder_config.resolve(model.path)
        top_k = self.engine.info.top_k
        if decoder.top_k > top_k:
            raise ValueError(
                f"the {decoder.kind} decoder reads {decoder.top_k} token candidates per frame, but "
                f"the engine sends {top_k} (EngineConfig.top_k)"
            )
        # Keyed by the language model's and lexicon's contents, not their paths: a new version of a model that
        # ships the same ones (new weights, say) shares the setup already loaded.
        contents = (fingerprint(decoder.lm_path), fingerprint(decoder.lexicon_path))
        key = (dataclasses.replace(decoder, lm_path=None, lexicon_path=None), contents, tuple(model.vocabulary))
        if key not in self._factories:
            factory = DecoderFactory(decoder, model.vocabulary)
            factory()  # (a vocabulary the decoder cannot take fails here, not in a stream)
            self._factories[key] = factory
        return self._factories[key]

    async def prepare(self, model: ModelInfo) -> str:
        """Make ready to decode ``model``, loaded by the engine and not yet served; "" or why it cannot be
        decoded."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        lists = self._phrase_lists(model.name)

        def prepare() -> None:
            _lowest_priority()
            try:
                outcome = (self._make(model), "")
            except (ValueError, OSError) as err:
                outcome = (None, str(err) or type(err).__name__)
            if outcome[0] is not None and (lists or self.vocabularies):
                started = time.perf_counter()
                self._build(outcome[0], lists)
                log.info(
                    "model %s version %s: its vocabularies and the phrases of %d live streams built in %.2f s",
                    model.name,
                    model.version,
                    len(lists),
                    time.perf_counter() - started,
                )
            loop.call_soon_threadsafe(done.set_result, outcome)

        # (A thread of its own, not the default pool's: its lowered priority dies with it.)
        threading.Thread(target=prepare, daemon=True, name="decoder-prepare").start()
        factory, error = await done
        if factory is not None:
            self._by_id[model.id] = ((model.path, model.version), factory)
        return error

    def models_changed(self, info: EngineInfo) -> None:
        """The engine serves ``info.models`` now (a ``Models`` event, or a restarted engine's ``Hello``): a setup for
        each (made ready by ``prepare``, unless the engine restarted), none for those gone."""
        by_id = {}
        for model in info.models:
            try:
                by_id[model.id] = ((model.path, model.version), self.decoder(model))
            except ValueError as err:  # (every frontend prepared it: only a restarted engine gets here)
                log.error("model %s cannot be decoded here: %s", model.name, err)
        self._by_id = by_id
