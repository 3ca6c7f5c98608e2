"""The PHP-FPM pool's size against the policy's total cap (controller.sidecar.fpm_pool)."""

from __future__ import annotations

from pathlib import Path

import pytest

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.fpm_pool import pool_size, pool_warning, total_cap
from overtake.controller.sidecar.policies import BaselinePolicy

DEBIAN_POOL = """; Start a new pool named 'www'.
[www]
user = www-data
group = www-data
listen = /run/php/php8.2-fpm.sock
pm = dynamic
pm.max_children = 5 ; Debian's default
pm.start_servers = 2
"""


def test_the_pool_size_is_read_from_a_pool_file_and_through_include(tmp_path: Path) -> None:
    (tmp_path / "pool.d").mkdir()
    (tmp_path / "pool.d" / "www.conf").write_text(DEBIAN_POOL)
    assert pool_size(tmp_path / "pool.d" / "www.conf") == ("www", 5)
    (tmp_path / "php-fpm.conf").write_text("[global]\npid = /run/php/fpm.pid\ninclude=pool.d/*.conf\n")
    assert pool_size(tmp_path / "php-fpm.conf") == ("www", 5)


@pytest.mark.parametrize(("text", "words"), [
    ("[global]\npid = x\n", "defines no pool"),
    (DEBIAN_POOL + "[api]\npm.max_children = 3\n", "the pools www, api"),
    (DEBIAN_POOL.replace("pm.max_children = 5 ; Debian's default", ""), "pm.max_children = (unset)"),
    (DEBIAN_POOL.replace("= 5", "= 0"), "pm.max_children = 0"),
    ("no section = here\n[[", "is not a PHP-FPM configuration"),
])
def test_a_pool_file_without_one_usable_size_is_refused_naming_the_field(tmp_path: Path, text: str, words: str) -> None:
    f = tmp_path / "www.conf"
    f.write_text(text)
    with pytest.raises(SidecarInputError, match="fpm_pool_config") as exc:
        pool_size(f)
    assert words in str(exc.value)


def test_a_missing_pool_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SidecarInputError, match="fpm_pool_config: cannot read"):
        pool_size(tmp_path / "nope.conf")


def test_total_caps_and_the_warning() -> None:
    assert total_cap(BaselinePolicy("pi(3)", 2)) == 3
    assert total_cap(BaselinePolicy("pi(1,8)", 2)) == 9
    assert total_cap(BaselinePolicy("passthrough", 2)) is None
    assert pool_warning(BaselinePolicy("pi(1,2)", 2), "www", 3) is None
    assert pool_warning(BaselinePolicy("passthrough", 2), "www", 3) is None  # pi(inf) admits nothing
    said = pool_warning(BaselinePolicy("pi(1,8)", 2), "www", 5)
    assert said is not None and "pm.max_children = 5" in said and "[www]" in said and "9" in said
