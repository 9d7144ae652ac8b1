"""``google.cloud.speech.v1.Speech/StreamingRecognize`` over the native servicer.

The messages are the google-cloud-speech wheel's own (its proto-plus types expose their protobuf classes
through ``.pb()``). The wheel ships no service descriptor, so a one-service file that imports the wheel's
message file is added to the default descriptor pool for reflection; it defines no message, so nothing is
registered twice.

Mapping decisions (docs/COMPAT.md has the user-facing list):
  * exactly one of results / speech event per response; the ``error`` field is never used (errors end
    the stream with a status, as Google's service does);
  * SPEECH_ACTIVITY_BEGIN / END only with ``enable_voice_activity_events``, with ``speech_event_time``;
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
from google.protobuf import descriptor_pb2, descriptor_pool

from cosystream.audio.codecs import AudioEncoding
from cosystream.engine.ipc import EngineInfo
from cosystream.server.compat.bridge import AudioFormat, CompatError, StreamAdapter, Translation
from cosystream.server.servicer import CosyStreamServicer
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
_ENCODING_NAMES = {  # for messages (A-law can only come from a WAV header)
    AudioEncoding.UNSPECIFIED: "ENCODING_UNSPECIFIED",
    AudioEncoding.LINEAR16: "LINEAR16",
    AudioEncoding.MULAW: "MULAW",
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


class GoogleTranslation(Translation):
    encoding_names = _ENCODING_NAMES

    def __init__(self, first, info: EngineInfo):
        if first is None or not first.HasField("streaming_config"):
            raise CompatError(_BAD, "Malordered Data Received. Send exactly one config, followed by audio data.")
        streaming = first.streaming_config
        config = streaming.config
        if config.language_code.lower() not in ("", *LANGUAGES):
            raise CompatError(_BAD, "Invalid recognition 'config': bad language code.")
        if config.encoding not in _ENCODINGS:
            name = _ENCODING_ENUM.values_by_number.get(config.encoding)
            name = name.name if name is not None else str(config.encoding)
            raise CompatError(
                _BAD,
                f"Invalid recognition 'config': encoding {name} is not supported by this server: "
                "use LINEAR16 or MULAW, or send a WAV file with the encoding unspecified",
            )
        if config.enable_separate_recognition_per_channel:
            raise CompatError(
                _BAD,
                "Invalid recognition 'config': enable_separate_recognition_per_channel is not supported: "
                "channels are mixed down to one",
            )
        self.declared = AudioFormat(
            _ENCODINGS[config.encoding], config.sample_rate_hertz, config.audio_channel_count
        )
        model = info.model_index(config.model)  # None for Google's own names: the default, 0, as ""
        self.native_config = pb.StreamingConfig(
            interim_results=streaming.interim_results,
            enable_word_time_offsets=config.enable_word_time_offsets or config.enable_word_confidence,
            model=info.models[model].name if model else "",
        )
        self.single_utterance = streaming.single_utterance
        self.voice_events = streaming.enable_voice_activity_events
        self.word_time_offsets = config.enable_word_time_offsets
        self.word_confidence = config.enable_word_confidence
        self.language = (config.language_code or "en-US").lower()

    def _event(self, kind: int, offset_ms: int | None = None) -> Response:
        response = Response(speech_event_type=kind)
        if offset_ms is not None:
            response.speech_event_time.FromMilliseconds(offset_ms)
        return response

    def translate(self, response: pb.StreamingRecognizeResponse) -> Iterator[Response]:
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
            result = out.results.add(is_final=native.is_final, language_code=self.language)
            result.result_end_time.FromMilliseconds(native.end_ms)
            alternative = result.alternatives.add(transcript=native.transcript)
            if native.is_final:
                alternative.confidence = native.confidence
                for word in native.words:
                    info = alternative.words.add(word=word.word)
                    if self.word_time_offsets:
                        info.start_time.FromMilliseconds(word.start_ms)
                        info.end_time.FromMilliseconds(word.end_ms)
                    if self.word_confidence:
                        info.confidence = word.confidence
                self.done = self.single_utterance
            else:
                result.stability = native.stability
            yield out


class GoogleSpeechAdapter(StreamAdapter):
    translation = GoogleTranslation
    early_codes = EARLY_CODES

    def open(self, first) -> GoogleTranslation:
        return GoogleTranslation(first, self.servicer.info)


def _add_service_descriptor() -> None:
    """Put ``google.cloud.speech.v1.Speech`` (StreamingRecognize only) in the default pool, for reflection."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(SERVICE_NAME)
        return
    except KeyError:
        pass
    request = Request.DESCRIPTOR
    proto = descriptor_pb2.FileDescriptorProto(
        name="cosystream/compat/google_cloud_speech_v1_service.proto",
        package="google.cloud.speech.v1",
        syntax="proto3",
        dependency=[request.file.name],
    )
    proto.service.add(name="Speech").method.add(
        name="StreamingRecognize",
        input_type=f".{request.full_name}",
        output_type=f".{Response.DESCRIPTOR.full_name}",
        client_streaming=True,
        server_streaming=True,
    )
    pool.Add(proto)


def add_to_server(servicer: CosyStreamServicer, server: grpc.aio.Server) -> str:
    """Serve the Google protocol on ``server``; returns the service name (for reflection and health)."""
    _add_service_descriptor()
    adapter = GoogleSpeechAdapter(servicer)
    handlers = {
        "StreamingRecognize": grpc.stream_stream_rpc_method_handler(
            adapter.StreamingRecognize,
            request_deserializer=Request.FromString,
            response_serializer=Response.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    return SERVICE_NAME
