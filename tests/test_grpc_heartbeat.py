"""The heartbeat oomtune's client adds to Optuna's gRPC storage proxy (which has none): when a RUNNING
trial counts as stale, on the observing worker's own clock (oomtune/study/grpc_proxy.py). No proxy
is needed: the client's reads are stood in for, its clock is a fake one.

By the rule (module docstring of oomtune.study.grpc_proxy): stale once its heartbeat value was seen
unchanged for more than ``grace_period`` seconds, every one of them while this process reached the
proxy; a new value or an outage of this process restarts the count.
"""

from __future__ import annotations

import pytest

pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")


class _Unavailable(Exception):
    """What a gRPC call raises when the proxy is down (``grpc._channel._InactiveRpcError``, code
    UNAVAILABLE), as oomtune.study.reconnect recognises it: a ``grpc`` module and ``code()``."""

    __module__ = "grpc._channel"

    def code(self):
        import grpc

        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses"


def _running(trial_id: int, beat):
    from optuna.trial import FrozenTrial, TrialState

    from oomtune.study.grpc_proxy import HEARTBEAT_ATTR

    attrs = {} if beat is None else {HEARTBEAT_ATTR: beat}
    return FrozenTrial(number=trial_id, state=TrialState.RUNNING, value=None, datetime_start=None,
                       datetime_complete=None, params={}, distributions={}, user_attrs={}, system_attrs=attrs,
                       intermediate_values={}, trial_id=trial_id)


@pytest.fixture
def client(monkeypatch):
    from oomtune.study import grpc_proxy as G

    cls = G.grpc_storage_class()
    storage = cls(host="127.0.0.1", port=9, heartbeat_interval=1, grace_period=5)   # no proxy: never called
    clock = {"now": 100.0}
    monkeypatch.setattr(G.time, "monotonic", lambda: clock["now"])
    running: list = []
    monkeypatch.setattr(cls, "get_all_trials", lambda self, study_id, deepcopy=True, states=None: list(running))
    yield storage, clock, running
    storage.close()


def test_unchanged_for_more_than_the_grace_period_is_stale(client, monkeypatch):
    monkeypatch.delenv("OOMTUNE_STORAGE_RETRY_S", raising=False)   # the default schedule: 1, 2, 4 ... 30 s
    storage, clock, running = client
    running[:] = [_running(7, ["other", 3]), _running(8, None)]          # 8 never beat (claimed, then died)
    assert storage._get_stale_trial_ids(0) == []                        # first seen at 100 s
    clock["now"] = 105.0
    assert storage._get_stale_trial_ids(0) == []                        # 5 s: not more than the grace
    clock["now"] = 105.5
    assert storage._get_stale_trial_ids(0) == [7]
    # 8 never beat: its worker may still be claiming it, waiting up to the longest retry delay (30 s)
    # between two tries of a storage call, so it counts as stale only after 5 + 30 s
    clock["now"] = 135.0
    assert storage._get_stale_trial_ids(0) == [7]
    clock["now"] = 135.5
    assert storage._get_stale_trial_ids(0) == [7, 8]


def test_a_new_beat_restarts_the_count(client):
    storage, clock, running = client
    running[:] = [_running(7, ["other", 3])]
    storage._get_stale_trial_ids(0)
    clock["now"] = 104.0
    running[:] = [_running(7, ["other", 4])]                            # it beat: seen anew at 104 s
    assert storage._get_stale_trial_ids(0) == []
    clock["now"] = 109.0
    assert storage._get_stale_trial_ids(0) == []                        # 5 s since the new beat
    clock["now"] = 109.5
    assert storage._get_stale_trial_ids(0) == [7]


def test_an_outage_of_the_observer_restarts_the_count(client):
    storage, clock, running = client
    running[:] = [_running(7, ["other", 3])]
    storage._get_stale_trial_ids(0)                                     # seen at 100 s

    def down(self, *args):
        raise _Unavailable()

    clock["now"] = 103.0
    with pytest.raises(_Unavailable):                                    # the proxy did not answer at 103 s
        storage._noting_outages(down)
    clock["now"] = 106.0                                                # 6 s unchanged, but not all reachable
    assert storage._get_stale_trial_ids(0) == []
    clock["now"] = 111.0
    assert storage._get_stale_trial_ids(0) == []                        # 5 s since it was seen again at 106
    clock["now"] = 111.5
    assert storage._get_stale_trial_ids(0) == [7]


def test_finished_trials_are_forgotten(client):
    storage, clock, running = client
    running[:] = [_running(7, ["other", 3])]
    storage._get_stale_trial_ids(0)
    running[:] = []                                                     # it finished
    storage._get_stale_trial_ids(0)
    assert storage._seen == {}
    clock["now"] = 200.0
    running[:] = [_running(7, ["other", 3])]                            # (a trial id seen again counts anew)
    assert storage._get_stale_trial_ids(0) == []


def test_heartbeats_change_with_every_beat_and_differ_between_processes(monkeypatch):
    from oomtune.study import grpc_proxy as G

    cls = G.grpc_storage_class()
    a, b = (cls(host="127.0.0.1", port=9, heartbeat_interval=1, grace_period=5) for _ in range(2))
    written = []
    from optuna.storages import GrpcStorageProxy

    monkeypatch.setattr(GrpcStorageProxy, "set_trial_system_attr",
                        lambda self, trial_id, key, value: written.append((trial_id, key, value)))
    a.record_heartbeat(3)
    a.record_heartbeat(3)
    b.record_heartbeat(3)
    values = [v for _, key, v in written if key == G.HEARTBEAT_ATTR]
    assert len(values) == 3 and len({repr(v) for v in values}) == 3
    a.close()
    b.close()


def test_a_lost_proxy_is_a_lost_connection_with_a_readable_line():
    from oomtune.study.reconnect import _first_line, is_connection_error

    assert is_connection_error(_Unavailable())
    assert _first_line(_Unavailable()) == "UNAVAILABLE: failed to connect to all addresses"


# -- a proxy that shut down, whatever status its calls were left with ----------------------------------------
@pytest.fixture
def aborting_server():
    """A real gRPC server whose one method ends each call with the next status of ``codes`` ("OK": answers
    b"ok"); yields (codes, the client's callable)."""
    from concurrent import futures

    import grpc

    codes: list[str] = []

    def handle(request, context):
        code = codes.pop(0)
        if code != "OK":
            context.abort(getattr(grpc.StatusCode, code), f"ended with {code}")
        return b"ok"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Storage", {"Get": grpc.unary_unary_rpc_method_handler(handle)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield codes, channel.unary_unary("/t.Storage/Get")
    channel.close()
    server.stop(None)


@pytest.mark.parametrize("code, lost", [
    ("UNAVAILABLE", True),        # refused, or cut by the proxy's shutdown ("Cancelling all calls")
    ("CANCELLED", True),          # waiting for a handler when the proxy shut down: grpc/grpc#41785
    ("INVALID_ARGUMENT", False),  # the proxy answered: retrying the same call cannot help
    ("NOT_FOUND", False),
])
def test_a_storage_call_the_proxy_left_unanswered_is_a_lost_connection(aborting_server, code, lost):
    """Field case grpc/grpc#41785 (gRPC Python, 2026): calls a server had received but not yet handed to a
    handler when it shut down end with CANCELLED, not UNAVAILABLE. oomtune's storage client never cancels a
    call itself (no deadline, no cancel()), so through a proxy restart such a call is a lost connection to
    retry; a worker that took it for an error ended its search."""
    import grpc

    from oomtune.study.reconnect import is_connection_error

    codes, call = aborting_server
    codes.append(code)
    with pytest.raises(grpc.RpcError) as caught:
        call(b"x")
    assert caught.value.code().name == code   # the real error object a gRPC call raises
    assert is_connection_error(caught.value) is lost


def test_a_call_cancelled_by_the_proxys_shutdown_is_retried_with_one_line(aborting_server):
    from oomtune.study.reconnect import retrying

    codes, call = aborting_server
    codes.extend(["CANCELLED", "OK"])
    lines: list[str] = []
    assert retrying(lambda: call(b"x"), "read trials", say=lines.append, delays_s=(0.0,)) == b"ok"
    assert lines == ["storage connection lost while trying to read trials: CANCELLED: ended with CANCELLED; "
                     "retry 1 of 1 in 0 s"]
