from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ActionSpec(_message.Message):
    __slots__ = ("num_actions",)
    NUM_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    num_actions: int
    def __init__(self, num_actions: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "actor_id", "run_id", "num_envs", "env_id", "observation_spec", "action_spec", "hostname", "pid", "observation_changes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPEC_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPEC_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_CHANGES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    actor_id: str
    run_id: str
    num_envs: int
    env_id: str
    observation_spec: TensorSpec
    action_spec: ActionSpec
    hostname: str
    pid: int
    observation_changes: bool
    def __init__(self, protocol_version: _Optional[int] = ..., actor_id: _Optional[str] = ..., run_id: _Optional[str] = ..., num_envs: _Optional[int] = ..., env_id: _Optional[str] = ..., observation_spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., action_spec: _Optional[_Union[ActionSpec, _Mapping]] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., observation_changes: _Optional[bool] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("observations", "rewards", "terminated", "truncated", "changed_offsets", "changed_words")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_WORDS_FIELD_NUMBER: _ClassVar[int]
    observations: bytes
    rewards: bytes
    terminated: bytes
    truncated: bytes
    changed_offsets: bytes
    changed_words: bytes
    def __init__(self, observations: _Optional[bytes] = ..., rewards: _Optional[bytes] = ..., terminated: _Optional[bytes] = ..., truncated: _Optional[bytes] = ..., changed_offsets: _Optional[bytes] = ..., changed_words: _Optional[bytes] = ...) -> None: ...

class ActorMessage(_message.Message):
    __slots__ = ("hello", "step")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    step: Step
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("action_spec", "policy_version", "learner_id", "observation_changes")
    ACTION_SPEC_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_CHANGES_FIELD_NUMBER: _ClassVar[int]
    action_spec: ActionSpec
    policy_version: int
    learner_id: str
    observation_changes: bool
    def __init__(self, action_spec: _Optional[_Union[ActionSpec, _Mapping]] = ..., policy_version: _Optional[int] = ..., learner_id: _Optional[str] = ..., observation_changes: _Optional[bool] = ...) -> None: ...

class Actions(_message.Message):
    __slots__ = ("actions", "policy_version")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    actions: bytes
    policy_version: int
    def __init__(self, actions: _Optional[bytes] = ..., policy_version: _Optional[int] = ...) -> None: ...

class LearnerMessage(_message.Message):
    __slots__ = ("welcome", "actions")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    actions: Actions
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., actions: _Optional[_Union[Actions, _Mapping]] = ...) -> None: ...
