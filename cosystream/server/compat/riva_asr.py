"""``nvidia.riva.asr.RivaSpeechRecognition`` (StreamingRecognize, offline Recognize,
GetRivaSpeechRecognitionConfig) over the native servicer, with the message classes the nvidia-riva-client wheel ships (``riva/client/proto``).

Mapping decisions (docs/COMPAT.md has the user-facing list):
  * each native result becomes one response with one result and one alternative; speech events have no
    Riva counterpart and are dropped;
  * ``audio_processed`` is float seconds, word ``start_time`` / ``end_time`` int32 ms from the start of
    the stream (Riva's units);
  * ``endpointing_config.stop_history`` (ms) becomes the native ``silence_ms`` (rounded up to 10 ms);
  * ``config.model`` names a served model (empty: the default); any other is Riva's "Unavailable model";
  * the request ``id`` of the first request is echoed on every response;
  * status codes are the native ones (Riva's client does not retry);
  * offline ``Recognize`` runs the request's audio as one BATCH session (whole_file.py): raw LINEAR_PCM /
    MULAW / ALAW, or a file (WAV header, FLAC, OGGOPUS) decoded by its header, up to
    ``FileLimits.long_audio_s``; one result per utterance's final, ``audio_processed`` its end.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_audio_pb2 as raudio

from cosystream.audio.codecs import AudioEncoding
from cosystream.decoding.greedy import MAX_ALTERNATIVES
from cosystream.engine.ipc import EngineInfo
from cosystream.server.auth import current_token
from cosystream.server.compat.bridge import AudioFormat, CompatError, StreamAdapter, Translation, context_phrases
from cosystream.server.compat.whole_file import FileLimits, open_content, recognize, recognize_channels
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

SERVICE_NAME = rasr.DESCRIPTOR.services_by_name["RivaSpeechRecognition"].full_name
LANGUAGE_CODE = "en-US"

_ENCODINGS = {
    raudio.ENCODING_UNSPECIFIED: AudioEncoding.UNSPECIFIED,
    raudio.LINEAR_PCM: AudioEncoding.LINEAR16,
    raudio.MULAW: AudioEncoding.MULAW,
    raudio.ALAW: AudioEncoding.ALAW,
}
FILE_ENCODINGS = frozenset({raudio.FLAC, raudio.OGGOPUS})  # offline Recognize: decoded by their header
STREAM_ENCODINGS = {
    raudio.FLAC: AudioEncoding.FLAC,
    raudio.OGGOPUS: AudioEncoding.OGG_OPUS,
}  # streams: as they arrive
_ENCODING_NAMES = {
    AudioEncoding.UNSPECIFIED: "ENCODING_UNSPECIFIED",
    AudioEncoding.LINEAR16: "LINEAR_PCM",
    AudioEncoding.MULAW: "MULAW",
    AudioEncoding.ALAW: "ALAW",
    AudioEncoding.FLAC: "FLAC",
    AudioEncoding.OGG_OPUS: "OGGOPUS",
}
_BAD = grpc.StatusCode.INVALID_ARGUMENT
_FRAME_MS = 10


def _unavailable_model(config, kind: str) -> CompatError:
    """Riva's wording for a language or model it does not serve."""
    model = f" model={config.model};" if config.model else ""
    return CompatError(
        _BAD,
        "Error: Unavailable model requested given these parameters: "
        f"language_code={config.language_code}; sample_rate={config.sample_rate_hertz}; type={kind};{model}",
    )


def check_config(config, info: EngineInfo, files: bool = False) -> tuple[AudioFormat, pb.StreamingConfig]:
    """The audio a Riva ``RecognitionConfig`` declares and the native config it asks for; raises
    :class:`CompatError` for one this server refuses. ``files``: an offline ``Recognize``, which may also
    declare FLAC or OGGOPUS (decoded by their header)."""
    served = config.model == "" or any(m.name == config.model for m in info.models)
    if config.language_code.lower() not in ("", LANGUAGE_CODE.lower()) or not served:
        raise _unavailable_model(config, "offline" if files else "online")
    streamed = not files and config.encoding in STREAM_ENCODINGS
    if config.encoding not in _ENCODINGS and not (files and config.encoding in FILE_ENCODINGS) and not streamed:
        known = raudio.AudioEncoding.DESCRIPTOR.values_by_number.get(config.encoding)
        name = known.name if known is not None else config.encoding
        usable = "LINEAR_PCM, MULAW, ALAW, FLAC or OGGOPUS"
        raise CompatError(
            _BAD,
            f"encoding {name} is not supported: use {usable}, or send a WAV file with the encoding unspecified",
        )
    if config.profanity_filter:
        raise CompatError(_BAD, "profanity_filter is not supported by this server: transcripts are not masked")
    if config.HasField("diarization_config") and config.diarization_config.enable_speaker_diarization:
        raise CompatError(_BAD, "diarization_config.enable_speaker_diarization is not supported: no speaker tags")
    declared = AudioFormat(
        STREAM_ENCODINGS[config.encoding]
        if streamed
        else _ENCODINGS.get(config.encoding, AudioEncoding.UNSPECIFIED),
        config.sample_rate_hertz,
        config.audio_channel_count,
    )
    endpointing = pb.EndpointingConfig()
    if config.HasField("endpointing_config") and config.endpointing_config.stop_history > 0:
        stop_ms = config.endpointing_config.stop_history
        endpointing.silence_ms = -(-stop_ms // _FRAME_MS) * _FRAME_MS
    native = pb.StreamingConfig(
        enable_word_time_offsets=config.enable_word_time_offsets,
        endpointing=endpointing,
        model=config.model,
        enable_automatic_punctuation=config.enable_automatic_punctuation,
        max_alternatives=min(max(config.max_alternatives, 0), MAX_ALTERNATIVES),  # "up to", as Google
        phrases=context_phrases(config.speech_contexts),  # (riva.client.add_word_boosting_to_config)
    )
    return declared, native


def fill_alternatives(result, native: pb.StreamingResult) -> None:
    """A result's alternatives on a Riva ``SpeechRecognitionResult``: a final's n best when the stream asked
    for more than one (best first, the first the transcript), else the transcript alone."""
    for entry in native.alternatives if native.is_final and native.alternatives else [native]:
        fill_alternative(result.alternatives.add(), entry)


def fill_alternative(alternative, native) -> None:
    """A result's transcript, confidence and words (int32 ms) on a Riva ``SpeechRecognitionAlternative``."""
    alternative.transcript = native.transcript
    alternative.confidence = native.confidence
    for word in native.words:
        alternative.words.add(
            word=word.word, start_time=word.start_ms, end_time=word.end_ms, confidence=word.confidence
        )


class RivaTranslation(Translation):
    encoding_names = _ENCODING_NAMES

    def __init__(self, first, info: EngineInfo):
        if first is None or not first.HasField("streaming_config"):
            raise CompatError(_BAD, "the first request must carry streaming_config, then audio_content")
        streaming = first.streaming_config
        self.declared, self.native_config = check_config(streaming.config, info)
        self.native_config.interim_results = streaming.interim_results
        self.request_id = first.id if first.HasField("id") else None
        self.separate_channels = streaming.config.enable_separate_recognition_per_channel

    def translate(
        self, response: pb.StreamingRecognizeResponse, channel_tag: int = 0
    ) -> Iterator[rasr.StreamingRecognizeResponse]:
        for native in response.results:
            out = rasr.StreamingRecognizeResponse()
            if self.request_id is not None:
                out.id.CopyFrom(self.request_id)
            result = out.results.add(
                is_final=native.is_final,
                stability=native.stability,
                audio_processed=response.latency.audio_processed_ms / 1000,
                channel_tag=channel_tag or 1,
            )
            fill_alternatives(result, native)
            yield out


class RivaAsrAdapter(StreamAdapter):
    translation = RivaTranslation

    def __init__(self, servicer: CosyStreamServicer, limits: FileLimits | None = None):
        super().__init__(servicer)
        self.limits = limits or FileLimits()

    def open(self, first) -> Translation:
        return RivaTranslation(first, self.servicer.info)

    async def Recognize(self, request, context):
        """Offline recognition: ``audio`` (raw, or a file with its header) as one BATCH session; one result
        per utterance's final, up to :attr:`FileLimits.long_audio_s` of audio."""
        limit_s = self.limits.long_audio_s
        try:
            try:
                declared, native = check_config(request.config, self.servicer.info, files=True)
                audio = open_content(
                    request.audio,
                    declared,
                    request.config.encoding in FILE_ENCODINGS,
                    _ENCODING_NAMES,
                    limit_s,
                    f"Recognize takes up to {limit_s:g} s here: split it",
                )
            except CompatError:
                self.servicer.metrics.rejected("invalid_argument")
                raise
            if request.config.enable_separate_recognition_per_channel and audio.channels > 1:
                finals = await recognize_channels(self.servicer, audio, native, current_token())
            else:
                finals = [(1, final) for final in await recognize(self.servicer, audio, native, current_token())]
        except CompatError as err:
            await context.abort(err.code, err.message, err.trailing_metadata())
        response = rasr.RecognizeResponse()
        if request.HasField("id"):
            response.id.CopyFrom(request.id)
        for channel_tag, final in finals:
            result = response.results.add(channel_tag=channel_tag, audio_processed=final.end_ms / 1000)
            fill_alternatives(result, final)
            for alternative in result.alternatives:
                alternative.language_code.append(LANGUAGE_CODE)
        return response

    async def GetRivaSpeechRecognitionConfig(self, request, context):
        """The models this server runs (or the one ``model_name`` names), the default first, in the shape
        ``--list-models`` clients read."""
        response = rasr.RivaSpeechRecognitionConfigResponse()
        for model in self.servicer.info.models:
            if request.model_name not in ("", model.name):
                continue
            config = response.model_config.add(model_name=model.name)
            config.parameters.update(
                {
                    "type": "online",
                    "streaming": "true",
                    "language_code": LANGUAGE_CODE,
                    "sample_rate": "16000",
                    "chunk_size": str(_FRAME_MS / 1000),
                    "encodings": "LINEAR_PCM,MULAW,ALAW",
                }
            )
        return response


def add_to_server(servicer: CosyStreamServicer, server: grpc.aio.Server) -> str:
    """Serve the Riva protocol on ``server``; returns the service name (for reflection and health)."""
    adapter = RivaAsrAdapter(servicer)
    handlers = {
        "StreamingRecognize": grpc.stream_stream_rpc_method_handler(
            adapter.StreamingRecognize,
            request_deserializer=rasr.StreamingRecognizeRequest.FromString,
            response_serializer=rasr.StreamingRecognizeResponse.SerializeToString,
        ),
        "Recognize": grpc.unary_unary_rpc_method_handler(
            adapter.Recognize,
            request_deserializer=rasr.RecognizeRequest.FromString,
            response_serializer=rasr.RecognizeResponse.SerializeToString,
        ),
        "GetRivaSpeechRecognitionConfig": grpc.unary_unary_rpc_method_handler(
            adapter.GetRivaSpeechRecognitionConfig,
            request_deserializer=rasr.RivaSpeechRecognitionConfigRequest.FromString,
            response_serializer=rasr.RivaSpeechRecognitionConfigResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    return SERVICE_NAME
