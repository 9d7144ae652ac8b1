"""``google.cloud.speech.v1.Speech`` in full: ``StreamingRecognize`` (google_speech.py), whole-file
``Recognize`` and ``LongRunningRecognize``, and the ``google.longrunning.Operations`` service the client polls.

A whole-file request runs as one BATCH session through the native servicer (whole_file.py), so the
token's quota, admission and model selection are those of a stream. Mapping decisions (docs/COMPAT.md):
  * ``RecognitionAudio.content`` only: a ``uri`` (gs://...) is INVALID_ARGUMENT;
  * ``Recognize`` takes up to :attr:`FileLimits.sync_audio_s` of audio (Google's 1 minute), longer is
    INVALID_ARGUMENT pointing at ``LongRunningRecognize``, which takes up to ``long_audio_s``; both are
    decided from the header or the byte count before anything is decoded;
  * LINEAR16 and MULAW raw; FLAC, OGG_OPUS, MP3 and a WAV header (any encoding declared or unspecified)
    decoded by their header;
  * one ``SpeechRecognitionResult`` per utterance's final, with ``result_end_time`` and ``language_code``;
  * ``LongRunningRecognize`` answers once the session is accepted (a quota refusal is the call's
    RESOURCE_EXHAUSTED); later failures are the operation's ``error``. ``output_config`` is refused.
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc
from google.cloud.speech_v1.types import cloud_speech
from google.longrunning import operations_pb2
from google.protobuf import descriptor_pb2, descriptor_pool

from cosystream.server.auth import current_token
from cosystream.server.compat.bridge import CompatError
from cosystream.server.compat.google_speech import (
    ENCODING_NAMES,
    FILE_ENCODINGS,
    SERVICE_NAME,
    GoogleSpeechAdapter,
    Request,
    Response,
    check_config,
    fill_alternatives,
)
from cosystream.server.compat.operations import SERVICE_NAME as OPERATIONS_SERVICE
from cosystream.server.compat.operations import OperationStore
from cosystream.server.compat.whole_file import (
    FileAudio,
    FileLimits,
    open_content,
    recognize,
    recognize_channels,
)
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

RecognizeRequest = cloud_speech.RecognizeRequest.pb()
RecognizeResponse = cloud_speech.RecognizeResponse.pb()
LongRequest = cloud_speech.LongRunningRecognizeRequest.pb()
LongResponse = cloud_speech.LongRunningRecognizeResponse.pb()
LongMetadata = cloud_speech.LongRunningRecognizeMetadata.pb()
_BAD = grpc.StatusCode.INVALID_ARGUMENT


class _Job:
    """One whole-file request, checked: its audio measured, its native config built."""

    def __init__(self, request, info, max_audio_s: float, too_long: str):
        config = request.config
        declared, self.native = check_config(config, info, files=True)
        if request.audio.WhichOneof("audio_source") != "content":
            raise CompatError(
                _BAD,
                "RecognitionAudio.uri is not supported by this server: send the audio bytes in "
                "RecognitionAudio.content",
            )
        self.audio: FileAudio = open_content(
            request.audio.content,
            declared,
            config.encoding in FILE_ENCODINGS,
            ENCODING_NAMES,
            max_audio_s,
            too_long,
        )
        self.word_time_offsets = config.enable_word_time_offsets
        self.word_confidence = config.enable_word_confidence
        self.language = (config.language_code or "en-US").lower()
        self.separate_channels = config.enable_separate_recognition_per_channel and self.audio.channels > 1

    async def run(
        self, servicer: CosyStreamServicer, admitted=None, on_final=None
    ) -> list[tuple[int, pb.StreamingResult]]:
        """The finals as ``(channel_tag, final)``: channel_tag 0 for the channels mixed, else 1..N."""
        if self.separate_channels:
            return await recognize_channels(servicer, self.audio, self.native, current_token(), admitted, on_final)
        finals = await recognize(servicer, self.audio, self.native, current_token(), admitted, on_final)
        return [(0, final) for final in finals]

    def fill(self, response, finals: list[tuple[int, pb.StreamingResult]]) -> None:
        """``results`` and ``total_billed_time`` of a (LongRunning)RecognizeResponse."""
        for channel_tag, native in finals:
            result = response.results.add(language_code=self.language, channel_tag=channel_tag)
            result.result_end_time.FromMilliseconds(native.end_ms)
            fill_alternatives(result, native, self.word_time_offsets, self.word_confidence)
        response.total_billed_time.FromSeconds(math.ceil(self.audio.duration_s))


class GoogleFileAdapter(GoogleSpeechAdapter):
    """Google's streaming adapter, plus ``Recognize`` and ``LongRunningRecognize``."""

    def __init__(self, servicer: CosyStreamServicer, limits: FileLimits, operations: OperationStore):
        super().__init__(servicer)
        self.limits = limits
        self.operations = operations

    def _job(self, request, max_audio_s: float, too_long: str) -> _Job:
        try:
            return _Job(request, self.servicer.info, max_audio_s, too_long)
        except CompatError:
            self.servicer.metrics.rejected("invalid_argument")
            raise

    async def Recognize(self, request, context):
        limit_s = self.limits.sync_audio_s
        try:
            job = self._job(
                request,
                limit_s,
                f"Sync input too long: Recognize takes up to {limit_s:g} s; use LongRunningRecognize",
            )
            finals = await job.run(self.servicer)
        except CompatError as err:
            await context.abort(err.code, err.message, err.trailing_metadata())
        response = RecognizeResponse()
        job.fill(response, finals)
        return response

    async def LongRunningRecognize(self, request, context):
        limit_s = self.limits.long_audio_s
        try:
            if request.HasField("output_config") and request.output_config.gcs_uri:
                raise CompatError(_BAD, "output_config is not supported by this server: the result is returned")
            job = self._job(request, limit_s, f"LongRunningRecognize takes up to {limit_s:g} s: split it")
            admitted = asyncio.Event()
            entry = self.operations.start(LongMetadata(), lambda metadata: self._run(job, metadata, admitted))
        except CompatError as err:
            await context.abort(err.code, err.message, err.trailing_metadata())
        waiter = asyncio.get_running_loop().create_task(admitted.wait())
        try:
            await asyncio.wait((waiter, entry.task), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            entry.task.cancel()
            self.operations.forget(entry)
            raise
        finally:
            waiter.cancel()
        if not admitted.is_set() and entry.operation.HasField("error"):  # refused before any audio was heard
            self.operations.forget(entry)
            error = entry.operation.error
            await context.abort(grpc.StatusCode(_STATUS_BY_NUMBER[error.code]), error.message)
        return self.operations.snapshot(entry)

    async def _run(self, job: _Job, metadata, admitted: asyncio.Event):
        duration_ms = max(1.0, job.audio.duration_s * 1000)
        metadata.start_time.GetCurrentTime()
        metadata.last_update_time.CopyFrom(metadata.start_time)

        def progress(final: pb.StreamingResult) -> None:
            metadata.progress_percent = min(99, int(final.end_ms * 100 / duration_ms))
            metadata.last_update_time.FromNanoseconds(time.time_ns())

        finals = await job.run(self.servicer, admitted, progress)
        metadata.progress_percent = 100
        metadata.last_update_time.GetCurrentTime()
        response = LongResponse()
        job.fill(response, finals)
        return response


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def _add_service_descriptor() -> None:
    """Put ``google.cloud.speech.v1.Speech`` in the default pool, for reflection."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(SERVICE_NAME)
        return
    except KeyError:
        pass
    operation = operations_pb2.Operation.DESCRIPTOR
    proto = descriptor_pb2.FileDescriptorProto(
        name="cosystream/compat/google_cloud_speech_v1_service.proto",
        package="google.cloud.speech.v1",
        syntax="proto3",
        dependency=[Request.DESCRIPTOR.file.name, operation.file.name],
    )
    service = proto.service.add(name="Speech")
    for name, request, response in (
        ("Recognize", RecognizeRequest, RecognizeResponse),
        ("LongRunningRecognize", LongRequest, operations_pb2.Operation),
    ):
        service.method.add(
            name=name,
            input_type=f".{request.DESCRIPTOR.full_name}",
            output_type=f".{response.DESCRIPTOR.full_name}",
        )
    service.method.add(
        name="StreamingRecognize",
        input_type=f".{Request.DESCRIPTOR.full_name}",
        output_type=f".{Response.DESCRIPTOR.full_name}",
        client_streaming=True,
        server_streaming=True,
    )
    pool.Add(proto)


def _register(server: grpc.aio.Server, service: str, handlers: dict) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def add_to_server(servicer: CosyStreamServicer, server: grpc.aio.Server) -> tuple[str, ...]:
    """Serve the Google protocol and its Operations on ``server``; returns the service names (for reflection
    and health)."""
    _add_service_descriptor()
    adapter = GoogleFileAdapter(servicer, FileLimits(), OperationStore())
    _register(
        server,
        SERVICE_NAME,
        {
            "StreamingRecognize": grpc.stream_stream_rpc_method_handler(
                adapter.StreamingRecognize,
                request_deserializer=Request.FromString,
                response_serializer=Response.SerializeToString,
            ),
            "Recognize": grpc.unary_unary_rpc_method_handler(
                adapter.Recognize,
                request_deserializer=RecognizeRequest.FromString,
                response_serializer=RecognizeResponse.SerializeToString,
            ),
            "LongRunningRecognize": grpc.unary_unary_rpc_method_handler(
                adapter.LongRunningRecognize,
                request_deserializer=LongRequest.FromString,
                response_serializer=operations_pb2.Operation.SerializeToString,
            ),
        },
    )
    _register(server, OPERATIONS_SERVICE, adapter.operations.handlers())
    return SERVICE_NAME, OPERATIONS_SERVICE
