"""The benchmark's short mode, run as users run it, so the benchmark cannot rot.

The figures of a seconds-long run on a shared machine are not checked
against targets (docs/benchmarks.md has the measured ones); what is checked is
that every case measures what it says, end to end, and reports it whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench import tethered
from bench.common import mean_interval, student_t_quantile
from tests.fleet import ROOT, wait_until

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench")
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "--short", "--out-dir", str(out_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    results = json.loads((out_dir / "results.json").read_text())
    return out_dir, completed.stdout, {result["case"]: result for result in results}


def test_every_case_reports_with_machine_and_commit(short_run):
    _, stdout, results = short_run
    assert sorted(results) == list("abcdef")
    for case, result in results.items():
        assert result["rows"], f"case {case} measured nothing"
        assert result["machine"]["usable_cores"] >= 1
        assert len(result["commit"].split("+")[0]) == 40
        assert f"({case}) " in stdout  # its table was printed


def test_raw_and_end_to_end_cases_measure_frames(short_run):
    _, _, results = short_run
    raw = {row["env"]: row for row in results["a"]["rows"]}
    assert set(raw) == {"atari:Pong/84x84", "counting:v0"}
    pong = raw["atari:Pong/84x84"]
    assert pong["env_frames_per_s"] == pytest.approx(4 * pong["env_steps_per_s"])
    usable = sorted(os.sched_getaffinity(0))
    rows = results["c"]["rows"]
    assert [row["learner_placement"] for row in rows] == ["shared", "own cores"][: len(usable)]
    for trivial in rows:
        assert trivial["env_frames_per_s"] > 0 and trivial["raw_env_frames_per_s"] > 0
        # The fleet's window, then the raw envs' at the same P and K; the row is made of them.
        fleet, raw_window = trivial["per_window"]
        assert (fleet["side"], raw_window["side"]) == ("fleet", "raw")
        assert trivial["env_frames_per_s"] == pytest.approx(fleet["env_frames_per_s"], rel=1e-3)
        assert trivial["raw_env_frames_per_s"] == pytest.approx(
            raw_window["env_frames_per_s"], rel=1e-3
        )
        assert trivial["ratio_to_raw"] == pytest.approx(
            trivial["env_frames_per_s"] / trivial["raw_env_frames_per_s"]
        )
        assert trivial["ratio_to_raw_per_pair"] == [
            pytest.approx(trivial["ratio_to_raw"], rel=1e-3)
        ]
        assert trivial["ratio_to_raw_ci95"] is None  # one pair has no spread to go by
        # The CPU split of the same windows: both sides' env processes ran.
        assert trivial["actors_cpu_us_per_step"] > 0 and trivial["raw_cpu_us_per_step"] > 0
        shared = trivial["learner_placement"] == "shared"  # then the learner's CPU counts
        assert trivial["cpu_ratio_to_raw"] == pytest.approx(
            trivial["raw_cpu_us_per_step"]
            / (trivial["actors_cpu_us_per_step"] + shared * trivial["learner_cpu_us_per_step"])
        )
    # Where the threads ran, as the kernel reported it during the run: everything on every
    # core; then the learner on cores of its own, one actor process per other core.
    assert rows[0]["learner_cpus"] == rows[0]["env_cpus"] == usable
    if len(usable) >= 2:
        own = rows[1]
        assert own["learner_cpus"] and own["env_cpus"]
        assert not set(own["learner_cpus"]) & set(own["env_cpus"])
        assert sorted(own["learner_cpus"] + own["env_cpus"]) == usable
        assert own["processes"] == len(own["env_cpus"])
    (training,) = results["d"]["rows"]
    assert training["updates_per_s"] > 0 and training["env_frames_per_s"] > 0
    for share in ("time_inference", "time_trainer_waiting", "time_training"):
        assert 0 <= training[share] <= 1.05


def test_serving_case_serves_every_stream(short_run):
    _, _, results = short_run
    rows = results["b"]["rows"]
    assert [(row["streams"], row["envs_per_stream"]) for row in rows] == [
        (16, 1),
        (16, 16),
        (64, 1),
    ]
    for row in rows:
        assert row["streams_progressing"] == row["streams"]
        assert row["actor_steps_per_s"] > 0 and row["learner_cpu_us_per_step"] > 0
        assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"]


def test_network_case_times_forward_and_train_step(short_run):
    _, _, results = short_run
    rows = results["e"]["rows"]
    jax_rows = [row for row in rows if row["framework"] == "jax"]
    assert {row["what"] for row in jax_rows} == {"forward", "train_step"}
    assert all(row["samples_per_s"] > 0 for row in jax_rows)


def test_dashboards_case_measures_both_states(short_run):
    _, _, results = short_run
    rows = results["f"]["rows"]
    assert [row["dashboards"] for row in rows] == ["on", "off"]
    on, off = rows
    assert on["windows"] == off["windows"] == 1
    assert on["http_requests"] >= 1 and off["http_requests"] == 0  # the page was watched
    assert on["env_frames_per_s"] > 0 and off["env_frames_per_s"] > 0
    summary = results["f"]["summary"]
    assert summary["fps_on_over_off"] == pytest.approx(
        on["env_frames_per_s"] / off["env_frames_per_s"]
    )


def test_plots_are_png_files(short_run):
    out_dir, _, _ = short_run
    for name in ("frames_per_s.png", "serving.png", "network.png"):
        assert (out_dir / name).read_bytes()[:8] == PNG_MAGIC, name


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T stopped, Z zombie), "" when gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def test_pausable_envs_stop_counting_while_paused_and_go_on_after():
    from bench.raw_env import PausableEnvs

    envs = PausableEnvs("counting:v0", processes=2, num_envs=4)
    pids = [worker.pid for worker in envs._workers]
    try:
        wait_until(lambda: envs.steps() > 0, 30, "the envs to step")
        envs.pause()
        wait_until(lambda: all(_state(pid) in ("t", "T") for pid in pids), 30, "them to stop")
        paused_at = envs.steps()
        assert paused_at % 4 == 0  # whole vector steps of K = 4
        # Stopped by the kernel: no step is counted until resumed (watched for 0.3 s).
        watched_until = time.monotonic() + 0.3
        while time.monotonic() < watched_until:
            assert envs.steps() == paused_at
        envs.resume()
        wait_until(lambda: envs.steps() > paused_at, 30, "the envs to step again")
    finally:
        envs.pause()  # closing ends stopped processes as well
        envs.close()
    assert all(_state(pid) in ("", "Z") for pid in pids)


def test_held_pausable_envs_are_made_in_the_background_and_step_from_the_first_resume():
    from bench.raw_env import PausableEnvs

    envs = PausableEnvs("counting:v0", processes=2, num_envs=4, held=True, wait=False)
    try:
        envs.wait_ready()
        assert all(ready.is_set() for ready in envs._readies)
        # Made and held: no step is taken before the first resume (watched for 0.3 s).
        watched_until = time.monotonic() + 0.3
        while time.monotonic() < watched_until:
            assert envs.steps() == 0
        envs.pause()  # a pause before the first resume must not keep them held
        envs.resume()
        wait_until(lambda: envs.steps() > 0, 30, "the envs to step after the first resume")
    finally:
        envs.close()


def test_pausable_envs_that_cannot_be_made_fail_wait_ready_with_their_exit_codes():
    from bench.raw_env import PausableEnvs

    # The spec is known, so the constructor returns; each process then fails to make 0 envs.
    envs = PausableEnvs("counting:v0", processes=2, num_envs=0, held=True, wait=False)
    with pytest.raises(RuntimeError, match=r"failed to start \(exit codes \[1"):
        envs.wait_ready()
    assert all(not worker.is_alive() for worker in envs._workers)


def test_pinning_reaches_every_thread_and_the_threads_started_after():
    from bench.common import cpus_of, pin_processes

    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("pinning to some of the cores needs two")
    script = (
        "import os, threading\n"
        "started = threading.Event()\n"
        "threading.Thread(target=lambda: (started.set(), threading.Event().wait()), daemon=True).start()\n"
        "started.wait()\n"
        "print(flush=True)\n"
        "input()\n"
        "later = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0))))\n"
        "later.start(); later.join()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child.stdout.readline()  # both threads are up
        assert len(os.listdir(f"/proc/{child.pid}/task")) == 2
        assert cpus_of([child.pid]) == usable
        pin_processes([child.pid], {usable[-1]})
        for thread in os.listdir(f"/proc/{child.pid}/task"):
            assert os.sched_getaffinity(int(thread)) == {usable[-1]}
        assert cpus_of([child.pid]) == [usable[-1]]
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == str([usable[-1]])  # inherited
    finally:
        child.kill()
        child.wait(timeout=30)


def test_other_processes_cpu_time_is_read_from_the_kernel():
    from bench.common import processes_cpu_seconds

    # Two children: one burns 0.5 s of CPU before it reports, one only waits.
    burn = (
        "import time\n"
        "start = time.process_time()\n"
        "while time.process_time() - start < 0.5: pass\n"
        "print(flush=True)\n"
        "input()\n"
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for script in (burn, "print(flush=True); input()")
    ]
    try:
        for child in children:
            child.stdout.readline()
        burner, idle = (child.pid for child in children)
        started = time.perf_counter()
        burnt = processes_cpu_seconds([burner])
        assert 0.45 <= burnt <= 0.5 + 1.0  # its burn and its interpreter's start-up
        assert processes_cpu_seconds([idle]) < burnt - 0.4
        assert processes_cpu_seconds([burner, idle]) >= burnt
        assert time.perf_counter() - started < 5  # reading /proc is cheap
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=30)


def _children_end_with_their_killed_parent(script: str, what: str) -> None:
    """Runs `script` in a parent process that prints its children's pids, SIGKILLs the
    parent (no clean-up runs in it) and waits for every child to end."""
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        pids = list(map(int, parent.stdout.readline().split()))
        assert pids and all(_state(pid) not in ("", "Z") for pid in pids)
    finally:
        parent.kill()
        parent.wait(timeout=30)
    try:
        wait_until(lambda: all(_state(pid) in ("", "Z") for pid in pids), 30, what, 0.2)
    finally:
        for pid in pids:
            if _state(pid) not in ("", "Z"):
                os.kill(pid, signal.SIGKILL)  # not left running after the test


def test_pausable_envs_end_when_the_benchmark_is_killed():
    script = (
        "from bench.raw_env import PausableEnvs\n"
        "envs = PausableEnvs('counting:v0', processes=1, num_envs=2)\n"
        "print(*(w.pid for w in envs._workers), flush=True)\n"
        "input()\n"
    )
    _children_end_with_their_killed_parent(script, "the env process to end with its parent")


def test_the_fleets_actors_end_when_the_benchmark_is_killed():
    """Killed, the benchmark takes its learner with it; its actors, which would retry a
    learner that went away for ever, end with it instead of loading the next runs."""
    script = (
        "from bench.end_to_end import serving_fleet\n"
        "with serving_fleet('counting:v0', 2, 2, 1, False) as (_, _, pids):\n"
        "    print(*pids, flush=True)\n"
        "    input()\n"
    )
    _children_end_with_their_killed_parent(script, "the actors to end with the benchmark")


def test_a_tethered_process_whose_parent_is_already_gone_never_runs_its_module():
    # Started by this test, not by the parent it names (the parent "ended" before it could
    # set its death signal): it exits before the module (which would print) runs.
    completed = subprocess.run(
        [sys.executable, "-m", "bench.tethered", str(os.getppid()), "json.tool", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (completed.returncode, completed.stdout) == (1, "")
    run_here = subprocess.run(
        tethered.command("json.tool", "--help"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run_here.returncode == 0 and "usage" in run_here.stdout


def test_the_alignment_probe_times_both_sides_of_every_row(capsys):
    """bench.aligned, the A/B behind "Batches read in place" (docs/benchmarks.md)."""
    from bench import aligned

    aligned.main(["--window-s", "0", "--min-rounds", "1", "--batches", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4  # a header, its rule, the policy's row, the training batch's
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == 4 and all(float(value) > 0 for value in cells[1:]), line
    assert lines[2].startswith("| policy, 2 rows |")


def test_the_onednn_probe_compiles_the_policy_both_ways_and_the_pinned_jaxlib_ignores_it(capsys):
    """bench.onednn, the A/B behind "oneDNN's convolutions" (docs/benchmarks.md).

    jaxlib 0.10.2 has no oneDNN convolution rewriter, so the option must change
    nothing. When this fails after a jax upgrade, the option has started to work:
    measure it (`python -m bench.onednn --step`) and give the policy its
    convolutions on oneDNN where it wins (docs/benchmarks.md has 0.12's figures).
    """
    from bench import onednn

    rows = onednn.main(["--window-s", "0", "--min-rounds", "1", "--batches", "2"])
    assert [row["what"] for row in rows] == ["policy, 2 rows"]
    (row,) = rows
    assert row["shipped_ms"] > 0 and row["onednn_ms"] > 0
    assert row["speedup"] == pytest.approx(row["shipped_ms"] / row["onednn_ms"])
    assert not row["onednn_convolutions"], "this jaxlib hands convolutions to oneDNN"
    assert row["max_difference"] == 0.0
    assert "policy, 2 rows" in capsys.readouterr().out


def test_trivial_rows_end_with_messages_that_fill_a_batch_four_times_the_presets():
    import dataclasses

    from bench.end_to_end import (
        message_sized_batch,
        own_core_configuration,
        trivial_configurations,
    )
    from learner.presets import preset_for

    preset = preset_for("atari:Pong/84x84")
    largest = preset.max_envs_per_stream
    for num_envs in (8, 32, largest, 100, 3 * largest, 8 * largest):
        rows = trivial_configurations(num_envs, False, "atari:Pong/84x84")
        assert len(rows) == len(set(rows))
        assert rows[-2:] == [(2 * largest, 2), (8 * largest, 2)]
        for envs, groups in rows:
            # The learner refuses a message larger than its batch: each row's learner
            # is made to take its messages whole.
            config = dataclasses.replace(
                preset, **message_sized_batch("atari:Pong/84x84", envs // groups)
            )
            assert envs // groups <= config.max_envs_per_stream
        # The row on the learner's own cores runs with the preset's batch as it is.
        assert own_core_configuration(rows, "atari:Pong/84x84") == (2 * largest, 2)
    assert trivial_configurations(32, False, "atari:Pong/84x84") == [(32, 1), (128, 2), (512, 2)]
    assert trivial_configurations(8, True, "atari:Pong/84x84") == [(8, 1)]
    assert own_core_configuration([(8, 1)], "atari:Pong/84x84") == (8, 1)
    assert own_core_configuration([(8 * largest, 1)], "atari:Pong/84x84") == (8 * largest, 1)
    # The preset is left as it is wherever it takes the message already.
    assert message_sized_batch("atari:Pong/84x84", largest) == {}
    assert message_sized_batch("atari:Pong/84x84", 4 * largest) == {
        "inference_batch_size": 4 * largest,
        "max_envs_per_actor": max(preset.max_envs_per_actor, 4 * largest),
    }


def test_the_alternating_comparison_runs_each_configuration_every_round(tmp_path, capsys):
    """bench.alternate, the A/B behind case (c)'s "Messages of 256 envs"."""
    from bench import alternate, machine

    out = tmp_path / "ab.json"
    # 256x2: messages of 128 envs, twice what the counting env's preset batches.
    fleets = ["--env", "counting:v0", "--processes", "1", "--configs", "4x1", "256x2"]
    timing = ["--rounds", "2", "--warmup-s", "0", "--duration-s", "0.5", "--windows", "2"]
    alternate.main([*fleets, *timing, "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["machine"] == machine.describe() and written["commit"] == machine.commit()
    assert written["settings"]["configs"] == ["4x1", "256x2"]
    assert written["settings"]["env"] == "counting:v0" and written["settings"]["rounds"] == 2
    runs = written["runs"]
    assert list(runs) == ["4x1", "256x2"]
    assert [row["inference_batch_size"] for row in runs["4x1"]] == [64, 64]
    assert [row["inference_batch_size"] for row in runs["256x2"]] == [128, 128]
    for rows in runs.values():
        assert len(rows) == 2
        for row in rows:
            assert row["env_frames_per_s"] > 0 and row["raw_env_frames_per_s"] > 0
            assert row["ratio_to_raw"] == pytest.approx(
                row["env_frames_per_s"] / row["raw_env_frames_per_s"]
            )
            assert row["learner_cpu_us_per_step"] > 0 and row["raw_cpu_us_per_step"] > 0
            assert row["actors_cpu_us_per_step"] > 0 and row["cpu_ratio_to_raw"] > 0
            assert isinstance(row["steal"], float) and 0 <= row["steal"] <= 1  # /proc/stat
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["4x1", "256x2"]
    for line, rows in zip(lines[2:], runs.values(), strict=True):
        # The mean of the two runs and its interval, from those runs' ratios.
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        mean, half = mean_interval([row["ratio_to_raw"] for row in rows])
        assert cells[2] == f"{mean:.3f}"
        assert cells[3] == f"{mean - half:.3f}-{mean + half:.3f}"
        assert all(row["ratio_to_raw_ci95"] is None for row in rows)  # one pair per run
    refused = [["--configs", text] for text in ("8", "8x3", "0x1", "ax2")]
    refused += [["--rounds", "0"], ["--windows", "3"], ["--duration-s", "0"]]
    for bad in refused:
        with pytest.raises(SystemExit):
            alternate.main(bad)
    assert capsys.readouterr().out == ""  # refused before anything ran


@pytest.mark.parametrize(
    "probability, df, expected",
    # Student's t tables: two-sided 95% for 1, 3, 9, 30 degrees of freedom; 90% and 99%.
    [
        (0.975, 1, 12.706),
        (0.975, 3, 3.182),
        (0.975, 9, 2.262),
        (0.975, 30, 2.042),
        (0.95, 5, 2.015),
        (0.995, 10, 3.169),
    ],
)
def test_student_t_quantiles_match_the_tables(probability, df, expected):
    assert student_t_quantile(probability, df) == pytest.approx(expected, abs=6e-4)


def test_the_mean_interval_is_students_over_the_values():
    # Standard deviation 1 over three values: t(2) = 4.303 times 1 / sqrt(3).
    assert mean_interval([1.0, 2.0, 3.0]) == (2.0, pytest.approx(4.3027 / 3**0.5, abs=1e-3))
    mean, half = mean_interval([0.9, 0.9, 0.9, 0.9])
    assert (mean, half) == (pytest.approx(0.9), pytest.approx(0.0, abs=1e-12))
    assert mean_interval([0.93]) == (0.93, None)  # one value: no interval
    for probability, df in ((0.5, 3), (1.0, 3), (0.975, 0)):
        with pytest.raises(ValueError, match="probability"):
            student_t_quantile(probability, df)


def test_the_attack_benchmark_runs_every_attack_against_a_training_learner(tmp_path):
    """`python -m bench.attacks`, every attack for a 2 s window: each report is whole, and
    the learner trained on through all of them. (The honest actor's rate is the
    benchmark's figure, not checked here: seconds on a shared machine say little.)"""
    completed = subprocess.run(
        [sys.executable, "-m", "bench.attacks", "--window-s", "2", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((tmp_path / "attacks.json").read_text())
    from bench.attacks import ATTACKS

    assert [row["attack"] for row in report["attacks"]] == list(ATTACKS), completed.stdout
    for row in report["attacks"]:
        assert row["learner_running"] and row["honest_actor_running"], row
        assert row["updates_during"] > 0, row
        assert row["honest_steps_per_s_undisturbed"] > 0, row
        assert "attacker failed" not in row["streams_ended"], row
    ended = {row["attack"]: row["streams_ended"] for row in report["attacks"]}
    assert set(ended["huge rewards"]) == {"INVALID_ARGUMENT"}
    assert set(ended["the honest actor's id from elsewhere"]) == {"ALREADY_EXISTS"}
    assert set(ended["70 MB messages"]) == {"RESOURCE_EXHAUSTED"}
    assert ended["200 silent hellos of 64 envs"] == {"welcomed, then silent": 200}
    assert report["stream_errors"]["INVALID_ARGUMENT"] > 0
