"""Who may do what, in isolation: route tags and the stage's route check, the coordinator's tokens."""

from __future__ import annotations

import pytest

from layerline.coordinator.auth import Tokens, bearer
from layerline.protos.v1 import stage_pb2
from layerline.shared.errors import Forbidden, InvalidInput, OverLimit
from layerline.shared.routes import check_address, check_tag, new_key, route_tag
from layerline.stage_worker import routing
from layerline.stage_worker.routing import RouteGuard

CHAIN = ["10.0.0.1:7101", "10.0.0.2:7102", "10.0.0.3:7103"]


def _header(chain: list[str], route: list[str], *, key: bytes, model_id: str = "m1") -> stage_pb2.StepHeader:
    return stage_pb2.StepHeader(
        model_id=model_id, chain=chain, route=route, route_tag=route_tag(key, model_id, chain) if key else b""
    )


def _guard(address: str, key: bytes | None) -> RouteGuard:
    guard = RouteGuard(address=lambda: address)
    guard.key = key
    return guard


def test_a_stage_follows_the_chain_its_coordinator_tagged() -> None:
    key = new_key()
    middle = _guard(CHAIN[1], key)
    assert middle.check(_header(CHAIN, CHAIN[2:], key=key), sender="stage") == "\0".join(CHAIN)
    assert middle.check(_header(CHAIN, CHAIN[2:], key=key), sender=None) == "\0".join(CHAIN)  # TLS off
    first = _guard(CHAIN[0], key)
    assert first.check(_header(CHAIN, CHAIN[1:], key=key), sender="coordinator") == "\0".join(CHAIN)


@pytest.mark.parametrize(
    ("me", "header", "sender", "message"),
    [
        (CHAIN[1], lambda k: _header(CHAIN, ["127.0.0.1:1"], key=k), "stage", "route must be the hops"),
        (CHAIN[1], lambda k: _header(CHAIN, CHAIN[2:], key=new_key()), "stage", "route_tag does not match"),
        (CHAIN[1], lambda k: _retagged(_header(CHAIN, CHAIN[2:], key=k), model_id="m2"), "stage", "does not match"),
        ("10.0.0.9:1", lambda k: _header(CHAIN, CHAIN[2:], key=k), "stage", "is not in the step's chain"),
        (CHAIN[1], lambda k: _header(CHAIN, CHAIN[2:], key=k), "coordinator", "at a chain's first stage"),
        (CHAIN[0], lambda k: _header(CHAIN, CHAIN[1:], key=k), "stage", "not to a first stage"),
    ],
)
def test_a_route_the_coordinator_did_not_issue_is_forbidden(me, header, sender, message) -> None:  # type: ignore[no-untyped-def]
    key = new_key()
    with pytest.raises(Forbidden, match=message):
        _guard(me, key).check(header(key), sender=sender)


def test_a_route_followed_before_is_checked_again_under_a_new_key_and_a_changed_field(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A stage remembers the routes it followed; the memory goes with its key, and a step that
    differs in any field of its route from one followed (tag, model, sender) is checked whole."""
    key = new_key()
    me = [CHAIN[1]]
    middle = RouteGuard(address=lambda: me[0])
    middle.key = key
    verified = []
    monkeypatch.setattr(routing, "check_tag", lambda *a: verified.append(a) or check_tag(*a))
    followed = _header(CHAIN, CHAIN[2:], key=key)
    assert middle.check(followed, sender="stage") == "\0".join(CHAIN)
    assert middle.check(followed, sender="stage") == "\0".join(CHAIN)
    assert len(verified) == 1  # the second time, remembered
    with pytest.raises(Forbidden, match="route must be the hops"):
        middle.check(_header(CHAIN, CHAIN[3:], key=key), sender="stage")  # another route under the chain's tag
    me[0] = CHAIN[2]  # the stage now advertises another address: the last of the chain
    with pytest.raises(Forbidden, match="route must be the hops"):
        middle.check(followed, sender="stage")
    me[0] = CHAIN[1]
    with pytest.raises(Forbidden, match="does not match"):
        middle.check(_retagged(_header(CHAIN, CHAIN[2:], key=key), model_id="m2"), sender="stage")
    with pytest.raises(Forbidden, match="route_tag does not match"):
        middle.check(_header(CHAIN, CHAIN[2:], key=new_key()), sender="stage")
    with pytest.raises(Forbidden, match="at a chain's first stage"):
        middle.check(followed, sender="coordinator")
    middle.key = new_key()  # the coordinator's key changed (it restarted): what was followed is not
    with pytest.raises(Forbidden, match="route_tag does not match"):
        middle.check(followed, sender="stage")


def _retagged(header: stage_pb2.StepHeader, *, model_id: str) -> stage_pb2.StepHeader:
    """The header edited after it was tagged: another model id under the same tag."""
    header.model_id = model_id
    return header


def test_without_a_coordinator_a_stage_follows_any_host_port_route() -> None:
    alone = _guard("127.0.0.1:7101", None)
    assert alone.check(stage_pb2.StepHeader(route=["127.0.0.1:7102", "node-b.local:80", "[::1]:7"]), sender=None) == ""
    for bad in ("unix:/tmp/socket", "127.0.0.1", "http://x:1", "x:0", "x:70000", "a b:1", "x" * 300 + ":1"):
        with pytest.raises(InvalidInput, match="is not HOST:PORT"):
            alone.check(stage_pb2.StepHeader(route=[bad]), sender=None)
    with pytest.raises(OverLimit, match="at most 64"):
        alone.check(stage_pb2.StepHeader(route=["h:1"] * 65), sender=None)
    check_address("localhost:7070")


def test_tokens_are_compared_by_digest_and_admins_are_users_too(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    users = tmp_path / "users"
    users.write_text("# clients\nalpha\n\n beta \n")
    admins = tmp_path / "admins"
    admins.write_text("root\n")
    tokens = Tokens.load(str(users), str(admins), environ={"LAYERLINE_API_TOKENS": "gamma, delta"})
    assert tokens.required
    assert [tokens.role_of(t) for t in ("alpha", "beta", "gamma", "delta", "root")] == ["user"] * 4 + ["admin"]
    assert [tokens.role_of(t) for t in ("alph", "alpha ", "", None, "ROOT")] == [None] * 5
    assert not Tokens.load(None, None, environ={}).required
    empty = tmp_path / "empty"
    empty.write_text("# none\n")
    with pytest.raises(ValueError, match=r"--api-tokens .*holds no token"):
        Tokens.load(str(empty), None, environ={})
    with pytest.raises(ValueError, match=r"--admin-tokens .*No such file"):
        Tokens.load(None, str(tmp_path / "missing"), environ={})
    assert bearer((("authorization", "Bearer abc"),)) == "abc"
    assert bearer((("authorization", "Basic abc"),)) is None
    assert bearer(None) is None
