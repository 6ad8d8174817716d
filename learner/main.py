"""seedrl-learner: parse the configuration, build the learner, run it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence

import tyro

from learner.backends.cpu import xla_flags
from learner.config import LearnerConfig
from learner.presets import preset_for


def parse_cli(argv: Sequence[str] | None = None) -> LearnerConfig:
    """LearnerConfig from command-line flags, on top of the preset they select."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--env", default=LearnerConfig.env)
    peek.add_argument("--preset", default="")
    known, _ = peek.parse_known_args(argv)
    try:
        defaults = preset_for(known.env, known.preset)
    except ValueError as error:
        raise SystemExit(f"seedrl-learner: {error}") from error
    return tyro.cli(
        LearnerConfig,
        args=argv,
        default=defaults,
        prog="seedrl-learner",
    )


def main(argv: Sequence[str] | None = None) -> None:
    xla_flags.apply()  # before JAX starts
    config = parse_cli(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # jax reports at INFO each accelerator plugin it did not find.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    # orbax narrates every checkpoint at INFO through absl; learner.training.checkpoint says
    # what matters in one line.
    logging.getLogger("absl").setLevel(logging.WARNING)
    from learner.agents.networks import NetworkMismatch
    from learner.backends import compile_cache, devices
    from learner.learner import Learner
    from learner.training.checkpoint import CheckpointMismatch, NoCheckpointError

    try:
        # Both before JAX starts its backend: the CPU device count, the other processes.
        devices.prepare_cpu_devices(config.learner_devices, config.inference_device)
        devices.initialize_distributed(
            devices.distributed_settings(
                config.coordinator_address, config.num_processes, config.process_id
            )
        )
        # Before the first compile, which builds the network's initial parameters.
        compile_cache.configure(config.compilation_cache, config.compilation_cache_dir)
        learner = Learner(config)
    except devices.DeviceError as error:
        logging.getLogger("learner").error("%s", error)
        sys.exit(2)
    except NoCheckpointError as error:
        logging.getLogger("learner").error("--init-checkpoint: %s", error)
        sys.exit(2)
    except (NetworkMismatch, CheckpointMismatch) as error:
        logging.getLogger("learner").error("%s", error)
        sys.exit(2)
    logging.getLogger("learner").info(
        "compiling inference and the update for %s (%s)...", config.env, config.network
    )
    started = time.monotonic()
    learner.compile()
    logging.getLogger("learner").info(
        "compiled in %.1f s: %s", time.monotonic() - started, compile_cache.summary()
    )
    sys.exit(asyncio.run(learner.run()))


if __name__ == "__main__":
    main()
