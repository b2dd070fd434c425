"""infra/home_identity.py: a home's id is written once and read alike by every process."""

from __future__ import annotations

import multiprocessing
import re
from pathlib import Path

import pytest

from selfrag.infra.home_identity import HOME_ID_FILE, HomeIdError, home_id


def test_a_home_gets_one_id_and_keeps_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = home_id(home)  # the folder is made too
    assert re.fullmatch(r"[0-9a-f]{32}", first)
    assert home_id(home) == first == (home / HOME_ID_FILE).read_text().strip()
    assert home_id(tmp_path / "other") != first
    assert [p.name for p in home.iterdir()] == [HOME_ID_FILE]  # no draft left behind


def _id_of(home: str) -> str:
    return home_id(Path(home))


def test_processes_racing_to_write_the_first_id_read_the_same(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        ids = pool.map(_id_of, [home] * 8)
    assert len(set(ids)) == 1


def test_a_file_that_is_not_an_id_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / HOME_ID_FILE).write_text("not an id\n")
    with pytest.raises(HomeIdError, match=HOME_ID_FILE):
        home_id(tmp_path)
