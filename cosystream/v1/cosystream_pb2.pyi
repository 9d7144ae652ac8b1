from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    LINEAR16: _ClassVar[AudioEncoding]
    MULAW: _ClassVar[AudioEncoding]
    ALAW: _ClassVar[AudioEncoding]
    OGG_OPUS: _ClassVar[AudioEncoding]
    FLAC: _ClassVar[AudioEncoding]
    WEBM_OPUS: _ClassVar[AudioEncoding]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    REALTIME: _ClassVar[Priority]
    BATCH: _ClassVar[Priority]
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
LINEAR16: AudioEncoding
MULAW: AudioEncoding
ALAW: AudioEncoding
OGG_OPUS: AudioEncoding
FLAC: AudioEncoding
WEBM_OPUS: AudioEncoding
PRIORITY_UNSPECIFIED: Priority
REALTIME: Priority
BATCH: Priority

class LoadModelRequest(_message.Message):
    __slots__ = ("name", "path", "precision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    precision: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., precision: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model", "load_seconds", "install_seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    load_seconds: float
    install_seconds: float
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., load_seconds: _Optional[float] = ..., install_seconds: _Optional[float] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamingRecognizeRequest(_message.Message):
    __slots__ = ("config", "audio", "control")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    config: StreamingConfig
    audio: bytes
    control: Control
    def __init__(self, config: _Optional[_Union[StreamingConfig, _Mapping]] = ..., audio: _Optional[bytes] = ..., control: _Optional[_Union[Control, _Mapping]] = ...) -> None: ...

class StreamingConfig(_message.Message):
    __slots__ = ("encoding", "sample_rate_hz", "priority", "interim_results", "endpointing", "model", "enable_word_time_offsets", "final_pass", "enable_automatic_punctuation", "max_alternatives", "phrases", "vocabulary", "resumable", "resume_token", "resume_offset_samples", "resume_after_response", "resume_snapshot")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INTERIM_RESULTS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENABLE_WORD_TIME_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    FINAL_PASS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_AUTOMATIC_PUNCTUATION_FIELD_NUMBER: _ClassVar[int]
    MAX_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    PHRASES_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    encoding: AudioEncoding
    sample_rate_hz: int
    priority: Priority
    interim_results: bool
    endpointing: EndpointingConfig
    model: str
    enable_word_time_offsets: bool
    final_pass: str
    enable_automatic_punctuation: bool
    max_alternatives: int
    phrases: _containers.RepeatedCompositeFieldContainer[Phrase]
    vocabulary: str
    resumable: bool
    resume_token: str
    resume_offset_samples: int
    resume_after_response: int
    resume_snapshot: bytes
    def __init__(self, encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate_hz: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., interim_results: _Optional[bool] = ..., endpointing: _Optional[_Union[EndpointingConfig, _Mapping]] = ..., model: _Optional[str] = ..., enable_word_time_offsets: _Optional[bool] = ..., final_pass: _Optional[str] = ..., enable_automatic_punctuation: _Optional[bool] = ..., max_alternatives: _Optional[int] = ..., phrases: _Optional[_Iterable[_Union[Phrase, _Mapping]]] = ..., vocabulary: _Optional[str] = ..., resumable: _Optional[bool] = ..., resume_token: _Optional[str] = ..., resume_offset_samples: _Optional[int] = ..., resume_after_response: _Optional[int] = ..., resume_snapshot: _Optional[bytes] = ...) -> None: ...

class Phrase(_message.Message):
    __slots__ = ("text", "boost")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BOOST_FIELD_NUMBER: _ClassVar[int]
    text: str
    boost: float
    def __init__(self, text: _Optional[str] = ..., boost: _Optional[float] = ...) -> None: ...

class EndpointingConfig(_message.Message):
    __slots__ = ("silence_ms", "max_utterance_ms", "vad_aggressiveness")
    SILENCE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_UTTERANCE_MS_FIELD_NUMBER: _ClassVar[int]
    VAD_AGGRESSIVENESS_FIELD_NUMBER: _ClassVar[int]
    silence_ms: int
    max_utterance_ms: int
    vad_aggressiveness: int
    def __init__(self, silence_ms: _Optional[int] = ..., max_utterance_ms: _Optional[int] = ..., vad_aggressiveness: _Optional[int] = ...) -> None: ...

class Control(_message.Message):
    __slots__ = ("type",)
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[Control.Type]
        FINALIZE: _ClassVar[Control.Type]
        SNAPSHOT: _ClassVar[Control.Type]
    TYPE_UNSPECIFIED: Control.Type
    FINALIZE: Control.Type
    SNAPSHOT: Control.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    type: Control.Type
    def __init__(self, type: _Optional[_Union[Control.Type, str]] = ...) -> None: ...

class StreamingRecognizeResponse(_message.Message):
    __slots__ = ("results", "speech_event", "latency", "session_id", "error", "response_index", "consumed_samples", "resume_token", "resume_snapshot")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SPEECH_EVENT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESUME_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StreamingResult]
    speech_event: SpeechEvent
    latency: Latency
    session_id: str
    error: StreamError
    response_index: int
    consumed_samples: int
    resume_token: str
    resume_snapshot: bytes
    def __init__(self, results: _Optional[_Iterable[_Union[StreamingResult, _Mapping]]] = ..., speech_event: _Optional[_Union[SpeechEvent, _Mapping]] = ..., latency: _Optional[_Union[Latency, _Mapping]] = ..., session_id: _Optional[str] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ..., response_index: _Optional[int] = ..., consumed_samples: _Optional[int] = ..., resume_token: _Optional[str] = ..., resume_snapshot: _Optional[bytes] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message", "retry_delay_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    retry_delay_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., retry_delay_ms: _Optional[int] = ...) -> None: ...

class StreamingResult(_message.Message):
    __slots__ = ("transcript", "is_final", "stability", "start_ms", "end_ms", "words", "utterance_index", "confidence", "model", "model_version", "final_pass", "alternatives")
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    STABILITY_FIELD_NUMBER: _ClassVar[int]
    START_MS_FIELD_NUMBER: _ClassVar[int]
    END_MS_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    UTTERANCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINAL_PASS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    transcript: str
    is_final: bool
    stability: float
    start_ms: int
    end_ms: int
    words: _containers.RepeatedCompositeFieldContainer[WordInfo]
    utterance_index: int
    confidence: float
    model: str
    model_version: str
    final_pass: str
    alternatives: _containers.RepeatedCompositeFieldContainer[Alternative]
    def __init__(self, transcript: _Optional[str] = ..., is_final: _Optional[bool] = ..., stability: _Optional[float] = ..., start_ms: _Optional[int] = ..., end_ms: _Optional[int] = ..., words: _Optional[_Iterable[_Union[WordInfo, _Mapping]]] = ..., utterance_index: _Optional[int] = ..., confidence: _Optional[float] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., final_pass: _Optional[str] = ..., alternatives: _Optional[_Iterable[_Union[Alternative, _Mapping]]] = ...) -> None: ...

class Alternative(_message.Message):
    __slots__ = ("transcript", "confidence", "words")
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    transcript: str
    confidence: float
    words: _containers.RepeatedCompositeFieldContainer[WordInfo]
    def __init__(self, transcript: _Optional[str] = ..., confidence: _Optional[float] = ..., words: _Optional[_Iterable[_Union[WordInfo, _Mapping]]] = ...) -> None: ...

class WordInfo(_message.Message):
    __slots__ = ("word", "start_ms", "end_ms", "confidence")
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_MS_FIELD_NUMBER: _ClassVar[int]
    END_MS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    word: str
    start_ms: int
    end_ms: int
    confidence: float
    def __init__(self, word: _Optional[str] = ..., start_ms: _Optional[int] = ..., end_ms: _Optional[int] = ..., confidence: _Optional[float] = ...) -> None: ...

class SpeechEvent(_message.Message):
    __slots__ = ("type", "offset_ms")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[SpeechEvent.Type]
        SPEECH_STARTED: _ClassVar[SpeechEvent.Type]
        SPEECH_ENDED: _ClassVar[SpeechEvent.Type]
    TYPE_UNSPECIFIED: SpeechEvent.Type
    SPEECH_STARTED: SpeechEvent.Type
    SPEECH_ENDED: SpeechEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    type: SpeechEvent.Type
    offset_ms: int
    def __init__(self, type: _Optional[_Union[SpeechEvent.Type, str]] = ..., offset_ms: _Optional[int] = ...) -> None: ...

class Latency(_message.Message):
    __slots__ = ("audio_processed_ms", "queue_ms", "compute_ms", "receive_to_send_ms")
    AUDIO_PROCESSED_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_TO_SEND_MS_FIELD_NUMBER: _ClassVar[int]
    audio_processed_ms: int
    queue_ms: float
    compute_ms: float
    receive_to_send_ms: float
    def __init__(self, audio_processed_ms: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., receive_to_send_ms: _Optional[float] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "models", "encodings", "min_sample_rate_hz", "max_sample_rate_hz", "max_sessions", "active_sessions", "device", "default_endpointing", "frontends", "loaded_model_versions", "engines", "final_model", "vocabularies", "load")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ENDPOINTING_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    LOADED_MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    FINAL_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCABULARIES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    version: str
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    encodings: _containers.RepeatedScalarFieldContainer[AudioEncoding]
    min_sample_rate_hz: int
    max_sample_rate_hz: int
    max_sessions: int
    active_sessions: int
    device: str
    default_endpointing: EndpointingConfig
    frontends: int
    loaded_model_versions: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    final_model: str
    vocabularies: _containers.RepeatedScalarFieldContainer[str]
    load: LoadStatus
    def __init__(self, version: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., encodings: _Optional[_Iterable[_Union[AudioEncoding, str]]] = ..., min_sample_rate_hz: _Optional[int] = ..., max_sample_rate_hz: _Optional[int] = ..., max_sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., device: _Optional[str] = ..., default_endpointing: _Optional[_Union[EndpointingConfig, _Mapping]] = ..., frontends: _Optional[int] = ..., loaded_model_versions: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., final_model: _Optional[str] = ..., vocabularies: _Optional[_Iterable[str]] = ..., load: _Optional[_Union[LoadStatus, _Mapping]] = ...) -> None: ...

class LoadStatus(_message.Message):
    __slots__ = ("engine_load", "realtime_sessions", "batch_sessions", "free_slots", "queued_frames", "overloaded", "admit_load", "refused_for_load", "frontend_lag_ms", "degradation", "audio_late_ms", "host_cpu_busy", "host_cpu_cores", "cpu_per_session", "admit_cpu")
    ENGINE_LOAD_FIELD_NUMBER: _ClassVar[int]
    REALTIME_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    OVERLOADED_FIELD_NUMBER: _ClassVar[int]
    ADMIT_LOAD_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FOR_LOAD_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    DEGRADATION_FIELD_NUMBER: _ClassVar[int]
    AUDIO_LATE_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_CPU_BUSY_FIELD_NUMBER: _ClassVar[int]
    HOST_CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    CPU_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    ADMIT_CPU_FIELD_NUMBER: _ClassVar[int]
    engine_load: float
    realtime_sessions: int
    batch_sessions: int
    free_slots: int
    queued_frames: int
    overloaded: bool
    admit_load: float
    refused_for_load: int
    frontend_lag_ms: float
    degradation: str
    audio_late_ms: float
    host_cpu_busy: float
    host_cpu_cores: float
    cpu_per_session: float
    admit_cpu: float
    def __init__(self, engine_load: _Optional[float] = ..., realtime_sessions: _Optional[int] = ..., batch_sessions: _Optional[int] = ..., free_slots: _Optional[int] = ..., queued_frames: _Optional[int] = ..., overloaded: _Optional[bool] = ..., admit_load: _Optional[float] = ..., refused_for_load: _Optional[int] = ..., frontend_lag_ms: _Optional[float] = ..., degradation: _Optional[str] = ..., audio_late_ms: _Optional[float] = ..., host_cpu_busy: _Optional[float] = ..., host_cpu_cores: _Optional[float] = ..., cpu_per_session: _Optional[float] = ..., admit_cpu: _Optional[float] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("index", "device", "serving", "active_sessions", "max_sessions", "load", "overloaded")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    OVERLOADED_FIELD_NUMBER: _ClassVar[int]
    index: int
    device: str
    serving: bool
    active_sessions: int
    max_sessions: int
    load: float
    overloaded: bool
    def __init__(self, index: _Optional[int] = ..., device: _Optional[str] = ..., serving: _Optional[bool] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., load: _Optional[float] = ..., overloaded: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "language", "sample_rate_hz", "frame_ms", "parameters", "vocabulary", "is_default", "version", "vocabulary_kind", "output_delay_ms", "precision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    FRAME_MS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_KIND_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    language: str
    sample_rate_hz: int
    frame_ms: int
    parameters: int
    vocabulary: _containers.RepeatedScalarFieldContainer[str]
    is_default: bool
    version: str
    vocabulary_kind: str
    output_delay_ms: int
    precision: str
    def __init__(self, name: _Optional[str] = ..., language: _Optional[str] = ..., sample_rate_hz: _Optional[int] = ..., frame_ms: _Optional[int] = ..., parameters: _Optional[int] = ..., vocabulary: _Optional[_Iterable[str]] = ..., is_default: _Optional[bool] = ..., version: _Optional[str] = ..., vocabulary_kind: _Optional[str] = ..., output_delay_ms: _Optional[int] = ..., precision: _Optional[str] = ...) -> None: ...
