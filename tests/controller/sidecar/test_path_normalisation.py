"""The sidecar routes on the path Apache will see (policy bypass by path spelling).

``//stage1``, ``/./stage1``, ``/%73tage1`` and ``/x/../stage1`` reach Apache's stage handler; the
sidecar must count and limit them as that stage. Reference: RFC 3986 §6.2.2 (case, percent-
encoding of unreserved characters) and §5.2.4 (dot segments), and Apache's MergeSlashes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from support.service_helpers import SidecarProc, StubApache

from overtake.controller.sidecar.target import BadTarget, normalize_target


@pytest.mark.parametrize(("sent", "target", "path"), [
    (b"/stage1", b"/stage1", "/stage1"),
    (b"//stage1", b"/stage1", "/stage1"),
    (b"/./stage1", b"/stage1", "/stage1"),
    (b"/%73tage1", b"/stage1", "/stage1"),
    (b"/x/../stage1", b"/stage1", "/stage1"),
    (b"/x/%2E%2E/stage1?work=0.1", b"/stage1?work=0.1", "/stage1"),
    (b"/a/b/..", b"/a/", "/a/"),
    (b"/%7euser/a%20b", b"/~user/a%20b", "/~user/a b"),
    (b"/a%3fb", b"/a%3Fb", "/a?b"),
    (b"/../../etc", b"/etc", "/etc"),
    (b"http://example.org//stage1?x#frag", b"/stage1?x", "/stage1"),
])
def test_targets_normalise_as_rfc_3986_and_apache_merge_slashes(sent: bytes, target: bytes, path: str) -> None:
    got_target, got_path, _ = normalize_target(sent, b"GET")
    assert (got_target, got_path) == (target, path)


@pytest.mark.parametrize("sent", [b"/a%2Fb", b"/a%00", b"/%zz", b"/%4", b"ftp://x/a", b"http://user@x/a", b"x/a"])
def test_targets_apache_would_treat_differently_are_refused(sent: bytes) -> None:
    with pytest.raises(BadTarget):
        normalize_target(sent, b"GET")


def test_path_spellings_are_limited_as_their_stage(work: Path, stub: StubApache) -> None:
    """pi(2,2): at most two stage-1 requests in Apache; six spellings of a 0.3 s stage-1 request
    take three rounds (>= 0.9 s), and Apache sees the normalised path every time."""
    s = SidecarProc(work, ["--policy", "pi(2,2)", "--apache", stub.url])
    try:
        before = stub.hits["/slow/0.3"]
        spellings = ["//slow/0.3", "/./slow/0.3", "/%73low/0.3", "/x/../slow/0.3", "//slow//0.3", "/slow/./0.3"]
        codes: list[int] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=lambda p=p: codes.append(s.request("GET", p)[0])) for p in spellings]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        assert codes == [200] * 6 and stub.hits["/slow/0.3"] - before == 6
        assert elapsed >= 0.85, f"six 0.3 s requests under a cap of 2 took {elapsed:.2f} s: the cap was bypassed"
        metrics = s.request("GET", "/-/metrics")[2].decode()
        assert 'overtake_stage_admitted_total{phase="1",stage="stage1"} 6.0' in metrics
        code, _, body = s.request("GET", "/slow%2F0.3")
        assert code == 400 and b"encoded slash" in body
    finally:
        assert s.stop() == 0
