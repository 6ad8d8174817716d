"""learner.backends.cpu.xla_flags: merging with the user's XLA_FLAGS, and the flag's effect on XLA:CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from learner.backends.cpu import xla_flags

YNN = "--xla_cpu_experimental_ynn_fusion_type"


def test_flags_are_appended_to_the_users_own():
    merged = xla_flags.merged_flags("--xla_force_host_platform_device_count=2")
    assert merged.split() == ["--xla_force_host_platform_device_count=2", *xla_flags.CPU_FLAGS]
    assert xla_flags.merged_flags("").split() == list(xla_flags.CPU_FLAGS)


def test_a_flag_the_user_sets_is_left_as_the_user_set_it():
    user = f"{YNN}=individual_dot --xla_cpu_enable_fast_math=false"
    assert xla_flags.merged_flags(user) == user


def test_apply_twice_adds_nothing_more(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nowhere")
    xla_flags.apply()
    once = os.environ["XLA_FLAGS"]
    xla_flags.apply()
    assert os.environ["XLA_FLAGS"] == once
    assert once.split() == ["--xla_dump_to=/tmp/nowhere", *xla_flags.CPU_FLAGS]


# A fresh interpreter compiles a convolution's gradient and prints how XLA:CPU
# placed each convolution: in a YNNPACK fusion or as XLA's own op.
PROBE = textwrap.dedent(
    """
    from learner.backends.cpu import xla_flags
    xla_flags.apply()
    import jax, jax.numpy as jnp
    from jax import lax

    def loss(x, k):
        y = lax.conv_general_dilated(
            x, k, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(y * y)

    x, k = jnp.ones((8, 84, 84, 4)), jnp.ones((8, 8, 4, 32))
    text = jax.jit(jax.grad(loss, argnums=1)).lower(x, k).compile().as_text()
    lines = [line for line in text.splitlines() if "conv_general_dilated" in line
             and " = " in line and "ROOT" not in line]
    ynn = sum("__ynn_fusion" in line or "ynn_fusion" in line.split(" = ")[0] for line in lines)
    print(f"ynn={ynn} xla={sum('convolution(' in line for line in lines)}")
    """
)


def _probe(user_flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    if user_flags:
        env["XLA_FLAGS"] = user_flags
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(300)
def test_the_flag_moves_convolutions_from_ynnpack_to_xla():
    # XLA:CPU's default (which a user's own setting restores, since theirs wins)
    # gives the forward convolution to YNNPACK, what made the Nature CNN slow;
    # importing the learner moves it to XLA's own convolution. The flag must
    # also parse: XLA aborts the process on an unknown value.
    assert _probe(f"{YNN}=+individual_convolution") == "ynn=1 xla=0"
    assert _probe("") == "ynn=0 xla=1"
