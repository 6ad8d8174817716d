"""seedrl-actor: parse the configuration, build the actor, run it.

This module and everything it imports stay free of jax: actors hold no model.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import tyro

from actors.actor import Actor, ActorConfig
from seedrl import allocator


def main(argv: Sequence[str] | None = None) -> None:
    # Before anything allocates the step's large blocks (seedrl/allocator.py).
    allocator.keep_freed_memory()
    config = tyro.cli(ActorConfig, args=argv, prog="seedrl-actor")
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    actor = Actor(config)
    try:
        code = asyncio.run(actor.run())
    except KeyboardInterrupt:
        code = 130
    finally:
        actor.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
