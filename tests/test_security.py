"""The shared token and TLS, with real learners, real actor processes and raw clients."""

from __future__ import annotations

import json
import os
import subprocess

import grpc
import pytest

from seedrl import security
from seedrl.proto import seedrl_pb2
from seedrl.transport import STREAM_PATH
from tests.fleet import (
    ROOT,
    LearnerThread,
    learner_argv,
    learner_config,
    port_from_log,
    spawn_actor,
    wait_until,
)
from tests.test_bad_input import ENV, hello

TOKEN = "tok-5f1c2e9b7a"


def first_reply(channel: grpc.Channel, metadata=()) -> seedrl_pb2.LearnerMessage:
    """Sends a hello; the learner's first message (its welcome), or the RpcError."""
    call = channel.stream_stream(STREAM_PATH)(iter([hello()]), metadata=metadata, timeout=20)
    return seedrl_pb2.LearnerMessage.FromString(next(iter(call)))


def refusal(channel: grpc.Channel, metadata=()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        first_reply(channel, metadata)
    return caught.value


def test_token_check_in_constant_form():
    assert security.token_matches([("authorization", "Bearer abc")], "abc")
    assert not security.token_matches([("authorization", "Bearer abd")], "abc")
    assert not security.token_matches([("authorization", "abc")], "abc")
    assert not security.token_matches([], "abc")
    assert not security.token_matches(None, "abc")
    assert security.token_matches([], "")  # no token configured: everyone
    assert security.call_metadata("") == ()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("token")
    learner = LearnerThread(learner_config(ENV, tmp / "run", auth_token=TOKEN)).start()
    yield learner, tmp
    learner.stop()


def test_a_stream_without_the_token_is_unauthenticated(guarded):
    learner, _ = guarded
    with grpc.insecure_channel(learner.address) as channel:
        error = refusal(channel)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing or wrong auth token" in error.details()
        assert TOKEN not in error.details()
        wrong = refusal(channel, security.call_metadata("tok-wrong"))
        assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED
        welcome = first_reply(channel, security.call_metadata(TOKEN))
        assert welcome.WhichOneof("message") == "welcome"
    assert learner.learner.stats.stream_error_counts()["UNAUTHENTICATED"] >= 2
    assert learner.learner.stats.env_steps == 0  # nothing was served to the strangers


def test_actors_with_and_without_the_token(guarded):
    learner, tmp = guarded
    wrong = spawn_actor(learner.address, ENV, 2, "stranger", tmp / "actors", "--auth-token", "x")
    assert wrong.wait(timeout_s=60) == 2  # refused for good: no retry loop
    assert "the learner refused actor stranger: UNAUTHENTICATED" in wrong.log()
    os.environ[security.TOKEN_ENV] = TOKEN  # the actor takes it from its environment
    try:
        good = spawn_actor(learner.address, ENV, 2, "member", tmp / "actors")
    finally:
        del os.environ[security.TOKEN_ENV]
    try:
        wait_until(lambda: learner.learner.stats.env_steps > 100, 60, "the member to be served")
    finally:
        good.kill()
    assert TOKEN not in good.log()


def test_the_token_is_never_logged_nor_saved(tmp_path):
    log = tmp_path / "learner.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            learner_argv(ENV, tmp_path / "run", "--auth-token", TOKEN, "--total-env-steps", "2000"),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            port = port_from_log(log, timeout_s=300)
            actor = spawn_actor(
                f"127.0.0.1:{port}", ENV, 2, "member", tmp_path / "actors", "--auth-token", TOKEN
            )
            assert process.wait(timeout=300) == 0
            assert actor.wait(timeout_s=60) == 0
        finally:
            process.kill()
    text = log.read_text()
    assert "the shared token" in text  # it says a token is required ...
    assert TOKEN not in text  # ... never which
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["auth_token"] == "<set>"
    assert TOKEN not in (tmp_path / "run" / "config.json").read_text()


# -- TLS -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs")
    subprocess.run([str(ROOT / "scripts" / "make_certs.sh"), str(directory)], check=True)
    return directory


def tls_channel(address: str, certs, client: bool = False) -> grpc.Channel:
    credentials = security.channel_credentials(
        str(certs / "ca.pem"),
        str(certs / "actor.pem") if client else "",
        str(certs / "actor.key") if client else "",
    )
    return grpc.secure_channel(address, credentials)


def assert_actor_served(learner: LearnerThread, tmp_path, *flags: str) -> None:
    """A real actor process with `flags` gets 100 env steps served, then is killed."""
    actor = spawn_actor(learner.address, ENV, 2, "tls", tmp_path / "actors", *flags)
    try:
        wait_until(lambda: learner.learner.stats.env_steps > 100, 60, "a TLS actor served")
    finally:
        actor.kill()


def tls_learner(tmp_path, certs, **overrides) -> LearnerThread:
    """A started learner with the test CA's learner certificate."""
    config = learner_config(
        ENV,
        tmp_path / "run",
        tls_cert=str(certs / "learner.pem"),
        tls_key=str(certs / "learner.key"),
        **overrides,
    )
    return LearnerThread(config).start()


def test_with_tls_a_plain_text_client_is_refused(tmp_path, certs):
    learner = tls_learner(tmp_path, certs)
    try:
        with grpc.insecure_channel(learner.address) as channel:
            error = refusal(channel)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        with tls_channel(learner.address, certs) as channel:
            assert first_reply(channel).WhichOneof("message") == "welcome"
        assert_actor_served(learner, tmp_path, "--tls-ca", str(certs / "ca.pem"))
    finally:
        learner.stop()


def test_a_client_certificate_when_the_learner_asks_for_one(tmp_path, certs):
    learner = tls_learner(tmp_path, certs, tls_client_ca=str(certs / "ca.pem"))
    try:
        with tls_channel(learner.address, certs, client=False) as channel:
            error = refusal(channel)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        with tls_channel(learner.address, certs, client=True) as channel:
            assert first_reply(channel).WhichOneof("message") == "welcome"
        assert_actor_served(
            learner,
            tmp_path,
            "--tls-ca",
            str(certs / "ca.pem"),
            "--tls-cert",
            str(certs / "actor.pem"),
            "--tls-key",
            str(certs / "actor.key"),
        )
    finally:
        learner.stop()


def test_unreadable_certificates_are_named(tmp_path):
    config = learner_config(
        ENV, tmp_path / "run", tls_cert=str(tmp_path / "none.pem"), tls_key=str(tmp_path / "k")
    )
    assert LearnerThread(config).start().wait(timeout_s=60) == 2
