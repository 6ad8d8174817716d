"""The learner's configuration: one frozen dataclass (presets: learner/presets.py; the CLI:
learner/main.py).

The CLI is generated from the dataclass by tyro, each field's docstring
becoming its help. A preset supplies the defaults, picked from the env id's
family unless --preset names one, so `seedrl-learner --env
classic:CartPole-v1` alone trains well; any flag overrides the preset.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Literal

from learner.agents.networks import (
    NetworkName,
    TorsoActivation,
    check_torso_channels,
    check_torso_options,
)
from learner.backends.devices import device_indices
from seedrl.transport import KEEPALIVE_INTERVAL_S, KEEPALIVE_TIMEOUT_S, check_keepalive


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Trains one agent with V-trace from the observations of a fleet of actors."""

    # -- what and where ------------------------------------------------------
    env: str = "atari:Pong"
    """Environment id, FAMILY:NAME: atari:Pong (any ALE game), classic:CartPole-v1,
    football:academy_empty_goal_close (any gfootball scenario), counting:v0."""
    preset: str = ""
    """Defaults to start from: atari, atari_84, classic, football, football_11v11, memory or
    counting; empty: from the env (football's 11 vs 11 scenarios take football_11v11,
    Atari frames of 64x64 or more atari_84)."""
    port: int = 8470
    """TCP port of the gRPC server the actors connect to (0: any free port)."""
    bind_address: str = "[::]"
    """Address the gRPC server listens on; "[::]" is every interface (IPv4 and IPv6)."""
    run_dir: str = ""
    """Directory for metrics, event files and checkpoints; empty: runs/ENV-TIMESTAMP. A run
    directory that has checkpoints is resumed from the newest."""
    total_env_steps: int = 50_000_000
    """Env steps (agent steps, summed over all envs of all actors) to train for; then exit."""
    seed: int = 0
    """Seed of the parameter initialisation and of action sampling."""
    stop_at_return: float | None = None
    """Also stop once the mean raw return of the last 100 episodes reaches this; None: never."""
    stop_eval_episodes: int = 0
    """With --stop-at-return: once the 100-episode mean reaches it, the learner also plays
    this many episodes greedily with its current parameters, on envs of its own, and stops
    only if their mean reaches it too (the run then ends with the state it played, as its
    last checkpoint); if not, it trains on and asks again after its actors have played as
    many episodes more. 0: the 100-episode mean alone decides."""
    stop_eval_epsilon: float = 0.0
    """The check acts epsilon-greedily: a uniform random action with this probability.
    Atari presets use 0.01, as Atari's evaluation protocols do: a greedy Breakout policy
    that never presses FIRE after losing a life would play on to the 108k-frame limit."""

    # -- inference -----------------------------------------------------------
    inference_batch_size: int = 64
    """Most envs in one inference batch; an actor's K envs are never split."""
    inference_timeout_ms: float = 5.0
    """Longest wait, from the oldest request, for a batch to fill."""

    # -- trajectories --------------------------------------------------------
    unroll_length: int = 20
    """T: transitions per unroll (an unroll holds T+1 steps, overlapping its successor by one)."""
    batch_size: int = 32
    """Unrolls per gradient update, over all learner devices and processes (the global
    batch); each of N learner processes collects batch_size / N of them."""
    batch_size_per_device: int = 0
    """When set, the global batch is this times the number of learner devices (all
    processes), replacing --batch-size: the batch grows with the devices."""
    unroll_queue_size: int = 64
    """Most finished unrolls waiting for the trainer; when full, inference waits (backpressure)."""

    # -- network -------------------------------------------------------------
    network: NetworkName = "nature_cnn"
    """Torso: nature_cnn or impala_resnet for images (compact_cnn, or compact_cnn_centered
    on frames less their median shade, for 42x42 ones), smm_cnn for football's packed
    mini-map, mlp for vectors."""
    mlp_hidden_sizes: tuple[int, ...] = (64, 64)
    """Layer sizes of the mlp torso."""
    torso_hidden_size: int = 0
    """Units of an image torso's last (dense) layer; 0: the torso's own (256 for
    compact_cnn, impala_resnet and smm_cnn, 512 for nature_cnn). On a CPU that layer holds
    most of the compact CNN's parameters and a third of its update's arithmetic."""
    torso_channels: tuple[int, ...] = ()
    """Convolution widths of the compact CNNs (two) or impala_resnet (one per stage); empty:
    the torso's own (16,32 and 16,32,32)."""
    torso_layer_norm: bool = False
    """LayerNorm on an image torso's last (dense) layer, before its ReLU: the units' inputs
    keep one scale while the convolutions beneath them learn."""
    torso_activation: TorsoActivation = "relu"
    """The activation of an image torso's last (dense) layer. Under relu a unit that an
    update switches off for every state gets no gradient again and stays off; leaky_relu
    passes it a hundredth of its gradient, which Adam's per-parameter scaling can turn into
    steps of about the usual size."""
    lstm_size: int = 0
    """Units of an LSTM core between the torso and the heads (a recurrent agent whose state
    the learner keeps per env); 0: feed-forward."""

    # -- devices and hosts ---------------------------------------------------
    learner_devices: str = "1"
    """Devices the update runs on, split along the batch: a count of this host's devices (the
    first N), "all", or their indices ("0,2"). On a CPU host a count makes that many CPU
    devices. With several learner processes each uses the same local devices."""
    inference_device: int = -1
    """Index of this host's device that runs inference; -1: the first training device."""
    coordinator_address: str = ""
    """HOST:PORT of learner process 0, for a learner over several processes (hosts); empty:
    JAX_COORDINATOR_ADDRESS, or a single process."""
    num_processes: int = 0
    """Learner processes in all (0: JAX_NUM_PROCESSES, or 1)."""
    process_id: int = -1
    """This learner process's index, 0..num_processes-1 (-1: JAX_PROCESS_ID)."""

    # -- optimisation --------------------------------------------------------
    optimizer: Literal["adam", "rmsprop"] = "adam"
    """Optimiser, after global-norm gradient clipping."""
    learning_rate: float = 4e-4
    """Step size at the start of training."""
    learning_rate_base_batch: int = 0
    """The linear scaling rule: when set, the step size is learning_rate x global batch /
    this (the batch learning_rate was tuned for); 0: learning_rate as given."""
    learning_rate_decay: bool = True
    """Decay the learning rate linearly to 0 at total_env_steps (or to learning_rate_final
    at learning_rate_decay_env_steps)."""
    learning_rate_decay_env_steps: int = 0
    """With learning_rate_decay: the env steps over which the rate falls to its final value,
    which it then holds until total_env_steps; 0 (or more than total_env_steps):
    total_env_steps."""
    learning_rate_final: float = 0.0
    """With learning_rate_decay: where the decay ends, as a fraction of the starting rate
    (0: the rate reaches 0)."""
    optimizer_epsilon: float = 1e-5
    """Epsilon of Adam or RMSProp."""
    rmsprop_decay: float = 0.99
    """RMSProp's moving-average decay (ignored by Adam)."""
    rmsprop_momentum: float = 0.0
    """RMSProp's momentum (ignored by Adam)."""
    max_grad_norm: float = 40.0
    """Gradients are scaled down to this global norm when larger."""

    # -- loss ----------------------------------------------------------------
    discount: float = 0.99
    """Discount per agent step."""
    vtrace_lambda: float = 1.0
    """V-trace's lambda: 1 is the paper's V-trace, lower cuts traces sooner."""
    clip_rho_threshold: float | None = 1.0
    """Clip of the importance weights in the value targets (rho-bar); None: no clip."""
    clip_pg_rho_threshold: float | None = 1.0
    """Clip of the importance weights in the policy gradient; None: no clip."""
    baseline_cost: float = 0.5
    """Weight of the value loss."""
    entropy_cost: float = 0.01
    """Weight of the entropy bonus at the start of training."""
    entropy_cost_decay: bool = False
    """Decay the entropy bonus's weight linearly to 0 at total_env_steps (or at
    entropy_decay_env_steps), as the learning rate decays: exploration early, a greedier
    policy late."""
    entropy_decay_env_steps: int = 0
    """With entropy_cost_decay: the env steps over which the bonus reaches 0, when that
    should come before total_env_steps; 0 (or more than total_env_steps): at
    total_env_steps."""
    entropy_floor: float = 0.0
    """A floor under the policy's mean entropy, as a share of the uniform policy's (the log
    of the number of actions): below it the loss pushes the entropy back up with weight
    entropy_floor_cost, above it the floor weighs nothing. 0: no floor. Lets an entropy
    bonus end early without the policy collapsing onto a few actions before it has
    learned, which stalls it."""
    entropy_floor_cost: float = 0.05
    """Weight of the push back up to entropy_floor, per nat the entropy is under it."""
    reward_clipping: Literal["abs_one", "none"] = "abs_one"
    """Rewards for training: abs_one clips to [-1, 1]. Reported returns are always raw."""
    reward_scale: float = 1.0
    """Rewards for training are multiplied by this, before clipping: it sets the size of
    the advantages against the entropy bonus. Reported returns are always raw."""

    policy_clip: float | None = None
    """PPO's clip of the ratio pi/mu in the policy loss, the advantages V-trace's (APPO);
    None: V-trace's importance-weighted policy gradient."""
    normalize_advantages: bool = False
    """Scale the policy gradient's advantages to zero mean and unit variance over each batch."""
    batch_passes: int = 1
    """Passes over each batch: more than 1 reuses every transition (as APPO and PPO do),
    the later passes off-policy by the earlier ones; use with --policy-clip."""
    minibatches: int = 1
    """Each batch is cut into this many minibatches of B / minibatches unrolls, each a
    gradient step: a batch gives batch_passes x minibatches updates."""
    batch_update: Literal["auto", "fused", "stepped"] = "auto"
    """How a batch's batch_passes x minibatches steps reach the device. fused: one call per
    batch, the new parameters going to inference once it is done; stepped: a call per step,
    each step's parameters acting at once. auto: stepped on a CPU (XLA:CPU runs one
    program of many steps slower than the steps one by one), fused elsewhere (a GPU's
    small steps are bound by what each call costs the host)."""

    # -- operation -----------------------------------------------------------
    log_interval_s: float = 5.0
    """Seconds between lines of metrics.jsonl and the console."""
    hello_timeout_s: float = 30.0
    """A new stream must send its hello within this time."""
    max_envs_per_actor: int = 256
    """Largest K an actor may bring (and at most inference_batch_size)."""
    max_streams: int = 8192
    """Streams served at once at most; further hellos are refused (RESOURCE_EXHAUSTED)."""
    max_env_slots: int = 65536
    """Envs of all streams at once at most; a hello that would pass it is refused."""
    max_abs_reward: float = 1e6
    """A step whose raw reward lies beyond +-this is refused, ending its stream: finite but
    huge rewards (float32's maximum) would overflow the loss and stop training for all."""
    max_abs_observation: float = 1e8
    """The same bound on float observations (integer ones, such as frames, are bounded by
    their type): wide enough for counting:v0's exact integers below 2**24."""

    # -- security ------------------------------------------------------------
    auth_token: str = dataclasses.field(default="", repr=False)
    """Shared token every actor must send; empty: SEEDRL_AUTH_TOKEN from the environment,
    or none. Never logged nor written to the run directory."""
    tls_cert: str = ""
    """PEM certificate of the learner: with --tls-key, actors must connect with TLS."""
    tls_key: str = ""
    """PEM private key of --tls-cert."""
    tls_client_ca: str = ""
    """PEM CA: when set, actors must present a client certificate it signed."""
    max_message_mb: float = 64.0
    """Largest message accepted from an actor, in MiB; larger ones end their stream with
    RESOURCE_EXHAUSTED before the learner buffers them."""
    stream_idle_timeout_s: float = 300.0
    """A stream that sends nothing for this long after its last reply is ended
    (DEADLINE_EXCEEDED) and its env slots freed."""
    keepalive_interval_s: float = KEEPALIVE_INTERVAL_S
    """Seconds between the learner's pings on each actor connection; with
    --keepalive-timeout-s it bounds how long a vanished actor host (cut link, lost
    machine) holds its env slots: about interval + timeout."""
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    """A ping unanswered for this long ends the connection and its streams."""

    # -- telemetry and checkpoints --------------------------------------------
    http_port: int = 8471
    """HTTP port of the live fleet page (/) and Prometheus metrics (/metrics); 0: any free
    port; -1: no HTTP server."""
    http_bind_address: str = "127.0.0.1"
    """Address the HTTP server listens on; 127.0.0.1 keeps it to this machine."""
    tensorboard: bool = True
    """Write TensorBoard event files under RUN_DIR/tensorboard."""
    checkpoint_interval_s: float = 600.0
    """Seconds between checkpoints of the training state (and one at every clean stop)."""
    checkpoints_to_keep: int = 3
    """Newest checkpoints kept under RUN_DIR/checkpoints; older ones are deleted."""
    init_checkpoint: str = ""
    """Start a new run from these parameters: a run directory (its newest checkpoint) or
    RUN_DIR/checkpoints/UPDATES. Ignored when RUN_DIR has checkpoints of its own (resume)."""
    compilation_cache: bool = True
    """Keep the compiled XLA programs on disk and load them at the next start with the same
    settings (a restart, a resume, a rerun) instead of compiling them again."""
    compilation_cache_dir: str = ""
    """Where; empty: $JAX_COMPILATION_CACHE_DIR where set, else ~/.cache/seedrl/xla
    ($XDG_CACHE_HOME/seedrl/xla). Bounded at 2 GiB, least recently used deleted first."""
    max_nonfinite_updates: int = 10
    """Stop (with a checkpoint of the last good state) after this many updates in a row
    whose loss or gradient was not finite; each one is skipped. A skip that one stream's
    data alone explains ends that stream instead and is not counted."""

    def __post_init__(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        require(0 <= self.port < 65536, f"port {self.port} is outside 0..65535")
        require(self.total_env_steps > 0, "total_env_steps must be positive")
        require(self.entropy_decay_env_steps >= 0, "entropy_decay_env_steps must not be negative")
        require(
            0.0 <= self.entropy_floor < 1.0,
            "entropy_floor is a share of the uniform policy's entropy, in [0, 1)",
        )
        require(self.entropy_floor_cost >= 0.0, "entropy_floor_cost must not be negative")
        require(
            self.learning_rate_decay_env_steps >= 0,
            "learning_rate_decay_env_steps must not be negative",
        )
        require(
            0.0 <= self.learning_rate_final <= 1.0,
            "learning_rate_final must be a fraction of the starting rate, in [0, 1]",
        )
        require(self.stop_eval_episodes >= 0, "stop_eval_episodes must not be negative")
        require(self.max_abs_reward > 0, "max_abs_reward must be positive")
        require(self.max_streams >= 1, "max_streams must be at least 1")
        require(self.max_env_slots >= 1, "max_env_slots must be at least 1")
        require(self.max_abs_observation > 0, "max_abs_observation must be positive")
        require(0.0 <= self.stop_eval_epsilon <= 1.0, "stop_eval_epsilon must be within [0, 1]")
        require(
            not self.stop_eval_episodes or self.stop_at_return is not None,
            "--stop-eval-episodes checks the policy before a stop at --stop-at-return: "
            "give --stop-at-return too",
        )
        require(self.inference_batch_size >= 1, "inference_batch_size must be at least 1")
        require(
            self.inference_timeout_ms >= 0,
            "inference_timeout_ms must not be negative (0: never wait for more requests)",
        )
        require(self.unroll_length >= 1, "unroll_length must be at least 1")
        require(self.batch_size >= 1, "batch_size must be at least 1")
        require(
            self.unroll_queue_size >= self.batch_size,
            f"unroll_queue_size ({self.unroll_queue_size}) must hold at least one batch "
            f"({self.batch_size}), or the trainer would wait forever",
        )
        require(self.learning_rate > 0, "learning_rate must be positive")
        require(self.batch_passes >= 1, "batch_passes must be at least 1")
        require(
            self.minibatches >= 1 and self.batch_size % self.minibatches == 0,
            f"minibatches ({self.minibatches}) must divide batch_size ({self.batch_size})",
        )
        require(
            self.policy_clip is None or 0 < self.policy_clip < 1,
            f"policy_clip {self.policy_clip} must be in (0, 1), or None for no clip",
        )
        require(self.lstm_size >= 0, "lstm_size must not be negative (0: no LSTM)")
        require(
            self.torso_hidden_size >= 0,
            "torso_hidden_size must not be negative (0: the torso's own size)",
        )
        check_torso_options(
            self.network, self.torso_hidden_size, self.torso_layer_norm, self.torso_activation
        )
        if self.torso_channels:
            check_torso_channels(self.network, self.torso_channels)
        require(self.batch_size_per_device >= 0, "batch_size_per_device must not be negative")
        require(
            self.learning_rate_base_batch >= 0,
            "learning_rate_base_batch must not be negative (0: no scaling)",
        )
        require(self.inference_device >= -1, "inference_device must be -1 or a device index")
        device_indices(self.learner_devices)  # raises DeviceError, a ValueError, if malformed
        require(self.max_grad_norm > 0, "max_grad_norm must be positive")
        require(
            math.isfinite(self.reward_scale) and self.reward_scale > 0,
            f"reward_scale {self.reward_scale} must be positive and finite",
        )
        require(0.0 <= self.discount <= 1.0, f"discount {self.discount} is outside [0, 1]")
        require(
            0.0 <= self.vtrace_lambda <= 1.0,
            f"vtrace_lambda {self.vtrace_lambda} is outside [0, 1]",
        )
        for name in ("clip_rho_threshold", "clip_pg_rho_threshold"):
            value = getattr(self, name)
            require(value is None or value > 0, f"{name} must be positive or None")
        require(self.log_interval_s > 0, "log_interval_s must be positive")
        require(self.max_envs_per_actor >= 1, "max_envs_per_actor must be at least 1")
        require(
            -1 <= self.http_port < 65536,
            f"http_port {self.http_port} is outside -1..65535 (-1: no HTTP server)",
        )
        require(
            self.http_port <= 0 or self.http_port != self.port,
            f"http_port and port are both {self.port}",
        )
        require(self.checkpoint_interval_s > 0, "checkpoint_interval_s must be positive")
        require(self.checkpoints_to_keep >= 1, "checkpoints_to_keep must be at least 1")
        require(self.max_nonfinite_updates >= 1, "max_nonfinite_updates must be at least 1")
        require(
            bool(self.tls_cert) == bool(self.tls_key),
            "--tls-cert and --tls-key go together",
        )
        require(
            not self.tls_client_ca or bool(self.tls_cert),
            "--tls-client-ca needs TLS (--tls-cert and --tls-key)",
        )
        require(self.stream_idle_timeout_s > 0, "stream_idle_timeout_s must be positive")
        require(self.max_message_mb > 0, "max_message_mb must be positive")
        check_keepalive(self.keepalive_interval_s, self.keepalive_timeout_s)

    def public(self) -> dict:
        """The configuration as config.json keeps it: the token's value withheld."""
        settings = dataclasses.asdict(self)
        settings["auth_token"] = "<set>" if self.auth_token else ""
        return settings

    @property
    def inference_timeout_s(self) -> float:
        return self.inference_timeout_ms / 1000.0

    @property
    def max_envs_per_stream(self) -> int:
        """An actor's K envs travel and are batched together, so K is capped by both limits."""
        return min(self.max_envs_per_actor, self.inference_batch_size)

    def resolved_run_dir(self) -> str:
        if self.run_dir:
            return self.run_dir
        name = self.env.replace(":", "-").replace("/", "-")
        return f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
