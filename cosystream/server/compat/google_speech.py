"""``google.cloud.speech.v1.Speech/StreamingRecognize`` over the native servicer, and the config checks
and result fields the whole-file methods (google_recognize.py, which serves the service) share with it.

The messages are the google-cloud-speech wheel's own (its proto-plus types expose their protobuf classes
through ``.pb()``).

Mapping decisions (docs/COMPAT.md has the user-facing list):
  * exactly one of results / speech event per response; the ``error`` field is never used (errors end
    the stream with a status, as Google's service does);
  * SPEECH_ACTIVITY_BEGIN / END only with ``enable_voice_activity_events``, with ``speech_event_time``;
  * ``enable_separate_recognition_per_channel`` with ``audio_channel_count`` N > 1: a native session per
    channel, results tagged ``channel_tag`` 1..N (streams and whole files alike);
  * ``single_utterance``: at the first utterance's end, END_OF_SINGLE_UTTERANCE, then its final, then
    the stream ends with OK (audio sent after the event is not recognized);
  * finals carry ``confidence`` and, when asked, words (Duration offsets from the start of the stream);
    interims carry ``stability`` and no words, as Google's do;
  * ``config.model`` that names a served model picks it; any other name (Google's "latest_long",
    "phone_call", "default", ...) gets the default model rather than an error, so clients written for
    Google keep working;
  * before the first response, UNAVAILABLE becomes RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED becomes
    OUT_OF_RANGE: the client retries the former two with a request iterator it has already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import MappingProxyType

import grpc
from google.cloud.speech_v1.types import cloud_speech

from cosystream.audio.codecs import AudioEncoding
from cosystream.decoding.greedy import MAX_ALTERNATIVES
from cosystream.decoding.phrases import MAX_BOOST
from cosystream.engine.ipc import EngineInfo
from cosystream.server.compat.bridge import AudioFormat, CompatError, StreamAdapter, Translation, context_phrases
from cosystream.v1 import cosystream_pb2 as pb

SERVICE_NAME = "google.cloud.speech.v1.Speech"
LANGUAGES = ("en-us",)  # compared lower-case; an empty language_code is accepted too

Request = cloud_speech.StreamingRecognizeRequest.pb()
Response = cloud_speech.StreamingRecognizeResponse.pb()
RecognitionConfig = cloud_speech.RecognitionConfig.pb()

_ENCODINGS = {
    RecognitionConfig.ENCODING_UNSPECIFIED: AudioEncoding.UNSPECIFIED,
    RecognitionConfig.LINEAR16: AudioEncoding.LINEAR16,
    RecognitionConfig.MULAW: AudioEncoding.MULAW,
}
STREAM_ENCODINGS = {  # streams only: decoded as they arrive (cosystream.audio.streams)
    RecognitionConfig.FLAC: AudioEncoding.FLAC,
    RecognitionConfig.OGG_OPUS: AudioEncoding.OGG_OPUS,
    RecognitionConfig.WEBM_OPUS: AudioEncoding.WEBM_OPUS,
}
FILE_ENCODINGS = frozenset(
    {RecognitionConfig.FLAC, RecognitionConfig.OGG_OPUS, RecognitionConfig.MP3}
)  # whole-file requests only: decoded by their header (cosystream.audio.files)
ENCODING_NAMES = {  # for messages (A-law can only come from a WAV header)
    AudioEncoding.UNSPECIFIED: "ENCODING_UNSPECIFIED",
    AudioEncoding.LINEAR16: "LINEAR16",
    AudioEncoding.MULAW: "MULAW",
    AudioEncoding.FLAC: "FLAC",
    AudioEncoding.OGG_OPUS: "OGG_OPUS",
    AudioEncoding.WEBM_OPUS: "WEBM_OPUS",
}
# Google's client retries these two before the first response with a request iterator it has consumed.
EARLY_CODES = MappingProxyType(
    {
        grpc.StatusCode.UNAVAILABLE: grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED: grpc.StatusCode.OUT_OF_RANGE,
    }
)
_ENCODING_ENUM = RecognitionConfig.DESCRIPTOR.enum_types_by_name["AudioEncoding"]
_BAD = grpc.StatusCode.INVALID_ARGUMENT


def check_config(config, info: EngineInfo, files: bool = False) -> tuple[AudioFormat, pb.StreamingConfig]:
    """The audio a ``RecognitionConfig`` declares and the native config it asks for; raises
    :class:`CompatError` for one this server refuses. ``files``: a whole-file request, which may also
    declare a file format (:data:`FILE_ENCODINGS`: decoded from its header)."""
    if config.language_code.lower() not in ("", *LANGUAGES):
        raise CompatError(_BAD, "Invalid recognition 'config': bad language code.")
    streamed = not files and config.encoding in STREAM_ENCODINGS
    if config.encoding not in _ENCODINGS and not (files and config.encoding in FILE_ENCODINGS) and not streamed:
        name = _ENCODING_ENUM.values_by_number.get(config.encoding)
        name = name.name if name is not None else str(config.encoding)
        usable = (
            "LINEAR16, MULAW, FLAC, OGG_OPUS or MP3" if files else "LINEAR16, MULAW, FLAC, OGG_OPUS or WEBM_OPUS"
        )
        raise CompatError(
            _BAD,
            f"Invalid recognition 'config': encoding {name} is not supported by this server: "
            f"use {usable}, or send a WAV file with the encoding unspecified",
        )
    for unsupported in _unhonoured(config):
        raise CompatError(_BAD, f"Invalid recognition 'config': {unsupported} is not supported by this server")
    declared = AudioFormat(
        STREAM_ENCODINGS[config.encoding]
        if streamed
        else _ENCODINGS.get(config.encoding, AudioEncoding.UNSPECIFIED),
        config.sample_rate_hertz,
        config.audio_channel_count,
    )
    model = info.model_index(config.model)  # None for Google's own names: the default, 0, as ""
    native = pb.StreamingConfig(
        enable_word_time_offsets=config.enable_word_time_offsets or config.enable_word_confidence,
        model=info.models[model].name if model else "",
        enable_automatic_punctuation=config.enable_automatic_punctuation,
        max_alternatives=min(max(config.max_alternatives, 0), MAX_ALTERNATIVES),  # Google: "up to"
        phrases=context_phrases(config.speech_contexts) + adaptation_phrases(config.adaptation),
        vocabulary=adaptation_vocabulary(config.adaptation),
    )
    return declared, native


def adaptation_phrases(adaptation) -> list[pb.Phrase]:
    """``adaptation.phrase_sets`` (inline phrase sets) as phrases: each phrase its own boost, else its set's."""
    return [
        pb.Phrase(text=phrase.value, boost=min(phrase.boost or phrase_set.boost, MAX_BOOST))
        for phrase_set in adaptation.phrase_sets
        for phrase in phrase_set.phrases
    ]


def adaptation_vocabulary(adaptation) -> str:
    """``adaptation.phrase_set_references`` (``projects/P/locations/L/phraseSets/NAME``): the server's named
    vocabulary NAME (serve --vocabulary NAME=FILE). One per stream; an unknown name is refused (the native
    message lists those the server has)."""
    references = list(adaptation.phrase_set_references)
    if len(references) > 1:
        raise CompatError(
            _BAD, "Invalid recognition 'config': one adaptation.phrase_set_references per stream is supported"
        )
    return references[0].rstrip("/").rsplit("/", 1)[-1] if references else ""


def _unhonoured(config) -> list[str]:
    """The fields set in ``config`` that would change what the client gets and that this server cannot
        honour (docs/COMPAT.md): refused rather than ignored. ``speech_contexts`` and ``adaptation``'s phrase
    sets are boosted phrases, its phrase set references the server's named vocabularies; ``use_enhanced`` and
    ``metadata`` are ignored."""
    unhonoured = []
    languages = [code for code in config.alternative_language_codes if code.lower() not in LANGUAGES]
    if languages:
        unhonoured.append(f"alternative_language_codes {', '.join(languages)} (en-US only)")
    if config.profanity_filter:
        unhonoured.append("profanity_filter (transcripts are not masked)")
    if config.HasField("diarization_config") and config.diarization_config.enable_speaker_diarization:
        unhonoured.append("diarization_config.enable_speaker_diarization (no speaker tags)")
    if config.HasField("enable_spoken_punctuation") and config.enable_spoken_punctuation.value:
        unhonoured.append("enable_spoken_punctuation")
    if config.HasField("enable_spoken_emojis") and config.enable_spoken_emojis.value:
        unhonoured.append("enable_spoken_emojis")
    if config.HasField("transcript_normalization") and config.transcript_normalization.entries:
        unhonoured.append("transcript_normalization")
    if config.adaptation.custom_classes or config.adaptation.abnf_grammar.abnf_strings:
        what = "custom_classes" if config.adaptation.custom_classes else "abnf_grammar"
        unhonoured.append(f"adaptation.{what} (phrase sets and speech_contexts are boosted; classes are not)")
    return unhonoured


def fill_alternatives(result, native: pb.StreamingResult, word_time_offsets: bool, word_confidence: bool) -> None:
    """A final's alternatives on a Google ``SpeechRecognitionResult``: its n best when the stream asked for
    more than one (best first, the first the transcript), else the transcript alone."""
    for entry in native.alternatives or [native]:
        alternative = result.alternatives.add(transcript=entry.transcript)
        fill_final(alternative, entry, word_time_offsets, word_confidence)


def fill_final(alternative, native, word_time_offsets: bool, word_confidence: bool) -> None:
    """A final's confidence and words on a Google ``SpeechRecognitionAlternative``."""
    alternative.confidence = native.confidence
    for word in native.words:
        info = alternative.words.add(word=word.word)
        if word_time_offsets:
            info.start_time.FromMilliseconds(word.start_ms)
            info.end_time.FromMilliseconds(word.end_ms)
        if word_confidence:
            info.confidence = word.confidence


class GoogleTranslation(Translation):
    encoding_names = ENCODING_NAMES

    def __init__(self, first, info: EngineInfo):
        if first is None or not first.HasField("streaming_config"):
            raise CompatError(_BAD, "Malordered Data Received. Send exactly one config, followed by audio data.")
        streaming = first.streaming_config
        config = streaming.config
        self.declared, self.native_config = check_config(config, info)
        self.native_config.interim_results = streaming.interim_results
        self.single_utterance = streaming.single_utterance
        self.voice_events = streaming.enable_voice_activity_events
        self.word_time_offsets = config.enable_word_time_offsets
        self.word_confidence = config.enable_word_confidence
        self.language = (config.language_code or "en-US").lower()
        if streaming.HasField("voice_activity_timeout"):
            raise CompatError(
                _BAD,
                "voice_activity_timeout is not supported by this server: a stream ends when the client ends "
                "it, or after the server's idle timeout without audio",
            )
        self.separate_channels = config.enable_separate_recognition_per_channel
        if self.separate_channels and self.single_utterance:
            raise CompatError(
                _BAD,
                "Invalid recognition 'config': single_utterance and enable_separate_recognition_per_channel "
                "cannot be combined here",
            )

    def _event(self, kind: int, offset_ms: int | None = None) -> Response:
        response = Response(speech_event_type=kind)
        if offset_ms is not None:
            response.speech_event_time.FromMilliseconds(offset_ms)
        return response

    def translate(self, response: pb.StreamingRecognizeResponse, channel_tag: int = 0) -> Iterator[Response]:
        if response.HasField("speech_event"):
            event = response.speech_event
            if event.type == pb.SpeechEvent.SPEECH_STARTED and self.voice_events:
                yield self._event(Response.SPEECH_ACTIVITY_BEGIN, event.offset_ms)
            elif event.type == pb.SpeechEvent.SPEECH_ENDED:
                if self.voice_events:
                    yield self._event(Response.SPEECH_ACTIVITY_END, event.offset_ms)
                if self.single_utterance:
                    self.stop_audio = True
                    yield self._event(Response.END_OF_SINGLE_UTTERANCE)
        for native in response.results:
            out = Response()
            result = out.results.add(
                is_final=native.is_final, language_code=self.language, channel_tag=channel_tag
            )
            result.result_end_time.FromMilliseconds(native.end_ms)
            if native.is_final:
                fill_alternatives(result, native, self.word_time_offsets, self.word_confidence)
                self.done = self.single_utterance
            else:
                result.alternatives.add(transcript=native.transcript)
                result.stability = native.stability
            yield out


class GoogleSpeechAdapter(StreamAdapter):
    translation = GoogleTranslation
    early_codes = EARLY_CODES

    def open(self, first) -> GoogleTranslation:
        return GoogleTranslation(first, self.servicer.info)
