"""Presets: the learner's defaults for each env family, which flags override.

`seedrl-learner --env classic:CartPole-v1` alone trains well because the env id's family
picks its preset unless --preset names one.
"""

from __future__ import annotations

import dataclasses

from learner.config import LearnerConfig

PRESETS: dict[str, LearnerConfig] = {
    # 42x42 frames and the compact CNN on each frame less its background shade (which
    # keeps its first-layer channels from switching off), its dense layer at 128 units (a
    # step a fifth cheaper than at 256, and as much learned per frame), trained as PPO
    # trains Atari: two passes over each batch in minibatches of two unrolls (a step per
    # 40), PPO's clip against the acting policy, lambda 0.95, gradients clipped to 0.5,
    # Adam at three times PPO's 2.5e-4. The learning rate and the entropy bonus (0.02)
    # decay to 0 over 8.5M agent steps (34M frames, about an hour on 2 cores of the
    # machine that measured it): exploration early, refinement late; at 0.01 the policy
    # sharpened before it had learned in some runs, which then lagged for the rest of the
    # hour. Advantages are not normalised: at their raw scale the entropy bonus holds the
    # policy near uniform longer, and Pong leaves random play sooner (docs/learning.md).
    # LayerNorm on the dense layer's inputs to its ReLU keeps them at one scale while the
    # convolutions beneath learn: from one seed +18 at 21M frames where the run without
    # stood at +14.6, from two others within a point of it per frame.
    "atari": LearnerConfig(
        env="atari:Pong",
        network="compact_cnn_centered",
        torso_hidden_size=128,
        torso_layer_norm=True,
        total_env_steps=8_500_000,
        learning_rate=7.5e-4,
        entropy_cost=0.02,
        entropy_cost_decay=True,
        batch_size=16,
        minibatches=8,
        batch_passes=2,
        policy_clip=0.2,
        normalize_advantages=False,
        vtrace_lambda=0.95,
        max_grad_norm=0.5,
        unroll_queue_size=16,
        stop_eval_epsilon=0.01,
    ),
    # 84x84 frames (atari:GAME/84x84): the Nature CNN and the usual IMPALA-family
    # settings (unroll 20, batch 32, discount 0.99, rewards clipped to [-1, 1], entropy
    # 0.01, gradient norm 40).
    "atari_84": LearnerConfig(env="atari:Pong/84x84", stop_eval_epsilon=0.01),
    # CartPole-v1 with 2 actors x 16 envs (docs/architecture.md, "CartPole"): the mlp
    # network's separate value torso, and rewards scaled by 0.1 so that advantages of
    # tens do not swamp the entropy bonus and collapse the policy to one action.
    "classic": LearnerConfig(
        env="classic:CartPole-v1",
        total_env_steps=500_000,
        network="mlp",
        mlp_hidden_sizes=(64, 64),
        inference_batch_size=64,
        inference_timeout_ms=2.0,
        unroll_length=10,
        batch_size=8,
        unroll_queue_size=32,
        learning_rate=2e-3,
        reward_clipping="none",
        reward_scale=0.1,
        entropy_cost=0.01,
        log_interval_s=2.0,
    ),
    # Google Research Football's academy scenarios (short drills, +1 for a goal): the
    # mini-map CNN and many small updates (T=16 x B=4), enough of them for the logits to
    # move within a drill's first 50k env steps (docs/football/empty-goal-close.png).
    "football": LearnerConfig(
        env="football:academy_empty_goal_close",
        total_env_steps=1_000_000,
        network="smm_cnn",
        inference_batch_size=64,
        inference_timeout_ms=2.0,
        unroll_length=16,
        batch_size=4,
        unroll_queue_size=32,
        learning_rate=1e-3,
        discount=0.993,
        vtrace_lambda=0.95,
        entropy_cost=0.003,
        reward_clipping="none",
        log_interval_s=5.0,
    ),
    # Full 11 vs 11 games with the scoring reward: SEED RL's published settings.
    "football_11v11": LearnerConfig(
        env="football:11_vs_11_easy_stochastic",
        total_env_steps=500_000_000,
        network="smm_cnn",
        unroll_length=32,
        batch_size=32,
        discount=0.997,
        vtrace_lambda=0.9,
        learning_rate=5.5e-5,
        entropy_cost=3.2e-5,
        reward_clipping="none",
    ),
    # The cue-recall task (envs/memory.py): an LSTM agent, small and fast.
    "memory": LearnerConfig(
        env="memory:cue-5",
        total_env_steps=200_000,
        network="mlp",
        mlp_hidden_sizes=(64,),
        lstm_size=64,
        inference_batch_size=64,
        inference_timeout_ms=2.0,
        unroll_length=10,
        batch_size=16,
        unroll_queue_size=32,
        # Decayed to 0 at total_env_steps, as every preset's: at a constant 2e-3 a run can
        # solve the task and lose it again in its last updates.
        learning_rate=2e-3,
        reward_clipping="none",
        entropy_cost=0.01,
        log_interval_s=2.0,
    ),
    # For system tests: small and fast.
    "counting": LearnerConfig(
        env="counting:v0",
        total_env_steps=1_000_000,
        network="mlp",
        mlp_hidden_sizes=(32,),
        inference_batch_size=64,
        inference_timeout_ms=2.0,
        unroll_length=8,
        batch_size=8,
        unroll_queue_size=16,
        learning_rate=1e-3,
        reward_clipping="none",
        log_interval_s=1.0,
    ),
}


def preset_for(env_id: str, preset: str = "") -> LearnerConfig:
    """The preset named `preset`, or the one of the env's family; env set to `env_id`."""
    family, _, scenario = env_id.partition(":")
    name = preset or family
    if not preset and family == "football" and scenario.startswith("11_vs_11"):
        name = "football_11v11"
    if not preset and family == "atari" and _atari_frame_size(scenario) >= 64:
        name = "atari_84"
    if name not in PRESETS:
        raise ValueError(f"no preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    config = dataclasses.replace(PRESETS[name], env=env_id, preset=name)
    if family == "football" and scenario.endswith("/simple115v2"):
        # 115 floats, not the mini-map: a vector torso.
        config = dataclasses.replace(config, network="mlp", mlp_hidden_sizes=(256, 256))
    return config


def _atari_frame_size(name: str) -> int:
    """The frame size an Atari env id's name asks for (0 when it names none or is malformed:
    the env then says what is wrong)."""
    for option in name.split("/")[1:]:
        height, _, width = option.partition("x")
        if height.isdigit() and height == width:
            return int(height)
    return 0
