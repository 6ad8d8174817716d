"""Case (b): how many actor streams one learner serves, and at what CPU cost.

The learner runs in this process with a policy that does no network compute
(uniform random actions, still jitted and fed the observations) on the
counting env, assembling unrolls as in training (a thread drops them where the
trainer would take them). Client processes hold the streams: each stream is
an actor's (hello, then step / actions round trips with K real counting
envs), many to a process. Each configuration is S streams x K envs.

Figures of the measured window: actor steps/s (one env's step; a message of
K envs is K actor steps), the learner process's CPU seconds per 1,000 actor
steps (every thread: gRPC, event loop, batching, inference, unroll assembly),
and the round-trip latency an actor sees, send to actions, p50 and p99.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import resource
import tempfile
import threading
import time

import numpy as np

from bench.common import CaseResult, Column, Settings, Window, drain_unrolls

# (streams, envs per stream), as the issue lists them.
CONFIGURATIONS = ((16, 1), (16, 16), (64, 16), (256, 4), (1024, 1), (4096, 1))
SHORT_CONFIGURATIONS = ((16, 1), (16, 16), (64, 1))
STREAMS_PER_CLIENT = 1024
SHORT_STREAMS_PER_CLIENT = 32  # so the short run has several client processes too
STREAMS_PER_CHANNEL = 32
CONNECTING_PER_CLIENT = 64
CONNECT_ATTEMPTS = 6
ENV = "counting:v0"


def raise_open_file_limit() -> None:
    """Thousands of streams need thousands of sockets: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- client side (a subprocess) ------------------------------------------------


async def _client_main(address, streams, num_envs, first_id, connection, window_box):
    import grpc
    import grpc.aio

    from envs import registry
    from seedrl.codec import StepCodec
    from seedrl.proto import seedrl_pb2
    from seedrl.specs import PROTOCOL_VERSION
    from seedrl.transport import STREAM_PATH, channel_options

    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(address, options=options)
        for _ in range(-(-streams // STREAMS_PER_CHANNEL))
    ]
    counts = np.zeros(streams, np.int64)
    latencies: list[float] = []
    connected = retries = 0
    all_connected = asyncio.Event()
    go = asyncio.Event()
    stop = asyncio.Event()

    # Connections open a few at a time, and a failed one is retried, as actors do.
    opening = asyncio.Semaphore(CONNECTING_PER_CLIENT)

    async def connect(index: int, hello: bytes):
        nonlocal retries
        for attempt in range(CONNECT_ATTEMPTS):
            async with opening:
                call = channels[index % len(channels)].stream_stream(STREAM_PATH)()
                try:
                    await call.write(hello)
                    if await call.read() is not grpc.aio.EOF:  # the welcome
                        return call
                    error = f"{await call.code()} {await call.details()}"
                except grpc.aio.AioRpcError as failure:
                    error = f"{failure.code()} {failure.details()}"
            retries += 1
            await asyncio.sleep(0.05 * 2**attempt)
        raise ConnectionError(f"stream {index} failed {CONNECT_ATTEMPTS} times: {error}")

    async def one_stream(index: int) -> None:
        nonlocal connected
        env = registry.make(ENV, num_envs, seed=first_id + index)
        codec = StepCodec(env.spec.observation, env.spec.action, num_envs)
        hello = seedrl_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            actor_id=f"bench-{first_id + index}",
            run_id="bench",
            num_envs=num_envs,
            env_id=ENV,
            observation_spec=env.spec.observation.to_proto(),
            action_spec=env.spec.action.to_proto(),
        )
        call = await connect(index, seedrl_pb2.ActorMessage(hello=hello).SerializeToString())
        connected += 1
        if connected == streams:
            all_connected.set()
        # Every stream of every client connects before any steps: a steady state.
        await go.wait()
        step = env.reset(seed=index)
        while not stop.is_set():
            sent = time.monotonic()
            await call.write(codec.encode_step(step))
            raw = await call.read()
            received = time.monotonic()
            if raw is grpc.aio.EOF:
                return
            actions = codec.decode_actions(seedrl_pb2.LearnerMessage.FromString(raw).actions)
            step = env.step(actions)
            start, end = window_box
            if start <= sent and received <= end:
                counts[index] += num_envs
                latencies.append(received - sent)
        await call.done_writing()

    tasks = [asyncio.create_task(one_stream(index)) for index in range(streams)]
    waiting = asyncio.create_task(all_connected.wait())
    await asyncio.wait([waiting, *tasks], return_when=asyncio.FIRST_COMPLETED)
    if not all_connected.is_set():
        failed = next(task for task in tasks if task.done())
        connection.send(f"failed: {failed.exception()!r}")
        return
    connection.send("connected")
    loop = asyncio.get_running_loop()
    start, end = await loop.run_in_executor(None, connection.recv)
    window_box[:] = [start, end]
    go.set()
    await asyncio.sleep(max(0.0, end - time.monotonic()) + 0.2)
    stop.set()
    connection.send((counts.tolist(), latencies, retries))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()


def _client(address, streams, num_envs, first_id, connection):
    raise_open_file_limit()
    # Until the window is known, nothing counts.
    asyncio.run(_client_main(address, streams, num_envs, first_id, connection, [float("inf"), 0.0]))


# -- learner side (this process) -------------------------------------------------


def serving_learner(env: str, run_dir: str, **overrides):
    """A compiled learner of `env` with the uniform random policy, not yet serving."""
    from bench import uniform_policy
    from envs import registry
    from learner.learner import Learner
    from learner.presets import preset_for

    config = dataclasses.replace(
        preset_for(env),
        port=0,
        http_port=0,
        bind_address="127.0.0.1",
        run_dir=run_dir,
        log_interval_s=1e9,  # the benchmark reads the stats itself
        total_env_steps=10**15,  # the benchmark decides when to stop
        **overrides,
    )
    spec = registry.spec(env)
    policy_fn = uniform_policy.make_uniform_policy_fn(spec.action.num_actions)
    learner = Learner(config, policy_fn=policy_fn, console=False)
    learner.compile()
    return learner


def measure(
    streams: int,
    num_envs: int,
    warmup_s: float,
    duration_s: float,
    run_dir: str,
    streams_per_client: int = STREAMS_PER_CLIENT,
):
    from learner.tools.background import BackgroundLearner

    learner = serving_learner(
        ENV,
        run_dir,
        inference_batch_size=max(1024, num_envs),
    )
    served = BackgroundLearner(learner, train=False).start()
    stop_drain = threading.Event()
    drain = threading.Thread(
        target=drain_unrolls, args=(learner.unrolls, stop_drain, learner.store.recycle), daemon=True
    )
    drain.start()
    context = multiprocessing.get_context("spawn")
    clients, pipes = [], []
    try:
        for first in range(0, streams, streams_per_client):
            mine, theirs = context.Pipe()
            count = min(streams_per_client, streams - first)
            process = context.Process(
                target=_client, args=(served.address, count, num_envs, first, theirs)
            )
            process.start()
            clients.append(process)
            pipes.append(mine)
        connect_started = time.monotonic()
        for pipe in pipes:
            if not pipe.poll(max(1.0, connect_started + 300 - time.monotonic())):
                raise TimeoutError(f"{streams} streams did not connect within 300 s")
            answer = pipe.recv()
            if answer != "connected":
                raise RuntimeError(f"a client could not connect its streams: {answer}")
        connect_s = time.monotonic() - connect_started
        start = time.monotonic() + warmup_s
        end = start + duration_s
        for pipe in pipes:
            pipe.send((start, end))
        time.sleep(max(0.0, start - time.monotonic()))
        learner.stats.snapshot()  # opens the stats' window
        window = Window()
        time.sleep(max(0.0, end - time.monotonic()))
        wall, cpu = window.elapsed()
        batch = learner.stats.snapshot()["window"].get("inference_batch_envs")
        counts, latencies, retries = [], [], 0
        for pipe in pipes:
            if not pipe.poll(120):
                raise TimeoutError("a client did not report")
            stream_counts, stream_latencies, stream_retries = pipe.recv()
            retries += stream_retries
            counts.extend(stream_counts)
            latencies.extend(stream_latencies)
    finally:
        for process in clients:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        served.stop()
        stop_drain.set()
        drain.join()
    steps = sum(counts)
    latency_ms = np.asarray(latencies) * 1000.0
    return {
        "streams": streams,
        "envs_per_stream": num_envs,
        "actor_steps_per_s": steps / wall,
        "messages_per_s": steps / num_envs / wall,
        "learner_cpu_s_per_1k_steps": 1000.0 * cpu / max(steps, 1),
        "learner_cpu_us_per_step": 1e6 * cpu / max(steps, 1),
        "learner_cpu_us_per_message": 1e6 * cpu * num_envs / max(steps, 1),
        "learner_cores": cpu / wall,
        "latency_p50_ms": float(np.percentile(latency_ms, 50)) if latencies else None,
        "latency_p99_ms": float(np.percentile(latency_ms, 99)) if latencies else None,
        "streams_progressing": int(sum(1 for count in counts if count > 0)),
        "inference_batch_mean": batch.mean() if batch else None,
        "connect_s": connect_s,
        "connect_retries": retries,
    }


def run(settings: Settings) -> CaseResult:
    raise_open_file_limit()
    result = CaseResult(
        case="b",
        title="serving capacity: uniform random policy, counting env",
        columns=[
            Column("streams", "streams", "{}"),
            Column("envs_per_stream", "K", "{}"),
            Column("actor_steps_per_s", "actor steps/s"),
            Column("learner_cpu_s_per_1k_steps", "learner CPU s/1k steps", "{:.4f}"),
            Column("learner_cpu_us_per_step", "us/step", "{:.1f}"),
            Column("latency_p50_ms", "p50 ms", "{:.2f}"),
            Column("latency_p99_ms", "p99 ms", "{:.2f}"),
            Column("streams_progressing", "progressing", "{}"),
        ],
    )
    configurations = SHORT_CONFIGURATIONS if settings.short else CONFIGURATIONS
    per_client = SHORT_STREAMS_PER_CLIENT if settings.short else STREAMS_PER_CLIENT
    with tempfile.TemporaryDirectory() as run_dir:
        for streams, num_envs in configurations:
            result.rows.append(
                measure(
                    streams,
                    num_envs,
                    settings.warmup_s,
                    settings.serving_duration_s,
                    run_dir,
                    per_client,
                )
            )
    result.notes.append(
        "Learner and clients share this machine's cores; the learner's CPU per step is its "
        "own process's (all threads), the throughput is bounded by the clients' CPU here."
    )
    return result
