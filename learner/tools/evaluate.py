"""seedrl-eval: plays a run's trained agent, with no learner server, and reports returns.

    seedrl-eval --run-dir runs/classic-CartPole-v1-... --episodes 20
    seedrl-eval --run-dir RUN --checkpoint 1200 --episodes 5 --sample --video pong.mp4

The run directory gives the env and the network (config.json) and the
parameters (checkpoints/, the newest unless --checkpoint names an update).
Episodes are spread evenly over the parallel envs, each env playing its own
quota, so short episodes are not over-counted. Actions are the policy's most
likely ones unless --sample draws them from it. The result is printed as a
table and, on the last line of stdout, as one JSON object (also written to
--json FILE). --video records the first episode of env 0 as an MP4 (needs
the `eval` extra: scripts/setup.sh --eval).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from learner.inference.player import MAX_ENVS, Player

logger = logging.getLogger("seedrl-eval")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Plays a trained agent from a run directory and reports its returns."""

    run_dir: str
    """The learner's run directory (with config.json and checkpoints/)."""
    env: str = ""
    """Play on this env id instead of the run's, one whose observations and actions are the
    run's: for instance atari:Pong for a run trained on atari:Pong/no-sticky, to see what
    sticky actions cost its policy. Empty: the run's env."""
    checkpoint: int | None = None
    """Update count of the checkpoint to load (see RUN_DIR/checkpoints); None: the newest."""
    episodes: int = 10
    """Episodes to play."""
    num_envs: int = 0
    """Envs played in parallel; 0: min(episodes, MAX_ENVS = 8)."""
    sample: bool = False
    """Sample actions from the policy instead of taking the most likely one."""
    epsilon: float = 0.0
    """With this probability a uniform random action instead of the most likely one (Atari's
    evaluation protocols use 0.001-0.05); ignored with --sample."""
    seed: int = 1_000_003
    """Seed of the envs and of action sampling (distinct from training's seeds)."""
    video: str = ""
    """Write an MP4 of the first episode of env 0 to this path."""
    video_fps: int = 0
    """Frames per second of the video; 0: the env's own rate."""
    json: str = ""
    """Also write the result as JSON to this file."""
    units: bool = False
    """Also count the image torso's last-layer units that never fire (output above 0) on
    up to UNIT_FRAMES frames spread over the play: under ReLU such a unit gets no gradient
    and has switched off for good."""
    compilation_cache: bool = True
    """Load the policy's compiled programs from the persistent compilation cache the
    learner uses, and write those it compiles, so that the next evaluation of a run of
    the same settings starts without compiling."""
    compilation_cache_dir: str = ""
    """Where; empty: $JAX_COMPILATION_CACHE_DIR where set, else ~/.cache/seedrl/xla
    ($XDG_CACHE_HOME/seedrl/xla), as seedrl-learner's default."""

    def __post_init__(self) -> None:
        if self.episodes < 1:
            raise ValueError("episodes must be at least 1")
        if self.num_envs < 0:
            raise ValueError("num_envs must not be negative")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError("epsilon must be within [0, 1]")
        if self.video_fps < 0:
            raise ValueError("video_fps must not be negative")


UNIT_FRAMES = 2048
"""The most frames --units keeps, spread evenly over the play."""


class FrameSample:
    """Every `stride`-th step's observations, the stride doubling (every other kept step
    dropped) whenever twice `limit` frames are held, so that the frames kept spread over
    the whole play however long it turns out to be."""

    def __init__(self, limit: int = UNIT_FRAMES):
        self.limit = limit
        self.stride = 1
        self._step = 0
        self._steps: list[Any] = []

    def __call__(self, observations: Any) -> None:
        import numpy as np

        if self._step % self.stride == 0:
            self._steps.append(np.array(observations))
            # Every step holds one frame per env.
            if len(self._steps) * len(observations) >= 2 * self.limit:
                self._steps = self._steps[::2]
                self.stride *= 2
        self._step += 1

    def frames(self) -> Any:
        """The frames kept, at most `limit` of them, evenly spaced."""
        import numpy as np

        frames = np.concatenate(self._steps)
        if len(frames) <= self.limit:
            return frames
        return frames[np.linspace(0, len(frames) - 1, self.limit).round().astype(int)]


def torso_units(network: Any, params: Any, observations: Any) -> dict[str, Any]:
    """The torso's last-layer units on `observations`: how many there are, how many never
    fire (output at most 0 on every one), and the share of (frame, unit) pairs that fire."""
    import numpy as np

    torso = {"params": params["params"]["torso"]}
    features = np.asarray(network.torso.apply(torso, observations))
    fires = features > 0
    return {
        "units": int(features.shape[-1]),
        "off": int(np.sum(~fires.any(axis=0))),
        "active_fraction": round(float(fires.mean()), 4),
        "frames": int(features.shape[0]),
    }


@dataclasses.dataclass
class EvalResult:
    env: str
    checkpoint_updates: int
    checkpoint_env_steps: int | None
    policy: str
    returns: list[float]
    lengths: list[int]
    seconds: float
    video: str | None
    torso_units: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        n = len(self.returns)
        mean = sum(self.returns) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in self.returns) / n)
        return {
            "env": self.env,
            "checkpoint_updates": self.checkpoint_updates,
            "checkpoint_env_steps": self.checkpoint_env_steps,
            "policy": self.policy,
            "episodes": n,
            "mean": round(mean, 4),
            "std": round(std, 4),
            "min": min(self.returns),
            "max": max(self.returns),
            "mean_length": round(sum(self.lengths) / n, 1),
            "returns": self.returns,
            "lengths": self.lengths,
            "seconds": round(self.seconds, 2),
            "video": self.video,
            "torso_units": self.torso_units,
        }


def _run_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise SystemExit(
            f"seedrl-eval: {path} not found: is {run_dir!r} a learner's run directory?"
        )
    with open(path) as file:
        return json.load(file)


class VideoWriter:
    """Frames to an MP4 (H.264, yuv420p) through imageio-ffmpeg's bundled ffmpeg."""

    def __init__(self, path: str, fps: int):
        try:
            import imageio_ffmpeg
        except ImportError as error:
            raise SystemExit(
                "seedrl-eval: --video needs imageio-ffmpeg: scripts/setup.sh --eval "
                "(or pip install 'seedrl[eval]')"
            ) from error
        self._module = imageio_ffmpeg
        self.path = path
        self._fps = fps
        self._writer: Any = None
        self.frames = 0

    def add(self, frame: Any) -> None:
        if self._writer is None:
            height, width = frame.shape[:2]
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._writer = self._module.write_frames(
                self.path,
                (width, height),
                fps=self._fps,
                codec="libx264",
                pix_fmt_out="yuv420p",
                macro_block_size=2,
                quality=7,
                ffmpeg_log_level="error",
            )
            self._writer.send(None)  # starts ffmpeg
        self._writer.send(frame.tobytes())
        self.frames += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def network_of_run(run: dict[str, Any], num_actions: int):
    """The network a run trained, from its config.json (`run`); fields a run of an older
    version did not write take the defaults it had."""
    from learner.agents.networks import make_network

    return make_network(
        run.get("network", "nature_cnn"),
        num_actions,
        tuple(run.get("mlp_hidden_sizes", (64, 64))),
        int(run.get("lstm_size", 0)),
        int(run.get("torso_hidden_size", 0)),
        tuple(run.get("torso_channels", ())),
        bool(run.get("torso_layer_norm", False)),
        run.get("torso_activation", "relu"),
    )


def check_env_fits(env_id: str, trained_on: str) -> None:
    """Refuses (SystemExit) an env whose observations or actions differ from those of the
    env the run trained on: its checkpoint's network could not play it."""
    from envs import registry

    try:
        spec, trained = registry.spec(env_id), registry.spec(trained_on)
    except (ValueError, KeyError) as error:
        raise SystemExit(f"seedrl-eval: --env {env_id}: {error}") from error
    ours, theirs = spec.model_observation, trained.model_observation
    if (ours.shape, ours.dtype) != (theirs.shape, theirs.dtype):
        raise SystemExit(
            f"seedrl-eval: --env {env_id} observes {ours.dtype} {tuple(ours.shape)}, but the "
            f"run trained on {trained_on}, which observes {theirs.dtype} {tuple(theirs.shape)}"
        )
    if spec.action.num_actions != trained.action.num_actions:
        raise SystemExit(
            f"seedrl-eval: --env {env_id} has {spec.action.num_actions} actions, but the run "
            f"trained on {trained_on}, which has {trained.action.num_actions}"
        )


def evaluate(config: EvalConfig) -> EvalResult:
    import jax
    import numpy as np

    from envs import registry
    from learner.agents.agent import make_agent
    from learner.agents.networks import init_params
    from learner.training import checkpoint

    run = _run_config(config.run_dir)
    env_id = config.env or run["env"]
    if env_id != run["env"]:
        check_env_fits(env_id, run["env"])
    num_envs = config.num_envs or min(config.episodes, MAX_ENVS)
    num_envs = min(num_envs, config.episodes)
    options: dict[str, Any] = {}
    if config.video:
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # gymnasium's pygame renderer
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
        os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
        options["render"] = True
    try:
        env = registry.make(env_id, num_envs, seed=config.seed, **options)
    except TypeError as error:
        raise SystemExit(f"seedrl-eval: {env_id} cannot render a video ({error})") from error
    spec = env.spec
    network = network_of_run(run, spec.action.num_actions)
    if config.units and run.get("network", "nature_cnn") == "mlp":
        env.close()
        raise SystemExit(
            "seedrl-eval: --units counts an image torso's last-layer ReLU units; "
            "the mlp network's layers are tanh"
        )
    model_observation = spec.model_observation
    example = np.zeros((1, *model_observation.shape), model_observation.np_dtype)
    try:
        params, meta = checkpoint.load_params(
            config.run_dir, init_params(network, jax.random.key(0), example), config.checkpoint
        )
    except (checkpoint.NoCheckpointError, checkpoint.CheckpointMismatch) as error:
        env.close()
        raise SystemExit(f"seedrl-eval: {error}") from error

    video = None
    if config.video:
        fps = config.video_fps or int(getattr(env, "render_fps", 30))
        video = VideoWriter(config.video, fps)
    started = time.perf_counter()
    sample = FrameSample() if config.units else None
    try:
        player = Player(make_agent(network), spec, config.sample, config.epsilon)
        returns, lengths = player.play(
            env, params, config.episodes, config.seed, video, observed=sample
        )
    finally:
        env.close()
        if video is not None:
            video.close()
    seconds = time.perf_counter() - started
    units = torso_units(network, params, sample.frames()) if sample is not None else None
    return EvalResult(
        env=env_id,
        checkpoint_updates=int(meta.get("updates", -1)),
        checkpoint_env_steps=meta.get("env_steps"),
        policy=player.policy,
        returns=returns,
        lengths=lengths,
        seconds=seconds,
        video=os.path.abspath(config.video) if config.video else None,
        torso_units=units,
    )


def table(summary: dict[str, Any]) -> str:
    header = f"{'episodes':>8} {'mean':>10} {'std':>10} {'min':>10} {'max':>10} {'length':>8}"
    row = (
        f"{summary['episodes']:>8} {summary['mean']:>10.2f} {summary['std']:>10.2f} "
        f"{summary['min']:>10.2f} {summary['max']:>10.2f} {summary['mean_length']:>8.1f}"
    )
    steps = summary["checkpoint_env_steps"]
    title = (
        f"{summary['env']}: checkpoint of update {summary['checkpoint_updates']}"
        + (f" ({steps:,} env steps)" if steps is not None else "")
        + f", {summary['policy']} actions, {summary['seconds']:.1f} s"
    )
    lines = [title, header, row]
    if summary["video"]:
        lines.append(f"video of the first episode: {summary['video']}")
    units = summary.get("torso_units")
    if units:
        lines.append(
            f"torso's last layer: {units['off']} of {units['units']} units never fire on "
            f"{units['frames']:,} frames of the play; a unit fires on "
            f"{units['active_fraction']:.1%} of them on average"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import tyro

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = tyro.cli(EvalConfig, args=argv, prog="seedrl-eval")
    except ValueError as error:
        raise SystemExit(f"seedrl-eval: {error}") from error
    from learner.backends.cpu import xla_flags

    xla_flags.apply()  # before JAX starts
    from learner.backends import compile_cache

    compile_cache.configure(config.compilation_cache, config.compilation_cache_dir)

    summary = evaluate(config).summary()
    # stderr: stdout's last line is the JSON result.
    print(f"seedrl-eval: {compile_cache.summary()}", file=sys.stderr)
    print(table(summary))
    if config.json:
        with open(config.json, "w") as file:
            json.dump(summary, file, indent=2)
    print(json.dumps(summary), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
