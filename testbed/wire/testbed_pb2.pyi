from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class DeviceDescriptor(_message.Message):
    __slots__ = ("name", "group", "kind", "profile", "predicted_gflops", "max_in_flight", "cache_bytes", "platform", "keeps_held", "instance")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GFLOPS_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    KEEPS_HELD_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    group: str
    kind: str
    profile: str
    predicted_gflops: float
    max_in_flight: int
    cache_bytes: int
    platform: str
    keeps_held: bool
    instance: str
    def __init__(self, name: _Optional[str] = ..., group: _Optional[str] = ..., kind: _Optional[str] = ..., profile: _Optional[str] = ..., predicted_gflops: _Optional[float] = ..., max_in_flight: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., platform: _Optional[str] = ..., keeps_held: _Optional[bool] = ..., instance: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token", "device")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    token: str
    device: DeviceDescriptor
    def __init__(self, token: _Optional[str] = ..., device: _Optional[_Union[DeviceDescriptor, _Mapping]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("device_id", "session_key", "lease_s", "heartbeat_s", "max_message_bytes", "time_dilation", "run_name", "dtype", "name")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIME_DILATION_FIELD_NUMBER: _ClassVar[int]
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    session_key: str
    lease_s: float
    heartbeat_s: float
    max_message_bytes: int
    time_dilation: float
    run_name: str
    dtype: DType
    name: str
    def __init__(self, device_id: _Optional[str] = ..., session_key: _Optional[str] = ..., lease_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., time_dilation: _Optional[float] = ..., run_name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., name: _Optional[str] = ...) -> None: ...

class Attach(_message.Message):
    __slots__ = ("device_id", "session_key")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    session_key: str
    def __init__(self, device_id: _Optional[str] = ..., session_key: _Optional[str] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("tiles",)
    TILES_FIELD_NUMBER: _ClassVar[int]
    tiles: int
    def __init__(self, tiles: _Optional[int] = ...) -> None: ...

class TileResult(_message.Message):
    __slots__ = ("task_id", "attempt", "c", "compute_s", "energy_j", "lag_s", "received_s", "started_s", "done_s")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    C_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ENERGY_J_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_S_FIELD_NUMBER: _ClassVar[int]
    STARTED_S_FIELD_NUMBER: _ClassVar[int]
    DONE_S_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    attempt: int
    c: Tensor
    compute_s: float
    energy_j: float
    lag_s: float
    received_s: float
    started_s: float
    done_s: float
    def __init__(self, task_id: _Optional[int] = ..., attempt: _Optional[int] = ..., c: _Optional[_Union[Tensor, _Mapping]] = ..., compute_s: _Optional[float] = ..., energy_j: _Optional[float] = ..., lag_s: _Optional[float] = ..., received_s: _Optional[float] = ..., started_s: _Optional[float] = ..., done_s: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("device_time_s",)
    DEVICE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    device_time_s: float
    def __init__(self, device_time_s: _Optional[float] = ...) -> None: ...

class Telemetry(_message.Message):
    __slots__ = ("values", "labels")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TileResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TileResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TileResult, _Mapping]]] = ...) -> None: ...

class DeviceMessage(_message.Message):
    __slots__ = ("attach", "credit", "result", "heartbeat", "telemetry", "results")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    attach: Attach
    credit: Credit
    result: TileResult
    heartbeat: Heartbeat
    telemetry: Telemetry
    results: TileResults
    def __init__(self, attach: _Optional[_Union[Attach, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ..., result: _Optional[_Union[TileResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ..., results: _Optional[_Union[TileResults, _Mapping]] = ...) -> None: ...

class Operand(_message.Message):
    __slots__ = ("key", "tensor", "version", "transposed", "parts", "held")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPOSED_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    key: str
    tensor: Tensor
    version: int
    transposed: bool
    parts: _containers.RepeatedCompositeFieldContainer[Operand]
    held: bool
    def __init__(self, key: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., transposed: _Optional[bool] = ..., parts: _Optional[_Iterable[_Union[Operand, _Mapping]]] = ..., held: _Optional[bool] = ...) -> None: ...

class Tile(_message.Message):
    __slots__ = ("task_id", "attempt", "step", "gemm", "op", "row", "col", "m", "k", "n", "a", "b", "deadline_s")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GEMM_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    COL_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    attempt: int
    step: int
    gemm: str
    op: str
    row: int
    col: int
    m: int
    k: int
    n: int
    a: Operand
    b: Operand
    deadline_s: float
    def __init__(self, task_id: _Optional[int] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ..., gemm: _Optional[str] = ..., op: _Optional[str] = ..., row: _Optional[int] = ..., col: _Optional[int] = ..., m: _Optional[int] = ..., k: _Optional[int] = ..., n: _Optional[int] = ..., a: _Optional[_Union[Operand, _Mapping]] = ..., b: _Optional[_Union[Operand, _Mapping]] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class Invalidate(_message.Message):
    __slots__ = ("before_version",)
    BEFORE_VERSION_FIELD_NUMBER: _ClassVar[int]
    before_version: int
    def __init__(self, before_version: _Optional[int] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    reason: str
    def __init__(self, task_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("tiles", "invalidate", "reject", "stop", "time_dilation")
    TILES_FIELD_NUMBER: _ClassVar[int]
    INVALIDATE_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TIME_DILATION_FIELD_NUMBER: _ClassVar[int]
    tiles: _containers.RepeatedCompositeFieldContainer[Tile]
    invalidate: Invalidate
    reject: Reject
    stop: Stop
    time_dilation: float
    def __init__(self, tiles: _Optional[_Iterable[_Union[Tile, _Mapping]]] = ..., invalidate: _Optional[_Union[Invalidate, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., time_dilation: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("device_id", "session_key", "reason")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    session_key: str
    reason: str
    def __init__(self, device_id: _Optional[str] = ..., session_key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("requeued_tiles",)
    REQUEUED_TILES_FIELD_NUMBER: _ClassVar[int]
    requeued_tiles: int
    def __init__(self, requeued_tiles: _Optional[int] = ...) -> None: ...
