"""Scheduling headers are honoured only from trusted sources: a client cannot claim the
short phase (X-Overtake-Phase) or a CPU class (X-Overtake-Class); and Apache's status pages are
never served through the sidecar (Apache's ``Require local`` would see the sidecar's address)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.service_helpers import SidecarProc, StubApache

STEERING = {"X-Overtake-Phase": "2", "X-Overtake-Next-Phase": "2", "X-Overtake-Class": "0"}


@pytest.fixture(scope="module")
def side(work: Path, stub: StubApache) -> SidecarProc:
    s = SidecarProc(work, ["--policy", "pi(2)", "--apache", stub.url, "--trusted-source", "127.0.0.1/32"])
    yield s  # type: ignore[misc]
    assert s.stop() == 0


def test_untrusted_clients_lose_their_scheduling_headers(side: SidecarProc) -> None:
    code, _, body = side.request("GET", "/stage2/echo", headers={**STEERING, "X-Other": "kept"}, source="127.0.0.2")
    assert code == 200
    seen = {k.lower(): v for k, v in json.loads(body)["headers"]}
    assert seen["x-other"] == "kept"
    assert not {"x-overtake-phase", "x-overtake-next-phase", "x-overtake-class"} & set(seen)


def test_trusted_sources_keep_them(side: SidecarProc) -> None:
    code, _, body = side.request("GET", "/stage2/echo", headers=STEERING, source="127.0.0.1")
    seen = {k.lower(): v for k, v in json.loads(body)["headers"]}
    assert code == 200 and all(seen[k.lower()] == v for k, v in STEERING.items())


@pytest.mark.parametrize("path", ["/server-status", "/server-status?auto", "//server-status", "/%73erver-status",
                                  "/overtake-prio-status", "/server-info"])
def test_status_pages_never_pass(side: SidecarProc, stub: StubApache, path: str) -> None:
    before = stub.hits["/server-status"]
    assert side.request("GET", path, source="127.0.0.1")[0] == 404
    assert stub.hits["/server-status"] == before  # the sidecar's own scrapes go straight to Apache


def test_bad_trusted_source_names_the_field(work: Path) -> None:
    import subprocess
    import sys

    from support.service_helpers import REPO

    out = subprocess.run([sys.executable, "-m", "overtake.api.cli", "sidecar", "--policy", "pi(1)", "--apache",
                          "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--stages", str(work / "none.yaml"),
                          "--trusted-source", "10.0.0.0/33"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "trusted_sources" in out.stderr and "10.0.0.0/33" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("source", "sent", "seen"), [
    ("127.0.0.1", "https", "https"),  # a TLS-terminating front end the sidecar trusts
    ("127.0.0.2", "https", "http"),  # anyone else: the scheme they used to reach the sidecar
    ("127.0.0.1", None, "http"),
])
def test_forwarded_proto_is_kept_from_trusted_sources_only(side: SidecarProc, source: str, sent: str | None,
                                                           seen: str) -> None:
    headers = {"X-Forwarded-Proto": sent} if sent else {}
    code, _, body = side.request("GET", "/stage2/proto", headers=headers, source=source)
    fields = [(k.lower(), v) for k, v in json.loads(body)["headers"]]
    assert code == 200 and [v for k, v in fields if k == "x-forwarded-proto"] == [seen]
